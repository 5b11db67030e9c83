"""The fence of one-sided KV reads: per block, how many times the exporter handed it out for new content.

A one-sided read (`cuda_ipc`) copies a session's blocks out of the exporter's cache while the exporter
knows nothing of it, and the confirming Release goes off the read's critical path. What proves the copy
read the session's KV is this table: the exporter's block manager bumps a block's epoch every time it
allocates the block for new content (before anything writes it), the session's ref carries the sum of
its blocks' epochs when it was pinned (`kv_epoch`), and the importer sums them again once its copy has
finished. Epochs only grow, so an equal sum means no block was reused before the copy ended: the bytes
are the session's. A different sum means some were: the import is thrown away and the prompt recomputed.

The table is a file in /dev/shm that the exporter creates and deletes (`kv_epochs` names it) and every
importer on the host maps read-only; writes are aligned 8-byte stores, which x86-64 and arm64 make
atomic. A file left by a process that died is deleted by the next exporter that starts.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import uuid
from pathlib import Path
from typing import Sequence

from common.errors import InvalidRequest, NotFound
from common.kv.shm_files import SHM_DIR, named_file
from common.pb.disagg.v1 import common_pb2

log = logging.getLogger(__name__)
EPOCHS_ATTRIBUTE = "kv_epochs"  # the exporter's table (a path under /dev/shm)
EPOCH_ATTRIBUTE = "kv_epoch"  # a session's blocks' epoch sum when it was pinned
PREFIX = "disagg-epochs-"
_WORD = 8


class StaleKv(NotFound):
    """Blocks a one-sided read copied were reused by the exporter before the copy ended: never use them."""


class BlockEpochs:
    """A table of int64 epochs, one per block, in a file mapped into this process."""

    def __init__(self, path: Path, num_blocks: int, writable: bool):
        flags = os.O_RDWR if writable else os.O_RDONLY
        fd = os.open(path, flags | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size != num_blocks * _WORD:
                raise InvalidRequest(f"KV epoch table {path} holds {size} bytes, not {num_blocks} blocks of {_WORD}")
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self._map = mmap.mmap(fd, size, access=access)
        finally:
            os.close(fd)
        self.path, self.num_blocks, self.owner = path, num_blocks, writable
        self._words = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, num_blocks: int) -> "BlockEpochs":
        """A new zeroed table owned (and deleted by `close`) by this process."""
        sweep_stale()
        path = SHM_DIR / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, num_blocks * _WORD)
        finally:
            os.close(fd)
        return cls(path, num_blocks, writable=True)

    @classmethod
    def open(cls, path_text: str, num_blocks: int) -> "BlockEpochs":
        """An exporter's table, read-only; only files this module makes are opened."""
        path = named_file(path_text, PREFIX, EPOCHS_ATTRIBUTE)
        try:
            return cls(path, num_blocks, writable=False)
        except OSError as exc:
            raise NotFound(f"cannot map the exporter's KV epoch table {path_text}: {exc.strerror}") from None

    def bump(self, block_id: int) -> None:
        self._words[block_id] += 1

    def total(self, block_ids: Sequence[int]) -> int:
        return sum(map(self._words.__getitem__, block_ids))

    def check(self, block_ids: Sequence[int], expected: int, what: str) -> None:
        """StaleKv unless the blocks' epochs still sum to `expected` (call it once the copy has finished)."""
        now = self.total(block_ids)
        if now != expected:
            raise StaleKv(f"{what}: the exporter reused some of its {len(block_ids)} blocks before the copy ended "
                          f"(epochs summed {expected} when it was pinned, {now} now); the copy is discarded")

    def close(self) -> None:
        self._words.release()
        self._map.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def fence_of(ref: common_pb2.KvSessionRef) -> int | None:
    """The session's epoch sum at pin time, where its exporter fences one-sided reads."""
    text = ref.attributes.get(EPOCH_ATTRIBUTE, "")
    return int(text) if text.lstrip("-").isdigit() else None


def open_peer_table(path: str, num_blocks: int, endpoint: str) -> BlockEpochs | None:
    """An exporter's table (its ref's `kv_epochs`), where this process can map it; else None, and reads from
    that exporter wait for their Release."""
    if not path:
        return None
    try:
        return BlockEpochs.open(path, num_blocks)
    except (NotFound, InvalidRequest) as exc:
        log.info("reads from %s wait for their Release: %s", endpoint, exc)
        return None


def sweep_stale() -> int:
    """Delete tables whose exporting process is gone (it crashed before deleting its own)."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        pid = path.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            # Gone already, or another user's in a shared /dev/shm (sticky: only its owner may delete it).
            with contextlib.suppress(FileNotFoundError, PermissionError):
                path.unlink()
                removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
