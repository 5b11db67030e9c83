"""The `shm` KV fast path between real processes on one host, and its fallback to the gRPC stream."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from common.kv import host, shm_files
from common.kv.store import pull_kv
from common.kv.transports.shm import files
from common.kv.wire import release_session
from common.pb.disagg.v1 import common_pb2, worker_pb2
from tests.integration.worker_client import WorkerClient, assert_pool_full

PROMPT = list(range(3, 40))

pytestmark = pytest.mark.skipif(not host.host_id(), reason="needs /dev/shm and a machine id")


@pytest.fixture(scope="module")
def prefill(worker_pair):
    client = WorkerClient.connect(worker_pair.prefill)
    yield client
    client.channel.close()


def _session(client: WorkerClient) -> common_pb2.KvSessionRef:
    request = worker_pb2.PrefillRequest(request_id="shm", token_ids=PROMPT,
                                        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8))
    return client.prefiller.Prefill(request, timeout=30).session


def _leftover_files() -> set[Path]:
    return set(shm_files.SHM_DIR.glob(f"{files.PREFIX}*"))


def test_same_host_pull_goes_through_shm_and_equals_the_grpc_stream(prefill):
    ref = _session(prefill)
    assert ref.attributes[host.HOST_ID_ATTRIBUTE] == host.host_id()
    remote = common_pb2.KvSessionRef()
    remote.CopyFrom(ref)
    remote.attributes[host.HOST_ID_ATTRIBUTE] = "another-host"
    before = _leftover_files()

    async def pull_both():
        fast, stream = await pull_kv(ref.endpoint, ref), await pull_kv(ref.endpoint, remote)
        return fast, stream, (await release_session(ref.endpoint, ref.session_id)).released

    fast, stream, released = asyncio.run(pull_both())
    assert (fast.transport, stream.transport) == ("shm", "grpc")
    assert fast.num_bytes == stream.num_bytes == fast.export.layout.block_bytes() * 10
    assert torch.equal(fast.export.blocks.view(torch.uint8), stream.export.blocks.view(torch.uint8))
    assert released and _leftover_files() <= before  # the importer deleted its file
    assert_pool_full(prefill)


def test_exporter_refuses_paths_outside_dev_shm_and_missing_files(prefill):
    ref = _session(prefill)
    try:
        for path, code in (("/tmp/disagg-kv-x", grpc.StatusCode.INVALID_ARGUMENT),
                           ("/dev/shm/other-name", grpc.StatusCode.INVALID_ARGUMENT),
                           ("/dev/shm/disagg-kv-missing-file", grpc.StatusCode.FAILED_PRECONDITION)):
            with pytest.raises(grpc.RpcError) as error:
                list(prefill.store.Pull(worker_pb2.PullRequest(handle=ref.session_id, shm_path=path), timeout=10))
            assert error.value.code() == code, (path, error.value.details())
        assert not Path("/dev/shm/disagg-kv-missing-file").exists()  # never created by the exporter
    finally:
        asyncio.run(release_session(ref.endpoint, ref.session_id))
    assert_pool_full(prefill)
