"""The NIXL KV data plane: the importer reads a session's blocks straight out of the exporter's cache.

The exporter (prefill) registers its whole KV cache tensor once with a UCX-backed NIXL agent and
publishes a NixlCacheInfo (agent name + metadata, base address, geometry). The importer (decode)
adds the exporter's agent once (cached by name, re-added when its metadata changes), registers the
target tensor for the read, and posts one READ of every (layer, k|v, run of consecutive blocks);
the exporter copies nothing. Between processes of one CPU-only host UCX reads with cross-memory
attach (process_vm_readv) after a TCP handshake; on a GPU host the same code reads VRAM (UCX's
cuda_ipc / RDMA transports).

The target is registered per read (well under a millisecond, against tens of milliseconds for a
session's read) rather than staged through a registered buffer: no extra copy, and concurrent
reads share nothing. read_blocks blocks its thread; read_blocks_async polls the transfer state
between short sleeps on the event loop, which is all the progress the importer's agent gets. A read
given up on (timed out, or its task cancelled) is not cancelled in NIXL, which may still write into
its target: the importer keeps the read and its target until NIXL reports it finished. Agents are
thread-safe (NIXL_THREAD_SYNC_STRICT).

The exporter's agent is made when a peer first opens the cache through NIXL (common.kv.transports.nixl), never
before. Its progress thread (over TCP its UCX worker must answer reads while the process is idle) sleeps on
UCX's wakeup fd and wakes by itself only every PROGRESS_WAKE_US: nixl_agent's own setting, 0, polls at zero
timeout, a core spun for as long as the process lives.

Cache layout (common/engine/model_runner.py): kv_cache is one contiguous tensor
[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], so the region of block b of
(layer l, k|v) is `region_bytes` long at byte offset ((l * 2 + kv) * num_blocks + b) * region_bytes.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from common.errors import DisaggError, FailedPrecondition, InvalidRequest, LayoutMismatch, Unavailable

log = logging.getLogger(__name__)

# `nixl` is the meta package (it picks nixl_cu13 / nixl_cu12 by torch's CUDA version); a bare
# nixl-cu13 or nixl-cu12 wheel is enough on its own.
_API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
MEM_TYPES = ("DRAM", "VRAM")
DEFAULT_TIMEOUT_S = 30.0
_FIRST_POLL_S = 0.00005
_MAX_POLL_S = 0.002
# The exporter's progress thread blocks on UCX's wakeup fd; this is only its timer for an event UCX fails to signal.
# 20 ms: an idle exporter spends ~0.2 % of a core on it (1 ms: 2.6 %; the 0 nixl_agent sets: 100 %).
PROGRESS_WAKE_US = 20_000


class NixlUnavailable(FailedPrecondition):
    """NIXL (with its UCX backend) cannot be used in this process."""


class TransferFailed(Unavailable):
    """A NIXL read did not complete: the peer went away, refused the descriptors, or timed out."""


@lru_cache(maxsize=1)
def _api() -> ModuleType:
    failures = []
    for name in _API_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout
        return module
    raise NixlUnavailable("NIXL is not installed (pip install 'disagg[nixl]'): " + "; ".join(failures))


_making_agent = threading.Lock()


@contextlib.contextmanager
def _progress_wake(api: ModuleType, delay_us: int) -> Iterator[None]:
    """nixl_agent fixes its config's pthrDelay at 0 and takes no argument for it; while this holds, the binding's
    agent is made with `delay_us` instead (set on the config on its way in)."""
    bindings = importlib.import_module(api.nixl_agent.__module__).nixlBind
    real = bindings.nixlAgent

    def make(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return real(name, config)

    with _making_agent:
        bindings.nixlAgent = make
        try:
            yield
        finally:
            bindings.nixlAgent = real


def _new_agent(prefix: str, progress_thread: bool) -> Any:
    """A UCX-backed agent. The exporter needs a progress thread (over TCP its worker must answer reads and
    connections while the process is idle): it waits on UCX's wakeup fd, waking by itself every
    PROGRESS_WAKE_US. The importer has none: it drives its own progress through check_xfer_state while it waits."""
    api = _api()
    name = f"disagg-{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    config = api.nixl_agent_config(
        enable_prog_thread=progress_thread,
        backends=["UCX"],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    try:
        with _progress_wake(api, PROGRESS_WAKE_US):
            agent = api.nixl_agent(name, config)
    except Exception as exc:
        raise NixlUnavailable(f"cannot create a NIXL agent: {_one_line(exc)}") from exc
    if "UCX" not in agent.backends:
        raise NixlUnavailable(f"NIXL has no UCX backend here (plugins: {', '.join(agent.get_plugin_list())})")
    return agent


_immortal: set[int] = set()


def _never_free(agent: Any) -> None:
    """Keep an agent alive until the process ends, past interpreter shutdown too: once a read of it failed
    (a dead or stopped peer), UCX still holds that request, and destroying the agent then aborts the
    process (arbiter.c: `ucs_arbiter_group_is_empty(group)' failed). One reference nothing releases."""
    if id(agent) not in _immortal:
        _immortal.add(id(agent))
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(agent))


@lru_cache(maxsize=1)
def nixl_unavailable_reason() -> str | None:
    """None when NIXL with its UCX backend works in this process, else a one-line reason. Never raises."""
    try:
        agent = _new_agent("probe", progress_thread=False)
        if "DRAM_SEG" not in agent.get_backend_mem_types("UCX"):
            return "NIXL's UCX backend cannot register host memory (DRAM)"
        return None
    except Exception as exc:  # the probe reports every failure as a reason, whatever its type
        return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return text if isinstance(exc, DisaggError) else f"{type(exc).__name__}: {text}".rstrip(": ")


def _mem_type(tensor: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", tensor.get_device()) if tensor.is_cuda else ("DRAM", 0)


@dataclass(frozen=True)
class NixlCacheInfo:
    """What an exporter publishes about its registered cache; the importer needs nothing else to read it."""

    agent_name: str
    agent_metadata: bytes
    base_addr: int
    num_layers: int
    num_blocks: int
    region_bytes: int
    mem_type: str
    device_id: int

    def to_fields(self) -> dict[str, int | str | bytes]:
        """Plain values (str, bytes, ints) keyed by field name, for a protobuf message of the same fields."""
        return asdict(self)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> NixlCacheInfo:
        """The inverse of to_fields (also takes a protobuf message's fields); InvalidRequest when malformed."""
        try:
            info = cls(
                agent_name=str(fields["agent_name"]), agent_metadata=bytes(fields["agent_metadata"]),
                base_addr=int(fields["base_addr"]), num_layers=int(fields["num_layers"]),
                num_blocks=int(fields["num_blocks"]), region_bytes=int(fields["region_bytes"]),
                mem_type=str(fields["mem_type"]), device_id=int(fields["device_id"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed NIXL cache info: {_one_line(exc)}") from None
        info.validate()
        return info

    def validate(self) -> None:
        if not self.agent_name or not self.agent_metadata:
            raise InvalidRequest("NIXL cache info needs an agent name and its metadata")
        if self.mem_type not in MEM_TYPES:
            raise InvalidRequest(f"NIXL cache info mem_type {self.mem_type!r} is not one of {MEM_TYPES}")
        if min(self.base_addr, self.num_layers, self.num_blocks, self.region_bytes) <= 0 or self.device_id < 0:
            raise InvalidRequest(f"NIXL cache info has a non-positive address or size: {self.geometry()}")

    def geometry(self) -> str:
        return f"{self.num_layers} layers x 2 x {self.num_blocks} blocks x {self.region_bytes} B"


class NixlExporter:
    """Registers one worker's whole KV cache with a NIXL agent once; peers read blocks out of it."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or not kv_cache.is_contiguous():
            raise LayoutMismatch("NIXL export needs a contiguous [L, 2, blocks, bs, H, D] cache, "
                                 f"got {tuple(kv_cache.shape)}")
        self._cache = kv_cache  # registered memory must outlive the registration
        self._agent = _new_agent("export", progress_thread=True)
        try:
            self._registration = self._agent.register_memory(kv_cache, backends=["UCX"])
        except Exception as exc:
            raise NixlUnavailable(f"cannot register the KV cache with NIXL: {_one_line(exc)}") from exc
        mem_type, device_id = _mem_type(kv_cache)
        self._info = NixlCacheInfo(
            agent_name=self._agent.name, agent_metadata=self._agent.get_agent_metadata(),
            base_addr=kv_cache.data_ptr(), num_layers=kv_cache.shape[0], num_blocks=kv_cache.shape[2],
            region_bytes=kv_cache[0, 0, 0].numel() * kv_cache.element_size(),
            mem_type=mem_type, device_id=device_id,
        )

    def info(self) -> NixlCacheInfo:
        return self._info

    def close(self) -> None:
        if self._registration is not None:
            self._agent.deregister_memory(self._registration, backends=["UCX"])
            self._registration = None


def _read_descs(peer: NixlCacheInfo, block_ids: np.ndarray, out: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) Nx3 descriptor arrays (address, length, device): one row per (layer, k|v, run of
    consecutive block ids), since a run is contiguous on both sides and one descriptor costs one copy."""
    region, n = np.uint64(peer.region_bytes), block_ids.size
    starts = np.flatnonzero(np.diff(block_ids.astype(np.int64), prepend=-2) != 1).astype(np.uint64)
    lengths = np.diff(starts, append=np.uint64(n)) * region
    planes = np.arange(peer.num_layers * 2, dtype=np.uint64)[:, None]
    remote_blocks = planes * np.uint64(peer.num_blocks) + block_ids[starts][None, :]
    remote_addr = np.uint64(peer.base_addr) + remote_blocks * region
    local_addr = np.uint64(out.data_ptr()) + (planes * np.uint64(n) + starts[None, :]) * region
    rows = remote_addr.size
    length = np.broadcast_to(lengths[None, :], remote_addr.shape).ravel()

    def descs(addr: np.ndarray, device: int) -> np.ndarray:
        return np.stack([addr.ravel(), length, np.full(rows, device, dtype=np.uint64)], axis=1)

    return descs(local_addr, _mem_type(out)[1]), descs(remote_addr, peer.device_id)


def validate_read(peer: NixlCacheInfo, block_ids: Sequence[int], out: torch.Tensor) -> np.ndarray:
    """Refuse a read that does not fit, before any byte moves; returns the block ids as uint64."""
    peer.validate()
    ids = np.asarray(list(block_ids), dtype=np.int64)
    if ids.size == 0:
        raise InvalidRequest("a NIXL read needs at least one block id")
    bad = ids[(ids < 0) | (ids >= peer.num_blocks)]
    if bad.size:
        raise InvalidRequest(f"block ids {bad[:8].tolist()} are outside the peer's cache of {peer.num_blocks} blocks")
    if out.dim() != 6 or out.shape[1] != 2 or out.shape[2] != ids.size or not out.is_contiguous():
        raise LayoutMismatch(f"NIXL read target must be a contiguous [L, 2, {ids.size}, bs, H, D] tensor, "
                             f"got {tuple(out.shape)}")
    if out.shape[0] != peer.num_layers:
        raise LayoutMismatch(f"layer count: exporter={peer.num_layers} importer={out.shape[0]}")
    expected = peer.num_layers * 2 * ids.size * peer.region_bytes
    if out.numel() * out.element_size() != expected:
        raise LayoutMismatch(f"NIXL read target holds {out.numel() * out.element_size()} bytes, the peer's "
                             f"{ids.size} blocks are {expected} ({peer.geometry()})")
    return ids.astype(np.uint64)


def _queued_work(out: torch.Tensor) -> torch.cuda.Event | None:
    """An event after the work queued on out's CUDA stream: NIXL must not write into memory still in use."""
    if not out.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(out.device))
    return event


def _pauses(deadline: float) -> Iterator[float]:
    """Sleeps between polls: from 50 us doubling to 2 ms, until the deadline."""
    pause = _FIRST_POLL_S
    while time.monotonic() < deadline:
        yield pause
        pause = min(pause * 2, _MAX_POLL_S)


class _Read:
    """One posted READ: its transfer handle, its target and the target's registration.

    A read still in flight (timed out, or its caller cancelled) is never cancelled: NIXL may go on
    writing into the target after a cancel, so the importer keeps it, and its target, until NIXL
    reports it finished; only then are the handle and the registration released."""

    def __init__(self, agent: Any, peer: NixlCacheInfo, ids: np.ndarray, out: torch.Tensor) -> None:
        self.agent, self.peer, self.out = agent, peer, out
        self.handle, self.error = None, ""
        self.registration = agent.register_memory(out, backends=["UCX"])
        try:
            local, remote = _read_descs(peer, ids, out)
            self.handle = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, _mem_type(out)[0]),
                agent.get_xfer_descs(remote, peer.mem_type), peer.agent_name, backends=["UCX"])
            self.state = agent.transfer(self.handle)
        except BaseException:
            self.release()
            raise

    def poll(self) -> str:
        if self.state == "PROC":
            try:
                self.state = self.agent.check_xfer_state(self.handle)
            except Exception as exc:  # e.g. the peer was removed or disconnected mid-transfer
                self.state, self.error = "ERR", _one_line(exc)
        return self.state

    def release(self) -> None:
        try:
            if self.handle is not None:
                self.agent.release_xfer_handle(self.handle)
        except Exception as exc:
            log.warning("NIXL read from %s: releasing its handle failed: %s", self.peer.agent_name, _one_line(exc))
        self.handle = None
        if self.registration is not None:
            self.agent.deregister_memory(self.registration, backends=["UCX"])
            self.registration = None


class NixlImporter:
    """Reads sessions' blocks from peers' registered caches; one per worker, peers added once and cached."""

    def __init__(self) -> None:
        self._agent = _new_agent("import", progress_thread=False)
        self._peers: dict[str, bytes] = {}
        self._in_flight: list[_Read] = []  # reads given up on but not finished: their targets stay alive
        self._forget_later: set[str] = set()  # peers to remove once their reads in flight finish
        self._lock = threading.RLock()

    def read_blocks(self, peer: NixlCacheInfo, block_ids: Sequence[int], out: torch.Tensor,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Blocking read of `block_ids` of every layer and k/v from `peer` into `out` [L, 2, n, bs, H, D]."""
        ids = validate_read(peer, block_ids, out)
        deadline = time.monotonic() + timeout_s
        queued = _queued_work(out)
        if queued is not None:
            queued.synchronize()
        read = self._start(peer, ids, out)
        try:
            for pause in _pauses(deadline):
                if read.poll() != "PROC":
                    break
                time.sleep(pause)
        finally:
            self._finish(read)
        self._check(read, timeout_s)

    async def read_blocks_async(self, peer: NixlCacheInfo, block_ids: Sequence[int], out: torch.Tensor,
                                timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """read_blocks for an event loop: posts the READ, then polls its state between short sleeps."""
        ids = validate_read(peer, block_ids, out)
        deadline = time.monotonic() + timeout_s
        queued = _queued_work(out)
        while queued is not None and not queued.query():
            await asyncio.sleep(_MAX_POLL_S)
        read = self._start(peer, ids, out)
        try:
            for pause in _pauses(deadline):
                if read.poll() != "PROC":
                    break
                await asyncio.sleep(pause)
        finally:
            self._finish(read)
        self._check(read, timeout_s)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def reads_in_flight(self) -> int:
        """Reads given up on (timed out or cancelled) that NIXL has not finished yet."""
        with self._lock:
            self._settle()
            return len(self._in_flight)

    def forget_peer(self, agent_name: str) -> None:
        """Drop a peer's metadata and connection (its worker restarted or left); deferred while a read
        given up on is still in flight from it."""
        with self._lock:
            if self._peers.pop(agent_name, None) is None:
                return
            if any(read.peer.agent_name == agent_name for read in self._in_flight):
                self._forget_later.add(agent_name)
                return
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception as exc:
                log.warning("NIXL could not remove peer %s: %s", agent_name, _one_line(exc))

    def close(self) -> None:
        for name in self.peers():
            self.forget_peer(name)
        in_flight = self.reads_in_flight()
        if in_flight:
            log.warning("NIXL importer closed with %d reads still in flight; their targets stay alive", in_flight)

    def _start(self, peer: NixlCacheInfo, ids: np.ndarray, out: torch.Tensor) -> _Read:
        with self._lock:
            self._settle()
            self._add_peer(peer)
        try:
            return _Read(self._agent, peer, ids, out)
        except Exception as exc:
            _never_free(self._agent)
            self.forget_peer(peer.agent_name)
            raise TransferFailed(f"NIXL read from {peer.agent_name} could not start: {_one_line(exc)}") from exc

    def _finish(self, read: _Read) -> None:
        if read.state == "PROC":
            with self._lock:
                self._in_flight.append(read)
        else:
            read.release()

    def _settle(self) -> None:
        """Release the reads given up on that NIXL has finished since; then remove the peers forgotten meanwhile."""
        running = []
        for read in self._in_flight:
            if read.poll() == "PROC":
                running.append(read)
            else:
                read.release()
        self._in_flight = running
        for name in self._forget_later - {read.peer.agent_name for read in running}:
            self._forget_later.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                log.warning("NIXL could not remove peer %s: %s", name, _one_line(exc))

    def _check(self, read: _Read, timeout_s: float) -> None:
        """Raise TransferFailed unless the read is DONE; a failed peer is forgotten (fresh metadata next time)."""
        if read.state == "DONE":
            return
        _never_free(self._agent)
        where = f"NIXL read of {read.peer.geometry()} from {read.peer.agent_name}"
        if read.state == "PROC":
            raise TransferFailed(f"{where} timed out after {timeout_s:g} s")
        self.forget_peer(read.peer.agent_name)
        raise TransferFailed(f"{where} failed: {read.error or 'the peer is gone or refused the read'}")

    def _add_peer(self, peer: NixlCacheInfo) -> None:
        known = self._peers.get(peer.agent_name)
        if known == peer.agent_metadata:
            return
        if known is not None:  # its metadata changed
            self.forget_peer(peer.agent_name)
        if peer.agent_name in self._forget_later:
            raise TransferFailed(f"NIXL peer {peer.agent_name} still has a read given up on in flight")
        try:
            added = self._agent.add_remote_agent(peer.agent_metadata)
            added = added.decode() if isinstance(added, bytes) else added
        except Exception as exc:
            raise TransferFailed(f"cannot add NIXL peer {peer.agent_name}: {_one_line(exc)}") from exc
        if added != peer.agent_name:
            self._agent.remove_remote_agent(added)
            raise InvalidRequest(f"NIXL metadata names agent {added!r}, the cache info names {peer.agent_name!r}")
        self._peers[peer.agent_name] = peer.agent_metadata
