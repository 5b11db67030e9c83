"""A unary answer that is ready when its caller's deadline has (all but) passed is not sent, and what it names is
freed at once. grpc does not tell a handler that the answer it returned went unread: the caller's timer fires
first (it started before the request travelled), the caller gets DEADLINE_EXCEEDED without the session id, and
the worker would hold the KV session (or the embeddings) until its TTL, past any leak check, stalling a drain.

The servicers run here in-process on a real tiny engine (prefill) and a real embedding table (encode), called
with a ServicerContext stand-in whose only job is to report the time left and record the abort.
"""
from __future__ import annotations

import asyncio
import io

import grpc
import pytest
import torch
from PIL import Image

from common.engine.config import EngineConfig
from common.engine.start import start_engine
from common.kv.embeddings import EmbeddingTable
from common.kv.wire import ChannelCache
from common.media import MediaConfig
from common.pb.disagg.v1 import common_pb2, worker_pb2
from services.encode.server import EncoderServicer, EncodeState
from services.kit.serving import DELIVERY_MARGIN_S
from services.prefill.__main__ import SPEC as PREFILL
from services.prefill.server import PrefillServicer
from services.worker.service import WorkerState

PROMPT = list(range(3, 22))


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    """What the servicers ask of grpc.aio.ServicerContext: the caller's time left, and abort()."""

    def __init__(self, remaining_s: float | None):
        self.remaining_s = remaining_s

    def time_remaining(self) -> float | None:
        return self.remaining_s

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def _prefill_request() -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(request_id="r", token_ids=PROMPT,
                                     sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4))


def test_a_prefill_answer_ready_past_the_deadline_is_refused_and_its_session_freed(tiny_llama):
    engine = start_engine(EngineConfig(model=tiny_llama, block_size=4, num_kv_blocks=64))

    async def run() -> tuple:
        state = WorkerState(worker_pb2.WORKER_ROLE_PREFILL, "tiny")
        await PREFILL.attach(state, engine)
        servicer = PrefillServicer(state, ChannelCache())
        with pytest.raises(Aborted) as late:
            await servicer.Prefill(_prefill_request(), Context(DELIVERY_MARGIN_S / 4))
        await state.drain(10)  # the release runs in the background, as it does when a caller cancels
        after_late = await engine.load()
        answered = await servicer.Prefill(_prefill_request(), Context(None))  # no deadline: answered
        held = await engine.load()
        await engine.release_session(answered.session.session_id)
        await state.drain(10)
        return late.value, after_late, answered, held

    try:
        late, after_late, answered, held = asyncio.run(run())
    finally:
        engine.shutdown()
    assert late.code is grpc.StatusCode.DEADLINE_EXCEEDED and "prefill answer" in late.details, late
    assert (after_late.active_sessions, after_late.kv_blocks_free) == (0, after_late.kv_blocks_total)
    assert answered.session.session_id and held.active_sessions == 1  # the same request, with time: a session


class _Encoder:
    """A vision model's output shape for each image (the model itself is not what this pins)."""

    tokens_per_image, hidden_size = 4, 8

    def encode(self, images: list) -> list[torch.Tensor]:
        return [torch.ones(self.tokens_per_image, self.hidden_size) for _ in images]


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_embeddings_ready_past_the_deadline_are_refused_and_freed():
    state = EncodeState(model_name="tiny-vision", table=EmbeddingTable(ttl_s=60, max_bytes=1 << 20),
                        media=MediaConfig(), max_images_per_request=4, encoder=_Encoder())
    servicer = EncoderServicer(state)
    request = worker_pb2.EncodeRequest(request_id="r", images=[common_pb2.Image(data=_png())] * 2)

    async def run() -> tuple:
        with pytest.raises(Aborted) as late:
            await servicer.Encode(request, Context(0.0))
        stored_after_late = state.table.stored()[0]
        answered = await servicer.Encode(request, Context(5.0))
        return late.value, stored_after_late, answered

    late, stored_after_late, answered = asyncio.run(run())
    assert late.code is grpc.StatusCode.DEADLINE_EXCEEDED and "embeddings" in late.details, late
    assert stored_after_late == 0
    assert len(answered.embeddings) == 2 and state.table.stored()[0] == 2
