"""The CPU's C kernels (cpu_attention.c, cpu_ops.c): each source built once per machine with the system C compiler
into the cache root (~/.cache/disagg/kernels) and loaded with ctypes. Where no compiler works, `library` is None and
the torch path runs instead (the same answer, slower)."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
HEADERS = [HERE / "cpu_bf16.h"]  # included by the sources: part of every build's digest
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]


def _cpu_signature() -> str:
    """The CPU's flags (-march=native builds for them): a cache shared by machines never loads another's build."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str, source: Path) -> Path:
    from common.engine.default_model import cache_root

    digest = hashlib.sha256(source.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
                            + " ".join(FLAGS).encode() + _cpu_signature().encode())
    target = cache_root() / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: two workers may race
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, str(source), "-o", str(built), "-lm"], check=True, capture_output=True,
                           text=True, timeout=120)
            os.replace(built, target)
    return target


@cache
def library(source: str) -> ctypes.CDLL | None:
    """The built library of `source` (a C file beside this one), or None where it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, HERE / source)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("the CPU kernels of %s could not be built (%s); the torch path runs instead", source, detail)
        return None
