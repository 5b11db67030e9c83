"""The LLaVA path in process: HF's vision half, our engine with spliced embeddings, against HF generate."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.models.llava import load_image_processor, load_vision_encoder
from common.engine.multimodal import ImageEmbedding
from common.engine.request import SamplingParams
from common.errors import InvalidRequest
from benchmarks.tiny_llava import NUM_IMAGE_TOKENS, _hf, hf_llava_greedy, make_tiny_llava, png_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return str(make_tiny_llava(tmp_path_factory.mktemp("tiny-llava")))


@pytest.fixture(scope="module")
def vision(llava_dir):
    return load_vision_encoder(llava_dir, torch.float32, torch.device("cpu")), load_image_processor(llava_dir)


def _embed(vision, data: bytes, seed_hash: str | None = None) -> ImageEmbedding:
    encoder, processor = vision
    pixels = processor(Image.open(io.BytesIO(data)).convert("RGB"), return_tensors="pt")["pixel_values"]
    return ImageEmbedding(encoder(pixels)[0], seed_hash or str(hash(data)))


def _engine(llava_dir: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=llava_dir, block_size=4, num_kv_blocks=128, **overrides))


def _run(engine: LLMEngine, rid: str, prompt: list[int], images: list[ImageEmbedding]) -> tuple[list[int], int]:
    engine.add_request(rid, prompt, GREEDY, images=images)
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    return tokens, cached


def test_vision_encoder_matches_hf_image_features(llava_dir, vision):
    model, processor = _hf(llava_dir)
    pixels = processor.image_processor(Image.open(io.BytesIO(png_bytes(1))), return_tensors="pt")["pixel_values"]
    ours = vision[0](pixels)
    with torch.inference_mode():
        theirs = model.model.get_image_features(pixels, vision_feature_layer=-2,
                                                vision_feature_select_strategy="default").pooler_output
    assert ours.shape == (1, NUM_IMAGE_TOKENS, 64)
    torch.testing.assert_close(ours[0], theirs[0])


@pytest.mark.parametrize("chunk", [2048, 5])  # 5: chunked prefill cuts through the image's placeholders
def test_greedy_with_image_matches_hf_generate(llava_dir, vision, chunk):
    data = png_bytes(2)
    prompt, expected = hf_llava_greedy(llava_dir, [data], "Look: <image>\nWhat is it?", GREEDY.max_tokens)
    engine = _engine(llava_dir, max_num_batched_tokens=chunk)
    tokens, _ = _run(engine, "r", prompt, [_embed(vision, data)])
    assert tokens == expected


@pytest.mark.slow  # a follower rank is a process
def test_an_image_request_at_tp2_matches_hf_generate(llava_dir, vision):
    """Rank 0 sends the image rows with the step; every rank splices them into its (vocab-parallel, all-reduced)
    embeddings. 49,153 vocabulary rows: the second rank's share is padded."""
    data = png_bytes(2)
    prompt, expected = hf_llava_greedy(llava_dir, [data], "Look: <image>\nWhat is it?", GREEDY.max_tokens)
    engine = _engine(llava_dir, max_num_batched_tokens=5, long_prefill_token_threshold=5, tensor_parallel_size=2)
    try:
        assert _run(engine, "r", prompt, [_embed(vision, data)])[0] == expected
    finally:
        engine.close()


def test_two_images_in_one_prompt_match_hf_generate(llava_dir, vision):
    a, b = png_bytes(3), png_bytes(4, size=(64, 20))
    prompt, expected = hf_llava_greedy(llava_dir, [a, b], "<image> and <image>: compare", GREEDY.max_tokens)
    tokens, _ = _run(_engine(llava_dir), "r", prompt, [_embed(vision, a), _embed(vision, b)])
    assert tokens == expected


def test_same_image_hits_prefix_cache_and_different_image_does_not(llava_dir, vision):
    a, b = png_bytes(5), png_bytes(6)
    prompt, expected_a = hf_llava_greedy(llava_dir, [a], "<image>\nDescribe the picture.", GREEDY.max_tokens)
    _, expected_b = hf_llava_greedy(llava_dir, [b], "<image>\nDescribe the picture.", GREEDY.max_tokens)
    engine = _engine(llava_dir)
    assert _run(engine, "a1", prompt, [_embed(vision, a, "hash-a")]) == (expected_a, 0)
    tokens, cached = _run(engine, "b1", prompt, [_embed(vision, b, "hash-b")])
    assert (tokens, cached) == (expected_b, 0)  # same token ids, different image: no block shared
    tokens, cached = _run(engine, "a2", prompt, [_embed(vision, a, "hash-a")])
    assert tokens == expected_a and cached == (len(prompt) - 1) // 4 * 4


def test_placeholder_count_mismatch_is_invalid(llava_dir, vision):
    engine = _engine(llava_dir)
    image = _embed(vision, png_bytes(7))
    token = engine.image_token_id
    with pytest.raises(InvalidRequest, match="15 image placeholder tokens"):
        engine.add_request("short", [5] + [token] * (NUM_IMAGE_TOKENS - 1) + [6], GREEDY, images=[image])
    with pytest.raises(InvalidRequest, match="placeholder tokens .* but no images"):
        engine.add_request("none", [5, token, 6], GREEDY)
    assert engine.requests == {}
