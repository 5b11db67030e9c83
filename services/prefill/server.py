"""Prefiller servicer: runs a prompt context_only, answers the first token and a KV session ref.

The ref names how the KV moves (the worker's KvPath): over our KV data plane (this worker's TensorStore, the
exporter's best backend first), or through a transport the engine drives (trtllm: TRANSFER_BACKEND_TRTLLM, the
context's DisaggregatedParams in `attributes`). Either way the importer releases the session through this worker's
TensorStore.
"""
from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import grpc

from common.engine.interface import Engine, EngineRequest
from common.engine.request import FinishReason, RequestOutput, RequestType, SamplingParams
from common.errors import InvalidRequest
from common.engine.multimodal import ImageEmbedding
from common.kv.embeddings import pull_and_release_embeddings
from common.kv.wire import ChannelCache
from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kit.convert import logprob_to_proto, logprobs_to_proto, request_type_name, sampling_from_proto
from services.kit.serving import abort_with, check_deliverable
from services.worker.tensor_store import TensorStoreServicer, add_tensor_store
from services.worker.ttft import prompt_parts
from services.worker.service import WorkerState

SERVICE_NAMES = [worker_pb2.DESCRIPTOR.services_by_name[name].full_name for name in ("Prefiller", "TensorStore")]
_CONTEXT_ONLY = (common_pb2.REQUEST_TYPE_UNSPECIFIED, common_pb2.REQUEST_TYPE_CONTEXT_ONLY)


def add_servicers(server: grpc.aio.Server, state: WorkerState, args: argparse.Namespace) -> None:
    channels = ChannelCache()  # to encode workers' TensorStores, for image embeddings
    state.closers.append(channels.close)
    worker_pb2_grpc.add_PrefillerServicer_to_server(PrefillServicer(state, channels), server)
    add_tensor_store(TensorStoreServicer(state), server)


class PrefillServicer(worker_pb2_grpc.PrefillerServicer):
    def __init__(self, state: WorkerState, channels: ChannelCache):
        self.state = state
        self.channels = channels

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        # Unique in the engine even when a router retries the same request id.
        engine_id = f"{request.request_id or 'prefill'}-{uuid.uuid4().hex[:8]}"
        received = time.monotonic()
        output: RequestOutput | None = None  # once set, the engine may hold a session of this request
        with self.state.admission.counted():
            try:
                engine = self.state.admit()
                sampling = _sampling(request)
                # Pulled and released before the engine sees the request: a cancel here leaves nothing held.
                images = await pull_and_release_embeddings(self.channels.get, request.embeddings,
                                                           context.time_remaining())
                outputs = await _context_only(engine, engine_id, request, sampling, images)
                output = outputs[0]
                response = await self._response(engine, output, request.request_id)
                _more_choices(response, outputs[1:])
                response.ttft_breakdown.CopyFrom(prompt_parts(received, output))
                check_deliverable(context, "the prefill answer")
            except asyncio.CancelledError:
                self._release_sessions_of(engine_id)  # the caller left: a session made meanwhile must not wait
                raise
            except Exception as exc:
                if output is not None:  # nobody will learn of the session the engine made
                    self._release_sessions_of(engine_id)
                await abort_with(context, exc)
            return response

    async def _response(self, engine: Engine, output: RequestOutput,
                        request_id: str) -> worker_pb2.PrefillResponse:
        if output.finish_reason is FinishReason.ABORT:
            raise self.state.ended()
        response = worker_pb2.PrefillResponse(first_token=output.new_token_ids[0],
                                              cached_tokens=output.num_cached_tokens)
        if output.new_logprobs:
            logprob = logprob_to_proto(output.new_logprobs[0])
            response.first_token_logprob = logprob.logprob
            response.first_token_top_logprobs.extend(logprob.top_logprobs)
        response.prompt_logprobs.extend(logprobs_to_proto(output.prompt_logprobs))
        if output.session_id is not None:
            ref = await self._session_ref(engine, output)
            ref.request_id, ref.first_token_logprob = request_id, response.first_token_logprob
            response.session.CopyFrom(ref)
            if self.state.metrics is not None:
                self.state.metrics.get("disagg_kv_sessions_exported_total").inc()
        return response

    async def _session_ref(self, engine: Engine, output: RequestOutput) -> common_pb2.KvSessionRef:
        # The output carries the session where the engine can (ours): asking for it again would wait for a step.
        session = output.session if output.session is not None else await engine.session(output.session_id)
        return await self.state.kv_path.ref(session, self.state.endpoint)

    def _release_sessions_of(self, engine_id: str) -> None:
        if self.state.engine is not None:
            self.state.spawn(_forget(self.state.engine, engine_id))


def _sampling(request: worker_pb2.PrefillRequest) -> SamplingParams:
    if request.request_type not in _CONTEXT_ONLY:
        raise InvalidRequest(f"Prefill runs CONTEXT_ONLY requests, got {request_type_name(request.request_type)}")
    return sampling_from_proto(request.sampling, None, request.output)


async def _context_only(engine: Engine, engine_id: str, request: worker_pb2.PrefillRequest,
                        sampling: SamplingParams, images: list[ImageEmbedding]) -> list[RequestOutput]:
    """Each choice's last output, by index: choice 0's holds the session (n > 1: the others only their first token)."""
    context_only = EngineRequest(engine_id, list(request.token_ids), sampling, RequestType.CONTEXT_ONLY,
                                 images=images or None)
    last = {out.index: out async for out in engine.generate(context_only)}
    return [last[i] for i in sorted(last)]


def _more_choices(response: worker_pb2.PrefillResponse, outputs: list[RequestOutput]) -> None:
    """The first tokens of choices 1..n-1 (an aborted choice has none: the request was cancelled)."""
    for out in outputs:
        lp = logprob_to_proto(out.new_logprobs[0]) if out.new_logprobs else None
        response.more_first_tokens.append(lp if lp is not None else common_pb2.TokenLogprob(
            token_id=out.new_token_ids[0] if out.new_token_ids else 0))


async def _forget(engine: Engine, engine_id: str) -> None:
    """Abort the request (generate() does not when cancelled while adding it), then free any session it made."""
    await engine.abort(engine_id)
    await engine.release_sessions_of(engine_id)
