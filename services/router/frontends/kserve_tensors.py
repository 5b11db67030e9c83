"""KServe v2 tensors on the wire: inputs in either format a client may use, BYTES outputs in the raw format.

An input's elements come either in its `contents` (the repeated field of its datatype) or in the request's
`raw_input_contents` (one entry per input, in order; what tritonclient sends): fixed-size types are packed
little-endian, BYTES elements are each a 4-byte little-endian length and the bytes. Every malformed tensor is
InvalidRequest naming the input.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Iterable, Union

from common.errors import InvalidRequest
from common.pb.inference import grpc_service_pb2 as pb

Value = Union[bytes, bool, int, float]

# struct codes of the fixed-size datatypes (raw contents are little-endian, no padding)
_STRUCT = {"BOOL": "?", "INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q", "UINT8": "B", "UINT16": "H",
           "UINT32": "I", "UINT64": "Q", "FP16": "e", "FP32": "f", "FP64": "d"}
# the InferTensorContents field each datatype travels in (FP16 has none: raw only)
_CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                   "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                   "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                   "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
DATATYPES = (*_STRUCT, "BYTES")
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class Tensor:
    """One decoded input: its elements flattened in row-major order."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: tuple[Value, ...]


def decode_inputs(request: pb.ModelInferRequest) -> dict[str, Tensor]:
    """Every input of `request` by name, from whichever format it came in."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
                             "it needs one per input, in the order of inputs")
    tensors: dict[str, Tensor] = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name in tensors:
            raise InvalidRequest(f"input '{tensor.name}' is given twice")
        tensors[tensor.name] = _decode(tensor, raw[index] if raw else None)
    return tensors


def _decode(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> Tensor:
    where = f"input '{tensor.name}'"
    if tensor.datatype not in DATATYPES:
        raise InvalidRequest(f"{where}: datatype {tensor.datatype!r} is not supported (one of {', '.join(DATATYPES)})")
    shared = sorted(key for key in tensor.parameters if key.startswith("shared_memory"))
    if shared:
        raise InvalidRequest(f"{where}: shared memory is not supported (parameter '{shared[0]}'); send the data")
    shape = tuple(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise InvalidRequest(f"{where}: shape {list(shape)} has a negative dimension")
    count = math.prod(shape)
    if raw is not None:
        if tensor.HasField("contents"):
            raise InvalidRequest(f"{where}: has both contents and raw_input_contents; send one of them")
        values = _from_raw(where, tensor.datatype, raw, count)
    else:
        values = _from_contents(where, tensor.datatype, tensor.contents)
    if len(values) != count:
        raise InvalidRequest(f"{where}: shape {list(shape)} holds {count} elements, the data has {len(values)}")
    return Tensor(tensor.name, tensor.datatype, shape, values)


def _from_raw(where: str, datatype: str, raw: bytes, count: int) -> tuple[Value, ...]:
    if datatype == "BYTES":
        return _split_bytes(where, raw)
    size = struct.calcsize(_STRUCT[datatype])
    if len(raw) != count * size:  # checked before unpacking: a wrong size never allocates a huge tuple
        raise InvalidRequest(f"{where}: raw content has {len(raw)} bytes; {count} {datatype} elements "
                             f"take {count * size}")
    return struct.unpack(f"<{count}{_STRUCT[datatype]}", raw)


def _split_bytes(where: str, raw: bytes) -> tuple[bytes, ...]:
    """Triton's raw BYTES: each element a 4-byte little-endian length, then its bytes."""
    elements, offset = [], 0
    while offset < len(raw):
        if offset + _LENGTH.size > len(raw):
            raise InvalidRequest(f"{where}: raw BYTES content ends inside an element's 4-byte length prefix")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += _LENGTH.size
        if offset + length > len(raw):
            raise InvalidRequest(f"{where}: raw BYTES element of {length} bytes runs past the content's end "
                                 f"({len(raw) - offset} left); each element is a 4-byte little-endian length "
                                 "and then its bytes")
        elements.append(raw[offset:offset + length])
        offset += length
    return tuple(elements)


def _from_contents(where: str, datatype: str, contents: pb.InferTensorContents) -> tuple[Value, ...]:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidRequest(f"{where}: {datatype} data goes in raw_input_contents (contents has no field for it)")
    stray = [f.name for f, _ in contents.ListFields() if f.name != field]
    if stray:
        raise InvalidRequest(f"{where}: datatype {datatype} takes contents.{field}, got contents.{stray[0]}")
    return tuple(getattr(contents, field))


def encode_bytes(values: Iterable[bytes]) -> bytes:
    """BYTES elements in Triton's raw format (what tritonclient's InferResult.as_numpy reads)."""
    return b"".join(_LENGTH.pack(len(value)) + value for value in values)


def bytes_output(name: str, values: list[bytes]) -> tuple[pb.ModelInferResponse.InferOutputTensor, bytes]:
    """A 1-D BYTES output tensor and its raw content."""
    return pb.ModelInferResponse.InferOutputTensor(name=name, datatype="BYTES", shape=[len(values)]), \
        encode_bytes(values)
