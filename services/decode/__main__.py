"""`python -m services.decode` / `disagg decode`: the decode worker process."""
from __future__ import annotations

from common.pb.disagg.v1 import worker_pb2
from services.decode.server import SERVICE_NAMES, add_servicers
from services.worker.handoff_flags import add_pull_args
from services.worker.service import EngineRole
from services.kit.process_exit import exit_process
from services.worker.shell import run_worker

SPEC = EngineRole(worker_pb2.WORKER_ROLE_DECODE, "The decode worker.", SERVICE_NAMES, add_servicers, add_pull_args)


def main(argv: list[str] | None = None) -> int:
    return run_worker(SPEC, argv)


if __name__ == "__main__":
    exit_process(main())
