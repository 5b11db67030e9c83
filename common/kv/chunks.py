"""Tensors as TensorStore chunks: raw little-endian bytes cut into ordered pieces, and back.

No gRPC here: a tensor becomes a TensorHeader plus bytes, the bytes become TensorChunk
messages, and an assembler checks a received chunk sequence before it is trusted.
"""
from __future__ import annotations

import math
import sys
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from common.errors import InvalidRequest, LayoutMismatch
from common.pb.disagg.v1 import worker_pb2

MAX_CHUNK_BYTES = 4 * 1024 * 1024
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
    """The data bytes per chunk: what the puller asked for (0 = default), within 4 MiB and the message cap."""
    size = min(requested or MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, max_message_bytes - header_room)
    if size < 1:
        raise InvalidRequest(f"max message size {max_message_bytes} leaves no room for tensor data")
    return size


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
    """Collects a Pull stream into one buffer, refusing gaps, reordering, overruns and short streams."""

    def __init__(self) -> None:
        self.header: worker_pb2.TensorHeader | None = None
        self.buffer = bytearray()
        self.received = 0

    def add(self, chunk: worker_pb2.TensorChunk) -> None:
        if self.header is None:
            self._start(chunk)
        elif chunk.HasField("header"):
            raise InvalidRequest(f"chunk at offset {chunk.offset} repeats the header; only the first chunk has one")
        if chunk.offset != self.received:
            raise InvalidRequest(f"chunk at offset {chunk.offset}, expected {self.received} "
                                 "(a chunk is missing or out of order)")
        if chunk.total_bytes != len(self.buffer):
            raise InvalidRequest(f"chunk says the tensor has {chunk.total_bytes} bytes, the first said {len(self.buffer)}")
        end = self.received + len(chunk.data)
        if end > len(self.buffer):
            raise InvalidRequest(f"chunk at offset {chunk.offset} runs to byte {end}, past the tensor's {len(self.buffer)}")
        self.buffer[self.received : end] = chunk.data
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
        self.buffer = bytearray(expected)

    def finish(self) -> tuple[worker_pb2.TensorHeader, torch.Tensor]:
        if self.header is None:
            raise InvalidRequest("the tensor stream was empty (no header)")
        if self.received != len(self.buffer):
            raise InvalidRequest(f"the tensor stream ended at byte {self.received} of {len(self.buffer)}")
        return self.header, tensor_from_bytes(self.buffer, self.header.shape, self.header.dtype)


def assemble(chunks: Iterable[worker_pb2.TensorChunk]) -> tuple[worker_pb2.TensorHeader, torch.Tensor]:
    assembler = ChunkAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()
