"""Files of this user under /dev/shm: made by one process, named to its peers, opened only by what made them."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from common.errors import InvalidRequest

SHM_DIR = Path("/dev/shm")


def new_file(prefix: str, nbytes: int) -> Path:
    """A new zero-filled file of `nbytes` under /dev/shm, this user's alone (the caller unlinks it)."""
    path = SHM_DIR / f"{prefix}{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path


def named_file(path_text: str, prefix: str, what: str) -> Path:
    """A peer's path, if it names a file of ours (`prefix`) directly in /dev/shm; InvalidRequest otherwise."""
    path = Path(path_text)
    if path.parent != SHM_DIR or not path.name.startswith(prefix) or "/" in path.name:
        raise InvalidRequest(f"{what} must name a file {SHM_DIR}/{prefix}*, got {path_text!r}")
    return path
