"""The workers' KV handoff flags, outside the engine's: which transports a worker offers or accepts, and how a decode
worker waits for its pull. The workers take them, and `disagg up` takes them too and passes them on (handoff_argv);
this module imports no torch, so that up does not."""
from __future__ import annotations

import argparse
import logging
import os

from common.kv.offer import known_transports

log = logging.getLogger(__name__)
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


def add_transport_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Every engine worker's."""
    parser.add_argument(
        "--kv-transports", "--kv-transfer-backends", action=_NewFlagName, default=_kv_transports_from_env(),
        metavar="NAMES",
        help="KV transports this worker offers (prefill) or accepts (decode), best first: 'auto' or a subset of "
             f"{','.join(known_transports())} (grpc is always kept as the fallback; env DISAGG_KV_TRANSPORTS)")


def add_pull_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """A decode worker's."""
    parser.add_argument("--kv-pull-timeout", type=float, default=60.0, metavar="S",
                        help="seconds a KV pull from a prefill worker may take before it counts as failed")
    parser.add_argument("--kv-load-failure-policy", choices=KV_LOAD_FAILURE_POLICIES, default="recompute",
                        help="when the KV pull fails (prefill gone, session expired, stream broken): "
                             "'recompute' runs the prompt here and carries on, 'fail' ends the request "
                             "(UNAVAILABLE or NOT_FOUND)")


def handoff_argv(args: argparse.Namespace, role: str) -> list[str]:
    """The handoff flags of a `role` worker ("prefill" or "decode") as its command line, with the values of `args`."""
    parser = argparse.ArgumentParser(add_help=False)
    add_transport_args(parser)
    if role == "decode":
        add_pull_args(parser)
    return [f"{action.option_strings[0]}={getattr(args, action.dest)}" for action in parser._actions]


class _NewFlagName(argparse.Action):
    """A flag whose first option string is its name; another one is its old name, kept working for one release
    with a warning that names the new one."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string != self.option_strings[0]:
            log.warning("%s is deprecated: use %s", option_string, self.option_strings[0])
        setattr(namespace, self.dest, values)


def _kv_transports_from_env() -> str:
    """DISAGG_KV_TRANSPORTS, else its old name DISAGG_KV_TRANSFER_BACKENDS (kept for one release, with a warning)."""
    old = os.environ.get("DISAGG_KV_TRANSFER_BACKENDS")
    if old is not None and "DISAGG_KV_TRANSPORTS" not in os.environ:
        log.warning("DISAGG_KV_TRANSFER_BACKENDS is deprecated: use DISAGG_KV_TRANSPORTS")
        return old
    return os.environ.get("DISAGG_KV_TRANSPORTS", "auto")
