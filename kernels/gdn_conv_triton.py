"""Triton kernels of the GDN causal conv1d (+ SiLU) over one step's flattened batch.

Same contract as kernels/gdn_reference.py:causal_conv1d_varlen_ref (shapes, the
`conv_state [num_slots, K-1, conv_dim]` pool, the slot rules); tests/kernels
compares the two. Two launches, in order on one stream:

1. `_conv_kernel`, one program per (BT tokens, BC channels): token t of a
   sequence starting at `start` reads taps `xx[pos .. pos + K-1]` of
   `xx = initial_state ++ x_seq` (pos = t - start): taps before the sequence come
   from the src slot (zeros without an initial state), the rest from x.
2. `_conv_state_kernel`, one program per (sequence, BC channels): the dst slot
   gets the last K-1 rows of `xx`, loaded whole before the store, so dst == src
   is safe; it runs after every read of the old states in launch 1.

Tokens map to their sequence through `token_seq` ([num_tokens] int32,
torch.searchsorted over query_start_loc on the device: no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spur.kernels.gdn_reference import GDNMetadata, check_conv_args
from spur.kernels.store_kv import check_triton_device

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _conv_kernel(
    x_ptr,  # [num_tokens, conv_dim]
    w_ptr,  # [conv_dim, K]
    bias_ptr,  # [conv_dim] (unused without HAS_BIAS)
    out_ptr,  # [num_tokens, conv_dim]
    state_ptr,  # [num_slots, K-1, conv_dim], dense per slot
    token_seq_ptr,  # [num_tokens] int32
    qsl_ptr,  # [num_seqs + 1] int32
    src_ptr,  # [num_seqs] int64
    has_init_ptr,  # [num_seqs] bool
    stride_xt,
    stride_ot,
    stride_wc,
    stride_wk,
    stride_slot,
    num_actual_tokens,
    conv_dim,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    # int64: rows * stride_xt exceeds 2**31 for long steps over a fused projection.
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = offs_c < conv_dim
    mt = rows < num_actual_tokens
    seq = tl.load(token_seq_ptr + rows, mask=mt, other=0)
    start = tl.load(qsl_ptr + seq, mask=mt, other=0)
    has_init = tl.load(has_init_ptr + seq, mask=mt, other=0) != 0
    src = tl.load(src_ptr + seq, mask=mt, other=0)
    pos = rows - start  # [BT] position in the sequence
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(K):
        p = pos + j - (K - 1)  # [BT] index into the sequence's x; < 0: into the state
        in_x = p >= 0
        m_x = (mt & in_x)[:, None] & mc[None, :]
        xv = tl.load(
            x_ptr + (rows + j - (K - 1))[:, None] * stride_xt + offs_c[None, :],
            mask=m_x,
            other=0.0,
        ).to(tl.float32)
        m_s = (mt & ~in_x & has_init)[:, None] & mc[None, :]
        sv = tl.load(
            state_ptr
            + src[:, None] * stride_slot
            + (p + K - 1)[:, None] * conv_dim
            + offs_c[None, :],
            mask=m_s,
            other=0.0,
        ).to(tl.float32)
        wj = tl.load(w_ptr + offs_c * stride_wc + j * stride_wk, mask=mc, other=0.0).to(tl.float32)
        acc += (xv + sv) * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + rows[:, None] * stride_ot + offs_c[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mt[:, None] & mc[None, :],
    )


@triton.jit
def _conv_state_kernel(
    x_ptr,  # [num_tokens, conv_dim]
    state_ptr,  # [num_slots, K-1, conv_dim], dense per slot
    qsl_ptr,  # [num_seqs + 1] int32
    src_ptr,  # [num_seqs] int64
    dst_ptr,  # [num_seqs] int64
    has_init_ptr,  # [num_seqs] bool
    stride_xt,
    stride_slot,
    conv_dim,
    K: tl.constexpr,
    BS: tl.constexpr,  # next power of two >= K-1
    BC: tl.constexpr,
):
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    offs_s = tl.arange(0, BS)
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    n = tl.load(qsl_ptr + seq + 1).to(tl.int64) - start
    has_init = tl.load(has_init_ptr + seq) != 0
    src = tl.load(src_ptr + seq)
    dst = tl.load(dst_ptr + seq)
    live = (offs_s < K - 1) & (n > 0)
    mc = offs_c < conv_dim
    idx = n + offs_s  # row of xx = initial_state (K-1 rows) ++ x_seq (n rows)
    in_x = idx >= K - 1
    xv = tl.load(
        x_ptr + (start + idx - (K - 1))[:, None] * stride_xt + offs_c[None, :],
        mask=(live & in_x)[:, None] & mc[None, :],
        other=0.0,
    )
    sv = tl.load(
        state_ptr + src * stride_slot + idx[:, None] * conv_dim + offs_c[None, :],
        mask=(live & ~in_x & has_init)[:, None] & mc[None, :],
        other=0.0,
    )
    new = xv.to(tl.float32) + sv.to(tl.float32)  # exactly one of the two is loaded
    tl.store(
        state_ptr + dst * stride_slot + offs_s[:, None] * conv_dim + offs_c[None, :],
        new.to(state_ptr.dtype.element_ty),
        mask=live[:, None] & mc[None, :],
    )


def _blocks(conv_dim: int) -> tuple[int, int]:
    """(BT, BC) of the output kernel."""
    return 16, min(128, max(16, triton.next_power_of_2(conv_dim)))


def causal_conv1d_varlen_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    metadata: GDNMetadata,
    activation: str | None = "silu",
    *,
    out: torch.Tensor | None = None,
    token_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of causal_conv1d_varlen_ref: same arguments, same contract.

    x: [num_tokens, conv_dim] (rows may be strided, channels contiguous);
    weight: [conv_dim, K]; conv_state: [num_slots, K-1, conv_dim], mutated.
    Returns out [num_tokens, conv_dim] in x's dtype. `token_seq` ([num_tokens]
    int32, each real token's sequence index) may be passed to share it between
    layers; it is computed on the device otherwise (once per step: metadata.memo).
    """
    check_conv_args(x, weight, bias, conv_state, activation)
    check_triton_device(x)
    for name, t in (("x", x), ("conv_state", conv_state)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is unsupported: use float32, bf16 or fp16")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous in conv_dim: call .contiguous()")
    num_tokens, conv_dim = x.shape
    kernel = weight.shape[1]
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_tokens}, {conv_dim}] with contiguous channels")
    out[metadata.num_actual_tokens :] = 0
    n = metadata.num_actual_tokens
    if n == 0:
        return out
    if token_seq is None:
        token_seq = gdn_token_seq(metadata, x.device)
    bt, bc = _blocks(conv_dim)
    _conv_kernel[(triton.cdiv(n, bt), triton.cdiv(conv_dim, bc))](
        x,
        weight,
        weight if bias is None else bias,
        out,
        conv_state,
        token_seq,
        metadata.query_start_loc,
        metadata.src_slots,
        metadata.has_initial_state,
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        weight.stride(1),
        conv_state.stride(0),
        n,
        conv_dim,
        K=kernel,
        BT=bt,
        BC=bc,
        HAS_BIAS=bias is not None,
        SILU=activation is not None,
    )
    _conv_state_kernel[(metadata.num_seqs, triton.cdiv(conv_dim, 128))](
        x,
        conv_state,
        metadata.query_start_loc,
        metadata.src_slots,
        metadata.dst_slots,
        metadata.has_initial_state,
        x.stride(0),
        conv_state.stride(0),
        conv_dim,
        K=kernel,
        BS=max(2, triton.next_power_of_2(kernel - 1)),
        BC=128,
    )
    return out


def gdn_token_seq(metadata: GDNMetadata, device: torch.device) -> torch.Tensor:
    """[num_actual_tokens] int32: the sequence index of each real token (no host sync).

    Computed once per step and device, kept in metadata.memo for the other layers.
    """
    key = ("gdn_token_seq", str(device))
    found = metadata.memo.get(key)
    if found is None:
        tokens = torch.arange(metadata.num_actual_tokens, device=device, dtype=torch.int32)
        bounds = metadata.query_start_loc[1:].to(device)
        found = torch.searchsorted(bounds, tokens, right=True).to(torch.int32)
        metadata.memo[key] = found
    return found


def signature(kernel: triton.JITFunction, types: dict[str, str], constexprs: dict) -> dict:
    """ASTSource signature: every argument by name, constexprs marked, other ints i32."""
    return {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in kernel.arg_names
    }


def compile_specs() -> list[tuple[str, triton.JITFunction, dict, dict, int]]:
    """(label, kernel, signature, constexprs, num_warps) of the variants compiled for sm_90.

    Qwen3.5's conv (kernel 4, SiLU, no bias) on bf16 and fp32 activations over
    float32 and bf16 state pools, and a biased, unactivated kernel-2 variant.
    """
    specs = []
    for label, act, state_t, k, bias, silu in [
        ("bf16-statefp32", "*bf16", "*fp32", 4, False, True),
        ("fp32", "*fp32", "*fp32", 4, False, True),
        ("fp16-statebf16-k2-bias", "*fp16", "*bf16", 2, True, False),
    ]:
        types = {"x_ptr": act, "w_ptr": act, "bias_ptr": act, "out_ptr": act}
        types |= {"state_ptr": state_t, "token_seq_ptr": "*i32", "qsl_ptr": "*i32"}
        types |= {"src_ptr": "*i64", "dst_ptr": "*i64", "has_init_ptr": "*i1"}
        types |= {"stride_slot": "i64"}
        bt, bc = _blocks(8192)
        main = dict(K=k, BT=bt, BC=bc, HAS_BIAS=bias, SILU=silu)
        state = dict(K=k, BS=max(2, triton.next_power_of_2(k - 1)), BC=128)
        for name, kern, constexprs in (
            ("conv", _conv_kernel, main),
            ("conv-state", _conv_state_kernel, state),
        ):
            sig = signature(kern, types, constexprs)
            specs.append((f"gdn-{name}-{label}", kern, sig, constexprs, 4))
    return specs
