"""Which KV transports (common.kv.transport, by name) a worker offers or accepts: --kv-transports, which narrows
them, the TransferBackend numbers of the built-in ones (torch-free, for the router), and the session-ref attributes
through which an exporter offers them and an importer picks one.

Best first: `cuda_ipc` (same host, GPU memory read GPU-side), `shm` (same host, through /dev/shm),
`nixl` (one-sided reads by descriptor, any host NIXL reaches: the cross-host fast path on RDMA
fabrics; over plain TCP it measured slower than `shm` and `grpc`, so same-host `shm` comes first),
`grpc` (TensorStore.Pull chunks: any host, always works). A worker's `--kv-transports` narrows what it offers
(prefill) or accepts (decode); `grpc` is always kept as the last resort.

All of these are the KV *data plane*: our TensorStore moves the bytes of an engine's paged cache. An engine may
instead drive a transport of its own (common.kv.transport.EngineTransport): `trtllm`, TensorRT-LLM's cache
transceiver, named in the ref as TRANSFER_BACKEND_TRTLLM. Both workers of a handoff must move KV the same way
(KvPath.check).
"""
from __future__ import annotations

from common.errors import InvalidConfig
from common.kv import transport
from common.pb.disagg.v1 import common_pb2

# The built-in transports' numbers, from their rows (common.kv.transport.BUILT_IN): the data plane's, and those an
# engine drives (no TensorStore pull).
DATA_PLANE_NUMBERS = {row.name: row.number for row in transport.BUILT_IN if not row.driven_by_engine}
PREFERENCE = tuple(DATA_PLANE_NUMBERS)
NAMES = {number: name for name, number in DATA_PLANE_NUMBERS.items()}
ENGINE_DRIVEN_NUMBERS = {row.name: row.number for row in transport.BUILT_IN if row.driven_by_engine}
# Session-ref attributes.
OFFERED_ATTRIBUTE = "transfer_backends"  # what the exporter offers, best first, comma separated
KV_CACHE_ID_ATTRIBUTE = "kv_cache_id"  # which cache allocation the session's block ids index


def known_transports() -> tuple[str, ...]:
    """The data plane's transports, built-in or registered, best first, grpc last."""
    return transport.names()


def parse_transports(text: str) -> tuple[str, ...]:
    """`auto` (every transport) or a comma-separated subset, kept in preference order, grpc always included."""
    known = transport.names()
    if text.strip() in ("", "auto"):
        return known
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidConfig(f"--kv-transports: unknown transport(s) {unknown}; choose from {list(known)} "
                            "or 'auto'")
    return tuple(n for n in known if n in names or n == transport.FALLBACK)


def name_of(number: int) -> str:
    return NAMES.get(number, common_pb2.TransferBackend.Name(number).removeprefix("TRANSFER_BACKEND_").lower())


def offered(attributes, transfer_backend: int) -> list[str]:
    """What an exporter offers for a session: its list attribute, else the ref's one transport, else grpc."""
    known = transport.names()
    listed = [n for n in attributes.get(OFFERED_ATTRIBUTE, "").split(",") if n in known]
    if listed:
        return listed
    single = NAMES.get(transfer_backend)
    return [single] if single and single != "grpc" else ["grpc"]

