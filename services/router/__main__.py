"""`python -m services.router` / `disagg router`: the public front door over prefill and decode workers."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from common import tls
from common.errors import InvalidConfig
from services.router.config import add_router_args, config_from_args, discovery_from_args
from services.router.server import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg router", description=__doc__)
    add_router_args(parser)
    tls.add_tls_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    try:
        config, discovery = config_from_args(args), discovery_from_args(args)
        tls.configure(tls.tls_from_args(args))
    except (InvalidConfig, ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    asyncio.run(serve(config, discovery))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
