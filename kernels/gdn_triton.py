"""Triton kernels of the gated delta rule over one step's flattened batch and a state pool.

Same contract as kernels/gdn_reference.py:gated_delta_rule_varlen_ref (read it
for the shapes, the pool layout and the slot rules); tests/kernels compares the
two. Two kernels, both with one program per (sequence, v head, block of BV
value columns) holding that slice of the recurrent state S [dk, BV] in
registers from the src slot to the dst slot:

- `_recurrent_kernel`, token by token (the decode form; any length works);
- `_chunk_kernel`, BT tokens at a time (the prefill form), the UT-transform
  algorithm of the reference: per chunk, A = strictly-lower(beta k k^T * decay)
  is inverted as (I + A)^-1 by forward substitution over its rows (the same
  recurrence as transformers' export path), then five matmuls read and update S.

The launcher sends single-token sequences to the recurrent kernel and longer
ones to the chunk kernel (each kernel skips the other kind), as the reference
does. Kernels run in float32 whatever the input and state dtypes; matmuls use
tf32 on 16-bit inputs and 3xTF32 (`tf32x3`, about fp32 accuracy on tensor cores)
on fp32 inputs: `ieee` would be FMA loops, and costs 3x the compile time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spur.kernels.gdn_reference import L2NORM_EPS, GDNMetadata, check_gdn_args
from spur.kernels.store_kv import check_triton_device

MAX_SHARED_BYTES = 227 * 1024  # sm_90, per block
CHUNK_SIZES = (16, 32, 64)
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _seq_bounds(qsl_ptr, seq, len_lo, len_hi):
    """[start, end) of a sequence's tokens; empty unless len_lo <= length <= len_hi."""
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    n = end - start
    active = (n >= len_lo) & (n <= len_hi)
    return start, tl.where(active, end, start)


@triton.jit
def _recurrent_kernel(
    q_ptr,  # [num_tokens, num_k_heads, k_head_dim]
    k_ptr,  # [num_tokens, num_k_heads, k_head_dim]
    v_ptr,  # [num_tokens, num_v_heads, v_head_dim]
    g_ptr,  # [num_tokens, num_v_heads]
    beta_ptr,  # [num_tokens, num_v_heads]
    out_ptr,  # [num_tokens, num_v_heads, v_head_dim]
    state_ptr,  # [num_slots, num_v_heads, k_head_dim, v_head_dim], dense per slot
    qsl_ptr,  # [num_seqs + 1] int32
    src_ptr,  # [num_seqs] int64
    dst_ptr,  # [num_seqs] int64
    has_init_ptr,  # [num_seqs] bool
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    stride_slot,
    scale,
    len_lo,
    len_hi,
    group,  # num_v_heads // num_k_heads
    k_head_dim,
    v_head_dim,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    EPS: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mk = offs_k < k_head_dim
    mv = offs_v < v_head_dim
    hk = h // group
    start, end = _seq_bounds(qsl_ptr, seq, len_lo, len_hi)
    has_init = tl.load(has_init_ptr + seq) != 0
    src = tl.load(src_ptr + seq)
    dst = tl.load(dst_ptr + seq)
    tile = h * k_head_dim * v_head_dim + offs_k[:, None] * v_head_dim + offs_v[None, :]
    m_s = mk[:, None] & mv[None, :]
    s = tl.load(state_ptr + src * stride_slot + tile, mask=m_s & has_init, other=0.0).to(
        tl.float32
    )  # [BK, BV]
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + offs_k, mask=mk, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + offs_k, mask=mk, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_v, mask=mv, other=0.0)
        g = tl.load(g_ptr + t * stride_gt + h * stride_gh).to(tl.float32)
        b = tl.load(beta_ptr + t * stride_bt + h * stride_bh).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + EPS)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + EPS)
        q = q * scale
        s = s * tl.exp(g)
        kv_mem = tl.sum(s * k[:, None], 0)  # [BV]
        delta = (v.to(tl.float32) - kv_mem) * b
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(
            out_ptr + t * stride_ot + h * stride_oh + offs_v,
            o.to(out_ptr.dtype.element_ty),
            mask=mv,
        )
    tl.store(
        state_ptr + dst * stride_slot + tile,
        s.to(state_ptr.dtype.element_ty),
        mask=m_s & (end > start),
    )


@triton.jit
def _chunk_kernel(
    q_ptr,  # [num_tokens, num_k_heads, k_head_dim]
    k_ptr,  # [num_tokens, num_k_heads, k_head_dim]
    v_ptr,  # [num_tokens, num_v_heads, v_head_dim]
    g_ptr,  # [num_tokens, num_v_heads]
    beta_ptr,  # [num_tokens, num_v_heads]
    out_ptr,  # [num_tokens, num_v_heads, v_head_dim]
    state_ptr,  # [num_slots, num_v_heads, k_head_dim, v_head_dim], dense per slot
    qsl_ptr,  # [num_seqs + 1] int32
    src_ptr,  # [num_seqs] int64
    dst_ptr,  # [num_seqs] int64
    has_init_ptr,  # [num_seqs] bool
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    stride_slot,
    scale,
    len_lo,
    len_hi,
    group,
    k_head_dim,
    v_head_dim,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    EPS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mk = offs_k < k_head_dim
    mv = offs_v < v_head_dim
    hk = h // group
    start, end = _seq_bounds(qsl_ptr, seq, len_lo, len_hi)
    has_init = tl.load(has_init_ptr + seq) != 0
    src = tl.load(src_ptr + seq)
    dst = tl.load(dst_ptr + seq)
    tile = h * k_head_dim * v_head_dim + offs_k[:, None] * v_head_dim + offs_v[None, :]
    m_s = mk[:, None] & mv[None, :]
    s = tl.load(state_ptr + src * stride_slot + tile, mask=m_s & has_init, other=0.0).to(
        tl.float32
    )  # [BK, BV]

    rows_i = offs_t[:, None]
    cols_j = offs_t[None, :]
    causal = rows_i >= cols_j  # [BT, BT], j <= i
    strict = rows_i > cols_j
    eye = (rows_i == cols_j).to(tl.float32)
    for c0 in range(start, end, BT):
        # Rows past the sequence load zeros (k, v, beta, g = 0), which makes them
        # inert: zero rows in A, U, W and V', and no decay (g = 0) at the end.
        rows = c0 + offs_t
        mt = rows < end
        m_tk = mt[:, None] & mk[None, :]
        m_tv = mt[:, None] & mv[None, :]
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + hk * stride_qh + offs_k[None, :],
            mask=m_tk,
            other=0.0,
        ).to(tl.float32)  # [BT, BK]
        k = tl.load(
            k_ptr + rows[:, None] * stride_kt + hk * stride_kh + offs_k[None, :],
            mask=m_tk,
            other=0.0,
        ).to(tl.float32)  # [BT, BK]
        v = tl.load(
            v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
            mask=m_tv,
            other=0.0,
        ).to(tl.float32)  # [BT, BV]
        g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=mt, other=0.0).to(tl.float32)
        b = tl.load(beta_ptr + rows * stride_bt + h * stride_bh, mask=mt, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 1) + EPS)[:, None]
            k = k * tl.rsqrt(tl.sum(k * k, 1) + EPS)[:, None]
        q = q * scale

        gc = tl.cumsum(g, 0)  # [BT] log-decay from the chunk start to each row
        g_last = tl.sum(g, 0)
        # exp(gc_i - gc_j) for j <= i; the masked half is never exponentiated (overflow).
        decay = tl.where(causal, tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
        kb = k * b[:, None]
        a = tl.dot(kb, tl.trans(k), input_precision=DOT_PRECISION)
        a = tl.where(strict, a * decay, 0.0)  # [BT, BT]
        # (I + A)^-1 = I + Y, Y strictly lower: Y[i] = -A[i] - sum_j A[i, j] Y[j],
        # rows j < i already final.
        y = -a
        for i in range(1, BT):
            row = tl.sum(tl.where(rows_i == i, y, 0.0), 0)  # [BT], -A[i]
            new = row + tl.sum(row[:, None] * y, 0)
            y = tl.where(rows_i == i, new[None, :], y)
        t_inv = y + eye
        u = tl.dot(t_inv, v * b[:, None], input_precision=DOT_PRECISION)  # [BT, BV]
        w = tl.dot(t_inv, kb * tl.exp(gc)[:, None], input_precision=DOT_PRECISION)  # [BT, BK]
        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)  # [BT, BV]
        attn = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay  # [BT, BT]
        o = tl.dot(q * tl.exp(gc)[:, None], s, input_precision=DOT_PRECISION)
        o += tl.dot(attn, v_new, input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=m_tv,
        )
        k_decayed = k * tl.exp(g_last - gc)[:, None]
        s = s * tl.exp(g_last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=DOT_PRECISION)
    tl.store(
        state_ptr + dst * stride_slot + tile,
        s.to(state_ptr.dtype.element_ty),
        mask=m_s & (end > start),
    )


def _blocks(k_head_dim: int, v_head_dim: int, chunk: bool) -> tuple[int, int]:
    """(BK, BV): the whole key dimension, value columns split for parallelism."""
    bk = max(16, triton.next_power_of_2(k_head_dim))
    bv = max(16, min(64 if chunk else 32, triton.next_power_of_2(v_head_dim)))
    return bk, bv


def gated_delta_rule_varlen_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    metadata: GDNMetadata,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
    method: str = "auto",
) -> torch.Tensor:
    """Triton version of gated_delta_rule_varlen_ref: same arguments, same contract.

    q, k: [num_tokens, num_k_heads, k_head_dim]; v: [num_tokens, num_v_heads,
    v_head_dim]; g, beta: [num_tokens, num_v_heads]; ssm_state [num_slots,
    num_v_heads, k_head_dim, v_head_dim] mutated through metadata's slots.
    Returns out [num_tokens, num_v_heads, v_head_dim] in q's dtype. `method`:
    "auto" (recurrent kernel for single-token sequences, chunk kernel for the
    rest), "recurrent" or "chunk" (every sequence through one kernel; tests).
    Raises ValueError for unsupported dtypes, strides, chunk sizes or devices.
    """
    check_gdn_args(q, k, v, g, beta, ssm_state)
    check_triton_device(q)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size {chunk_size} is unsupported: use one of {CHUNK_SIZES}")
    if method not in ("auto", "recurrent", "chunk"):
        raise ValueError(f"method {method!r} is unknown: use 'auto', 'recurrent' or 'chunk'")
    for name, t in (("q", q), ("k", k), ("v", v), ("ssm_state", ssm_state)):
        if t.dtype not in _INPUT_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is unsupported: use float32, bf16 or fp16")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension: call .contiguous()")
    num_tokens, num_k_heads, k_head_dim = q.shape
    num_v_heads, v_head_dim = v.shape[1:]
    if out is None:
        out = q.new_empty((num_tokens, num_v_heads, v_head_dim))
    elif tuple(out.shape) != (num_tokens, num_v_heads, v_head_dim) or out.stride(-1) != 1:
        raise ValueError(
            f"out must be [{num_tokens}, {num_v_heads}, {v_head_dim}] with a contiguous last "
            f"dimension, got shape {tuple(out.shape)}"
        )
    out[metadata.num_actual_tokens :] = 0
    if metadata.num_seqs == 0 or metadata.num_actual_tokens == 0:
        return out
    kernels = []
    if method == "recurrent":
        kernels.append((_recurrent_kernel, 1, num_tokens))
    elif method == "chunk":
        kernels.append((_chunk_kernel, 1, num_tokens))
    else:
        lens = metadata.query_lens_cpu
        if bool((lens == 1).any()):
            kernels.append((_recurrent_kernel, 1, 1))
        if metadata.max_query_len > 1:
            kernels.append((_chunk_kernel, 2, num_tokens))
    args = (
        q,
        k,
        v,
        g,
        beta,
        out,
        ssm_state,
        metadata.query_start_loc,
        metadata.src_slots,
        metadata.dst_slots,
        metadata.has_initial_state,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        out.stride(0),
        out.stride(1),
        ssm_state.stride(0),
        float(k_head_dim**-0.5 if scale is None else scale),
    )
    for kernel, len_lo, len_hi in kernels:
        chunk = kernel is _chunk_kernel
        bk, bv = _blocks(k_head_dim, v_head_dim, chunk)
        grid = (metadata.num_seqs, num_v_heads, triton.cdiv(v_head_dim, bv))
        extra = {"BT": chunk_size, "DOT_PRECISION": _dot_precision(q.dtype)} if chunk else {}
        kernel[grid](
            *args,
            len_lo,
            len_hi,
            num_v_heads // num_k_heads,
            k_head_dim,
            v_head_dim,
            BK=bk,
            BV=bv,
            L2NORM=use_qk_l2norm,
            EPS=L2NORM_EPS,
            num_warps=_num_warps(chunk, bk, bv),
            **extra,
        )
    return out


def _num_warps(chunk: bool, bk: int, bv: int) -> int:
    return 8 if chunk and bk * bv >= 64 * 64 else 4


def _dot_precision(dtype: torch.dtype) -> str:
    return "tf32x3" if dtype == torch.float32 else "tf32"


def signature(kernel: triton.JITFunction, types: dict[str, str], constexprs: dict) -> dict:
    """ASTSource signature: every argument by name, constexprs marked, other ints i32."""
    return {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in kernel.arg_names
    }


def compile_specs() -> list[tuple[str, triton.JITFunction, dict, dict, int]]:
    """(label, kernel, signature, constexprs, num_warps) of the variants tests compile for sm_90.

    Qwen3.5 / Qwen3-Next head sizes (128 x 128) with bf16 and fp32 activations
    over a float32 or bf16 state pool, chunk 64 and 32, and a small odd head size.
    """
    specs = []
    # (label, activation type, state type, k_head_dim, v_head_dim, chunk size)
    variants = [
        ("bf16-statefp32", "*bf16", "*fp32", 128, 128, 64),
        ("fp32", "*fp32", "*fp32", 128, 128, 64),
        ("fp16-statebf16-small", "*fp16", "*bf16", 48, 40, 32),
    ]
    for label, act, state_t, dk, dv, bt in variants:
        types = {f"{n}_ptr": act for n in ("q", "k", "v", "out")}
        types |= {"g_ptr": "*fp32", "beta_ptr": act, "state_ptr": state_t, "qsl_ptr": "*i32"}
        types |= {"src_ptr": "*i64", "dst_ptr": "*i64", "has_init_ptr": "*i1", "scale": "fp32"}
        types |= {"stride_slot": "i64"}
        for kernel, chunk in ((_recurrent_kernel, False), (_chunk_kernel, True)):
            bk, bv = _blocks(dk, dv, chunk)
            constexprs = dict(BK=bk, BV=bv, L2NORM=True, EPS=L2NORM_EPS)
            if chunk:
                constexprs |= dict(BT=bt, DOT_PRECISION="tf32x3" if act == "*fp32" else "tf32")
            name = "chunk" if chunk else "recurrent"
            sig = signature(kernel, types, constexprs)
            specs.append(
                (f"gdn-{name}-{label}", kernel, sig, constexprs, _num_warps(chunk, bk, bv))
            )
    return specs
