"""Embedding handles (TTL, byte cap, release), placeholder expansion and image-keyed block hashes."""
from __future__ import annotations

import time

import pytest
import torch

from common.engine.multimodal import ImageEmbedding, MultiModalInputs
from common.errors import InvalidRequest, ResourceExhausted, SessionExpired
from common.kv.chunks import assemble, chunk_tensor, tensor_to_bytes
from common.kv.embeddings import EmbeddingTable, embedding_header, embedding_ref
from services.router.images import ImageTokens

IMG = 9


def test_embedding_table_releases_expires_and_caps_bytes():
    table = EmbeddingTable(ttl_s=0.2, max_bytes=3 * 4 * 8)
    a = table.put(torch.ones(4, 2), "ha")
    b = table.put(torch.zeros(4, 2), "hb")
    assert table.stored() == (2, 64)
    with pytest.raises(ResourceExhausted, match="--max-stored-bytes=96"):
        table.put(torch.ones(8, 2), "hc")
    assert table.release(a.handle) and not table.release(a.handle)
    assert table.get(b.handle).content_hash == "hb"
    time.sleep(0.25)
    assert table.stored() == (0, 0) and table.num_expired == 1
    with pytest.raises(SessionExpired, match="unknown, released or expired"):
        table.get(b.handle)


def test_embedding_round_trips_through_tensor_store_chunks():
    entry = EmbeddingTable(60, 1 << 20).put(torch.randn(16, 8), "h")
    ref = embedding_ref(entry, "host:1")
    assert (list(ref.shape), ref.placeholder_token_count, ref.content_hash) == ([16, 8], 16, "h")
    header, tensor = assemble(chunk_tensor(embedding_header(entry.tensor), tensor_to_bytes(entry.tensor), 100))
    assert header.layout == "token,hidden" and torch.equal(tensor, entry.tensor)


def test_placeholders_expand_per_image_and_mark_unmarked_prompts():
    tokens = ImageTokens(IMG, "<image>", 3)
    assert tokens.expand([1, IMG, 2, IMG], 2) == [1, IMG, IMG, IMG, 2, IMG, IMG, IMG]
    assert tokens.expand([1, IMG, IMG, IMG, 2], 1) == [1, IMG, IMG, IMG, 2]  # already expanded
    with pytest.raises(InvalidRequest, match="2 image placeholders .* for 1 images"):
        tokens.expand([IMG, 1, IMG], 1)
    assert tokens.mark_text("hi", 2) == "<image>\n<image>\nhi" and tokens.mark_text("a <image>", 1) == "a <image>"
    chat = tokens.mark_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], 1)
    assert chat[1]["content"] == "<image>\nq" and chat[0]["content"] == "s"


def test_only_blocks_covering_an_image_carry_its_hash():
    prompt = [1, 2, 3, 4, IMG, IMG, IMG, 5]
    mm = MultiModalInputs.build(prompt, IMG, [ImageEmbedding(torch.zeros(3, 4), "abc")], hidden_size=4)
    assert mm.block_key(0, 4) == b"" and mm.block_key(4, 8) == b"abc@0" and mm.block_key(6, 10) == b"abc@-2"
    offsets, rows = mm.rows_in(5, 8)
    assert offsets.tolist() == [0, 1] and rows.shape == (2, 4)
    other = MultiModalInputs.imported(prompt, IMG, 4)
    assert other.block_key(4, 8) != mm.block_key(4, 8) and other.rows_in(0, 8)[1].shape[0] == 0


def test_router_expands_placeholders_for_prompt_chat_and_token_ids(tmp_path):
    from common.pb.disagg.v1 import common_pb2, generation_pb2
    from services.router.frontends.grpc_convert import request_from_proto
    from services.router.generation import ServedModel
    from services.router.prepare import RequestPreparer
    from benchmarks.tiny_llava import NUM_IMAGE_TOKENS, make_tiny_llava

    preparer = RequestPreparer.from_model_dir(make_tiny_llava(tmp_path / "llava"))
    image_id = preparer.facts.image_token_id
    model = ServedModel("tiny-llava", 512)
    image = [common_pb2.Image(data=b"png")]
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="What is it?")])
    requests = [generation_pb2.GenerateRequest(prompt="<image> What is it?", images=image),
                generation_pb2.GenerateRequest(prompt="What is it?", images=image),  # marker added in front
                generation_pb2.GenerateRequest(chat=chat, images=image),
                generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, image_id, 6]), images=image)]
    for request in requests:
        prepared = preparer.prepare(request_from_proto(request, "r"), model)
        assert prepared.prompt.count(image_id) == NUM_IMAGE_TOKENS and len(prepared.images) == 1, request
    with pytest.raises(InvalidRequest, match="0 image placeholders"):
        preparer.prepare(request_from_proto(generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6]), images=image), "r"), model)
