"""`disagg bench --router a,b`: router replicas over the same workers take the requests in turn, and every token
each one streams is timed as from one router."""
from __future__ import annotations

import asyncio
import contextlib
from functools import partial

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.cli.bench.clients import GrpcClient, SendOptions
from services.cli.bench.stats import RequestRecord
from services.cli.bench.workload import BenchRequest
from tests.loopback_grpc import loopback_server


class _Counting(generation_pb2_grpc.GenerationServicer):
    """A router stand-in that streams two tokens and a finish, counting the requests it got."""

    def __init__(self):
        self.request_ids: list[str] = []

    async def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        for token in (5, 6):
            yield generation_pb2.GenerateResponse(request_id=request.request_id,
                                                  delta=common_pb2.Delta(token_ids=[token]))
        yield generation_pb2.GenerateResponse(request_id=request.request_id, finished=common_pb2.Finished(
            reason=common_pb2.FINISH_REASON_LENGTH))


def test_requests_go_to_each_router_in_turn():
    async def run():
        servicers = [_Counting(), _Counting()]
        async with contextlib.AsyncExitStack() as servers:
            addresses = [(await servers.enter_async_context(
                loopback_server(partial(generation_pb2_grpc.add_GenerationServicer_to_server, servicer))))[1]
                for servicer in servicers]
            client = GrpcClient(",".join(addresses))
            records = [RequestRecord(i, 3, 2, start=0.0) for i in range(5)]
            try:
                await asyncio.gather(*(client.one(BenchRequest(i, [1, 2, 3], 2), SendOptions(run_id="t"), records[i])
                                       for i in range(5)))
            finally:
                await client.close()
        return servicers, records

    servicers, records = asyncio.run(run())
    assert sorted(servicers[0].request_ids) == [f"bench-t-{i}" for i in (0, 2, 4)]
    assert sorted(servicers[1].request_ids) == [f"bench-t-{i}" for i in (1, 3)]
    assert all(r.output_tokens == 2 and len(r.token_times) == 2 and r.error is None for r in records)
