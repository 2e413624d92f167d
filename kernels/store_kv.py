"""Triton kernel that writes this step's K/V into the paged cache.

One program per token: it reads the token's slot, and copies its
[num_kv_heads, head_dim] key and value tiles to

```
kv_cache[0 | 1, slot // block_size, slot % block_size, :, :]
```

quantizing to fp8 e4m3 (stored = real / scale, saturating at +-448) when the
cache is fp8. Tokens with slot -1 (padding) write nothing. The torch reference
is kernels/reference.py:store_kv_ref; tests/kernels compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spur.kernels import fp8
from spur.kernels.fp8 import Scale
from spur.kernels.reference import check_store_kv_args


@triton.jit
def load_scale(scale, SCALE_IS_PTR: tl.constexpr):
    """A per-tensor scale given either as an fp32 scalar or as a pointer to one."""
    if SCALE_IS_PTR:
        return tl.load(scale).to(tl.float32)
    else:
        return scale


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]; uint8 bits if fp8
    slot_ptr,  # [num_tokens] int64
    k_scale,  # fp32 scalar, or pointer to one (SCALE_IS_PTR)
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_blk,
    stride_c_off,
    stride_c_h,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    # Padding tokens (slot -1) keep every lane masked off rather than returning early,
    # which keeps the control flow uniform.
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    blk = slot // block_size
    off = slot % block_size

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim) & valid
    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    dst = cache_ptr + blk * stride_c_blk + off * stride_c_off
    dst += offs_h[:, None] * stride_c_h + offs_d[None, :]

    if IS_FP8:
        ks = load_scale(k_scale, SCALE_IS_PTR)
        vs = load_scale(v_scale, SCALE_IS_PTR)
        # Saturate before converting: e4m3fn has no infinity, an overflow would be NaN.
        # div_rn: the division rounded as torch's reference rounds it (Triton's `/` is
        # PTX div.full.f32, up to 2 ulp off, which flips quotients halfway between two
        # e4m3 values); free here, the kernel is memory-bound.
        kq = tl.clamp(tl.div_rn(k.to(tl.float32), ks), -448.0, 448.0).to(tl.float8e4nv)
        vq = tl.clamp(tl.div_rn(v.to(tl.float32), vs), -448.0, 448.0).to(tl.float8e4nv)
        tl.store(dst, kq.to(tl.uint8, bitcast=True), mask=mask)
        tl.store(dst + stride_c_kv, vq.to(tl.uint8, bitcast=True), mask=mask)
    else:
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def scale_arg(scale: Scale, device: torch.device) -> tuple[float | torch.Tensor, bool]:
    """(kernel argument, is_pointer) for a per-tensor scale.

    A float passes by value; a one-element tensor passes as a pointer so a scale
    that lives on the GPU is never synced to the host.
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"KV scales are per tensor: got shape {tuple(scale.shape)}")
        if scale.device != device:
            raise ValueError(f"scale is on {scale.device}, move it to {device}")
        return scale.reshape(1).float(), True
    return float(scale), False


def check_triton_device(t: torch.Tensor) -> None:
    """Raise ValueError unless t can be handed to a Triton kernel here."""
    from spur.configs import env

    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and env.triton_interpret():
        return
    raise ValueError(
        f"the triton backend needs CUDA tensors (got {t.device}); use the torch backend, or "
        "set TRITON_INTERPRET=1 before importing triton to interpret kernels on CPU"
    )


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> None:
    """Triton version of store_kv_ref: same arguments, same contract (mutates kv_cache).

    key, value: [num_tokens, num_kv_heads, head_dim] (only the first
    len(slot_mapping) rows are read); slot_mapping: [num_tokens] int64, -1 = skip.
    """
    check_store_kv_args(key, value, kv_cache, slot_mapping)
    check_triton_device(kv_cache)
    if slot_mapping.stride(0) != 1:
        raise ValueError("slot_mapping must be contiguous: call .contiguous()")
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    is_fp8 = fp8.is_fp8_cache(kv_cache.dtype)
    # Always hand the kernel the uint8 view of an fp8 cache: the kernel bitcasts, so
    # float8_e4m3fn and uint8 caches share one compiled variant.
    cache = fp8.as_bytes(kv_cache) if is_fp8 else kv_cache
    ks, ks_ptr = scale_arg(k_scale, kv_cache.device)
    vs, vs_ptr = scale_arg(v_scale, kv_cache.device)
    if ks_ptr != vs_ptr:
        raise ValueError("pass k_scale and v_scale both as floats or both as tensors")
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        cache,
        slot_mapping,
        ks,
        vs,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        block_size,
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=is_fp8,
        SCALE_IS_PTR=ks_ptr,
    )


def compile_specs() -> list[tuple[str, triton.JITFunction, dict, dict]]:
    """(label, kernel, signature, constexprs) for the variants tests compile for Hopper."""
    specs = []
    for label, src, dst, is_fp8, scale_t in [
        ("bf16", "*bf16", "*bf16", False, "fp32"),
        ("fp32", "*fp32", "*fp32", False, "fp32"),
        ("fp16-fp8", "*fp16", "*u8", True, "fp32"),
        ("bf16-fp8-ptrscale", "*bf16", "*u8", True, "*fp32"),
    ]:
        constexprs = dict(BLOCK_H=8, BLOCK_D=128, IS_FP8=is_fp8, SCALE_IS_PTR=scale_t != "fp32")
        types = {
            "key_ptr": src,
            "value_ptr": src,
            "cache_ptr": dst,
            "slot_ptr": "*i64",
            "k_scale": scale_t,
            "v_scale": scale_t,
        }
        sig = {
            name: "constexpr" if name in constexprs else types.get(name, "i32")
            for name in _store_kv_kernel.arg_names
        }
        specs.append((f"store_kv-{label}", _store_kv_kernel, sig, constexprs))
    return specs
