"""The CPU's paged decode attention kernel (cpu_attention.c): built once per machine with the system C compiler
into the cache root (~/.cache/disagg/kernels), loaded with ctypes. Where no compiler works, `kernel()` is None and
TorchPagedAttention gathers the blocks and calls SDPA instead (the same answer, slower: README "The CPU path")."""
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

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # of q and out
_CACHE_DTYPES = {**_DTYPES, torch.float8_e4m3fn: 2}  # of the caches: the compute dtype, or FP8 (read times a scale)
_I64P = ctypes.POINTER(ctypes.c_int64)


def _cpu_signature() -> str:
    """The CPU's flags (-march=native builds for them): a cache shared by machines never loads another's build."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str) -> Path:
    from common.engine.default_model import cache_root

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_signature().encode())
    target = cache_root() / "kernels" / f"cpu_attention-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: two workers may race
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True,
                           text=True, timeout=120)
            os.replace(built, target)
    return target


@cache
def kernel():
    """The compiled kernel's function, or None where it cannot be built (no C compiler, or DISAGG_CPU_KERNELS=0)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if os.environ.get("DISAGG_CPU_KERNELS", "1") == "0" or compiler is None:
        return None
    try:
        function = ctypes.CDLL(str(_build(compiler))).paged_decode_attention
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("the CPU attention kernel could not be built (%s); decode attention gathers blocks instead", detail)
        return None
    function.restype = ctypes.c_int
    function.argtypes = ([ctypes.c_void_p] * 4 + [_I64P] * 3 + [ctypes.c_int64] * 7
                         + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_float])
    return function


def applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The kernel's cases: CPU tensors of float32 or bf16, the caches of the same dtype or FP8 (an FP8 KV cache),
    each cache block [block_size, Hkv, D] contiguous (a tensor-parallel rank's slice of the heads is not), one torch
    thread (the kernel runs on one core; with more, torch's SDPA spreads over them) and the kernel built."""
    n, block_size, heads, dim = k_cache.shape
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
            and k_cache.stride()[1:] == (heads * dim, dim, 1) and torch.get_num_threads() == 1
            and kernel() is not None)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
           seq_lens: torch.Tensor, starts: torch.Tensor, scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """q [B, Hq, D]; caches [N, block_size, Hkv, D]; block_ids [B * max_blocks] int64, each sequence's blocks;
    attends to tokens [starts[b], seq_lens[b]) of sequence b → [B, Hq, D] (check `applies` first). An FP8
    cache's values are read times `kv_scale`."""
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, heads, dim = q.shape
    ptr = lambda t: ctypes.cast(t.data_ptr(), _I64P)  # noqa: E731
    status = kernel()(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), ptr(block_ids),
                      ptr(seq_lens), ptr(starts), batch, block_ids.numel() // max(batch, 1), k_cache.shape[1], heads,
                      k_cache.shape[2], dim, k_cache.stride(0), scale, _DTYPES[q.dtype], _CACHE_DTYPES[k_cache.dtype],
                      kv_scale)
    if status:
        raise MemoryError("the CPU attention kernel could not allocate its workspace")
    return out
