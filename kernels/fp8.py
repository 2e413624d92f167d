"""fp8 (e4m3) KV-cache storage helpers.

An fp8 cache stores `real / scale` rounded to float8_e4m3fn, with one float
scale per tensor (`k_scale`, `v_scale`). Several fp8 ops (index_put, most
arithmetic) are missing on CPU, so an fp8 cache is allocated as torch.uint8 and
read or written through `.view(torch.float8_e4m3fn)`; on CUDA the cache may be
either uint8 or float8_e4m3fn and both are accepted everywhere.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite e4m3fn value; quantization saturates here instead of making NaN.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)

# Storage dtypes a KV cache may have.
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, FP8_DTYPE)

Scale = float | torch.Tensor


def is_fp8_cache(dtype: torch.dtype) -> bool:
    """True when a cache of this storage dtype holds fp8 e4m3 values."""
    return dtype in (torch.uint8, FP8_DTYPE)


def as_fp8(t: torch.Tensor) -> torch.Tensor:
    """View a uint8 / float8_e4m3fn tensor as float8_e4m3fn (no copy)."""
    return t if t.dtype == FP8_DTYPE else t.view(FP8_DTYPE)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a uint8 / float8_e4m3fn tensor as uint8 (no copy); indexing works on CPU."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def quantize(x: torch.Tensor, scale: Scale) -> torch.Tensor:
    """`x / scale` saturated to +-FP8_MAX and rounded to e4m3, returned as uint8 bits.

    The result has x's shape; x is not mutated.
    """
    y = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX)
    return y.to(FP8_DTYPE).view(torch.uint8)


def dequantize(bits: torch.Tensor, scale: Scale) -> torch.Tensor:
    """fp8 bits (uint8 or float8_e4m3fn) times `scale`, as a new float32 tensor."""
    return as_fp8(bits).float() * scale


def scale_value(scale: Scale) -> float:
    """A host float from a float or one-element tensor (syncs if the tensor is on a device)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"KV scales are per tensor: expected one element, got shape {tuple(scale.shape)}"
            )
        return float(scale.item())
    return float(scale)
