"""The command-line tools: the `disagg` command and what it runs (up, supervise, run, generate, bench, healthcheck)."""
