"""`python -m services.router` / `disagg router`: the router process's entry point, before any request: its flags,
then server.py."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from common import tls
from common.discovery.consul import ConsulDiscovery
from common.engine.default_model import model_label
from common.errors import InvalidConfig
from services.router.config import add_router_args, config_from_args, discovery_from_args
from services.kit.observability import Observability, add_observability_args
from services.kit.process_exit import exit_process
from services.router.server import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg router", description=__doc__)
    add_router_args(parser)
    tls.add_tls_args(parser)
    add_observability_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        tls.configure(tls.tls_from_args(args))
        obs = Observability.from_args("router", config.model_name or model_label(config.model), args)
        discovery = ConsulDiscovery(obs.consul) if obs.consul is not None else discovery_from_args(args)
    except (InvalidConfig, ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    try:
        asyncio.run(serve(config, discovery, obs))
    except InvalidConfig as exc:  # found only when binding (a port taken): one line, no traceback
        print(f"disagg router: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_process(main())
