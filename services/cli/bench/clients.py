"""One client per front door, each timing every token arrival of one request: disagg.v1 Generate (gRPC),
OpenAI `/v1/completions` with SSE (aiohttp), KServe v2 `ModelStreamInfer` (gRPC). The same workload goes through
each, so their figures differ only by the front door (and the client's own cost, kept small: no SDKs). Each sends
the API key it is given (services/kit/auth.py): metadata on gRPC, `Authorization: Bearer` on HTTP."""
from __future__ import annotations

import json
import ssl
import struct
import time
from dataclasses import dataclass

import aiohttp
import grpc

from common import channels, tls
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from common.pb.inference import grpc_service_pb2 as kserve_pb2, grpc_service_pb2_grpc as kserve_grpc
from services.cli.bench.stats import RequestRecord
from services.cli.bench.workload import BenchRequest
from services.kit.auth import grpc_metadata, http_headers
from services.router.frontends.kserve_tensors import encode_bytes

API_NAMES = ("grpc", "openai", "kserve")


@dataclass(frozen=True)
class SendOptions:
    model: str = ""
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float | None = None
    run_id: str = "run"


def https_context(url: str) -> ssl.SSLContext | bool:
    """An https:// URL is verified with --tls-ca where given (the system's roots otherwise)."""
    settings = tls.current()
    return settings.client_ssl_context() if url.startswith("https://") and settings.dials_tls else True


class GrpcClient:
    """disagg.v1 Generation.Generate: one server-streaming RPC per request on one channel per router; with several
    routers (`router` comma-separated: replicas over the same workers), request i goes to router i mod N."""

    def __init__(self, router: str, channel_options=(), api_key: str | None = None):
        self._channels = [channels.aio_channel(address, channel_options) for address in router.split(",")]
        self._stubs = [generation_pb2_grpc.GenerationStub(channel) for channel in self._channels]
        self._metadata = grpc_metadata(api_key)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def one(self, request: BenchRequest, options: SendOptions, record: RequestRecord) -> None:
        message = generation_pb2.GenerateRequest(
            request_id=f"bench-{options.run_id}-{request.index}", model=options.model,
            sampling=common_pb2.SamplingParams(max_tokens=request.max_tokens, temperature=options.temperature),
            stop=common_pb2.StopConditions(ignore_eos=options.ignore_eos))
        if request.prompt_text is not None:
            message.prompt = request.prompt_text
        else:
            message.token_ids.ids.extend(request.prompt_token_ids)
        try:
            stub = self._stubs[request.index % len(self._stubs)]
            async for response in stub.Generate(message, timeout=options.timeout_s, metadata=self._metadata):
                if response.HasField("delta"):
                    if response.delta.token_ids:
                        record.token_times.append(time.perf_counter())
                        record.output_tokens += len(response.delta.token_ids)
                elif response.finished.reason == common_pb2.FINISH_REASON_ERROR:
                    record.error = response.finished.error.message or "finished with reason ERROR"
                else:
                    parts = response.finished.usage.ttft_breakdown.ListFields()
                    record.ttft_breakdown = {field.name: ms for field, ms in parts} or None
                    record.router_ttft_ms = response.finished.usage.ttft_ms or None
        except grpc.aio.AioRpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"


class OpenAIClient:
    """POST /v1/completions with stream and include_usage: a chunk with text is a token arrival; the usage
    chunk counts the tokens."""

    def __init__(self, base_url: str, max_connections: int | None = None, api_key: str | None = None):
        self._url = base_url.rstrip("/") + "/v1/completions"
        self._headers = http_headers(api_key)
        connector = aiohttp.TCPConnector(limit=max_connections or 0, ssl=https_context(base_url))
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        await self._session.close()

    async def one(self, request: BenchRequest, options: SendOptions, record: RequestRecord) -> None:
        body = {"model": options.model, "max_tokens": request.max_tokens, "temperature": options.temperature,
                "ignore_eos": options.ignore_eos, "stream": True, "stream_options": {"include_usage": True},
                "prompt": request.prompt_text if request.prompt_text is not None else request.prompt_token_ids}
        headers = {**self._headers, "X-Request-Id": f"bench-{options.run_id}-{request.index}"}
        timeout = aiohttp.ClientTimeout(total=options.timeout_s)
        try:
            async with self._session.post(self._url, json=body, headers=headers, timeout=timeout) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    self._chunk(json.loads(line[6:]), record)
        except (aiohttp.ClientError, TimeoutError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"

    @staticmethod
    def _chunk(chunk: dict, record: RequestRecord) -> None:
        if "error" in chunk:
            record.error = chunk["error"].get("message", "error event")
        elif (choices := chunk.get("choices")) and (choices[0].get("text") or choices[0].get("finish_reason") is None):
            # A token's event, its text "" while the server holds it back (a partial character: most tokens of a
            # random-weight model whose vocabulary outgrows its tokenizer's): an arrival all the same, as vLLM's bench
            # counts it. The finish event carries no token.
            record.token_times.append(time.perf_counter())
        if chunk.get("usage"):
            record.output_tokens = chunk["usage"]["completion_tokens"]
            record.ttft_breakdown = chunk["usage"].get("ttft_breakdown")  # ours, beside OpenAI's fields
            record.router_ttft_ms = chunk["usage"].get("ttft_ms")


class KServeClient:
    """inference.GRPCInferenceService/ModelStreamInfer, one decoupled stream per request (`stream` true, sampling
    in `sampling_parameters`); a response with text is a token arrival. KServe carries no token counts, so a
    request that ends by length counts its max_tokens, and one that stops early one token per text response."""

    def __init__(self, router: str, channel_options=(), api_key: str | None = None):
        self._channel = channels.aio_channel(router, channel_options)
        self._stub = kserve_grpc.GRPCInferenceServiceStub(self._channel)
        self._metadata = grpc_metadata(api_key)

    async def close(self) -> None:
        await self._channel.close()

    async def one(self, request: BenchRequest, options: SendOptions, record: RequestRecord) -> None:
        if request.prompt_text is None:
            raise ValueError("KServe takes text prompts (text_input); make the workload with a tokenizer")
        call = self._stub.ModelStreamInfer(timeout=options.timeout_s, metadata=self._metadata)
        texts, finish = 0, ""
        try:
            await call.write(_kserve_request(request, options))
            await call.done_writing()
            async for response in call:
                if response.error_message:
                    record.error = response.error_message
                    return
                text, reason = _outputs(response.infer_response)
                if text:
                    record.token_times.append(time.perf_counter())
                    texts += 1
                finish = reason or finish
        except grpc.aio.AioRpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
            return
        record.output_tokens = request.max_tokens if finish == "length" else texts


def _kserve_request(request: BenchRequest, options: SendOptions) -> kserve_pb2.ModelInferRequest:
    sampling = {"max_tokens": request.max_tokens, "temperature": options.temperature, "ignore_eos": options.ignore_eos}
    message = kserve_pb2.ModelInferRequest(model_name=options.model, id=f"bench-{options.run_id}-{request.index}")
    for name, datatype, raw in (("text_input", "BYTES", encode_bytes([request.prompt_text.encode()])),
                                ("stream", "BOOL", b"\x01"),
                                ("sampling_parameters", "BYTES", encode_bytes([json.dumps(sampling).encode()]))):
        message.inputs.add(name=name, datatype=datatype, shape=[1])
        message.raw_input_contents.append(raw)
    return message


def _outputs(response: kserve_pb2.ModelInferResponse) -> tuple[str, str]:
    """(text_output, finish_reason) of one response; "" where absent."""
    found = {"text_output": "", "finish_reason": ""}
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        if tensor.name in found and len(raw) >= 4:
            (size,) = struct.unpack_from("<I", raw)
            found[tensor.name] = raw[4:4 + size].decode("utf-8", "replace")
    return found["text_output"], found["finish_reason"]


def make_client(api: str, router: str, http_url: str, max_concurrency: int | None, channel_options=(),
                api_key: str | None = None):
    if api == "grpc":
        return GrpcClient(router, channel_options, api_key)
    if api == "openai":
        return OpenAIClient(http_url, max_concurrency, api_key)
    if api == "kserve":
        return KServeClient(router, channel_options, api_key)
    raise ValueError(f"unknown API {api!r}; one of {list(API_NAMES)}")
