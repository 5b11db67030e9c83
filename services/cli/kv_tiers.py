"""Where `disagg up`'s workers keep their disk KV tiers, and the budget: one node-wide directory with
--shared-kv-cache, else a directory of its own for each worker.

--shared-kv-cache: every worker gets the same directory (--disk-kv-cache-dir, default DEFAULT_ROOT/<host name>) and
the same budget, which is the whole directory's (common/kv/tiers/disk.py evicts across every process's files), and
writes its finished requests' full blocks through to it (--kv-cache-write-through): a decode worker's answer is
there for the prefill of the next turn. Without --disk-kv-cache-gb the budget is SHARE_OF_FREE of the free space on
the directory's filesystem at start, at most MAX_DEFAULT_GB. Without --shared-kv-cache, a --disk-kv-cache-dir DIR
gives each worker DIR/<its name> and --disk-kv-cache-gb each: per-worker tiers, as a worker started alone has.
The host tier (--host-kv-cache-gb) stays each worker's own: pinned memory is one process's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
from pathlib import Path

from common.errors import InvalidConfig

DEFAULT_ROOT = Path.home() / ".cache" / "disagg" / "kv-tiers"
SHARE_OF_FREE = 0.1
MAX_DEFAULT_GB = 64.0
GB = 1 << 30


def add_kv_tier_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--shared-kv-cache", action="store_true",
                   help="every worker shares one disk KV tier (--disk-kv-cache-dir, default "
                        "~/.cache/disagg/kv-tiers/<host>; budget --disk-kv-cache-gb, default a tenth of the free disk "
                        "up to 64 GB) and writes finished requests through to it: one worker's answer serves the "
                        "next turn on any")


def node_dir(args: argparse.Namespace) -> Path:
    """The node-wide tier's directory: --disk-kv-cache-dir, else DEFAULT_ROOT/<host name>."""
    return Path(args.disk_kv_cache_dir).expanduser() if args.disk_kv_cache_dir else DEFAULT_ROOT / socket.gethostname()


def default_budget_gb(directory: Path) -> float:
    """SHARE_OF_FREE of the free space where `directory` is (made if missing), at most MAX_DEFAULT_GB."""
    directory.mkdir(parents=True, exist_ok=True)
    return round(min(shutil.disk_usage(directory).free * SHARE_OF_FREE / GB, MAX_DEFAULT_GB), 3)


def settle(args: argparse.Namespace) -> None:
    """Fill in --shared-kv-cache's directory and budget on `args` (once, before the workers' command lines are built:
    every worker then gets the same budget); InvalidConfig if the budget comes out as none."""
    if not args.shared_kv_cache:
        return
    directory = node_dir(args)
    budget = args.disk_kv_cache_gb if args.disk_kv_cache_gb is not None else default_budget_gb(directory)
    if budget <= 0:
        raise InvalidConfig(f"--shared-kv-cache: no disk budget for {directory} (free space {_free_gb(directory)} GB); "
                            "give --disk-kv-cache-gb, or a --disk-kv-cache-dir with room")
    args.disk_kv_cache_dir, args.disk_kv_cache_gb = str(directory), budget


def worker_tier_flags(args: argparse.Namespace, worker_name: str) -> tuple[dict[str, object], list[str]]:
    """A worker's disk tier: engine-flag overrides (by attribute) and switches to add, after `settle`."""
    if args.shared_kv_cache:
        return {}, [] if args.kv_cache_write_through else ["--kv-cache-write-through"]
    if args.disk_kv_cache_dir:
        return {"disk_kv_cache_dir": os.path.join(args.disk_kv_cache_dir, worker_name)}, []
    return {}, []


def summary(args: argparse.Namespace) -> str:
    """One line for the banner: where the node-wide tier is and its budget ("" without --shared-kv-cache)."""
    if not args.shared_kv_cache:
        return ""
    return f"shared KV tier: {args.disk_kv_cache_dir} ({args.disk_kv_cache_gb:g} GB for every worker together)"


def _free_gb(directory: Path) -> str:
    try:
        return f"{shutil.disk_usage(directory).free / GB:.1f}"
    except OSError:
        return "?"
