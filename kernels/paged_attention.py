"""Triton paged attention: a unified kernel for any batch and a split-KV decode kernel.

Both kernels read K/V only through the block tables and share one inner loop
(`_attend_tiles`): online softmax over tiles of BLOCK_N context positions. A tile
may cross KV blocks, so block_size needs not be a power of two; every position
looks its block id up in the block table:

```
position p of request r -> kv_cache[0|1, block_tables[r, p // block_size], p % block_size]
```

Unified kernel (any query lengths, chunked prefill with cached context, decodes),
one program per (query block, KV head). Rows of a program are BLOCK_Q query
tokens x GROUP query heads that share the KV head, so K/V tiles are loaded once
per group:

```
row m -> token q_block * BLOCK_Q + m // GROUP, query head kv_head * GROUP + m % GROUP
```

Request r's query blocks start at program `query_start_loc[r] // BLOCK_Q + r`, an
upper bound on the blocks of requests before r that needs no host work; the
grid is `num_tokens // BLOCK_Q + num_reqs` and a program finds its request by
binary search, exiting at once if it falls past its request's last block.

Decode kernel (every request has one query token): one program per (request,
KV head, split). With few requests and long contexts the context is split into
NUM_SPLITS parts whose partial (max, sum, acc) are combined by `_reduce_kernel`
(flash-decoding), so a small batch still fills the GPU.

Scores use exp2 with log2(e) folded into the scale. fp8 caches are dequantized
by folding k_scale into the score scale and v_scale into the output.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from spur.kernels import fp8
from spur.kernels.fp8 import Scale
from spur.kernels.metadata import AttentionMetadata
from spur.kernels.reference import check_attention_args
from spur.kernels.store_kv import check_triton_device, load_scale, scale_arg

# A constexpr global: jit code may only read globals declared this way.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend_tiles(
    acc,  # [BLOCK_M, BLOCK_D] fp32, un-normalized output so far
    m_i,  # [BLOCK_M] fp32, running max of scores (log2 domain)
    l_i,  # [BLOCK_M] fp32, running sum of exp2(score - m_i)
    q,  # [BLOCK_M, BLOCK_D] in the compute dtype
    q_pos,  # [BLOCK_M] int32, context position of each row's token
    row_valid,  # [BLOCK_M] bool
    k_ptr,  # cache + kv_head offset, K half
    v_ptr,  # cache + kv_head offset, V half
    table_ptr,  # this request's block-table row
    seq_len,
    tile_lo,
    tile_hi,
    qk_scale,  # softmax scale * k_scale * log2(e)
    sliding_window,
    stride_c_blk,
    stride_c_off,
    block_size,
    head_dim,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold context tiles [tile_lo, tile_hi) into the online-softmax state."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n  # [BLOCK_N] context positions
        in_ctx = pos < seq_len
        blk = tl.load(table_ptr + pos // block_size, mask=in_ctx, other=0).to(tl.int64)
        slot = blk * stride_c_blk + (pos % block_size) * stride_c_off  # [BLOCK_N]
        # K loaded transposed: [BLOCK_D, BLOCK_N]. Positions past the context load 0 so
        # that stale cache contents (even NaN) never reach the sums.
        k = tl.load(
            k_ptr + slot[None, :] + offs_d[:, None], mask=d_ok[:, None] & in_ctx[None, :], other=0
        )
        if IS_FP8:
            k = k.to(tl.float8e4nv, bitcast=True)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        allowed = row_valid[:, None] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))  # [BLOCK_M, BLOCK_N]

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing allowed yet keeps max -inf; subtract 0 instead so that
        # exp2(-inf - -inf) cannot make NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(
            v_ptr + slot[:, None] + offs_d[None, :], mask=in_ctx[:, None] & d_ok[None, :], other=0
        )  # [BLOCK_N, BLOCK_D]
        if IS_FP8:
            v = v.to(tl.float8e4nv, bitcast=True)
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _unified_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]; uint8 bits if fp8
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    k_scale,  # fp32 scalar, or pointer to one (SCALE_IS_PTR)
    v_scale,
    scale,
    sliding_window,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_kv,
    stride_c_blk,
    stride_c_off,
    stride_c_h,
    stride_bt,
    block_size,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr,
    IS_FP8: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Request of this program: the last r with query_start_loc[r] // BLOCK_Q + r <= pid.
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        right = first <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid - 1)
    req = lo
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= q_len:
        return  # slack program past this request's last query block

    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # position of the request's first query token
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = q_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] token index within the request
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    # BLOCK_M need not be a multiple of GROUP: rows past BLOCK_Q * GROUP belong to the
    # next query block (its program computes them), so they are masked here.
    row_valid = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok
    row_off = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & (offs_d[None, :] < head_dim),
        other=0.0,
    )

    qk_scale = scale * LOG2E
    if IS_FP8:
        qk_scale = qk_scale * load_scale(k_scale, SCALE_IS_PTR)
    last_pos = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    tile_hi = last_pos // BLOCK_N + 1
    tile_lo = 0
    if SLIDING:
        first_pos = ctx_len + q_block * BLOCK_Q
        tile_lo = tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_ptr = cache_ptr + kv_head * stride_c_h
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        row_valid,
        k_ptr,
        k_ptr + stride_c_kv,
        block_tables_ptr + req.to(tl.int64) * stride_bt,
        seq_len,
        tile_lo,
        tile_hi,
        qk_scale,
        sliding_window,
        stride_c_blk,
        stride_c_off,
        block_size,
        head_dim,
        BLOCK_N,
        BLOCK_D,
        SLIDING,
        IS_FP8,
        DOT_PRECISION,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if IS_FP8:
        out = out * load_scale(v_scale, SCALE_IS_PTR)
    tl.store(
        out_ptr + row_off[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & (offs_d[None, :] < head_dim),
    )


@triton.jit
def _decode_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim], written when NUM_SPLITS == 1
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32, when NUM_SPLITS > 1
    part_ml_ptr,  # [2, num_tokens, num_heads, NUM_SPLITS] fp32 (max, sum), when NUM_SPLITS > 1
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]; uint8 bits if fp8
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    k_scale,
    v_scale,
    scale,
    sliding_window,
    num_tokens,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_kv,
    stride_c_blk,
    stride_c_off,
    stride_c_h,
    stride_bt,
    block_size,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr,
    IS_FP8: tl.constexpr,
    SCALE_IS_PTR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == q_start:
        return  # request with no query token this step

    seq_len = tl.load(seq_lens_ptr + req)
    pos = seq_len - 1  # the single query token's position
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    # Rows are the GROUP query heads of this KV head, padded to BLOCK_M >= 16 for tl.dot.
    row_valid = offs_m < GROUP
    head = kv_head * GROUP + offs_m
    d_ok = offs_d < head_dim
    q_row = q_start.to(tl.int64)
    q = tl.load(
        q_ptr + q_row * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_ok[None, :],
        other=0.0,
    )
    qk_scale = scale * LOG2E
    if IS_FP8:
        qk_scale = qk_scale * load_scale(k_scale, SCALE_IS_PTR)

    tile_lo = 0
    if SLIDING:
        tile_lo = tl.maximum(pos - sliding_window + 1, 0) // BLOCK_N
    tile_end = pos // BLOCK_N + 1
    per_split = tl.cdiv(tile_end - tile_lo, NUM_SPLITS)
    t0 = tile_lo + split * per_split
    t1 = tl.minimum(t0 + per_split, tile_end)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_ptr = cache_ptr + kv_head * stride_c_h
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        tl.zeros([BLOCK_M], dtype=tl.int32) + pos,
        row_valid,
        k_ptr,
        k_ptr + stride_c_kv,
        block_tables_ptr + req.to(tl.int64) * stride_bt,
        seq_len,
        t0,
        t1,
        qk_scale,
        sliding_window,
        stride_c_blk,
        stride_c_off,
        block_size,
        head_dim,
        BLOCK_N,
        BLOCK_D,
        SLIDING,
        IS_FP8,
        DOT_PRECISION,
    )
    if IS_FP8:
        acc = acc * load_scale(v_scale, SCALE_IS_PTR)
    mask = row_valid[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        # Partial state of this split; an empty split leaves (-inf, 0, 0), weight 0.
        part = (q_row * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=mask)
        tl.store(part_ml_ptr + part, m_i, mask=row_valid)
        tl.store(part_ml_ptr + num_tokens * num_heads * NUM_SPLITS + part, l_i, mask=row_valid)


@triton.jit
def _reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32
    part_ml_ptr,  # [2, num_tokens, num_heads, NUM_SPLITS] fp32
    num_tokens,
    num_heads,
    stride_ot,
    stride_oh,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Combine the splits of one (token, head): out = sum_s w_s acc_s / sum_s w_s l_s."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < head_dim
    part = (token * num_heads + head) * NUM_SPLITS + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + part, mask=s_ok, other=float("-inf"))
    lse = tl.load(part_ml_ptr + num_tokens * num_heads * NUM_SPLITS + part, mask=s_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * head_dim + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    m_max = tl.max(m, 0)  # finite: the split holding the query's own position is non-empty
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    total = tl.sum(w * lse, 0)
    out = tl.sum(w[:, None] * acc, 0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


# --------------------------------------------------------------------------- launcher

# Hopper allows 227 KiB of shared memory per block; the compile test checks each variant.
MAX_SHARED_BYTES = 227 * 1024


def _variant(
    group: int, head_dim: int, is_fp8: bool, sliding: bool, scale_is_ptr: bool, fp32: bool
) -> dict:
    """Constexprs shared by the unified and the decode kernel."""
    return dict(
        GROUP=group,
        BLOCK_D=triton.next_power_of_2(head_dim),
        SLIDING=sliding,
        IS_FP8=is_fp8,
        SCALE_IS_PTR=scale_is_ptr,
        # fp32 models get exact fp32 products; tf32 would cost ~1e-3 relative error.
        DOT_PRECISION="ieee" if fp32 else "tf32",
    )


def _min_rows(group: int) -> int:
    # tl.dot needs at least 16 rows; a group's query heads fill them first.
    return max(16, triton.next_power_of_2(group))


def _unified_blocks(variant: dict, max_query_len: int) -> dict:
    """Tile sizes of the unified kernel: 64-row blocks when queries can fill them."""
    group, min_m = variant["GROUP"], _min_rows(variant["GROUP"])
    block_m = max(64 if max_query_len * group >= 64 else min_m, min_m)
    block_n = 32 if variant["BLOCK_D"] <= 128 else 16
    return dict(variant, BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_N=block_n)


def _decode_blocks(variant: dict, num_splits: int) -> dict:
    block_n = 64 if variant["BLOCK_D"] <= 128 else 32
    rows = _min_rows(variant["GROUP"])
    return dict(variant, BLOCK_M=rows, BLOCK_N=block_n, NUM_SPLITS=num_splits)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _decode_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split the context only when (request, KV head) programs cannot fill the GPU."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    work = num_reqs * num_kv_heads
    tiles = triton.cdiv(max_seq_len, 64)
    if work >= sms or tiles < 8:
        return 1
    # Aim for ~2 programs per SM, at least 4 tiles per split, at most 16 splits.
    return max(1, min(triton.cdiv(2 * sms, work), tiles // 4, 16))


def _check_metadata_layout(metadata: AttentionMetadata) -> None:
    for name in ("query_start_loc", "seq_lens"):
        if getattr(metadata, name).stride(0) != 1:
            raise ValueError(f"metadata.{name} must be contiguous: call .contiguous()")
    if metadata.block_tables.stride(1) != 1:
        raise ValueError("metadata.block_tables rows must be contiguous: call .contiguous()")


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of paged_attention_ref: same arguments, same contract.

    query: [num_tokens, num_heads, head_dim]; returns out [num_tokens, num_heads,
    head_dim] in query's dtype, padding rows zeroed. A decode-only batch
    (max_query_len == 1) takes the split-KV decode kernel, anything else the
    unified kernel. `num_splits` forces the decode split count (tests); None
    chooses from the batch size and the GPU's SM count. Launches asynchronously
    and never syncs: the grid comes from the host-side ints in metadata.
    """
    check_attention_args(query, kv_cache, metadata, out, sliding_window)
    check_triton_device(query)
    _check_metadata_layout(metadata)
    if out is None:
        out = torch.empty_like(query)
    elif out.stride(-1) != 1:
        raise ValueError("out must be contiguous in head_dim")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_actual = metadata.num_actual_tokens
    if num_actual < query.shape[0]:
        out[num_actual:].zero_()
    if metadata.num_reqs == 0 or num_actual == 0:
        return out

    num_heads, head_dim = query.shape[1], query.shape[2]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    is_fp8 = fp8.is_fp8_cache(kv_cache.dtype)
    cache = fp8.as_bytes(kv_cache) if is_fp8 else kv_cache
    ks, ks_ptr = scale_arg(k_scale, query.device)
    vs, vs_ptr = scale_arg(v_scale, query.device)
    if ks_ptr != vs_ptr:
        raise ValueError("pass k_scale and v_scale both as floats or both as tensors")
    variant = _variant(
        num_heads // num_kv_heads,
        head_dim,
        is_fp8,
        sliding_window is not None,
        ks_ptr,
        query.dtype == torch.float32,
    )
    # Arguments common to both kernels after the scales, in kernel order.
    tail = (
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        metadata.block_tables.stride(0),
        block_size,
        head_dim,
    )
    window = sliding_window or 0

    if metadata.max_query_len > 1:
        blocks = _unified_blocks(variant, metadata.max_query_len)
        grid = (num_actual // blocks["BLOCK_Q"] + metadata.num_reqs, num_kv_heads)
        _unified_attention_kernel[grid](
            query,
            out,
            cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            ks,
            vs,
            scale,
            window,
            metadata.num_reqs,
            *tail,
            **blocks,
        )
        return out

    splits = num_splits or _decode_splits(
        metadata.num_reqs, num_kv_heads, metadata.max_seq_len, query.device
    )
    if splits > 1:
        part_acc = torch.empty(
            (num_actual, num_heads, splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(
            (2, num_actual, num_heads, splits), dtype=torch.float32, device=query.device
        )
    else:
        part_acc = part_ml = out  # not touched by the kernel when NUM_SPLITS == 1
    _decode_kernel[(metadata.num_reqs, num_kv_heads, splits)](
        query,
        out,
        part_acc,
        part_ml,
        cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        ks,
        vs,
        scale,
        window,
        num_actual,
        num_heads,
        *tail,
        **_decode_blocks(variant, splits),
    )
    if splits > 1:
        _reduce_kernel[(num_actual, num_heads)](
            out,
            part_acc,
            part_ml,
            num_actual,
            num_heads,
            out.stride(0),
            out.stride(1),
            head_dim,
            NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=variant["BLOCK_D"],
        )
    return out


# --------------------------------------------------------------------------- compile specs


def signature(kernel: triton.JITFunction, types: dict[str, str], constexprs: dict) -> dict:
    """ASTSource signature: every argument by name, constexprs marked, other ints i32."""
    return {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in kernel.arg_names
    }


def compile_specs() -> list[tuple[str, triton.JITFunction, dict, dict]]:
    """(label, kernel, signature, constexprs) of the variants tests compile for sm_90.

    The constexprs come from the launcher's own helpers, so the compile test
    covers the configurations that run: bf16/fp16/fp32 queries, fp8 caches with
    scalar and pointer scales, sliding windows, GQA groups 1 to 8, head_dim 64 to
    256 (80 is not a power of two), decode with and without splits.
    """
    specs = []
    # (label, query type, cache type, fp8, sliding, pointer scales, group, head_dim)
    variants = [
        ("bf16", "*bf16", "*bf16", False, False, False, 8, 128),
        ("fp16-fp8-sw", "*fp16", "*u8", True, True, False, 3, 64),
        ("fp32-sw", "*fp32", "*fp32", False, True, False, 1, 80),
        ("bf16-fp8-ptrscale", "*bf16", "*u8", True, False, True, 4, 256),
    ]
    for label, qt, ct, is_fp8, sliding, ptr, group, head_dim in variants:
        scale_t = "*fp32" if ptr else "fp32"
        types = {
            "q_ptr": qt,
            "out_ptr": qt,
            "cache_ptr": ct,
            "block_tables_ptr": "*i32",
            "query_start_loc_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "part_acc_ptr": "*fp32",
            "part_ml_ptr": "*fp32",
            "k_scale": scale_t,
            "v_scale": scale_t,
            "scale": "fp32",
        }
        variant = _variant(group, head_dim, is_fp8, sliding, ptr, qt == "*fp32")
        for name, kernel, constexprs in [
            ("unified-long", _unified_attention_kernel, _unified_blocks(variant, 512)),
            ("decode", _decode_kernel, _decode_blocks(variant, 1)),
            ("decode-split", _decode_kernel, _decode_blocks(variant, 4)),
        ]:
            specs.append(
                (f"{name}-{label}", kernel, signature(kernel, types, constexprs), constexprs)
            )
    # The unified kernel's small-block configuration, and the split reduction.
    small = _unified_blocks(_variant(3, 64, False, False, False, False), 2)
    types = {"q_ptr": "*fp16", "out_ptr": "*fp16", "cache_ptr": "*fp16", "scale": "fp32"}
    types |= {f"{n}_ptr": "*i32" for n in ("block_tables", "query_start_loc", "seq_lens")}
    types |= {"k_scale": "fp32", "v_scale": "fp32"}
    sig = signature(_unified_attention_kernel, types, small)
    specs.append(("unified-short-fp16", _unified_attention_kernel, sig, small))
    for qt in ("*bf16", "*fp32"):
        red = dict(NUM_SPLITS=5, BLOCK_S=8, BLOCK_D=128)
        types = {"out_ptr": qt, "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
        sig = signature(_reduce_kernel, types, red)
        specs.append((f"reduce-{qt[1:]}", _reduce_kernel, sig, red))
    return specs
