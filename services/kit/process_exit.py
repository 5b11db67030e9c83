"""Leave a service process once it has shut down in order, without finalising the interpreter.

When a service's `main` returns, everything it owes the world is done: its servers stopped, Consul left, spans
flushed (`Observability.stop`), what its role held freed (`WorkerRole.close`). Finalising the interpreter after that
took an idle decode worker ~1.2 s of a core on the 2-core machine (SIGTERM to exit): the last garbage collection
walks every start-up object (common.heap hands them back to the collector at exit) and torch's libraries tear down.
`disagg up`, compose and the tests stop processes one after another, so every stop paid it. The service entry points
end here instead: logging and the standard streams flushed, then `os._exit`, as a tensor-parallel follower rank
always has.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe must not turn an exit into a traceback
            stream.flush()
    os._exit(code)
