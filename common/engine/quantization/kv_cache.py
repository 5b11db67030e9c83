"""What the paged KV cache stores: the model's dtype ("auto"), or FP8 (float8_e4m3fn) with a scale.

An FP8 cache holds K / scale and V / scale, saturated to FP8's range, and attention reads them back as
stored * scale: the torch reference dequantises the gathered blocks to the compute dtype, the CPU's C decode kernel
reads each byte through a table of its values (cpu_attention.c), and on CUDA the Triton kernels store through
Triton's own conversion to FP8 (whether it saturates there is unverified) and convert each loaded tile to q's dtype
(checked in Triton's interpreter on the CPU; unmeasured on a GPU). Where Triton has no FP8 (compute capability < 8.9) the torch reference runs, without CUDA
graphs (model_runner.make_attention_backend). The scale is 1.0 for K and V of every layer,
what vLLM uses without calibration (its k_scale / v_scale default); it is part of the KV fingerprint, so two workers
share FP8 blocks only when they read them with the same scale. Blocks move between workers as the cache holds them:
FP8, half the bytes of bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.config import KV_CACHE_DTYPES
from common.engine.quantization.fp8_linear import FP8, FP8_MAX
from common.kv.words import as_words
from common.errors import InvalidConfig

UNCALIBRATED_SCALE = 1.0


@dataclass(frozen=True)
class KvCacheFormat:
    dtype: torch.dtype  # what the cache tensor holds
    scale: float = 1.0  # FP8 only: stored = value / scale

    @classmethod
    def of(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> "KvCacheFormat":
        if kv_cache_dtype == "auto":
            return cls(model_dtype)
        if kv_cache_dtype == "fp8":
            return cls(FP8, UNCALIBRATED_SCALE)
        raise InvalidConfig(f"--kv-cache-dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    def triton_reads(self, device: torch.device) -> bool:
        """Whether the Triton kernels (attention_triton.py, kernels.rope_store_kv) take this cache on `device`: one of
        the compute dtype, or FP8 at scale 1.0 (they convert without a scale) where Triton has FP8 (compute
        capability >= 8.9)."""
        return not self.is_fp8 or (self.scale == 1.0 and torch.cuda.get_device_capability(device) >= (8, 9))

    def write(self, flat_cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """values [T, H, D] into flat_cache [slots, H, D] at `slots`."""
        if not self.is_fp8:
            flat_cache.index_copy_(0, slots, values)
            return
        scaled = values if self.scale == 1.0 else values / self.scale
        encoded = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)  # saturate: FP8 e4m3fn has no infinity
        as_words(flat_cache).index_copy_(0, slots, as_words(encoded))

    def read(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks as the cache holds them → values in `dtype`."""
        if not self.is_fp8:
            return stored
        values = stored.to(dtype)
        return values if self.scale == 1.0 else values * self.scale

    def fingerprint_fields(self) -> dict[str, object]:
        """What an FP8 cache adds to the KV fingerprint (nothing for "auto": fingerprints stay as they were)."""
        return {"kv_cache_dtype": str(self.dtype).removeprefix("torch."), "kv_scale": self.scale} if self.is_fp8 else {}
