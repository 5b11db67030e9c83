"""Checks every KV transport must pass, shared by the CPU integration tests and the GPU tests:
the handed-off request gives the aggregated engine's tokens, Usage says which transport moved how many
bytes, and a cancel at any point leaves every block free on both workers."""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Iterator, Mapping

from common.engine.engine import LLMEngine
from common.engine.request import SamplingParams
from common.kv import host, transport
from common.kv.transports.nixl import nixl_unavailable_reason
from common.pb.disagg.v1 import common_pb2, worker_pb2
from tests.integration.processes import ServiceProcess, start_services, stop_cleanly
from tests.integration.worker_client import DecodeStream, WorkerClient, assert_pool_full, split

NO_EOS = common_pb2.StopConditions(ignore_eos=True)


@functools.cache
def cpu_transports() -> tuple[str, ...]:
    """The transports CPU workers on this machine can use, in the order of preference: shm (where the host has an id),
    nixl (over DRAM, where NIXL runs) and grpc."""
    return tuple(b for b, ok in (("shm", bool(host.host_id())), ("nixl", nixl_unavailable_reason() is None),
                                 ("grpc", True)) if ok)


@contextlib.contextmanager
def transport_cluster(args: tuple[str, ...], transports: list[str], extra: list[tuple[str, tuple[str, ...]]] = (),
                    env: Mapping[str, str] | None = None) -> Iterator[dict]:
    """A prefill offering every transport (client "prefill"), a decode accepting any ("decode_any", process
    "decode_any_process"), one decode accepting only each of `transports` (client named by the transport),
    and `extra` workers (clients "extra0", ...); every process stopped cleanly afterwards."""
    specs = [("prefill", args), ("decode", args), *[("decode", (*args, "--kv-transports", b)) for b in transports],
             *extra]
    with connected_workers(specs, env) as (processes, clients):
        yield {"prefill": clients[0], "prefill_process": processes[0], "decode_any": clients[1],
               "decode_any_process": processes[1], **dict(zip(transports, clients[2:])),
               **{f"extra{i}": c for i, c in enumerate(clients[2 + len(transports):])}}


@contextlib.contextmanager
def connected_workers(specs: list[tuple[str, tuple[str, ...]]], env: Mapping[str, str] | None = None
                      ) -> Iterator[tuple[list[ServiceProcess], list[WorkerClient]]]:
    """The workers of `specs`, started together, and a client on each; afterwards all stopped together, cleanly."""
    processes = start_services(specs, env=env)
    clients = [WorkerClient.connect(p) for p in processes]
    try:
        yield processes, clients
    finally:
        for client in clients:
            client.channel.close()
        stop_cleanly(processes)


def prefill(client: WorkerClient, prompt: list[int], max_tokens: int) -> worker_pb2.PrefillResponse:
    request = worker_pb2.PrefillRequest(request_id="r", token_ids=prompt,
                                        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))
    return client.prefiller.Prefill(request, timeout=60)


def decode_start(prefilled: worker_pb2.PrefillResponse, prompt: list[int], max_tokens: int,
                 offer: str | None = None) -> worker_pb2.DecodeClientMessage:
    start = worker_pb2.DecodeStart(request_id="r", token_ids=prompt, first_token=prefilled.first_token, stop=NO_EOS,
                                   sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))
    start.session.CopyFrom(prefilled.session)
    if offer is not None:  # what a (stale or foreign) exporter might offer
        start.session.attributes["transfer_backends"] = offer
    return worker_pb2.DecodeClientMessage(start=start)


def check_handoff(prefill_client: WorkerClient, decode_client: WorkerClient, reference: LLMEngine,
                  prompt: list[int], via: str, max_tokens: int = 12, offer: str | None = None) -> common_pb2.Usage:
    """prefill → decode through `via` (a transport's name): HF-identical greedy tokens (the reference engine matches HF),
    Usage names the transport and the bytes of every layer's K and V of the prompt's blocks."""
    expected = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    prefilled = prefill(prefill_client, prompt, max_tokens)
    assert prefilled.first_token == expected[0]
    messages = decode_client.decoder.Decode(iter([decode_start(prefilled, prompt, max_tokens, offer)]), timeout=60)
    tokens, finished = split(messages)
    assert [prefilled.first_token, *tokens] == expected
    usage = finished.usage
    assert usage.kv_transfer_backend == transport.number_of(via), \
        common_pb2.TransferBackend.Name(usage.kv_transfer_backend)
    assert usage.kv_transfer_bytes == len(prefilled.session.block_ids) * reference.kv_layout.block_bytes()
    assert usage.kv_transfer_ms > 0
    for client in (prefill_client, decode_client):
        assert_pool_full(client)
    return usage


def check_cancels_free_everything(prefill_client: WorkerClient, decode_client: WorkerClient,
                                  prompt: list[int], offer: str | None = None) -> None:
    """Cancel right after the start (before or during the pull) and after the first delta (during
    decode): both workers' pools are full again within 10 s, well inside the session TTL. `offer`: as
    check_handoff's, the transports the session names (the pull goes through them)."""
    for wait_for_delta in (False, True):
        prefilled = prefill(prefill_client, prompt, 400)
        stream = DecodeStream(decode_client, decode_start(prefilled, prompt, 400, offer), timeout_s=60)
        try:
            if wait_for_delta:
                assert next(iter(stream.responses)).HasField("delta")
            stream.cancel()
            for _ in stream.responses:
                pass
        finally:
            stream.close()
        deadline = time.monotonic() + 10
        for client in (prefill_client, decode_client):
            assert_pool_full(client, max(0.1, deadline - time.monotonic()))
