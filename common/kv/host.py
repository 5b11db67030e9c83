"""Which running host a process is on: two workers of one host may share /dev/shm (and its GPUs), which the
exporter says in every ref (HOST_ID_ATTRIBUTE) and the importer compares with its own."""
from __future__ import annotations

import contextlib
from functools import lru_cache
from pathlib import Path

from common.kv.shm_files import SHM_DIR

HOST_ID_ATTRIBUTE = "host_id"


@lru_cache(maxsize=1)
def host_id() -> str:
    """Machine id + boot id: equal only for processes of one running host ('' when unknown)."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        with contextlib.suppress(OSError):
            parts.append(Path(path).read_text().strip())
    return ":".join(parts) if len(parts) == 2 and SHM_DIR.is_dir() else ""


def same_host(attributes) -> bool:
    mine = host_id()
    return bool(mine) and attributes.get(HOST_ID_ATTRIBUTE, "") == mine
