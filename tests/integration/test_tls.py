"""Mutual TLS between every process: router, prefill and decode only talk to peers with a certificate
from the deployment's CA; a plaintext or unauthenticated client gets nothing."""
from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from common.errors import InvalidConfig
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from common.tls import TlsConfig
from tests.hf_reference import hf_greedy
from tests.integration.processes import start_services, stop_in_waves


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(root: Path) -> Path:
    """A CA, and one certificate for 127.0.0.1 / localhost that every process presents (server and client)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=disagg-test-ca", cwd=root)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr",
             "-subj", "/CN=localhost", cwd=root)
    (root / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                  "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.pem", "-days", "2", "-extfile", "ext.cnf", cwd=root)
    return root


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls_cluster(pki, tiny_llama):
    env = {"DISAGG_TLS_CERT": str(pki / "node.pem"), "DISAGG_TLS_KEY": str(pki / "node.key"),
           "DISAGG_TLS_CA": str(pki / "ca.pem"), "DISAGG_TLS_CLIENT_AUTH": "1", "OMP_NUM_THREADS": "1"}
    args = ("--model", tiny_llama, "--block-size", "4", "--num-kv-blocks", "64")
    workers = start_services([("prefill", args), ("decode", args)], env=env)
    processes = list(workers)
    try:
        processes += start_services([("router", ("--model", tiny_llama, "--prefill-workers", workers[0].address,
                                                 "--decode-workers", workers[1].address))], env=env)
        yield processes
    finally:
        stop_in_waves(processes)


def _request() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=list(range(3, 22))),
                                          sampling=common_pb2.SamplingParams(temperature=0, max_tokens=6),
                                          stop=common_pb2.StopConditions(ignore_eos=True))


def test_a_request_goes_through_mutual_tls_end_to_end(mtls_cluster, tiny_llama):
    router = mtls_cluster[-1]
    with router.channel() as channel:  # the CA, and the node certificate as client certificate
        responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(_request(), timeout=60))
    tokens = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
    assert tokens == hf_greedy(tiny_llama, list(range(3, 22)), 6)[0]


def test_plaintext_and_certificate_less_clients_are_refused(mtls_cluster, pki):
    router = mtls_cluster[-1]
    with grpc.insecure_channel(router.address) as channel:
        with pytest.raises(grpc.RpcError) as plain:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(_request(), timeout=10))
    assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    no_cert = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    for process in mtls_cluster:  # workers too: nobody without a certificate reaches them
        with grpc.secure_channel(process.address, no_cert) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(generation_pb2_grpc.GenerationStub(channel).Generate(_request(), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, process.name


def test_tls_settings_are_checked_before_serving(pki):
    with pytest.raises(InvalidConfig, match="go together"):
        TlsConfig(cert=pki / "node.pem")
    with pytest.raises(InvalidConfig, match="needs --tls-ca"):
        TlsConfig(cert=pki / "node.pem", key=pki / "node.key", client_auth=True)
    with pytest.raises(InvalidConfig, match="no such file"):
        TlsConfig(ca=pki / "missing.pem")
