"""TensorRT-LLM behind the engine interface (`--engine trtllm`). UNVERIFIED ON HARDWARE.

Written against TensorRT-LLM's public LLM API (tensorrt_llm.LLM.generate_async with DisaggregatedParams,
get_kv_cache_events_async, KvCacheConfig, CacheTransceiverConfig); no machine here can run it, so only the
pure mappings below are tested (against a recorded signature list, tests/unit/trtllm_api_signatures.json).

- context_only runs the prompt; TensorRT-LLM keeps its KV for its own cache transceiver, and the
  context's DisaggregatedParams (first_gen_tokens, ctx_request_id, opaque_state, ...) become the
  session's `KvSessionRef.attributes` ("trtllm.*", opaque_state base64), with TRANSFER_BACKEND_TRTLLM.
- generation_only takes those attributes back (`kv_import_from_attributes` → `TrtLlmDisaggParams`, as `kv_import`):
  the transceiver moves the KV (the `trtllm` transport, common.kv.transports.trtllm): it is an `OwnKvTransport`,
  not a `KvSessionHost` (it has no kv_cache or leases for our data plane).
- Its KV cache events are re-keyed to our chained block hashes (common.kv.block_hash), so the
  router's KV index works unchanged.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

import torch

from common.kv.block_hash import ROOT_HASH, hash_block
from common.engine.config import EngineConfig, resolve_max_model_len
from common.engine.interface import EngineFacts, EngineLoad, EngineRequest
from common.engine.models.contract import head_dim_of
from common.engine.request import FinishReason, RequestOutput, RequestType, SamplingParams, TokenLogprob
from common.errors import FailedPrecondition, InvalidConfig, InvalidRequest, NotFound
from common.kv.events import EventBody, KvEventLog, Subscriber
from common.kv.layout import KvLayout, model_fingerprint
from common.kv.session import KvSession, KvSessionTable

NOT_INSTALLED = "TensorRT-LLM is not installed; --engine trtllm needs NVIDIA's TensorRT-LLM image"
KV_TRANSPORT = "trtllm"  # the transport its cache transceiver is (common.kv.transports.trtllm)
ATTRIBUTE_PREFIX = "trtllm."
OPAQUE_STATE = ATTRIBUTE_PREFIX + "opaque_state"
EVENT_BUFFER_MAX_SIZE = 1024
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "cancelled": FinishReason.ABORT,
           "abort": FinishReason.ABORT}


def import_tensorrt_llm() -> Any:
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise InvalidConfig(NOT_INSTALLED) from exc
    return tensorrt_llm


# --- pure mappings (tested in CI) ---

def llm_kwargs(config: EngineConfig, max_model_len: int) -> dict[str, Any]:
    """tensorrt_llm.LLM(**...) for our EngineConfig; the two nested dicts build KvCacheConfig / CacheTransceiverConfig."""
    kv_cache = {"enable_block_reuse": config.enable_prefix_caching, "tokens_per_block": config.block_size,
                "event_buffer_max_size": EVENT_BUFFER_MAX_SIZE if config.enable_prefix_caching else 0}
    if config.gpu_memory_utilization is not None:
        kv_cache["free_gpu_memory_fraction"] = config.gpu_memory_utilization
    return {"model": config.model, "dtype": config.dtype, "max_batch_size": config.max_num_seqs,
            "max_num_tokens": config.max_num_batched_tokens, "max_seq_len": max_model_len,
            "tensor_parallel_size": config.tensor_parallel_size,  # TensorRT-LLM shards over its own MPI ranks
            "kv_cache_config": kv_cache,
            # An unpulled context's KV goes back to TensorRT-LLM's pool after our session TTL.
            "cache_transceiver_config": {"backend": "DEFAULT",
                                         "kv_transfer_timeout_ms": int(config.session_ttl_s * 1000)}}


def sampling_kwargs(sampling: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """tensorrt_llm.SamplingParams(**...). Stop strings stay with the router (it owns the text stream);
    greedy is top_k=1, TensorRT-LLM's greedy rule (its temperature must be > 0)."""
    if sampling.structured is not None:  # its own guided decoding is not wired to ours
        raise FailedPrecondition("structured output (response_format, guided_*) needs --engine torch; this worker "
                                 "runs TensorRT-LLM")
    kwargs: dict[str, Any] = {"max_tokens": min(sampling.max_tokens or max_new_tokens, max_new_tokens),
                              "ignore_eos": sampling.ignore_eos, "detokenize": False}
    if sampling.greedy:
        kwargs["top_k"] = 1
    else:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
        if sampling.top_k:
            kwargs["top_k"] = sampling.top_k
        if sampling.min_p:
            kwargs["min_p"] = sampling.min_p
    if sampling.stop_token_ids:
        kwargs["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        kwargs["seed"] = sampling.seed
    if sampling.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    if sampling.logprobs:
        kwargs["logprobs"] = max(1, sampling.top_logprobs)
    if sampling.presence_penalty:
        kwargs["presence_penalty"] = sampling.presence_penalty
    if sampling.frequency_penalty:
        kwargs["frequency_penalty"] = sampling.frequency_penalty
    if sampling.n > 1 or sampling.logit_bias or sampling.prompt_logprobs is not None:
        raise InvalidRequest("n > 1, logit_bias and prompt_logprobs run on the torch engine, not on TensorRT-LLM")
    return kwargs


@dataclass(frozen=True)
class TrtLlmDisaggParams:
    """The context phase's DisaggregatedParams, as they travel in KvSessionRef.attributes."""

    first_gen_tokens: tuple[int, ...]
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: tuple[int, ...] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None

    _INTS = ("ctx_request_id", "disagg_request_id", "ctx_dp_rank")
    _LISTS = ("first_gen_tokens", "draft_tokens")

    @classmethod
    def from_params(cls, params: Any) -> "TrtLlmDisaggParams":
        """From a tensorrt_llm DisaggregatedParams (a context_only output's)."""
        if params is None or not getattr(params, "first_gen_tokens", None):
            raise FailedPrecondition("TensorRT-LLM finished a context_only request without DisaggregatedParams "
                                     "(is cache_transceiver_config set on both workers?)")
        draft = getattr(params, "draft_tokens", None)
        return cls(tuple(params.first_gen_tokens), params.ctx_request_id, params.opaque_state,
                   tuple(draft) if draft is not None else None, getattr(params, "disagg_request_id", None),
                   getattr(params, "ctx_dp_rank", None), getattr(params, "ctx_info_endpoint", None))

    def attributes(self) -> dict[str, str]:
        out = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value is None:
                continue
            if name == "opaque_state":
                out[OPAQUE_STATE] = base64.b64encode(value).decode("ascii")
            elif name in self._LISTS:
                out[ATTRIBUTE_PREFIX + name] = ",".join(map(str, value))
            else:
                out[ATTRIBUTE_PREFIX + name] = str(value)
        return out

    @classmethod
    def from_attributes(cls, attributes: Mapping[str, str]) -> "TrtLlmDisaggParams":
        values: dict[str, Any] = {}
        try:
            for name in cls.__dataclass_fields__:
                raw = attributes.get(ATTRIBUTE_PREFIX + name)
                if raw is None:
                    continue
                if name == "opaque_state":
                    values[name] = base64.b64decode(raw, validate=True)
                elif name in cls._LISTS:
                    values[name] = tuple(int(t) for t in raw.split(",") if t)
                else:
                    values[name] = int(raw) if name in cls._INTS else raw
        except ValueError as exc:
            raise InvalidRequest(f"malformed TensorRT-LLM DisaggregatedParams attribute: {exc}") from exc
        if not values.get("first_gen_tokens"):
            raise InvalidRequest(f"a TensorRT-LLM KV session ref needs {ATTRIBUTE_PREFIX}first_gen_tokens")
        return cls(**values)

    def disaggregated_kwargs(self) -> dict[str, Any]:
        """DisaggregatedParams(**...) for the generation_only request."""
        kwargs = {name: getattr(self, name) for name in self.__dataclass_fields__ if getattr(self, name) is not None}
        kwargs = {k: list(v) if k in self._LISTS else v for k, v in kwargs.items()}
        return {"request_type": RequestType.GENERATION_ONLY.value, **kwargs}


def disaggregated_kwargs(request_type: RequestType, disagg_params: TrtLlmDisaggParams | None) -> dict[str, Any] | None:
    """DisaggregatedParams(**...) for a request of `request_type`; None for an aggregated one."""
    if request_type is RequestType.CONTEXT_AND_GENERATION:
        return None
    if request_type is RequestType.CONTEXT_ONLY:
        return {"request_type": RequestType.CONTEXT_ONLY.value}
    if disagg_params is None:
        raise InvalidRequest("generation_only on --engine trtllm needs the context phase's DisaggregatedParams "
                             "(a KvSessionRef with transfer_backend TRTLLM), not pulled KV blocks")
    return disagg_params.disaggregated_kwargs()


@dataclass
class KvEventTranslator:
    """TensorRT-LLM KV cache events (KVCacheEventSerializer dicts) → our event bodies, re-keyed from its block
    hashes to our chained xxh3 hashes over the blocks' token ids. Partial blocks are not announced."""

    block_size: int
    _ours: dict[int, int] = field(default_factory=dict)  # its block hash → our block hash

    def translate(self, event: Mapping[str, Any]) -> list[EventBody]:
        data = event["data"]
        kind = data["type"]
        if kind == "created":  # a fresh cache: nothing in it
            self._ours.clear()
            return [("cleared",)]
        if kind == "removed":
            hashes = [self._ours.pop(h) for h in data["block_hashes"] if h in self._ours]
            return [("removed", hashes)] if hashes else []
        if kind == "stored":
            return self._stored(data)
        return []  # "updated": a block's priority or cache level changed; the router does not track that

    def _stored(self, data: Mapping[str, Any]) -> list[EventBody]:
        their_parent = data.get("parent_hash")
        parent = self._ours.get(their_parent) if their_parent is not None else None
        if their_parent is not None and parent is None:
            return []  # its parent was never announced (a partial block, or before we subscribed)
        hashes: list[int] = []
        previous = ROOT_HASH if parent is None else parent
        for block in data["blocks"]:
            tokens = block["tokens"]
            if len(tokens) != self.block_size or any(t.get("token_extra_id") for t in tokens):
                break  # partial, or keyed by content the token ids don't show (multimodal)
            previous = hash_block(previous, [int(t["token_id"]) for t in tokens])
            self._ours[block["block_hash"]] = previous
            hashes.append(previous)
        return [("stored", hashes, parent, len(hashes) * self.block_size)] if hashes else []


def finish_reason(name: str | None) -> FinishReason | None:
    return _FINISH.get(name) if name else None


def load_from_stats(stats: Mapping[str, Any] | None, running: int, sessions: int, expired: int) -> EngineLoad:
    """EngineLoad from TensorRT-LLM's latest iteration stats (a get_stats_async dict), or our own counts."""
    kv = (stats or {}).get("kvCacheStats") or {}
    total, free = int(kv.get("maxNumBlocks", 0)), int(kv.get("freeNumBlocks", 0))
    waiting = int((stats or {}).get("numQueuedRequests", 0))
    return EngineLoad(running=running, waiting=waiting, kv_blocks_total=total, kv_blocks_free=free,
                      kv_usage_ratio=(total - free) / total if total else 0.0, active_sessions=sessions,
                      expired_sessions=expired, session_bytes=0)


# --- the engine ---

class TrtLlmEngine:
    """The Engine protocol over tensorrt_llm.LLM. Every method runs on the asyncio loop: the LLM API is async."""

    kv_transport = KV_TRANSPORT

    def __init__(self, trtllm: Any, llm: Any, facts: EngineFacts) -> None:
        self._trtllm, self._llm, self._facts = trtllm, llm, facts
        self._running: dict[str, Any] = {}  # request id → its tensorrt_llm RequestOutput (a live result)
        self._sessions = KvSessionTable(facts.config.session_ttl_s)
        self._disagg_params: dict[str, TrtLlmDisaggParams] = {}  # session id → what generation_only needs
        self._stats: Mapping[str, Any] | None = None
        self._events = KvEventLog(facts.kv_layout.block_size) if facts.config.enable_prefix_caching else None
        self._translator = KvEventTranslator(facts.kv_layout.block_size)
        self._pump: asyncio.Task | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> "TrtLlmEngine":
        trtllm = import_tensorrt_llm()
        from tensorrt_llm.llmapi import CacheTransceiverConfig, KvCacheConfig
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(config.model)
        text = getattr(hf_config, "text_config", None) or hf_config
        max_model_len = resolve_max_model_len(config, text.max_position_embeddings)
        kwargs = llm_kwargs(config, max_model_len)
        kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
        kwargs["cache_transceiver_config"] = CacheTransceiverConfig(**kwargs["cache_transceiver_config"])
        layout = KvLayout(num_layers=text.num_hidden_layers, num_kv_heads=text.num_key_value_heads,
                          head_dim=head_dim_of(text),
                          block_size=config.block_size, dtype=config.dtype,
                          # never equal to a torch engine's: the two caches are not interchangeable
                          fingerprint="trtllm-" + model_fingerprint(hf_config, config.dtype))
        facts = EngineFacts(layout, max_model_len, config, None, torch.device("cuda"), name="trtllm")
        return cls(trtllm, trtllm.LLM(**kwargs), facts)

    async def facts(self) -> EngineFacts:
        return self._facts

    async def load(self) -> EngineLoad:
        # get_stats_async drains what accumulated; an empty queue ends it with IndexError / a timeout.
        with contextlib.suppress(IndexError, asyncio.TimeoutError, asyncio.QueueEmpty):
            async for stats in self._llm.get_stats_async(timeout=0.01):
                self._stats = stats
        self._expire()
        return load_from_stats(self._stats, len(self._running), len(self._sessions.sessions),
                               self._sessions.num_expired)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving early aborts it (RequestOutput.abort) and TensorRT-LLM frees it."""
        request_id, prompt_token_ids, request_type = request.request_id, request.prompt_token_ids, request.request_type
        if request.images:
            raise FailedPrecondition("--engine trtllm serves text only here; run images on the torch engine")
        if request_id in self._running:
            raise InvalidRequest(f"request {request_id} is already running")
        disagg_params = request.kv_import if isinstance(request.kv_import, TrtLlmDisaggParams) else None
        first_token = request.first_token
        expected = disagg_params.first_gen_tokens if disagg_params is not None else None
        if expected is not None and first_token is not None and expected[:1] != (first_token,):
            raise InvalidRequest(f"first token {first_token} differs from the DisaggregatedParams' {expected}")
        params = self._request_params(prompt_token_ids, request.sampling, request_type, disagg_params)
        result = self._llm.generate_async(prompt_token_ids, sampling_params=params[0], disaggregated_params=params[1],
                                          streaming=request_type is not RequestType.CONTEXT_ONLY)
        self._running[request_id] = result
        skip = len(disagg_params.first_gen_tokens) if disagg_params else 0  # the context phase already answered those
        sent, finished = 0, False
        try:
            async for out in result:
                completion = out.outputs[0]
                tokens = list(completion.token_ids)
                if skip and sent == 0 and tuple(tokens[:skip]) == disagg_params.first_gen_tokens:
                    sent = skip
                new, sent, finished = tokens[sent:], len(tokens), out.finished
                yield self._output(request_id, prompt_token_ids, request_type, completion, new, tokens, finished)
        finally:
            self._running.pop(request_id, None)
            if not finished:
                result.abort()

    def _request_params(self, prompt: list[int], sampling: SamplingParams, request_type: RequestType,
                        disagg_params: TrtLlmDisaggParams | None) -> tuple[Any, Any]:
        room = self._facts.max_model_len - len(prompt)
        if not prompt or room < 1:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens; it must have 1 to "
                                 f"{self._facts.max_model_len - 1}")
        disagg = disaggregated_kwargs(request_type, disagg_params)
        return (self._trtllm.SamplingParams(**sampling_kwargs(sampling, room)),
                self._trtllm.DisaggregatedParams(**disagg) if disagg is not None else None)

    def _output(self, request_id: str, prompt: list[int], request_type: RequestType, completion: Any,
                new: list[int], tokens: list[int], finished: bool) -> RequestOutput:
        reason = finish_reason(getattr(completion, "finish_reason", None)) if finished else None
        session_id = None
        if finished and request_type is RequestType.CONTEXT_ONLY and reason is not FinishReason.ABORT:
            session_id = self._pin(request_id, prompt, TrtLlmDisaggParams.from_params(completion.disaggregated_params))
            reason = FinishReason.CONTEXT_DONE
        logprobs = [TokenLogprob(t, float(_top_value(lp, t)), []) for t, lp in
                    zip(new, (getattr(completion, "logprobs", None) or [])[-len(new):] if new else [])]
        return RequestOutput(request_id, new, logprobs, finished=finished, finish_reason=reason,
                             num_prompt_tokens=len(prompt), num_output_tokens=len(tokens), session_id=session_id)

    # --- KV sessions: TensorRT-LLM's transceiver holds and moves the KV; we hold its DisaggregatedParams ---

    def _pin(self, request_id: str, prompt: list[int], disagg_params: TrtLlmDisaggParams) -> str:
        session = self._sessions.create(request_id, [], len(prompt), disagg_params.first_gen_tokens[0], [])
        self._disagg_params[session.session_id] = disagg_params
        return session.session_id

    def _expire(self) -> None:
        for session in self._sessions.pop_expired():
            self._disagg_params.pop(session.session_id, None)

    def _get(self, session_id: str) -> KvSession:
        self._expire()
        return self._sessions.get(session_id)

    async def session(self, session_id: str) -> KvSession:
        return dataclasses.replace(self._get(session_id))

    async def session_attributes(self, session_id: str) -> dict[str, str]:
        """KvSessionRef.attributes for this session (transfer_backend TRANSFER_BACKEND_TRTLLM)."""
        self._get(session_id)
        return self._disagg_params[session_id].attributes()

    def kv_import_from_attributes(self, attributes: Mapping[str, str]) -> TrtLlmDisaggParams:
        """generation_only's DisaggregatedParams, from the ref a context_only worker made (session_attributes)."""
        return TrtLlmDisaggParams.from_attributes(attributes)

    async def release_session(self, session_id: str) -> bool:
        """Forget its DisaggregatedParams. The LLM API has no call to free a finished context's KV: TensorRT-LLM frees it
        once transferred or after kv_transfer_timeout_ms (set to our session TTL)."""
        self._expire()
        self._disagg_params.pop(session_id, None)
        try:
            self._sessions.release(session_id)
        except NotFound:
            return False
        return True

    async def release_sessions_of(self, request_id: str) -> int:
        mine = [s.session_id for s in self._sessions.sessions.values() if s.request_id == request_id]
        return sum([await self.release_session(k) for k in mine])

    async def release_all_sessions(self) -> int:
        count = len(self._sessions.sessions)
        self._sessions.sessions.clear()
        self._disagg_params.clear()
        return count

    async def abort(self, request_id: str) -> bool:
        result = self._running.get(request_id)
        if result is None:
            return False
        result.abort()
        return True

    async def abort_all(self) -> int:
        return sum([await self.abort(request_id) for request_id in list(self._running)])

    # --- KV events ---

    async def subscribe_kv_events(self, loop: asyncio.AbstractEventLoop) -> Subscriber | None:
        if self._events is None:
            return None
        if self._pump is None:
            self._pump = loop.create_task(self._pump_events())
        return self._events.subscribe(loop)

    def unsubscribe_kv_events(self, subscriber: Subscriber) -> None:
        if self._events is not None:
            self._events.unsubscribe(subscriber)

    async def _pump_events(self) -> None:
        async for event in self._llm.get_kv_cache_events_async(timeout=None):
            for body in self._translator.translate(event):
                apply_event(self._events, body)

    def shutdown(self) -> None:
        if self._pump is not None:
            self._pump.get_loop().call_soon_threadsafe(self._pump.cancel)
        self._llm.shutdown()


def apply_event(log: KvEventLog, body: EventBody) -> None:
    """Feed one translated event into our event log (which numbers it and snapshots for new subscribers)."""
    if body[0] == "stored":
        log.stored(body[1], body[2])
    elif body[0] == "removed":
        log.removed(body[1])
    else:
        log.cleared()


def _top_value(logprob: Any, token_id: int) -> float:
    """A TensorRT-LLM logprob entry: a float, or a {token id: Logprob(logprob, rank)} dict."""
    if isinstance(logprob, Mapping):
        entry = logprob.get(token_id)
        return getattr(entry, "logprob", entry) if entry is not None else float("nan")
    return logprob
