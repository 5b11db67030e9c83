"""KV data plane without gRPC: tensors → chunks → tensors, and every way a chunk stream can be wrong."""
import pytest
import torch

from common.errors import InvalidRequest, LayoutMismatch
from common.kv.chunks import (DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, ChunkAssembler, assemble, chunk_size, chunk_tensor,
                              encoded_chunks, parse_chunk, tensor_to_bytes)
from common.kv.layout import KvLayout
from common.kv.paths import check_pullable
from common.kv.session import KvSession
from common.kv.wire import kv_from_pull, kv_header, session_ref
from common.pb.disagg.v1 import common_pb2, worker_pb2

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", fingerprint="f00d")


def _header(tensor: torch.Tensor) -> worker_pb2.TensorHeader:
    return worker_pb2.TensorHeader(kind=worker_pb2.TENSOR_KIND_EMBEDDING, shape=list(tensor.shape),
                                   dtype=str(tensor.dtype).removeprefix("torch."), layout="token,hidden")


def _chunks(tensor: torch.Tensor, size: int) -> list[worker_pb2.TensorChunk]:
    return list(chunk_tensor(_header(tensor), tensor_to_bytes(tensor), size))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [7, 64, 1000, MAX_CHUNK_BYTES])
def test_round_trip_is_bit_exact(dtype, size):
    tensor = torch.randn(13, 37, generator=torch.Generator().manual_seed(0)).to(dtype)
    chunks = _chunks(tensor, size)
    assert all(len(c.data) <= size for c in chunks)
    assert [c.offset for c in chunks] == list(range(0, len(tensor_to_bytes(tensor)), size))
    assert chunks[0].HasField("header") and not any(c.HasField("header") for c in chunks[1:])
    header, back = assemble(chunks)
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))


@pytest.mark.parametrize("size", [1000, DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES])
def test_serialized_chunks_parse_back_into_the_same_tensor(size):
    tensor = torch.randn(3 * MAX_CHUNK_BYTES // 4 + 5, generator=torch.Generator().manual_seed(1))
    raw = list(encoded_chunks(_header(tensor), tensor_to_bytes(tensor), size))
    assert [worker_pb2.TensorChunk.FromString(r) for r in raw] == _chunks(tensor, size)  # protobuf's own encoding
    assembler = ChunkAssembler()
    for message in raw:
        assembler.add(*parse_chunk(message))
    header, back = assembler.finish()
    assert list(header.shape) == list(tensor.shape) and torch.equal(back, tensor)


def test_bytes_are_little_endian():
    assert bytes(tensor_to_bytes(torch.tensor([1.0], dtype=torch.bfloat16))) == b"\x80\x3f"
    assert bytes(tensor_to_bytes(torch.tensor([1], dtype=torch.int32))) == b"\x01\x00\x00\x00"


def test_empty_tensor_is_one_chunk_with_the_header():
    (chunk,) = _chunks(torch.empty(0, 4), 16)
    assert chunk.total_bytes == 0 and chunk.HasField("header")
    assert assemble([chunk])[1].shape == (0, 4)


@pytest.mark.parametrize("corrupt, error, message", [
    (lambda cs: cs[:1] + cs[2:], InvalidRequest, "chunk at offset 200, expected 100"),
    (lambda cs: cs[:-1], InvalidRequest, "ended at byte 1000 of 1092"),
    (lambda cs: [cs[1], cs[0], *cs[2:]], InvalidRequest, "the first chunk .* has no header"),
    (lambda cs: [], InvalidRequest, "empty"),
    (lambda cs: cs + cs[-1:], InvalidRequest, "chunk at offset 1000, expected 1092"),
    (lambda cs: [_with(cs[0], total_bytes=1093), *cs[1:]], LayoutMismatch, "has 1092 bytes, the stream says 1093"),
    (lambda cs: [cs[0], _with(cs[1], total_bytes=5), *cs[2:]], InvalidRequest, "has 5 bytes, the first said 1092"),
    (lambda cs: [cs[0], _with(cs[1], data=b"x" * 2000), *cs[2:]], InvalidRequest, "past the tensor's 1092"),
    (lambda cs: [cs[0], _with(cs[1], header=cs[0].header), *cs[2:]], InvalidRequest, "repeats the header"),
])
def test_corrupt_streams_are_refused_with_a_clear_message(corrupt, error, message):
    chunks = _chunks(torch.zeros(7, 39), 100)  # 1092 bytes: not a multiple of the chunk size
    with pytest.raises(error, match=message):
        assemble(corrupt(chunks))


def _with(chunk: worker_pb2.TensorChunk, **changes) -> worker_pb2.TensorChunk:
    copy = worker_pb2.TensorChunk()
    copy.CopyFrom(chunk)
    for name, value in changes.items():
        getattr(copy, name).CopyFrom(value) if name == "header" else setattr(copy, name, value)
    return copy


def test_unknown_dtype_is_a_layout_mismatch():
    header = worker_pb2.TensorHeader(shape=[2], dtype="complex_nonsense")
    with pytest.raises(LayoutMismatch, match="unsupported tensor dtype 'complex_nonsense'"):
        assemble([worker_pb2.TensorChunk(offset=0, total_bytes=8, data=b"\0" * 8, header=header)])


def test_chunk_size_stays_within_4mib_and_the_message_cap():
    assert chunk_size(0, 16 << 20, 1 << 20) == DEFAULT_CHUNK_BYTES < MAX_CHUNK_BYTES
    assert chunk_size(100 << 20, 16 << 20, 1 << 20) == MAX_CHUNK_BYTES
    assert chunk_size(1000, 16 << 20, 1 << 20) == 1000
    assert chunk_size(4 << 20, 3 << 20, 1 << 20) == 2 << 20
    assert chunk_size(0, DEFAULT_CHUNK_BYTES + 1000, 1 << 20) == 1000
    with pytest.raises(InvalidRequest, match="leaves no room"):
        chunk_size(0, 1 << 20, 1 << 20)


def _session(num_tokens: int = 10) -> tuple[common_pb2.KvSessionRef, torch.Tensor]:
    block_ids = [7, 3, 9]
    session = KvSession("s1", "r1", block_ids, num_tokens, first_token=42, expires_at=0.0, expires_at_unix=1.5)
    blocks = torch.randn(LAYOUT.block_shape(len(block_ids)))
    return session_ref(LAYOUT, session, "127.0.0.1:1"), blocks


def test_kv_round_trip_through_the_session_ref():
    ref, blocks = _session()
    assert ref.expires_at_unix_ms == 1500 and ref.first_token == 42 and list(ref.block_ids) == [7, 3, 9]
    chunks = chunk_tensor(kv_header(LAYOUT, ref.block_ids, blocks), tensor_to_bytes(blocks), 1000)
    header, tensor = assemble(chunks)
    export = kv_from_pull(header, tensor, ref)
    assert export.layout == LAYOUT and export.num_tokens == 10 and torch.equal(export.blocks, blocks)


@pytest.mark.parametrize("field, value, message", [
    ("fingerprint", "beef", "fingerprint: pulled='f00d' ref='beef'"),
    ("dtype", "bfloat16", "dtype: pulled='float32' ref='bfloat16'"),
    ("num_kv_heads", 4, r"shape: pulled=\[2, 2, 3, 4, 2, 8\] ref=\[2, 2, 3, 4, 4, 8\]"),
])
def test_pulled_header_that_disagrees_with_the_ref_is_refused(field, value, message):
    ref, blocks = _session()
    header = kv_header(LAYOUT, ref.block_ids, blocks)
    setattr(ref, field, value)
    with pytest.raises(LayoutMismatch, match=message):
        kv_from_pull(header, blocks, ref)


def test_pulled_block_ids_must_be_the_sessions():
    ref, blocks = _session()
    with pytest.raises(LayoutMismatch, match=r"block_ids: pulled=\[3, 7, 9\] ref=\[7, 3, 9\]"):
        kv_from_pull(kv_header(LAYOUT, [3, 7, 9], blocks), blocks, ref)


def test_unpullable_refs_are_refused_before_any_transfer():
    ref, _ = _session()
    ref.transfer_backend = common_pb2.TRANSFER_BACKEND_TRTLLM  # TensorRT-LLM's transceiver moves its own KV
    with pytest.raises(InvalidRequest, match="TRANSFER_BACKEND_TRTLLM is not supported"):
        check_pullable(ref)
    ref, _ = _session(num_tokens=13)
    with pytest.raises(InvalidRequest, match="lists 3 blocks for 13 tokens of block size 4"):
        check_pullable(ref)
