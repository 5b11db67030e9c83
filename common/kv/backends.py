"""KV transfer backends (the transports of common.kv.transport, by name): the flag that narrows them, the
TransferBackend numbers of the built-in ones (torch-free, for the router), and the session-ref attributes
through which an exporter offers them and an importer picks one.

Best first: `cuda_ipc` (same host, GPU memory read GPU-side), `shm` (same host, through /dev/shm),
`nixl` (one-sided reads by descriptor, any host NIXL reaches: the cross-host fast path on RDMA
fabrics; over plain TCP it measured slower than `shm` and `grpc`, so same-host `shm` comes first),
`grpc` (TensorStore.Pull chunks: any host, always works). A worker's `--kv-transfer-backends` narrows what it offers (prefill) or accepts
(decode); `grpc` is always kept as the last resort.

All of these are the KV *data plane* (DATA_PLANE): our TensorStore moves the bytes of an engine's paged cache.
An engine may instead move KV itself (common.engine.interface.EngineFacts.kv_transfer): `trtllm`, TensorRT-LLM's
cache transceiver, named in the ref as TRANSFER_BACKEND_TRTLLM. Both workers of a handoff must move KV the
same way (`check_kv_transfer`).
"""
from __future__ import annotations

from common.errors import FailedPrecondition, InvalidConfig
from common.kv import transport
from common.kv.transport import BackendUnavailable
from common.pb.disagg.v1 import common_pb2

# The built-in transports take their `number` from here (common.kv.transports).
BACKENDS = {"cuda_ipc": common_pb2.TRANSFER_BACKEND_CUDA_IPC, "shm": common_pb2.TRANSFER_BACKEND_SHM,
            "nixl": common_pb2.TRANSFER_BACKEND_NIXL, "grpc": common_pb2.TRANSFER_BACKEND_GRPC}
PREFERENCE = tuple(BACKENDS)
NAMES = {number: name for name, number in BACKENDS.items()}
# Session-ref attributes.
OFFERED_ATTRIBUTE = "transfer_backends"  # what the exporter offers, best first, comma separated
KV_CACHE_ID_ATTRIBUTE = "kv_cache_id"  # which cache allocation the session's block ids index


DATA_PLANE = "data_plane"
# Transfers an engine does itself, by the name EngineFacts.kv_transfer gives them: no TensorStore pull.
ENGINE_TRANSFERS = {"trtllm": common_pb2.TRANSFER_BACKEND_TRTLLM}
_HOW = {DATA_PLANE: "over the KV data plane (TensorStore: " + ", ".join(PREFERENCE) + ")",
        "trtllm": "through TensorRT-LLM's cache transceiver (TRANSFER_BACKEND_TRTLLM)"}


def parse_backends(text: str) -> tuple[str, ...]:
    """`auto` (every backend) or a comma-separated subset, kept in preference order, grpc always included."""
    known = transport.names()
    if text.strip() in ("", "auto"):
        return known
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidConfig(f"--kv-transfer-backends: unknown backend(s) {unknown}; choose from {list(known)} "
                            "or 'auto'")
    return tuple(n for n in known if n in names or n == transport.FALLBACK)


def name_of(number: int) -> str:
    return NAMES.get(number, common_pb2.TransferBackend.Name(number).removeprefix("TRANSFER_BACKEND_").lower())


def offered(attributes, transfer_backend: int) -> list[str]:
    """What an exporter offers for a session: its list attribute, else the ref's one backend, else grpc."""
    known = transport.names()
    listed = [n for n in attributes.get(OFFERED_ATTRIBUTE, "").split(",") if n in known]
    if listed:
        return listed
    single = NAMES.get(transfer_backend)
    return [single] if single and single != "grpc" else ["grpc"]


def kv_transfer_of(transfer_backend: int) -> str:
    """Who moves the KV of a ref with this transfer_backend: an engine transfer's name, or DATA_PLANE."""
    for name, number in ENGINE_TRANSFERS.items():
        if number == transfer_backend:
            return name
    return DATA_PLANE


def check_kv_transfer(session_id: str, transfer_backend: int, kv_transfer: str, engine: str) -> None:
    """FailedPrecondition, naming both sides, when a ref's KV moves another way than this worker's engine
    imports KV (a trtllm prefill's ref at a torch decode worker, or the reverse)."""
    theirs = kv_transfer_of(transfer_backend)
    if theirs == kv_transfer:
        return
    name = common_pb2.TransferBackend.Name(transfer_backend) if transfer_backend in \
        common_pb2.TransferBackend.values() else str(transfer_backend)
    raise FailedPrecondition(
        f"KV session {session_id} was exported with transfer_backend {name}, to be moved {_HOW[theirs]}, but this "
        f"decode worker runs --engine {engine}, which imports KV only {_HOW[kv_transfer]}; run prefill and decode "
        "workers with the same --engine")
