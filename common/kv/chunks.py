"""Tensors as TensorStore chunks: raw little-endian bytes cut into ordered pieces, and back.

No gRPC here: a tensor becomes a TensorHeader plus bytes, the bytes become TensorChunk
messages, and an assembler checks a received chunk sequence before it is trusted.
"""
from __future__ import annotations

import math
import sys
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from google.protobuf.message import DecodeError

from common.errors import InvalidRequest, LayoutMismatch
from common.kv.buffers import host_empty
from common.pb.disagg.v1 import worker_pb2

MAX_CHUNK_BYTES = 4 * 1024 * 1024  # the most a puller may ask for (TensorStore.Pull's contract)
# What a puller gets when it asks for nothing: 1 MiB chunks cost both ends less CPU than 4 MiB ones (the
# exporter's serialized chunks and gRPC's received messages are freed and reused warm by the allocator, where
# 4 MiB ones come as fresh pages), and a pull between hosts is bound by that CPU unless its link is slower.
DEFAULT_CHUNK_BYTES = 1024 * 1024
# Same-size integer types: every dtype (bfloat16 included, which numpy lacks) travels as these.
_INT_OF_SIZE = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32),
                8: (torch.int64, np.int64)}
_LITTLE = sys.byteorder == "little"


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or dtype.itemsize not in _INT_OF_SIZE:
        raise LayoutMismatch(f"unsupported tensor dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_to_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements, row-major, little-endian; a view (no copy) on little-endian hosts."""
    tensor = tensor.detach().cpu().contiguous()
    torch_int, _ = _INT_OF_SIZE[tensor.element_size()]
    array = tensor.view(torch_int).numpy()
    if not _LITTLE:
        array = array.byteswap()
    return memoryview(array.reshape(-1).view(np.uint8))


def tensor_from_bytes(data: bytearray, shape: Sequence[int], dtype: str) -> torch.Tensor:
    """The inverse of tensor_to_bytes; shares `data`'s memory on little-endian hosts."""
    torch_type = torch_dtype(dtype)
    expected = math.prod(shape) * torch_type.itemsize
    if len(data) != expected:
        raise LayoutMismatch(f"{len(data)} bytes cannot hold a {dtype} tensor of shape {list(shape)} "
                             f"({expected} bytes)")
    _, np_int = _INT_OF_SIZE[torch_type.itemsize]
    array = np.frombuffer(data, dtype=np.dtype(np_int).newbyteorder("<"))
    if not _LITTLE:
        array = array.astype(np_int)
    return torch.from_numpy(array).view(torch_type).reshape(tuple(shape))


def chunk_size(requested: int, max_message_bytes: int, header_room: int) -> int:
    """The data bytes per chunk: what the puller asked for (0 = DEFAULT_CHUNK_BYTES), within 4 MiB and the
    message cap."""
    size = min(requested or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, max_message_bytes - header_room)
    if size < 1:
        raise InvalidRequest(f"max message size {max_message_bytes} leaves no room for tensor data")
    return size


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


_DATA_TAG = bytes([(3 << 3) | 2])  # TensorChunk.data: field 3, length-delimited


def encoded_chunks(header: worker_pb2.TensorHeader, data: memoryview,
                   max_chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[bytes]:
    """The same chunks as chunk_tensor, already serialized, each built with one copy of its data
    (protobuf would make two); sent through a serializer that passes bytes through."""
    total = len(data)
    for offset in range(0, max(total, 1), max_chunk_bytes):
        piece = data[offset : offset + max_chunk_bytes]
        fields = worker_pb2.TensorChunk(offset=offset, total_bytes=total)
        if offset == 0:
            fields.header.CopyFrom(header)
        yield b"".join((fields.SerializeToString(), _DATA_TAG, _varint(len(piece)), piece))


def _read_varint(raw: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw):
            raise InvalidRequest("a tensor chunk ends inside a varint")
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def parse_chunk(raw: bytes) -> tuple[worker_pb2.TensorChunk, memoryview]:
    """A serialized TensorChunk as its small fields plus a view of its data (no copy of the data)."""
    view, pos, small, data = memoryview(raw), 0, bytearray(), memoryview(b"")
    while pos < len(view):
        start = pos
        key, pos = _read_varint(view, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _read_varint(view, pos)
        elif wire == 2:
            length, pos = _read_varint(view, pos)
            if pos + length > len(view):
                raise InvalidRequest("a tensor chunk's field runs past the message")
            if key >> 3 == 3:
                data, pos = view[pos : pos + length], pos + length
                continue
            pos += length
        else:
            raise InvalidRequest(f"unexpected wire type {wire} in a tensor chunk")
        small += view[start:pos]
    try:
        return worker_pb2.TensorChunk.FromString(bytes(small)), data
    except DecodeError as exc:
        raise InvalidRequest(f"could not parse a tensor chunk: {exc}") from None


def chunk_tensor(header: worker_pb2.TensorHeader, data: memoryview,
                 max_chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[worker_pb2.TensorChunk]:
    """Chunks of at most `max_chunk_bytes`, in order; the header rides on the first (an empty tensor is one chunk)."""
    total = len(data)
    for offset in range(0, max(total, 1), max_chunk_bytes):
        chunk = worker_pb2.TensorChunk(offset=offset, total_bytes=total,
                                       data=bytes(data[offset : offset + max_chunk_bytes]))
        if offset == 0:
            chunk.header.CopyFrom(header)
        yield chunk


class ChunkAssembler:
    """Collects a Pull stream into one buffer, refusing gaps, reordering, overruns and short streams.

    The buffer is a uint8 tensor from `allocate` (pinned memory when the KV goes on to a GPU; by default host
    memory in huge pages, common.kv.buffers)."""

    def __init__(self, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self.header: worker_pb2.TensorHeader | None = None
        self.buffer = memoryview(bytearray())
        self.received = 0
        self._allocate = allocate or host_empty
        self._bytes = torch.empty(0, dtype=torch.uint8)

    def add(self, chunk: worker_pb2.TensorChunk, data: memoryview | bytes | None = None) -> None:
        """Take one chunk; `data` is its payload when parse_chunk split it off (else chunk.data)."""
        data = chunk.data if data is None else data
        if self.header is None:
            self._start(chunk)
        elif chunk.HasField("header"):
            raise InvalidRequest(f"chunk at offset {chunk.offset} repeats the header; only the first chunk has one")
        if chunk.offset != self.received:
            raise InvalidRequest(f"chunk at offset {chunk.offset}, expected {self.received} "
                                 "(a chunk is missing or out of order)")
        if chunk.total_bytes != len(self.buffer):
            raise InvalidRequest(f"chunk says the tensor has {chunk.total_bytes} bytes, the first said {len(self.buffer)}")
        end = self.received + len(data)
        if end > len(self.buffer):
            raise InvalidRequest(f"chunk at offset {chunk.offset} runs to byte {end}, past the tensor's {len(self.buffer)}")
        self.buffer[self.received : end] = data
        self.received = end

    def _start(self, chunk: worker_pb2.TensorChunk) -> None:
        if not chunk.HasField("header"):
            raise InvalidRequest(f"the first chunk (offset {chunk.offset}) has no header")
        header = chunk.header
        expected = math.prod(header.shape) * torch_dtype(header.dtype).itemsize
        if chunk.total_bytes != expected:
            raise LayoutMismatch(f"tensor of shape {list(header.shape)} and dtype {header.dtype} has {expected} bytes, "
                                 f"the stream says {chunk.total_bytes}")
        self.header = header
        self._bytes = self._allocate(expected)
        self.buffer = memoryview(self._bytes.numpy()).cast("B") if expected else memoryview(bytearray())

    def finish(self) -> tuple[worker_pb2.TensorHeader, torch.Tensor]:
        if self.header is None:
            raise InvalidRequest("the tensor stream was empty (no header)")
        if self.received != len(self.buffer):
            raise InvalidRequest(f"the tensor stream ended at byte {self.received} of {len(self.buffer)}")
        if _LITTLE and len(self.buffer):  # a view of the (pinned) buffer itself
            return self.header, self._bytes.view(torch_dtype(self.header.dtype)).reshape(tuple(self.header.shape))
        return self.header, tensor_from_bytes(bytearray(self.buffer), self.header.shape, self.header.dtype)


def assemble(chunks: Iterable[worker_pb2.TensorChunk]) -> tuple[worker_pb2.TensorHeader, torch.Tensor]:
    assembler = ChunkAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()
