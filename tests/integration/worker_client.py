"""Sync clients for worker processes in tests: stubs, a Decode stream that can Cancel, and pool checks."""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from common.pb.disagg.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.kit.serving import channel_options
from tests.integration.processes import ServiceProcess


@dataclass
class WorkerClient:
    """Sync stubs on one channel to a worker."""

    channel: grpc.Channel
    worker: worker_pb2_grpc.WorkerStub = field(init=False)
    prefiller: worker_pb2_grpc.PrefillerStub = field(init=False)
    store: worker_pb2_grpc.TensorStoreStub = field(init=False)
    decoder: worker_pb2_grpc.DecoderStub = field(init=False)

    def __post_init__(self) -> None:
        self.worker = worker_pb2_grpc.WorkerStub(self.channel)
        self.prefiller = worker_pb2_grpc.PrefillerStub(self.channel)
        self.store = worker_pb2_grpc.TensorStoreStub(self.channel)
        self.decoder = worker_pb2_grpc.DecoderStub(self.channel)

    @classmethod
    def connect(cls, process: ServiceProcess) -> "WorkerClient":
        return cls(grpc.insecure_channel(process.address, options=channel_options()))

    def load(self) -> worker_pb2.Load:
        return self.worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


def assert_pool_full(client: WorkerClient, timeout_s: float = 5.0) -> None:
    """Every block free and no session left (waiting only for work the server finishes after replying)."""
    wait_until(lambda: is_idle(client.load()), timeout_s, lambda: f"blocks still held: {client.load()}")


def is_idle(load: worker_pb2.Load) -> bool:
    return load.kv_blocks_free == load.kv_blocks_total and load.active_kv_sessions == 0 and not load.running_requests


def wait_until(condition: Callable[[], bool], timeout_s: float, describe: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, describe()
        time.sleep(0.02)


def split(messages) -> tuple[list[int], common_pb2.Finished]:
    messages = list(messages)
    assert messages[-1].HasField("finished") and all(m.HasField("delta") for m in messages[:-1])
    return [t for m in messages[:-1] for t in m.delta.token_ids], messages[-1].finished


class DecodeStream:
    """A Decode call whose client side stays open, so a Cancel can follow the start."""

    def __init__(self, client: WorkerClient, start: worker_pb2.DecodeClientMessage, timeout_s: float = 30):
        self.request_id = start.start.request_id
        self._outgoing: queue.Queue = queue.Queue()
        self._outgoing.put(start)
        self.responses = client.decoder.Decode(iter(self._outgoing.get, None), timeout=timeout_s)

    def cancel(self) -> None:
        self._outgoing.put(worker_pb2.DecodeClientMessage(cancel=common_pb2.Cancel(request_id=self.request_id)))

    def close(self) -> None:
        """Half-close the client side (always call it: grpc's sender thread waits on the queue)."""
        self._outgoing.put(None)


class DecodeManyClient:
    """A DecodeMany call whose client side stays open (many tagged requests on one stream); entries read back
    grouped by tag."""

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
