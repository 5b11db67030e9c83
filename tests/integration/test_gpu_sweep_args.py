"""The attention sweeps' command line (benchmarks/gpu/attention_cases.sweep_args), as a user runs a sweep: a shape name
it does not know, or a machine without a CUDA GPU, ends it with one line and exit status 2, not a traceback. The
engine's prefill and mixed-step bench (benchmarks/gpu_prefill.py) says the same without a GPU."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]


def _sweep(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", ["benchmarks.gpu.sweep_decode_attention", "benchmarks.gpu.sweep_prefill_attention"])
def test_an_unknown_shape_is_refused_by_name(module):
    result = _sweep(module, "--shapes", "3b-nope")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--shapes: no shape 3b-nope; the shapes are " in result.stderr.splitlines()[-1]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_a_sweep_says_so_in_one_line():
    result = _sweep("benchmarks.gpu.sweep_decode_attention", "--shapes", "3b-b64-c1400")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith("needs a CUDA GPU: a sweep times the kernels on one")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_the_prefill_bench_says_so_in_one_line():
    result = _sweep("benchmarks.gpu_prefill", "--skip-hf", "--mixed-batch", "64")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith("needs a CUDA GPU: it times the engine's steps on one")
