"""The disk tier: one file a block under DIR/<layout id>/, LRU by last access, within a byte budget for DIR.

Safe for several processes on one directory (the node-wide tier builds on it): a record is written to a temporary
file and renamed into place, so a reader sees a whole file or none, and a writer killed mid-write leaves only a
temporary that readers never open and a later scan removes; every read is verified (record.decode, then
StoredBlock.verify by the caller); a read touches the file's mtime, the LRU clock of every process; eviction
scans the whole directory (every layout's files, another process's too) and takes the oldest, and a file that
vanishes meanwhile (another process evicted it) is a miss, never an error. Each process counts its own writes
between scans, so the directory may overshoot its budget by what the others wrote since their last scan.
"""
from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

from common.kv.tiers.identity import TierLayout
from common.kv.tiers.metrics import TierMetrics
from common.kv.tiers.record import BlockKey, RecordRejected, StoredBlock, encode_header, read_key

SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"


class DiskFull(OSError):
    def __init__(self, detail: str):
        super().__init__(errno.ENOSPC, detail)


class DiskTier:
    name = "disk"
    TEMP_AGE_S = 60.0  # a temporary file this old was left by a writer that died: no write takes that long
    LOW_WATER = 0.9  # eviction frees down to this share of the budget, so that it scans once per many writes
    RESCAN_S = 10.0  # a scan at least this often brings in what other processes wrote and evicted

    def __init__(self, root: str | Path, capacity_bytes: int, layout: TierLayout, metrics: TierMetrics):
        self.root = Path(root)
        self.dir = self.root / layout.id
        self.capacity = capacity_bytes
        self.layout = layout
        self.metrics = metrics
        self.dir.mkdir(parents=True, exist_ok=True)
        self._describe()
        self._lock = threading.Lock()  # this process's writers and evictions (one mover thread, and tests)
        self.used = self._scan()[0]
        self._scanned_at = time.monotonic()
        self.on_evicted: Callable[[list[int]], None] | None = None  # told the hashes this process evicted

    def path(self, block_hash: int) -> Path:
        name = f"{block_hash:016x}"
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    def __contains__(self, block_hash: int) -> bool:
        return self.path(block_hash).exists()

    def read(self, block_hash: int) -> bytearray | None:
        """The file's bytes (None if there is none), its mtime set to now: the LRU's clock."""
        path = self.path(block_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            data = bytearray(os.fstat(fd).st_size)
            view, got = memoryview(data), 0
            while got < len(data):
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        try:
            os.utime(path)
        except OSError:
            pass  # evicted meanwhile: the bytes read are still whole
        return data if got == len(data) else data[:got]

    def write(self, block: StoredBlock) -> int:
        """Store `block` unless a file holds it already (then its mtime is touched); the bytes written. Raises
        OSError (DiskFull where the budget or the disk has no room): the block is then not stored."""
        path = self.path(block.key.hash)
        if self._touch(path):
            return 0
        header = encode_header(self.layout, block)
        size = len(header) + block.payload.numel()
        with self._lock:
            if size > self.capacity:
                raise DiskFull(f"a block of {size} bytes exceeds the disk tier's budget of {self.capacity}")
            self._make_room(size)
            path.parent.mkdir(exist_ok=True)
            _write_whole(path, header, memoryview(block.payload.numpy()))
            self.used += size
        self.metrics.used(self.name, self.used)
        return size

    def held_keys(self) -> list[BlockKey]:
        """The keys of this layout's records (their headers read; a record that fails is skipped: a read of it
        would be rejected too)."""
        keys = []
        for directory, _, names in os.walk(self.dir):
            for name in names:
                if name.endswith(SUFFIX):
                    try:
                        keys.append(read_key(os.path.join(directory, name), self.layout))
                    except (OSError, RecordRejected, ValueError, KeyError):
                        continue
        return keys

    def discard(self, block_hash: int) -> None:
        try:
            os.unlink(self.path(block_hash))
        except FileNotFoundError:
            pass

    def _touch(self, path: Path) -> bool:
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    def _make_room(self, size: int) -> None:
        files = None
        if time.monotonic() - self._scanned_at > self.RESCAN_S:
            self.used, files = self._scan(collect=True)  # (kept: an eviction right after needs no second walk)
            self._scanned_at = time.monotonic()
        if self.used + size <= self.capacity:
            return
        total, files = (self.used, files) if files is not None else self._scan(collect=True)
        target = self.capacity * self.LOW_WATER - size
        evicted: list[int] = []
        for _, file_size, path in sorted(files):
            if total <= target:
                break
            try:
                os.unlink(path)
                evicted.append(int(os.path.basename(path)[:16], 16))
            except (FileNotFoundError, ValueError):
                pass  # another process evicted it first (or a name not of ours)
            total -= file_size
        self.used, self._scanned_at = total, time.monotonic()
        self.metrics.evicted(self.name, len(evicted))
        if evicted and self.on_evicted is not None:
            self.on_evicted(evicted)
        if total + size > self.capacity:
            raise DiskFull(f"the disk tier's budget of {self.capacity} bytes has no room for {size} more")

    def _scan(self, collect: bool = False) -> tuple[int, list[tuple[float, int, str]]]:
        """Bytes of records under the root (every layout's) and, with `collect`, each one's (mtime, size, path);
        temporary files of writers that died are removed on the way."""
        total, files, now = 0, [], time.time()
        for directory, _, names in os.walk(self.root):
            for name in names:
                path = os.path.join(directory, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                if name.endswith(TEMP_SUFFIX):
                    if now - st.st_mtime > self.TEMP_AGE_S:
                        try:
                            os.unlink(path)
                        except FileNotFoundError:
                            pass
                    continue
                if name.endswith(SUFFIX):
                    total += st.st_size
                    if collect:
                        files.append((st.st_mtime, st.st_size, path))
        return total, files

    def _describe(self) -> None:
        """layout.json beside the records: which model, dtype and shape they are of (for people; never read)."""
        path = self.dir / "layout.json"
        if path.exists():
            return
        _write_whole(path, json.dumps(self.layout.as_dict(), indent=1, sort_keys=True).encode())


def _write_whole(path: Path, *chunks) -> None:
    """Write `chunks` to `path` through a temporary renamed into place: a reader sees the whole file or none, and a
    writer that dies leaves only a temporary (which _scan sweeps once stale)."""
    temp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
    try:
        with open(temp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
