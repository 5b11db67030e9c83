"""The one-machine entry points as a user runs them: `disagg up`, then `disagg generate` against it;
and the real SmolLM2-135M through router → prefill → decode, token for token against HF."""
from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from common.engine.default_model import DEFAULT_MODEL_NAME, default_model_dir
from common.tokenizer import Tokenizer
from common.pb.disagg.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.hf_reference import hf_greedy
from services.cli.ports import check_port_free
from tests.integration.observed import wait_for
from tests.integration.processes import REPO_ROOT, free_port
from tests.integration.test_router import make_text_model

BANNER = re.compile(r"disagg is up: router on (\S+)")


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    return str(make_text_model(tmp_path_factory.mktemp("models") / "tiny-text"))


class Up:
    """`disagg up` as a child process; its output is collected for the banner and for failures."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, sigint_ignored: bool = False):
        """`sigint_ignored`: started as bash starts a background job (`disagg up &` in a script), SIGINT ignored."""
        http_off = () if "--http-port" in args else ("--http-port", "0")  # port 8000 may be taken
        self.popen = subprocess.Popen([sys.executable, "-m", "services", "up", *http_off, *args], cwd=REPO_ROOT,
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      env={**os.environ, **(env or {})},
                                      preexec_fn=_ignore_sigint if sigint_ignored else None)
        self.lines: list[str] = []
        self.router: str | None = None
        self._found = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line)
            match = BANNER.search(line)
            if match:
                self.router = match.group(1)
                self._found.set()
        self._found.set()

    def wait(self, timeout_s: float = 180) -> str:
        assert self._found.wait(timeout_s) and self.router, "".join(self.lines)
        return self.router

    def stop(self, *more: signal.Signals) -> int:
        """Ctrl-C; once `up` says it is stopping, each of `more` (a second signal while it stops its children).
        The exit code, or -9 where it had to be killed."""
        self.popen.send_signal(signal.SIGINT)
        try:
            if more:
                self.wait_line("stopping...", 30)  # SIGINT alone started the stop
            for sig in more:
                time.sleep(0.2)
                self.popen.send_signal(sig)
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.popen.poll() is None:  # it did not stop: kill it, and its children (own sessions) with it
                children = _child_pids(self.popen.pid)
                self.popen.kill()
                self.popen.wait()
                _stop_pids(children)
        return self.popen.returncode

    def wait_line(self, needle: str, timeout_s: float) -> str:
        """The first line with `needle` in it, once there is one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = next((line for line in list(self.lines) if needle in line), None)
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no line with {needle!r} within {timeout_s}s:\n" + "".join(self.lines))

    def metrics_urls(self) -> dict[str, str]:
        """The banner's Prometheus lines: child name → its /metrics URL."""
        return dict(m.groups() for m in (re.search(r"^\s+(\S+)\s+(http://\S+/metrics)$", line) for line in self.lines)
                    if m)


def _stop_pids(pids: list[int]) -> None:
    """SIGTERM each (a worker stops its TP followers), SIGKILL what is left after 10 s."""
    for sig, grace_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _free_port_run(count: int) -> int:
    """The first of `count` consecutive ports that are free now."""
    while True:
        base = free_port()
        if base + count <= 65535 and all(check_port_free("127.0.0.1", base + i) is None for i in range(count)):
            return base


def _child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_up_then_generate_streams_the_hf_answer(text_model):
    """As a script runs it: `disagg up &` (bash starts it with SIGINT ignored), `disagg generate` at once (it waits
    for the router), SIGINT stops everything."""
    router = f"127.0.0.1:{free_port()}"
    # DISAGG_METRICS_PORT once gave every child the same port: now each gets its own
    up = Up("--model", text_model, "--router-port", router.rsplit(":", 1)[1], sigint_ignored=True,
            env={"DISAGG_METRICS_PORT": str(_free_port_run(1))})
    generate = subprocess.Popen([sys.executable, "-m", "services", "generate", "--router", router, "--raw", "--greedy",
                                 "--max-tokens", "10", "--wait", "170", "The sea is"], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        assert up.wait() == router
        children = _child_pids(up.popen.pid)
        assert len(children) == 3, "".join(up.lines)  # router, prefill, decode
        metrics = up.metrics_urls()
        assert set(metrics) == {"router", "prefill-0", "decode-0"} and len(set(metrics.values())) == 3, metrics
        stdout, stderr = generate.communicate(timeout=120)
        assert generate.returncode == 0, stderr
        tokenizer = Tokenizer.from_model_dir(text_model)
        expected = hf_greedy(text_model, tokenizer.encode("The sea is"), 10, stop_at_eos=True)[0]
        assert stdout == tokenizer.decode(expected)
        assert re.search(r"\[length: \d+ prompt \+ 10 completion tokens, ttft \d+ ms", stderr), stderr
        waited = subprocess.run([sys.executable, "-m", "services", "wait", "--router", router, "--timeout", "30"],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert waited.returncode == 0 and waited.stdout.startswith(f"{router} is SERVING"), waited.stderr
    finally:  # SIGINT although it was started ignoring it; then a second signal while it stops them (pkill, a
        # supervisor's SIGTERM) once left the workers running
        generate.kill()
        generate.wait()
        assert up.stop(signal.SIGTERM, signal.SIGINT) == 0, "".join(up.lines)
    for pid in children:  # every child stopped with it
        deadline = time.monotonic() + 10
        while subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, f"child {pid} outlived disagg up"
            time.sleep(0.1)


def _scrapes(url: str) -> bool:
    try:
        return 'role="decode"' in urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return False


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.mark.slow
def test_up_restarts_a_killed_worker_on_its_addresses_and_serves_again(text_model):
    base = _free_port_run(3)
    up = Up("--model", text_model, "--router-port", "0", "--policy", "kv_aware", "--max-num-seqs", "4",
            "--block-size", "8", "--metrics-port-base", str(base))
    try:
        router = up.wait()
        up.wait_line("A process that dies is restarted", 10)
        addresses = {m.group(1): m.group(2) for m in (re.search(r"^\s+(prefill-0|decode-0)\s+(\S+)  \(gRPC", line)
                                                     for line in up.lines) if m}
        assert set(addresses) == {"prefill-0", "decode-0"}, "".join(up.lines)  # the banner names the workers
        metrics = up.metrics_urls()  # router, then prefill-0, decode-0, from the base
        assert metrics == {name: f"http://127.0.0.1:{base + i}/metrics"
                           for i, name in enumerate(["router", "prefill-0", "decode-0"])}, "".join(up.lines)
        assert 'role="decode"' in urllib.request.urlopen(metrics["decode-0"], timeout=10).read().decode()
        decode = next(pid for pid in _child_pids(up.popen.pid) if "services.decode" in _cmdline(pid))
        command = _cmdline(decode)
        assert command[command.index("--max-num-seqs") + 1] == "4" and "--block-size" in command  # engine flags go on

        os.kill(decode, signal.SIGKILL)
        assert up.wait_line("decode-0 was killed", 10).strip() == \
            "disagg up: decode-0 was killed by SIGKILL; restarting it in 1s"
        back = up.wait_line("decode-0 is back on", 120)
        assert back.strip().endswith(f"on {addresses['decode-0']} (restart 1)"), back
        wait_for(lambda: _scrapes(metrics["decode-0"]), 30, "the restarted decode's metrics on the same port")
        deadline = time.monotonic() + 60
        while True:  # the router probes the worker it marked down until it answers again
            result = subprocess.run([sys.executable, "-m", "services", "generate", "--router", router, "--greedy",
                                     "--max-tokens", "4", "--timeout", "20", "The sea is"], cwd=REPO_ROOT,
                                    capture_output=True, text=True, timeout=60)
            if result.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert result.returncode == 0, result.stderr + "".join(up.lines)
        assert up.popen.poll() is None  # nothing else was torn down
    finally:
        assert up.stop() == 0, "".join(up.lines)


def test_generate_reports_an_unreachable_router():
    result = subprocess.run([sys.executable, "-m", "services", "generate", "--router", "127.0.0.1:1",
                             "--timeout", "5", "--wait", "1", "hi"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "error from 127.0.0.1:1: UNAVAILABLE" in result.stderr
    assert "(not SERVING after waiting 1s: UNAVAILABLE" in result.stderr, result.stderr


@functools.cache
def _hf_answer(model: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """HF's greedy answer, computed once for both modes' clusters (about 1.4 s a question for SmolLM2 here)."""
    return tuple(hf_greedy(model, list(prompt), max_tokens, stop_at_eos=True)[0])


@pytest.mark.slow
def test_smollm2_through_disagg_up_matches_hf(smollm2):
    """The shared SmolLM2 clusters (tests/integration/conftest.py): aggregated, and router → prefill → decode."""
    model = str(default_model_dir())
    tokenizer = Tokenizer.from_model_dir(model)
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(smollm2.router))
    for question in ["What is the capital of France?", "Name three colours."]:
        chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content=question)])
        request = generation_pb2.GenerateRequest(
            chat=chat, model=DEFAULT_MODEL_NAME, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=24))
        responses = list(stub.Generate(request, timeout=120))
        tokens = [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]
        text = "".join(r.delta.text for r in responses if r.HasField("delta"))
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        expected = list(_hf_answer(model, tuple(prompt), 24))
        assert tokens == expected, (smollm2.mode, question)
        assert text == tokenizer.decode(expected)
