"""The service processes the integration tests start: benchmarks/processes.py, the one place they are written."""
from benchmarks.processes import (REPO_ROOT, ServiceProcess, free_port, prefill_decode,  # noqa: F401
                                  start_prefill_decode, start_service, start_services, stop_cleanly, stop_in_waves)
