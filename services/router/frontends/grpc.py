"""The disagg.v1.Generation front door: our own gRPC API, a thin adapter onto the router core."""
from __future__ import annotations

import contextlib
import uuid
from typing import AsyncIterator

import grpc

from common.errors import DisaggError
from common.pb.disagg.v1 import generation_pb2, generation_pb2_grpc
from services.router.frontends import FrontDoor
from services.router.frontends.coalesce import coalesced
from services.router.frontends.grpc_convert import request_from_proto, response_of
from services.router.frontends.grpc_stream import Multiplexer
from services.router.generation import Core
from services.kit.serving import abort_with

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core: Core):
        self._core = core

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        request_id = request.request_id or uuid.uuid4().hex
        try:
            core_request = request_from_proto(request, request_id)
        except DisaggError as exc:
            self._core.rejected(exc)
            await abort_with(context, exc)
        try:
            events = self._core.stream(core_request, context.time_remaining())
            # A write that falls behind sends the deltas that piled up meanwhile as one (coalesce.py).
            async with contextlib.aclosing(events) as events, contextlib.aclosing(coalesced(events)) as merged:
                async for event in merged:
                    await context.write(response_of(request_id, event))
        except Exception as exc:  # cancellation (the client went away) passes through: the stream counted it
            await abort_with(context, exc)

    async def GenerateStream(self, request_iterator: AsyncIterator[generation_pb2.GenerateStreamRequest],
                             context: grpc.aio.ServicerContext) -> None:
        try:
            await Multiplexer(self._core).serve(request_iterator, context)
        except DisaggError as exc:
            await abort_with(context, exc)

    async def ListModels(self, request: generation_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> generation_pb2.ListModelsResponse:
        try:
            model = self._core.served_model()
        except DisaggError as exc:
            await abort_with(context, exc)
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(
            id=model.name, max_model_len=model.max_model_len, supports_images=model.supports_images)])


def add_to_server(server: grpc.aio.Server, core: Core) -> None:
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(core), server)


FRONT_DOOR = FrontDoor(grpc_services=(SERVICE_NAME,), add_to_server=add_to_server)
