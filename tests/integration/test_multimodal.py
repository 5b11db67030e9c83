"""Images through router → encode → prefill → decode as four real processes, against HF generate.

The model is a tiny random LLaVA (CLIP vision tower, Llama text model, SmolLM2's tokenizer with an
<image> token); one encode, one prefill and one decode worker serve it behind one router.
"""
from __future__ import annotations

import io
import os
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.conftest import WORKER_ENV
from tests.integration.processes import ServiceProcess, start_services, stop_cleanly
from benchmarks.tiny_llava import NUM_IMAGE_TOKENS, hf_llava_greedy, make_smollm2_llava, make_tiny_llava, png_bytes

MAX_TOKENS = 8
ENGINE_ARGS = ("--block-size", "4", "--num-kv-blocks", "128")
# Short enough for the expiry test, long enough that "released within 3 s" cannot be an expiry.
EMBEDDING_TTL_S = 5.0


def _greedy(max_tokens: int = MAX_TOKENS) -> dict:
    return dict(sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))


def _collect(responses) -> tuple[list[int], common_pb2.Finished]:
    tokens, finished = [], None
    for response in responses:
        if response.HasField("delta"):
            tokens += response.delta.token_ids
        else:
            finished = response.finished
    return tokens, finished


def _start(model: str, encode_args: tuple[str, ...] = (), other_routers: bool = False) -> list[ServiceProcess]:
    """encode, prefill, decode, then the router over them; all stopped if any fails to start.

    With other_routers, two more routers start beside it: one without an encode worker, and one
    that runs every prompt aggregated on the decode worker (--min-remote-prefill-tokens).
    """
    workers = start_services([("encode", ("--model", model, *encode_args)), ("prefill", ("--model", model, *ENGINE_ARGS)),
                              ("decode", ("--model", model, *ENGINE_ARGS))], env=WORKER_ENV)
    routers = [("router", _router_args(model, *workers))]
    if other_routers:
        routers += [("router", _router_args(model, None, *workers[1:])),
                    ("router", (*_router_args(model, *workers), "--min-remote-prefill-tokens", "100000"))]
    try:
        started = start_services(routers, env=WORKER_ENV)
    except BaseException:
        stop_cleanly(workers)
        raise
    return [*workers, *started]


def _router_args(model: str, encode: ServiceProcess | None, prefill: ServiceProcess, decode: ServiceProcess):
    args = ("--model", model, "--prefill-workers", prefill.address, "--decode-workers", decode.address)
    return args + (("--encode-workers", encode.address) if encode else ())


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_llava(tmp_path_factory.mktemp("models") / "tiny-llava"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "inside.png").write_bytes(png_bytes(40))
    outside = root.parent / "outside.png"
    outside.write_bytes(png_bytes(41))
    os.symlink(outside, root / "link.png")
    return root


@pytest.fixture(scope="module")
def services(model, media_dir):
    processes = _start(model, ("--allowed-media-dir", str(media_dir), "--max-image-pixels", "1000000",
                               "--embedding-ttl", str(EMBEDDING_TTL_S)), other_routers=True)
    yield dict(zip(["encode", "prefill", "decode", "router", "no_encode_router", "aggregated_router"], processes))
    stop_cleanly(processes)


def _stub(process: ServiceProcess) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(process.address))


def _load(process: ServiceProcess) -> worker_pb2.Load:
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(process.address)).GetLoad(worker_pb2.GetLoadRequest())


def _info(process: ServiceProcess) -> worker_pb2.WorkerInfo:
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(process.address)).GetInfo(worker_pb2.GetInfoRequest())


def _wait_released(services: dict, timeout_s: float = 3.0) -> None:
    """No embedding held by encode, no block or session held by prefill and decode, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        encode, prefill, decode = (_load(services[r]) for r in ("encode", "prefill", "decode"))
        done = (encode.stored_tensors == 0 and encode.stored_tensor_bytes == 0
                and all(l.kv_blocks_free == l.kv_blocks_total and not l.active_kv_sessions and not l.running_requests
                        for l in (prefill, decode)))
        if done:
            return
        assert time.monotonic() < deadline, f"resources still held: encode={encode} prefill={prefill} decode={decode}"
        time.sleep(0.05)


def _image_request(text: str, *images: bytes, **kwargs) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=text, images=[common_pb2.Image(data=d) for d in images],
                                          **{**_greedy(), **kwargs})


def test_greedy_with_images_matches_hf_generate(model, services):
    stub = _stub(services["router"])
    cases = [("<image>\nWhat is in the picture?", [png_bytes(1)]),
             ("Compare <image> with <image>.", [png_bytes(2), png_bytes(3, size=(64, 20))]),
             ("A text-only question.", [])]
    for text, images in cases:
        prompt, expected = hf_llava_greedy(model, images, text, MAX_TOKENS)
        tokens, finished = _collect(stub.Generate(_image_request(text, *images)))
        assert tokens == expected, text
        assert finished.usage.prompt_tokens == len(prompt)
    _wait_released(services)


def test_image_without_marker_goes_first_and_data_url_and_path_work(model, services):
    import base64

    data = png_bytes(40)  # the file inside the allowed media dir
    _, expected = hf_llava_greedy(model, [data], "<image>\nDescribe it.", MAX_TOKENS)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    stub = _stub(services["router"])
    for image in (common_pb2.Image(data_url=url), common_pb2.Image(path="inside.png"), common_pb2.Image(data=data)):
        request = generation_pb2.GenerateRequest(prompt="Describe it.", images=[image], **_greedy())
        assert _collect(stub.Generate(request))[0] == expected
    _wait_released(services)


def test_same_image_hits_the_prefix_cache_and_a_different_image_does_not(model, services):
    stub = _stub(services["router"])
    text = "<image>\nCount the colours in this one."
    prompt, expected_a = hf_llava_greedy(model, [png_bytes(10)], text, MAX_TOKENS)
    _, expected_b = hf_llava_greedy(model, [png_bytes(11)], text, MAX_TOKENS)
    tokens, finished = _collect(stub.Generate(_image_request(text, png_bytes(10))))
    assert tokens == expected_a and finished.usage.cached_prompt_tokens == 0
    tokens, finished = _collect(stub.Generate(_image_request(text, png_bytes(11))))
    assert tokens == expected_b and finished.usage.cached_prompt_tokens == 0  # same ids, other image
    tokens, finished = _collect(stub.Generate(_image_request(text, png_bytes(10))))
    assert tokens == expected_a and finished.usage.cached_prompt_tokens == (len(prompt) - 1) // 4 * 4
    _wait_released(services)


def test_cancelled_requests_release_their_embeddings(model, services):
    stub = _stub(services["router"])
    for delay_s in (0.0, 0.01, 0.03, 0.06, 0.1, 0.2):
        call = stub.Generate(_image_request("<image>\nTell a long story.", png_bytes(20), **_greedy(200)))
        time.sleep(delay_s)
        call.cancel()
    _wait_released(services, timeout_s=3.0)  # within the TTL: released, not expired
    _, expected = hf_llava_greedy(model, [png_bytes(21)], "<image>\nStill there?", MAX_TOKENS)
    assert _collect(stub.Generate(_image_request("<image>\nStill there?", png_bytes(21))))[0] == expected


def test_bad_images_are_invalid_argument_and_the_workers_keep_serving(model, services):
    png = png_bytes(30)
    huge = io.BytesIO()
    Image.fromarray(np.zeros((1, 20000, 3), dtype=np.uint8)).save(huge, format="PNG")
    many = io.BytesIO()
    Image.fromarray(np.zeros((1200, 1000, 3), dtype=np.uint8)).save(many, format="PNG")
    cases = [
        (common_pb2.Image(data=b"this is not an image"), "not a recognised image format"),
        (common_pb2.Image(data=png[: len(png) // 2]), "truncated or corrupt"),
        (common_pb2.Image(data=b""), "0 bytes"),
        (common_pb2.Image(data=huge.getvalue()), "sides may be at most 16384 pixels"),
        (common_pb2.Image(data=many.getvalue()), "more than the limit of 1000000"),
        (common_pb2.Image(data_url="data:image/png;base64,@@@"), "not valid base64"),
        (common_pb2.Image(path="../outside.png"), "outside the allowed media directory"),
        (common_pb2.Image(path="/etc/passwd"), "outside the allowed media directory"),
        (common_pb2.Image(path="link.png"), "outside the allowed media directory"),
        (common_pb2.Image(path="http://127.0.0.1:9/cat.png"), "fetching images by URL is off"),
    ]
    stub = _stub(services["router"])
    for image, message in cases:
        request = generation_pb2.GenerateRequest(prompt="<image> what?", images=[image], **_greedy())
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (message, info.value.details())
        assert message in info.value.details() and "image 0" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_image_request("<image> and <image>", png)))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "2 image placeholders" in info.value.details()
    _, expected = hf_llava_greedy(model, [png], "<image> what?", MAX_TOKENS)
    assert _collect(stub.Generate(_image_request("<image> what?", png)))[0] == expected
    _wait_released(services)


def test_encode_handles_expire_and_free_their_memory(services):
    _wait_released(services)
    with grpc.insecure_channel(services["encode"].address) as channel:
        response = worker_pb2_grpc.EncoderStub(channel).Encode(worker_pb2.EncodeRequest(
            images=[common_pb2.Image(data=png_bytes(50)), common_pb2.Image(data=png_bytes(50))]))
        refs = list(response.embeddings)
        assert [list(r.shape) for r in refs] == [[NUM_IMAGE_TOKENS, 64]] * 2
        assert all(_info(services[role]).supports_images for role in ("encode", "prefill", "decode"))
        assert refs[0].content_hash == refs[1].content_hash and refs[0].handle != refs[1].handle
        load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())
        assert (load.stored_tensors, load.stored_tensor_bytes) == (2, 2 * NUM_IMAGE_TOKENS * 64 * 4)
        time.sleep(EMBEDDING_TTL_S + 0.5)
        load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest())
        assert (load.stored_tensors, load.stored_tensor_bytes) == (0, 0)
        with pytest.raises(grpc.RpcError) as info:
            list(worker_pb2_grpc.TensorStoreStub(channel).Pull(worker_pb2.PullRequest(handle=refs[0].handle)))
        assert info.value.code() is grpc.StatusCode.NOT_FOUND and "expired" in info.value.details()


def test_images_without_an_encode_worker_are_failed_precondition(model, services):
    stub = _stub(services["no_encode_router"])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_image_request("<image> what?", png_bytes(1))))
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "no encode worker" in info.value.details()
    _, expected = hf_llava_greedy(model, [], "Just text.", MAX_TOKENS)
    assert _collect(stub.Generate(_image_request("Just text.")))[0] == expected  # text-only requests skip encode


def test_aggregated_decode_pulls_the_embeddings_itself(model, services):
    stub = _stub(services["aggregated_router"])
    text = "<image>\nAggregated, please."
    prompt, expected = hf_llava_greedy(model, [png_bytes(70)], text, MAX_TOKENS)
    assert _collect(stub.Generate(_image_request(text, png_bytes(70))))[0] == expected
    tokens, finished = _collect(stub.Generate(_image_request(text, png_bytes(70))))
    assert tokens == expected and finished.usage.cached_prompt_tokens == (len(prompt) - 1) // 4 * 4
    _wait_released(services)


@pytest.mark.slow
def test_smollm2_under_a_random_vision_tower_matches_hf_generate(tmp_path):
    model = str(make_smollm2_llava(tmp_path / "smollm2-llava"))
    processes = _start(model)
    try:
        stub = _stub(processes[-1])
        for text, seed in [("<image>\nWhat do you see?", 60), ("Describe <image> briefly.", 61)]:
            _, expected = hf_llava_greedy(model, [png_bytes(seed)], text, MAX_TOKENS)
            assert _collect(stub.Generate(_image_request(text, png_bytes(seed))))[0] == expected
        tokens, finished = _collect(stub.Generate(_image_request("<image>\nWhat do you see?", png_bytes(60))))
        assert finished.usage.cached_prompt_tokens > 0
    finally:
        stop_cleanly(processes)
