"""Decoder.DecodeMany on a real decode worker: many tagged requests on one stream, each one Decode's.

The router's shared streams (services/router/shared_decode.py) ride on this; the router tests run them end to end.
Here the worker's side of the contract: the same tokens as Decode, per-request cancel and refusal that spare the
stream's other requests, a stream that ends or breaks freeing every block.
"""
from __future__ import annotations

import queue
from typing import Iterator

import grpc
import pytest

from common.pb.disagg.v1 import common_pb2, worker_pb2
from tests.integration.test_workers import GREEDY, LONG, decode_start, run_prefill
from tests.integration.worker_client import WorkerClient, assert_pool_full, split

OK = grpc.StatusCode.OK.value[0]


@pytest.fixture(scope="module")
def prefill(worker_pair) -> Iterator[WorkerClient]:
    client = WorkerClient.connect(worker_pair.prefill)
    yield client
    client.channel.close()


@pytest.fixture(scope="module")
def decode(worker_pair) -> Iterator[WorkerClient]:
    client = WorkerClient.connect(worker_pair.decode)
    yield client
    client.channel.close()


@pytest.fixture(autouse=True)
def every_block_returns(prefill, decode) -> Iterator[None]:
    yield
    for client in (prefill, decode):
        assert_pool_full(client)


class Shared:
    """A DecodeMany call whose client side stays open; entries read back grouped by tag."""

    def __init__(self, client: WorkerClient, timeout_s: float = 30):
        self._outgoing: queue.Queue = queue.Queue()
        self.responses = client.decoder.DecodeMany(iter(self._outgoing.get, None), timeout=timeout_s)
        self.by_tag: dict[int, list[worker_pb2.TaggedDecodeServerMessage]] = {}
        self.num_responses = 0

    def send(self, tag: int, message: worker_pb2.DecodeClientMessage, timeout_s: float | None = None) -> None:
        tagged = worker_pb2.TaggedDecodeClientMessage(tag=tag, message=message)
        if timeout_s is not None:
            tagged.timeout_s = timeout_s
        self._outgoing.put(worker_pb2.DecodeManyRequest(messages=[tagged]))

    def cancel(self, tag: int) -> None:
        self.send(tag, worker_pb2.DecodeClientMessage(cancel=common_pb2.Cancel()))

    def close(self) -> None:
        self._outgoing.put(None)

    def read_until_ended(self, tags: set[int]) -> None:
        """Read responses until every tag in `tags` has its `end`."""
        open_tags = set(tags)
        for response in self.responses:
            self.num_responses += 1
            for entry in response.messages:
                self.by_tag.setdefault(entry.tag, []).append(entry)
                if entry.HasField("end"):
                    open_tags.discard(entry.tag)
            if not open_tags:
                return
        raise AssertionError(f"the stream ended before tags {open_tags} did")

    def end_of(self, tag: int) -> worker_pb2.RequestStatus:
        entries = self.by_tag[tag]
        assert entries[-1].HasField("end") and all(e.HasField("message") for e in entries[:-1]), entries
        return entries[-1].end

    def messages_of(self, tag: int) -> list[worker_pb2.DecodeServerMessage]:
        return [e.message for e in self.by_tag[tag] if e.HasField("message")]


def test_many_requests_on_one_stream_give_decode_s_tokens_in_fewer_messages(prefill, decode):
    expected = split(decode.decoder.Decode(iter([decode_start(None, **LONG)]), timeout=60))[0]
    shared = Shared(decode)
    tags = set(range(1, 7))
    try:
        for tag in tags:  # aggregated and handoff requests side by side
            prefilled = run_prefill(prefill, **LONG) if tag % 2 else None
            shared.send(tag, decode_start(prefilled, **LONG), timeout_s=60)
        shared.read_until_ended(tags)
    finally:
        shared.close()
    for tag in tags:
        assert shared.end_of(tag).code == OK
        tokens, finished = split(shared.messages_of(tag))
        assert tokens == (expected[1:] if tag % 2 else expected), f"tag {tag}"  # a prefill worker sampled the first
        assert finished.reason == common_pb2.FINISH_REASON_LENGTH
    deltas = sum(len(shared.messages_of(tag)) - 1 for tag in tags)
    assert shared.num_responses < deltas, "the requests' deltas did not share messages"
    assert list(shared.responses) == []  # half-closed with nothing running: the stream ends with OK


def test_a_cancel_or_a_refusal_ends_one_request_and_spares_the_others(prefill, decode):
    shared = Shared(decode)
    try:
        shared.send(1, decode_start(run_prefill(prefill, **LONG), **LONG))
        shared.send(2, decode_start(None, **LONG))
        bad = decode_start(None, **GREEDY)
        bad.start.request_type = common_pb2.REQUEST_TYPE_GENERATION_ONLY  # without a session: refused
        shared.send(3, bad)
        shared.cancel(1)
        shared.read_until_ended({1, 2, 3})
        refused = shared.end_of(3)
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "needs a session" in refused.message
        assert shared.end_of(1).code == OK
        assert shared.messages_of(1)[-1].finished.reason == common_pb2.FINISH_REASON_CANCELLED
        assert shared.end_of(2).code == OK and split(shared.messages_of(2))[1].reason == common_pb2.FINISH_REASON_LENGTH
        del shared.by_tag[3]
        shared.send(3, decode_start(None, **GREEDY))  # an ended tag may be used again
        shared.read_until_ended({3})
        assert split(shared.messages_of(3))[1].reason == common_pb2.FINISH_REASON_LENGTH
    finally:
        shared.close()


def test_a_stream_the_client_cancels_frees_every_request_on_it(prefill, decode):
    shared = Shared(decode)
    shared.send(1, decode_start(run_prefill(prefill, **LONG), **LONG))
    shared.send(2, decode_start(None, **LONG))
    first = next(iter(shared.responses))  # both running (or one has produced)
    assert first.messages
    shared.responses.cancel()
    shared.close()
    # every_block_returns checks both pools


def test_a_tag_started_twice_is_a_broken_stream(decode):
    shared = Shared(decode)
    shared.send(1, decode_start(None, **LONG))
    shared.send(1, decode_start(None, **LONG))
    shared.close()
    with pytest.raises(grpc.RpcError) as raised:
        list(shared.responses)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "tag 1 already runs" in raised.value.details()


def test_an_empty_prompt_is_refused_on_its_tag(decode):
    shared = Shared(decode)
    try:
        shared.send(5, decode_start(None, prompt=[], **GREEDY))
        shared.read_until_ended({5})
    finally:
        shared.close()
    assert shared.end_of(5).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
