"""What every disagg server shares, router and workers: serving, observability, the drain, request parsing, proto conversions."""
