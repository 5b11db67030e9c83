"""The file through which a session's bytes cross: the importer (decode) creates an empty file
/dev/shm/disagg-kv-<random> and sends its path in PullRequest.shm_path; the exporter writes the session's bytes
into it and answers only the header; the importer reads the file and deletes it. The file is the importer's from
creation to deletion, so the exporter holds nothing that an expiry or a crash could leak."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from common.errors import InvalidRequest
from common.kv.errors import TransportUnavailable
from common.kv.shm_files import new_file, named_file

PREFIX = "disagg-kv-"


class ShmUnavailable(TransportUnavailable):
    """The exporter cannot open the importer's file: not the same host (or /dev/shm) after all."""


@contextlib.contextmanager
def shm_file() -> Iterator[Path]:
    """A new empty file under /dev/shm for one pull, deleted when the block ends."""
    path = new_file(PREFIX, 0)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def write_into(path_text: str, data: memoryview) -> None:
    """Exporter side: write `data` into the importer's existing file; never creates or follows links."""
    path = named_file(path_text, PREFIX, "shm_path")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
    except OSError as exc:
        raise ShmUnavailable(f"cannot open {path_text} on this host: {exc.strerror}") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def read_into(path: Path, buffer) -> None:
    """Read the whole file into `buffer` (a uint8 tensor, pinned when it goes on to a GPU)."""
    total_bytes = buffer.numel()
    size = path.stat().st_size
    if size != total_bytes:
        raise InvalidRequest(f"shm file {path} has {size} bytes, the exporter said {total_bytes}")
    view, done = memoryview(buffer.numpy()).cast("B"), 0
    with path.open("rb", buffering=0) as f:
        while done < total_bytes:
            n = f.readinto(view[done:])
            if not n:
                raise InvalidRequest(f"shm file {path} ended at byte {done} of {total_bytes}")
            done += n
