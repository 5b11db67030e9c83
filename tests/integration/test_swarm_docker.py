"""deploy/compose/swarm.yml under `docker stack deploy` on a single-node swarm of the local engine, with
swarm-stand-ins.yml for consul / jaeger / prometheus (no registry to pull theirs) and the images
test_compose_docker builds (same tag, cached). Under steady greedy traffic over gRPC, decode is scaled 1 → 3 (the
router sees all three in Consul) and prefill rolls to a new image tag (start-first, the old task drains on SIGTERM):
no request fails and every answer equals the first answer for its prompt.

The swarm is left as found: `docker swarm init` only where the engine is in none, and `docker swarm leave --force`
only then (with the docker_gwbridge network init added); the stack, its networks and configs, and the image tag the
test adds are removed. Skips, saying why,
where no engine runs or it is in a swarm this test cannot deploy to (a worker node, a locked or pending one).
Run: `python3 -m pytest -q tests/integration/test_swarm_docker.py` (as root, as test_compose_docker).
"""
from __future__ import annotations

import json
import os
import threading
from typing import Iterator

import grpc
import pytest

from tests.integration.observed import wait_for
from tests.integration.test_compose import COMPOSE_DIR
from tests.integration.test_compose_docker import IMAGE_TAG, PROMPTS, Stack, _run, docker, images  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROLLED_TAG = "test-swarm-2"  # prefill's new image: disagg:test-compose under a second name
DECODE_METRICS_PORT = 9102  # swarm.yml's DISAGG_METRICS_PORT for decode, inside each task's container
FILES = ("-c", str(COMPOSE_DIR / "swarm.yml"), "-c", str(COMPOSE_DIR / "swarm-stand-ins.yml"))


@pytest.fixture(scope="module")
def swarm(docker: str) -> Iterator[str]:
    """A single-node swarm: the engine's own if it is a manager already, else one initialised here and left after."""
    info = json.loads(_run(docker, "info", "--format", "{{json .Swarm}}", timeout=30).stdout)
    state = info.get("LocalNodeState")
    if state == "active" and not info.get("ControlAvailable"):
        pytest.skip("the engine is a swarm worker node: a stack can only be deployed from a manager")
    if state not in ("active", "inactive"):
        pytest.skip(f"the engine's swarm is {state}: not deploying to it")
    initialised = state == "inactive"
    networks_before = set(_networks(docker))
    if initialised:
        joined = _run(docker, "swarm", "init", "--advertise-addr", "127.0.0.1", timeout=60, check=False)
        if joined.returncode:
            pytest.skip(f"docker swarm init fails here: {joined.stderr.strip()}")
    try:
        yield docker
    finally:
        if initialised:  # leaving removes the ingress network; the bridge swarm init added stays unless removed
            _run(docker, "swarm", "leave", "--force", timeout=60)
            for network in set(_networks(docker)) - networks_before:
                _run(docker, "network", "rm", network, timeout=60)


def _networks(docker: str) -> list[str]:
    return _run(docker, "network", "ls", "--format", "{{.Name}}", timeout=60).stdout.split()


class SwarmStack(Stack):
    """swarm.yml deployed as a stack on free host ports; its services are NAME_router, NAME_prefill, ..."""

    def __init__(self, docker: str) -> None:
        super().__init__(docker)
        self.name = f"disagg-swarm-{os.getpid()}"
        self.env["DECODE_REPLICAS"] = "1"

    def stack(self, *args: str, timeout: float = 300) -> str:
        return _run(self.docker, "stack", *args, timeout=timeout, env=self.env).stdout

    def service(self, *args: str, timeout: float = 300) -> str:
        return _run(self.docker, "service", *args, timeout=timeout, env=self.env).stdout

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.stack.namespace={self.name}"
        return [line for kind in ("service", "network", "config")
                for line in _run(self.docker, kind, "ls", "-q", "--filter", label, timeout=60).stdout.split()]

    def serving(self) -> bool:
        roles = {"disagg-router": 1, "disagg-prefill": 1, "disagg-decode": 1}
        try:
            return all(len(self.passing(service)) == n for service, n in roles.items()) and bool(
                self.generate(PROMPTS[0]))
        except (OSError, ValueError, grpc.RpcError):
            return False


@pytest.fixture(scope="module")
def stack(swarm, images) -> Iterator[SwarmStack]:
    stack = SwarmStack(swarm)
    try:
        stack.stack("deploy", "--resolve-image", "never", *FILES, stack.name)
        wait_for(stack.serving, 240, "the stack to answer through router, prefill and decode", every_s=2)
        yield stack
    except BaseException:
        for role in ("router", "prefill", "decode"):
            print(_run(swarm, "service", "logs", "--raw", "--tail", "40", f"{stack.name}_{role}", timeout=60,
                       check=False).stdout)
        raise
    finally:
        _run(swarm, "stack", "rm", stack.name, timeout=120, check=False)
        wait_for(lambda: stack.leftovers() == [], 120, "the stack's services, networks and configs to go", every_s=1)
        _run(swarm, "image", "rm", f"disagg:{ROLLED_TAG}", timeout=60, check=False)


class Traffic:
    """Client threads sending greedy requests until stopped; an answer that differs from `expected` is a failure."""

    def __init__(self, stack: SwarmStack, expected: dict[str, str], clients: int = 3) -> None:
        self.stack, self.expected = stack, expected
        self.answered: list[str] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def _client(self, offset: int) -> None:
        prompts = list(self.expected)
        i = offset
        while not self._stop.is_set():
            prompt = prompts[i % len(prompts)]
            i += 1
            try:
                text = self.stack.generate(prompt)
            except grpc.RpcError as exc:
                self.failures.append(f"{prompt!r}: {exc.code().name} {exc.details()}")
                continue
            (self.answered if text == self.expected[prompt] else self.failures).append(f"{prompt!r} -> {text!r}")

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)


def _rows_stepped(stack: SwarmStack, role: str, port: int) -> dict[str, float]:
    """Each running task's rows stepped so far (disagg_engine_step_sequences_total over every kind), read from its
    own /metrics inside its container, by container id."""
    ids = _run(stack.docker, "ps", "-q", "--filter", f"label=com.docker.swarm.service.name={stack.name}_{role}",
               timeout=60).stdout.split()
    read = ("import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:%d/metrics', timeout=10)"
            ".read().decode())" % port)
    rows = {}
    for container in ids:
        text = _run(stack.docker, "exec", container, "python", "-c", read, timeout=60).stdout
        rows[container] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                              if line.startswith("disagg_engine_step_sequences_total{"))
    return rows


def _update_state(stack: SwarmStack, role: str) -> str:
    return stack.service("inspect", "--format", "{{if .UpdateStatus}}{{.UpdateStatus.State}}{{end}}",
                         f"{stack.name}_{role}", timeout=60).strip()


def test_decode_scaled_up_and_prefill_rolled_under_traffic_lose_no_request(stack):
    expected = {prompt: stack.generate(prompt) for prompt in PROMPTS}  # greedy: the same text every time
    _run(stack.docker, "tag", f"disagg:{IMAGE_TAG}", f"disagg:{ROLLED_TAG}", timeout=60)
    with Traffic(stack, expected) as traffic:
        stack.service("scale", "--detach=false", f"{stack.name}_decode=3")
        wait_for(lambda: len(stack.passing("disagg-decode")) == 3, 120, "the router's Consul to pass 3 decode",
                 every_s=1)
        served_before_roll = len(traffic.answered)
        stepped_at_scale = _rows_stepped(stack, "decode", DECODE_METRICS_PORT)
        stack.service("update", "--detach=false", "--no-resolve-image", "--image", f"disagg:{ROLLED_TAG}",
                      f"{stack.name}_prefill")
        wait_for(lambda: len(stack.passing("disagg-prefill")) == 1, 60, "the old prefill to leave Consul", every_s=1)
        # Every decode replica serves: the two added ones too, not only the first (each stepped rows of its own
        # after it joined; the engine's warm-up ran before it passed its health check).
        wait_for(lambda: all(rows > stepped_at_scale.get(container, float("inf"))
                             for container, rows in _rows_stepped(stack, "decode", DECODE_METRICS_PORT).items()),
                 60, "every decode replica to step rows of its own under traffic", every_s=2)
    assert len(stepped_at_scale) == 3, stepped_at_scale
    assert traffic.failures == [] and served_before_roll >= 3 and len(traffic.answered) > served_before_roll, (
        traffic.failures, served_before_roll, len(traffic.answered))
    assert _update_state(stack, "prefill") == "completed"  # not rolled back
    image = stack.service("inspect", "--format", "{{.Spec.TaskTemplate.ContainerSpec.Image}}",
                          f"{stack.name}_prefill", timeout=60)
    assert image.strip() == f"disagg:{ROLLED_TAG}"
