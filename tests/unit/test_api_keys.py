"""API keys on the router's doors, over a fake core: where keys come from, the gRPC interceptor (disagg.v1 and KServe v2,
unary and streaming; health, reflection and KServe's liveness open unless asked), the HTTP middleware (OpenAI's
401 JSON, WWW-Authenticate, /health and /metrics open), and what `disagg up` hands its router."""
from __future__ import annotations

import argparse
import asyncio
import json

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from multidict import CIMultiDict

from common.errors import InvalidConfig
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from common.pb.inference import grpc_service_pb2 as kserve_pb2, grpc_service_pb2_grpc as kserve_grpc
from common.telemetry.metrics import Metrics
from services.kit.auth import MISSING, WRONG, ApiKeys, add_api_key_args, api_keys_from_args, client_key
from services.kit.grpc_auth import api_key_interceptors
from services.kit.serving import start_server
from services.router.config import RouterConfig
from services.router.frontends import grpc as generation_door, kserve
from services.router.frontends.openai import make_app
from services.router.generation import Finished, FinishReason, TextDelta, Usage
from tests.fake_core import FakeCore

KEY, OTHER = "sk-test-7f3a", "sk-second-91b2"
WORDS = [TextDelta((7,), "Hello"), TextDelta((8,), " sea"), Finished(FinishReason.LENGTH, Usage(3, 2))]


def keys_of(*argv: str, env: dict[str, str] | None = None) -> ApiKeys:
    parser = argparse.ArgumentParser()
    add_api_key_args(parser)
    return api_keys_from_args(parser.parse_args(argv), env or {})


def test_keys_come_from_flags_the_environment_and_a_file(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# team keys\n{OTHER}\n\n  third-key  \n")
    assert keys_of("--api-key", KEY).refusal(KEY) is None
    from_both = keys_of("--api-key", KEY, "--api-key-file", str(key_file))
    assert [from_both.refusal(k) for k in (KEY, OTHER, "third-key")] == [None, None, None]
    from_env = keys_of(env={"DISAGG_API_KEY": f"{KEY},{OTHER}", "DISAGG_API_KEY_FILE": str(key_file)})
    assert [from_env.refusal(k) for k in (KEY, OTHER, "third-key", "nope")] == [None, None, None, WRONG]
    assert keys_of("--api-key", OTHER, env={"DISAGG_API_KEY": KEY}).refusal(KEY) == WRONG  # the flag wins
    assert not keys_of().required and keys_of().refusal(None) is None


def test_bad_key_settings_are_refused_naming_the_flag(tmp_path):
    with pytest.raises(InvalidConfig, match="--api-key-protects-health needs a key"):
        keys_of("--api-key-protects-health")
    with pytest.raises(InvalidConfig, match="without spaces"):
        keys_of("--api-key", "two words")
    with pytest.raises(InvalidConfig, match="--api-key-file .*missing"):
        keys_of("--api-key-file", str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(InvalidConfig, match="holds no key"):
        keys_of("--api-key-file", str(tmp_path / "empty"))


def test_a_key_is_never_in_a_repr_and_a_refusal_never_echoes_it():
    keys = keys_of("--api-key", KEY)
    config = RouterConfig(model="m", api_keys=keys)
    assert KEY not in repr(config) and KEY not in repr(keys)
    assert keys.refusal(None) == MISSING and keys.refusal("sk-guess") == WRONG and "sk-guess" not in WRONG


def test_a_client_sends_its_flag_else_the_routers_first_key(tmp_path):
    assert client_key(argparse.Namespace(api_key=KEY), {"DISAGG_API_KEY": OTHER}) == KEY
    assert client_key(argparse.Namespace(api_key=None), {"DISAGG_API_KEY": f"{OTHER},{KEY}"}) == OTHER
    (tmp_path / "keys").write_text(f"{KEY}\n")
    assert client_key(argparse.Namespace(), {"DISAGG_API_KEY_FILE": str(tmp_path / "keys")}) == KEY
    assert client_key(argparse.Namespace(), {}) is None


# --- gRPC ---

def serve_grpc(keys: ApiKeys, scenario):
    """`scenario(channel)` against a server with both gRPC doors (and health, reflection) over a fake core."""
    async def main():
        core = FakeCore(WORDS)
        doors = [generation_door.FRONT_DOOR, kserve.FRONT_DOOR]
        health = [m for door in doors for m in door.health_methods]
        server = await start_server(lambda s: [d.add_to_server(s, core) for d in doors],
                                    [n for d in doors for n in d.grpc_services], "127.0.0.1", 0,
                                    interceptors=api_key_interceptors(keys, health))
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                return await scenario(channel)
        finally:
            await server.server.stop(None)
    return asyncio.run(main())


def _request() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=2))


async def _status(call) -> tuple[grpc.StatusCode, str]:
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            [_ async for _ in result]
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_grpc_doors_need_the_key_in_metadata_and_serve_the_next_request():
    async def scenario(channel):
        generation = generation_pb2_grpc.GenerationStub(channel)
        infer = kserve_grpc.GRPCInferenceServiceStub(channel)
        bearer, wrong = (("authorization", f"Bearer {KEY}"),), (("authorization", "Bearer sk-guess"),)
        calls = {
            "no key": lambda: generation.Generate(_request()),
            "wrong key": lambda: generation.Generate(_request(), metadata=wrong),
            "no key, streaming requests": lambda: generation.GenerateStream(iter(())),
            "no key, kserve": lambda: infer.ModelMetadata(kserve_pb2.ModelMetadataRequest(name="tiny")),
            "no key, kserve stream": lambda: infer.ModelStreamInfer(iter(())),
            "bearer": lambda: generation.Generate(_request(), metadata=bearer),
            "x-api-key": lambda: generation.Generate(_request(), metadata=(("x-api-key", KEY),)),
            "bearer, kserve": lambda: infer.ModelMetadata(kserve_pb2.ModelMetadataRequest(name="tiny"),
                                                          metadata=bearer),
        }
        return {name: await _status(call) for name, call in calls.items()}

    found = serve_grpc(keys_of("--api-key", KEY), scenario)
    unauthenticated = (grpc.StatusCode.UNAUTHENTICATED, MISSING)
    assert found["no key"] == found["no key, streaming requests"] == found["no key, kserve"] == unauthenticated
    assert found["no key, kserve stream"] == unauthenticated
    assert found["wrong key"] == (grpc.StatusCode.UNAUTHENTICATED, WRONG)
    assert found["bearer"] == found["x-api-key"] == found["bearer, kserve"] == (grpc.StatusCode.OK, "")


@pytest.mark.parametrize("protects_health", [False, True])
def test_health_reflection_and_kserve_liveness_stay_open_unless_asked(protects_health):
    async def scenario(channel):
        health = health_pb2_grpc.HealthStub(channel)
        infer = kserve_grpc.GRPCInferenceServiceStub(channel)
        calls = {"health": lambda: health.Check(health_pb2.HealthCheckRequest()),
                 "live": lambda: infer.ServerLive(kserve_pb2.ServerLiveRequest()),
                 "ready": lambda: infer.ServerReady(kserve_pb2.ServerReadyRequest()),
                 "model ready": lambda: infer.ModelReady(kserve_pb2.ModelReadyRequest(name="tiny"))}
        return {name: (await _status(call))[0] for name, call in calls.items()}

    argv = ("--api-key", KEY, *(["--api-key-protects-health"] if protects_health else []))
    expected = grpc.StatusCode.UNAUTHENTICATED if protects_health else grpc.StatusCode.OK
    assert serve_grpc(keys_of(*argv), scenario) == dict.fromkeys(["health", "live", "ready", "model ready"], expected)


# --- HTTP ---

def serve_http(keys: ApiKeys, scenario, metrics: Metrics | None = None):
    async def main():
        app = make_app(FakeCore(WORDS * 4), 4096, api_keys=keys, metrics=metrics.registry if metrics else None)
        async with TestClient(TestServer(app)) as client:
            return await scenario(client)
    return asyncio.run(main())


async def _answer(response) -> tuple[int, dict | str, CIMultiDict]:
    text = await response.text()
    body = json.loads(text) if response.content_type == "application/json" else text
    return response.status, body, response.headers.copy()  # case-insensitive


def test_http_needs_a_bearer_key_and_answers_openai_401_json():
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    async def scenario(client):
        found = {}
        for name, headers in {"none": {}, "wrong": {"Authorization": "Bearer sk-guess"},
                              "not bearer": {"Authorization": f"Basic {KEY}"},
                              "right": {"Authorization": f"Bearer {KEY}", "X-Request-Id": "r1"}}.items():
            async with client.post("/v1/chat/completions", json=chat, headers=headers) as response:
                found[name] = await _answer(response)
        async with client.get("/v1/models") as response:
            found["models"] = await _answer(response)
        return found

    found = serve_http(keys_of("--api-key", KEY), scenario)
    status, body, headers = found["none"]
    assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="disagg"' and headers["X-Request-Id"]
    assert body == {"error": {"message": MISSING, "type": "invalid_request_error", "param": None,
                              "code": "invalid_api_key"}}
    status, body, headers = found["wrong"]
    assert status == 401 and body["error"]["message"] == WRONG and body["error"]["code"] == "invalid_api_key"
    assert headers["WWW-Authenticate"] == 'Bearer realm="disagg", error="invalid_token"'
    assert found["not bearer"][0] == 401 and found["models"][0] == 401
    status, body, headers = found["right"]  # after three refusals, served
    assert status == 200 and body["choices"][0]["message"]["content"] == "Hello sea" and headers["X-Request-Id"] == "r1"


def test_health_and_metrics_stay_open_on_http_unless_asked():
    metrics = Metrics.create("router", "tiny")
    metrics.get("disagg_requests_total", status="OK").inc()

    async def scenario(client):
        found = {}
        for path in ("/health", "/health/live", "/metrics"):
            async with client.get(path) as response:
                found[path] = await _answer(response)
        return found

    found = serve_http(keys_of("--api-key", KEY), scenario, metrics)
    assert found["/health"][0] == found["/health/live"][0] == 200
    status, text, headers = found["/metrics"]
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert 'disagg_requests_total{model="tiny",role="router",status="OK"} 1.0' in text
    assert "# TYPE disagg_time_to_first_token_seconds histogram" in text
    guarded = serve_http(keys_of("--api-key", KEY, "--api-key-protects-health"), scenario, metrics)
    assert {path: answer[0] for path, answer in guarded.items()} == dict.fromkeys(found, 401)


def test_without_keys_everything_is_open_and_without_metrics_there_is_no_metrics_route():
    async def scenario(client):
        async with client.get("/v1/models") as models, client.get("/metrics") as metrics:
            return models.status, metrics.status

    assert serve_http(ApiKeys(), scenario) == (200, 404)


# --- disagg up ---

def test_up_hands_its_router_the_keys_out_of_its_command_line_and_checks_health_with_one(tmp_path):
    import dataclasses

    from services.cli.banner import summary
    from services.cli.supervise import Child
    from services.cli.up import parse_args, plan, router_argv, router_env, router_health_metadata

    key_file = tmp_path / "keys"
    key_file.write_text(f"{OTHER}\n")
    args = parse_args(["--model", "/m", "--api-key", KEY, "--api-key-file", str(key_file), "--api-key-protects-health"])
    settled = plan(args)
    argv = router_argv(args, settled, {"prefill": "h:1", "decode": "h:2"}, 0)
    assert KEY not in " ".join(argv) and router_env(args) == {"DISAGG_API_KEY": KEY}
    assert argv[argv.index("--api-key-file") + 1] == str(key_file) and "--api-key-protects-health" in argv
    assert router_health_metadata(args) == (("authorization", f"Bearer {KEY}"),)
    assert router_health_metadata(parse_args(["--api-key", KEY])) == ()  # open health: nothing sent
    children = [Child(name, "m", [], address=f"127.0.0.1:{5000 + i}") for i, name in enumerate(settled.names)]
    text = summary(children, dataclasses.replace(settled, model_dir="/m"), "127.0.0.1", 8000, keyed=True)
    assert 'curl -N -H "Authorization: Bearer $DISAGG_API_KEY" http://127.0.0.1:8000/v1/chat/completions' in text
    # The commands send $DISAGG_API_KEY (disagg generate reads it too): the summary says to set it first.
    assert text.index("export DISAGG_API_KEY=") < text.index("disagg generate")
    assert KEY not in text


def test_up_refuses_a_certificate_without_the_ca_that_dials_it(tmp_path):
    from services.cli.up import parse_args, preflight

    for name in ("cert.pem", "key.pem"):
        (tmp_path / name).write_text("unused")
    args = parse_args(["--model", str(tmp_path), "--router-port", "0", "--http-port", "0", "--metrics-port-base", "-1",
                       "--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")])
    with pytest.raises(InvalidConfig, match="--tls-cert needs --tls-ca"):
        preflight(args)


# --- HTTPS ---

def test_the_http_door_serves_https_from_the_tls_flags_and_client_auth_asks_a_certificate(tmp_path):
    import ssl

    import aiohttp

    from common.tls import TlsConfig
    from services.router.frontends.openai import start_http
    from tests.integration.test_tls import make_pki

    pki = make_pki(tmp_path)
    cert, key, ca = pki / "node.pem", pki / "node.key", pki / "ca.pem"

    async def get(settings: TlsConfig, client: ssl.SSLContext) -> int | str:
        door = await start_http(FakeCore(WORDS), "127.0.0.1", 0, 4096, ssl_context=settings.server_ssl_context())
        try:
            assert door.banner("127.0.0.1") == f"OpenAI-compatible HTTP on https://127.0.0.1:{door.port}/v1"
            async with aiohttp.ClientSession() as session:
                async with session.get(f"https://127.0.0.1:{door.port}/health", ssl=client) as response:
                    return response.status
        except aiohttp.ClientError as exc:
            return type(exc).__name__
        finally:
            await door.stop()

    ca_only = TlsConfig(ca=ca).client_ssl_context()
    with_cert = TlsConfig(cert=cert, key=key, ca=ca).client_ssl_context()
    assert asyncio.run(get(TlsConfig(cert=cert, key=key), ca_only)) == 200
    mutual = TlsConfig(cert=cert, key=key, ca=ca, client_auth=True)
    assert asyncio.run(get(mutual, with_cert)) == 200
    refused = asyncio.run(get(mutual, ca_only))  # the TLS handshake fails: no HTTP status at all
    assert refused in ("ServerDisconnectedError", "ClientOSError", "ClientConnectorError"), refused
