"""The KServe v2 / Triton front door: inference.GRPCInferenceService on the router's gRPC port, onto the core.

tritonclient (and any KServe v2 gRPC client) talks to the router as to a Triton server serving one decoupled LLM
model, with the tensors Triton's LLM backends and Dynamo use (kserve_model.py). ModelInfer answers with the whole
text; ModelStreamInfer streams (kserve_stream.py). Statuses: NOT_FOUND for another model or version,
INVALID_ARGUMENT naming the bad input, UNAVAILABLE with no decode worker ready, and the core's own statuses
(services.kit.serving.status_of). Model repository, statistics, shared memory, trace and log settings are
UNIMPLEMENTED (the generated servicer's answer).
"""
from __future__ import annotations

from importlib import metadata
from typing import AsyncIterator

import grpc

from common.errors import DisaggError, InvalidRequest, NotFound, Unavailable
from common.pb.inference import grpc_service_pb2 as pb
from common.pb.inference import grpc_service_pb2_grpc as pb_grpc
from services.router.frontends import FrontDoor
from services.router.frontends.kserve_model import check_model, model_config, model_metadata
from services.router.frontends.kserve_stream import StreamSession, parse_for, whole_text
from services.router.generation import Core, ServedModel
from services.kit.serving import abort_with

SERVICE_NAME = "inference.GRPCInferenceService"
SERVER_NAME = "disagg"
# Triton's names for what this server does of its protocol extensions.
EXTENSIONS = ("model_configuration", "parameters")
Context = grpc.aio.ServicerContext


def _version() -> str:
    try:
        return metadata.version("disagg")
    except metadata.PackageNotFoundError:
        return "unknown"


class KserveServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core: Core):
        self._core = core

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._core.ready())

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=_version(), extensions=EXTENSIONS)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        try:
            model = self._core.served_model()
        except Unavailable:  # no decode worker: whatever the name, nothing is ready
            return pb.ModelReadyResponse(ready=False)
        try:
            check_model(request.name, request.version, model)
        except NotFound as exc:
            await abort_with(context, exc)
        return pb.ModelReadyResponse(ready=self._core.ready())

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        return model_metadata(await self._model(request.name, request.version, context))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        return model_config(await self._model(request.name, request.version, context))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        """The whole text in one response; `stream` true is INVALID_ARGUMENT (that is ModelStreamInfer's)."""
        try:
            parsed = parse_for(self._core, request, unary=True)
            text, reason = await whole_text(self._core, parsed, context.time_remaining())
        except Exception as exc:  # cancellation (the client went away) passes through and closes the stream
            await abort_with(context, exc)
        return parsed.reply.response(text, reason)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context: Context) -> None:
        try:
            await StreamSession(self._core, context).serve(request_iterator)
        except InvalidRequest as exc:
            await abort_with(context, exc)

    async def _model(self, name: str, version: str, context: Context) -> ServedModel:
        try:
            model = self._core.served_model()
            check_model(name, version, model)
        except DisaggError as exc:
            await abort_with(context, exc)
        return model


def add_to_server(server: grpc.aio.Server, core: Core) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(KserveServicer(core), server)


FRONT_DOOR = FrontDoor(grpc_services=(SERVICE_NAME,), add_to_server=add_to_server,
                       health_methods=tuple(f"/{SERVICE_NAME}/{m}" for m in ("ServerLive", "ServerReady", "ModelReady")))
