"""Torch reference implementations of the KV store and paged attention.

These run on any device and are the CPU serving path, so they are written to be
reasonably fast there: no per-token Python loops. Each prefill chunk is one SDPA
call over its gathered context. Decode requests (one query token) on a float32 or
bfloat16 CPU cache go to the native kernel (kernels/native.py, C, reads K/V in
place); otherwise they are sorted by length and attended in groups, one SDPA call
per group over their padded, gathered contexts.

KV cache layout of one attention layer (see kernels/__init__.py):

```
kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]
          ^ 0 = K, 1 = V
slot s  -> block s // block_size, offset s % block_size
```

The validators here are shared with the Triton launchers so both backends
reject the same inputs with the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from spur.kernels import fp8, native
from spur.kernels.fp8 import Scale
from spur.kernels.metadata import AttentionMetadata

# --------------------------------------------------------------------------- validation


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """Raise ValueError unless kv_cache has the [2, blocks, block_size, kv_heads, dim] layout."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got shape "
            f"{tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in fp8.KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} is unsupported: use float32, bfloat16, float16, "
            "or uint8 / float8_e4m3fn for an fp8 cache"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim (stride(-1) == 1)")


def check_store_kv_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Raise ValueError naming the problem if store_kv's arguments do not fit together."""
    check_kv_cache(kv_cache)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match kv_cache, "
                f"got {tuple(t.shape)}"
            )
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim: call .contiguous()")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be a 1-D int64 tensor, got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    if slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but key only {key.shape[0]} rows"
        )
    if slot_mapping.device != kv_cache.device:
        raise ValueError(
            f"slot_mapping is on {slot_mapping.device} but kv_cache is on {kv_cache.device}"
        )


def check_attention_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    out: torch.Tensor | None,
    sliding_window: int | None,
) -> None:
    """Raise ValueError naming the problem if paged_attention's arguments do not fit."""
    check_kv_cache(kv_cache)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(
            f"query must be [num_tokens, num_heads, {head_dim}] to match kv_cache, got "
            f"{tuple(query.shape)}"
        )
    if query.shape[1] % num_kv_heads:
        raise ValueError(
            f"num_heads={query.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"query dtype {query.dtype} unsupported: use float32/bfloat16/float16")
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous in head_dim: call .contiguous()")
    if query.device != kv_cache.device:
        raise ValueError(f"query is on {query.device} but kv_cache is on {kv_cache.device}")
    if metadata.num_actual_tokens > query.shape[0]:
        raise ValueError(
            f"metadata has {metadata.num_actual_tokens} query tokens but query has "
            f"{query.shape[0]} rows"
        )
    if metadata.block_tables.dim() != 2 or metadata.block_tables.shape[0] < metadata.num_reqs:
        raise ValueError(
            f"block_tables must be [num_reqs={metadata.num_reqs}, max_blocks], got "
            f"{tuple(metadata.block_tables.shape)}"
        )
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        t = getattr(metadata, name)
        if t.dtype != torch.int32:
            raise ValueError(f"metadata.{name} must be int32, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"metadata.{name} is on {t.device} but query is on {query.device}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype):
        raise ValueError(
            f"out must match query ({tuple(query.shape)}, {query.dtype}), got "
            f"{tuple(out.shape)}, {out.dtype}"
        )


# --------------------------------------------------------------------------- store


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
) -> None:
    """Write this step's K/V into the paged cache, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim]; rows past
            len(slot_mapping) are ignored.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; mutated.
        slot_mapping: [num_tokens'] int64, slot per token; -1 entries are skipped.
        k_scale, v_scale: fp8 only: stored = real / scale (saturating).

    Slots must be distinct (one token per slot), else which write wins is undefined.
    """
    check_store_kv_args(key, value, kv_cache, slot_mapping)
    block_size = kv_cache.shape[2]
    n = slot_mapping.shape[0]
    # Boolean filtering syncs on a device; fine for a reference, and on CPU it is cheap.
    rows = torch.nonzero(slot_mapping >= 0).squeeze(1)
    if rows.numel() == 0:
        return
    slots = slot_mapping[rows]
    blocks, offsets = slots // block_size, slots % block_size
    k, v = key[:n][rows], value[:n][rows]  # [num_valid, num_kv_heads, head_dim]
    if fp8.is_fp8_cache(kv_cache.dtype):
        # index_put_ has no fp8 kernel on CPU: write the raw bytes instead.
        cache = fp8.as_bytes(kv_cache)
        cache[0, blocks, offsets] = fp8.quantize(k, k_scale)
        cache[1, blocks, offsets] = fp8.quantize(v, v_scale)
    else:
        kv_cache[0, blocks, offsets] = k.to(kv_cache.dtype)
        kv_cache[1, blocks, offsets] = v.to(kv_cache.dtype)


# --------------------------------------------------------------------------- attention
#
# Context gathering, for a request with block table row T:
#
#   position p  ->  cache[T[p // block_size], p % block_size]      [num_kv_heads, head_dim]
#
# A prefill chunk gathers its whole blocks and trims the ends. Decodes (on the SDPA
# path) are gathered per length group, slot by slot, into a [B, S] grid padded to
# the group's longest context; padding cells repeat the request's last real slot,
# so they read finite, written values (never an unwritten or stale block whose
# bytes may be NaN) and are then masked. The C kernel reads only window positions.


def _compute_dtypes(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes SDPA runs in, (for prefill chunks, for decodes).

    A bfloat16 / float16 cache read with queries of its own dtype is attended in
    that dtype, which skips a float32 copy of every gathered K/V; everything else
    (fp32, fp8, mixed) runs in float32. Except float16 prefill chunks: SDPA's CPU
    float16 path is slower than float32 there (one layer, 512-token chunk: 13.2 vs
    11.0 ms), while decodes gain (54 decodes: 13.5 vs 27.3 ms; bf16: 5.3 vs 11.8).
    """
    if kv_cache.dtype != query.dtype or query.dtype not in (torch.bfloat16, torch.float16):
        return torch.float32, torch.float32
    prefill = query.dtype if query.dtype == torch.bfloat16 or query.is_cuda else torch.float32
    return prefill, query.dtype


def _to_compute(x: torch.Tensor, scale: Scale, is_fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V as real values in `dtype` (dequantized for fp8); may return x itself."""
    return fp8.dequantize(x, scale).to(dtype) if is_fp8 else x.to(dtype)


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its paged context.

    Args:
        query: [num_tokens, num_heads, head_dim]; rows past
            metadata.num_actual_tokens are padding. Query head h reads KV head
            h // (num_heads // num_kv_heads).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], already
            holding this step's K/V (store_kv runs first). Not mutated.
        metadata: see AttentionMetadata; only the _cpu copies are read on the host.
        scale: softmax scale (usually head_dim ** -0.5).
        k_scale, v_scale: fp8 dequantization scales (real = stored * scale).
        sliding_window: if set, token at position p sees [p - sliding_window + 1, p].
        out: optional [num_tokens, num_heads, head_dim] buffer in query's dtype.

    Returns out (allocated if None) with padding rows zeroed. Scores and softmax
    are accumulated in float32. On CPU, decodes on a float32 or bfloat16 cache go to
    the C kernel (kernels/native.py), float32 throughout; bf16 prefill chunks go to
    its query tiles (`native.prefill_tiles`: AVX-512 BF16 builds), and otherwise
    the tokens of prefill chunks of contexts up to NATIVE_PREFILL_MAX_CONTEXT go to
    the decode kernel, each as a decode over its own causal window. On the SDPA path a
    bfloat16 / float16 cache read by queries of the same dtype is attended in that
    dtype (SDPA accumulates in float32 and rounds the probabilities to the input
    dtype for the weighted sum, as the Triton kernel does), which skips a float32
    copy of every gathered K/V; other combinations (fp32, fp8, mixed) are computed
    in float32. Only context positions inside the window are read.
    """
    check_attention_args(query, kv_cache, metadata, out, sliding_window)
    if out is None:
        out = torch.empty_like(query)
    out[metadata.num_actual_tokens :].zero_()
    is_fp8 = fp8.is_fp8_cache(kv_cache.dtype)
    k_cache, v_cache = (fp8.as_bytes(kv_cache) if is_fp8 else kv_cache).unbind(0)
    dtypes = _compute_dtypes(query, kv_cache)
    ctx = _Context(k_cache, v_cache, metadata.block_tables, k_scale, v_scale, is_fp8, dtypes)

    kernel, (prefills, groups, plan, tile_plan) = step_layout(
        query, kv_cache, metadata, sliding_window
    )
    for r, start, q_len, seq_len in prefills:
        _prefill(query, out, ctx, r, start, q_len, seq_len, scale, sliding_window)
    if tile_plan is not None:
        native.prefill_attention(kernel, query, out, k_cache, v_cache, tile_plan, scale)
    if plan is not None:
        native.decode_attention(kernel, query, out, k_cache, v_cache, plan, scale)
    for group in groups:
        _decode_group(query, out, ctx, group, scale)
    return out


Layout = tuple[
    list[tuple[int, int, int, int]],
    list["_DecodeGroup"],
    native.DecodePlan | None,
    native.PrefillPlan | None,
]


def step_layout(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    sliding_window: int | None,
) -> tuple[Any, Layout]:
    """The native ops serving decodes of `query` over `kv_cache` (None: SDPA) and the
    step's layout: (prefill chunks left to SDPA as (request, first row, query length,
    seq_len), SDPA decode groups, the native decode plan, the native prefill plan).

    Only `query`'s dtype, heads and head_dim are read, so a stand-in of no rows serves.
    The first layer of a step derives the layout and memoises it on `metadata`; every
    later layer (and the Llama decoder stack, models/llama_stack.py) reuses it.
    """
    kernel = native.decode_kernel(query, kv_cache)
    tiles = native.prefill_tiles(kernel, query, kv_cache)
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    key = ("torch-reference", block_size, num_blocks, sliding_window, str(query.device))
    key += (kernel is None, tiles)
    layout = metadata.memo.get(key)
    if layout is None:
        layout = metadata.memo[key] = _layout(
            metadata,
            block_size,
            sliding_window,
            native_decodes=kernel is not None,
            prefill_tiles=tiles,
            num_blocks=num_blocks,
        )
    return kernel, layout


@dataclass(frozen=True)
class _DecodeGroup:
    """Index tensors of one decode group, the same in every layer of a step."""

    rows: torch.Tensor  # [B] query rows
    slot: torch.Tensor  # [B, S] flat slot read for each position (padding repeats)
    valid: torch.Tensor  # [B, S] bool, False on padding


def _layout(
    metadata: AttentionMetadata,
    block_size: int,
    sliding_window: int | None,
    *,
    native_decodes: bool,
    prefill_tiles: bool,
    num_blocks: int,
) -> Layout:
    """Prefill chunks for SDPA (request, first row, query length, seq_len), the decodes'
    length groups for SDPA, the native decode plan, and the native prefill plan."""
    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    prefills: list[tuple[int, int, int, int]] = []
    decodes: list[int] = []
    for r in range(metadata.num_reqs):
        q_len = starts[r + 1] - starts[r]
        if q_len == 1:
            decodes.append(r)
        elif q_len > 1:
            prefills.append((r, starts[r], q_len, seq_lens[r]))
    # A decode at context length n attends to [first, n): its window.
    first = {
        r: 0 if sliding_window is None else max(0, seq_lens[r] - sliding_window) for r in decodes
    }
    tile_plan = None
    if prefill_tiles and prefills:
        tile_plan = native.plan_prefills(
            metadata.block_tables,
            prefills,
            sliding_window,
            num_blocks=num_blocks,
            block_size=block_size,
        )
        prefills = []
    if native_decodes:
        # Each token of a prefill chunk whose context is short enough is one more entry
        # of the plan: its own window, over the cache in place.
        reqs, rows = list(decodes), [starts[r] for r in decodes]
        firsts, lens = [first[r] for r in decodes], [seq_lens[r] for r in decodes]
        sdpa_prefills = []
        for r, start, q_len, seq_len in prefills:
            if seq_len > NATIVE_PREFILL_MAX_CONTEXT:
                sdpa_prefills.append((r, start, q_len, seq_len))
                continue
            ends = range(seq_len - q_len + 1, seq_len + 1)  # token i sees [.., ends[i])
            reqs += [r] * q_len
            rows += range(start, start + q_len)
            lens += ends
            firsts += (
                [0] * q_len
                if sliding_window is None
                else [max(0, end - sliding_window) for end in ends]
            )
        if not reqs:
            return sdpa_prefills, [], None, tile_plan
        plan = native.plan_decodes(
            metadata.block_tables,
            reqs,
            rows,
            firsts,
            lens,
            num_blocks=num_blocks,
            block_size=block_size,
        )
        return sdpa_prefills, [], plan, tile_plan
    groups = [
        _decode_indices(
            metadata.block_tables,
            group,
            [starts[r] for r in group],
            [first[r] for r in group],
            [seq_lens[r] for r in group],
            block_size,
        )
        for group in _length_groups(decodes, seq_lens)
    ]
    return prefills, groups, None, tile_plan


# Prefill chunks of contexts up to this many tokens run in the C decode kernel, one
# plan entry per query token (its causal window); longer ones in SDPA. Measured on 2
# cores (SmolLM2 geometry, 4 fresh prompts, one layer), kernel vs SDPA: bf16 0.67 vs
# 1.51 ms at 100 tokens, 5.3 vs 10.1 at 300, 18.3 vs 29.4 at 600, but 46.1 vs 42.8 ms
# for one prompt of 2000; fp32 3.8 vs 7.7 ms at 300, 48 vs 68 at 1000 (BENCHMARKS.md,
# seventeenth round). A kernel of query tiles would win at every length.
NATIVE_PREFILL_MAX_CONTEXT = 1536

# A padded decode batch gathers and attends over max(len) positions per request: with
# contexts of mixed lengths much of that is padding, and one gather of a large batch
# (17 MB of K for 32 requests of ~700 tokens of SmolLM2) falls out of the CPU caches
# before SDPA reads it. So decodes are sorted by length and attended in groups of
# DECODE_GROUP_SIZE requests of similar length, one gather and one SDPA each.
# Measured on 2 cores (SmolLM2 geometry, contexts of 60 to 760 tokens, one layer):
# 16 / 32 / 64 decodes in 8.7 / 18.5 / 35.9 ms as one batch, 1.7 / 3.8 / 7.8 ms in
# groups of 8 (groups of 16: 11.1 / 5.0 / 9.6 ms; of 4: 2.6 / 4.0 / 8.1 ms).
DECODE_GROUP_SIZE = 8


def _length_groups(reqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """`reqs` sorted by context length, in consecutive groups of DECODE_GROUP_SIZE."""
    if len(reqs) <= DECODE_GROUP_SIZE:
        return [reqs] if reqs else []
    ordered = sorted(reqs, key=lambda r: seq_lens[r])
    size = DECODE_GROUP_SIZE
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


class _Context:
    """The paged K/V of one layer: caches [num_blocks, block_size, H_kv, D] and tables."""

    def __init__(self, k_cache, v_cache, block_tables, k_scale, v_scale, is_fp8, dtypes) -> None:
        self.k_cache, self.v_cache, self.block_tables = k_cache, v_cache, block_tables
        self.k_scale, self.v_scale, self.is_fp8 = k_scale, v_scale, is_fp8
        self.block_size = k_cache.shape[1]
        # What K/V are read as by prefill chunks (span) and decodes (slots).
        self.prefill_dtype, self.decode_dtype = dtypes

    # index_select, not cache[idx]: on CPU it is ~5x faster than advanced indexing.

    def span(self, r: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request r's K and V at positions [start, end): each [end - start, H_kv, D]."""
        bs = self.block_size
        blocks = self.block_tables[r, start // bs : -(-end // bs)].long()
        lo = start % bs
        k = self.k_cache.index_select(0, blocks).flatten(0, 1)[lo : lo + end - start]
        v = self.v_cache.index_select(0, blocks).flatten(0, 1)[lo : lo + end - start]
        return (
            _to_compute(k, self.k_scale, self.is_fp8, self.prefill_dtype),
            _to_compute(v, self.v_scale, self.is_fp8, self.prefill_dtype),
        )

    def slots(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at flat slot ids [B, S]: each [B, S, H_kv, D] in self.decode_dtype."""
        kv = []
        for cache, scale in ((self.k_cache, self.k_scale), (self.v_cache, self.v_scale)):
            if cache.stride(0) == cache.stride(1) * cache.shape[1]:
                # [num_blocks, block_size, H, D] -> [num_slots, H, D] is a view here.
                x = cache.flatten(0, 1).index_select(0, slot.flatten())
                x = x.view(*slot.shape, *cache.shape[2:])
            else:  # exotic strides: index blocks and offsets separately, no big copy
                x = cache[slot // self.block_size, slot % self.block_size]
            kv.append(_to_compute(x, scale, self.is_fp8, self.decode_dtype))
        return kv[0], kv[1]


def _prefill(
    query: torch.Tensor,
    out: torch.Tensor,
    ctx: _Context,
    r: int,
    start: int,
    q_len: int,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Attention for request r's q_len > 1 query tokens; writes out[start:start+q_len]."""
    first_pos = seq_len - q_len  # query i sits at first_pos + i (bottom-right aligned)
    ctx_start = 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)
    k, v = ctx.span(r, ctx_start, seq_len)  # [S, H_kv, D]
    # SDPA's grouped-query mode shares each KV head with its query heads without
    # materializing repeated K/V (broadcasting a KV dim instead is ~10x slower on CPU).
    q = (
        query[start : start + q_len].to(ctx.prefill_dtype).transpose(0, 1).unsqueeze(0)
    )  # [1, H, L, D]
    k = k.transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
    v = v.transpose(0, 1).unsqueeze(0)
    if first_pos == 0 and sliding_window is None:
        # Fresh prefill: SDPA's top-left aligned causal mask is exactly ours.
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(first_pos, seq_len, device=query.device)  # [L]
        k_pos = torch.arange(ctx_start, seq_len, device=query.device)  # [S]
        mask = k_pos[None, :] <= q_pos[:, None]  # [L, S]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [1, H, L, D]
    out[start : start + q_len] = o[0].transpose(0, 1).to(out.dtype)


def _decode_indices(
    block_tables: torch.Tensor,
    reqs: list[int],
    rows: list[int],
    first: list[int],
    lens: list[int],
    block_size: int,
) -> _DecodeGroup:
    """Slots of one decode group's padded [B, S] grid over the windows [first, len).
    Padding cells repeat the request's last real slot, so they read finite, written
    values (never an unwritten or stale block whose bytes may be NaN) and are then
    masked."""
    device = block_tables.device
    width = max(n - f for n, f in zip(lens, first, strict=True))
    lens_t = torch.tensor(lens, device=device)
    pos = torch.tensor(first, device=device)[:, None] + torch.arange(width, device=device)
    valid = pos < lens_t[:, None]  # [B, S]
    pos = torch.minimum(pos, lens_t[:, None] - 1)  # padding repeats the last real position
    tables = block_tables[torch.tensor(reqs, device=device)].long()  # [B, max_blocks]
    slot = tables.gather(1, pos // block_size) * block_size + pos % block_size  # [B, S]
    return _DecodeGroup(torch.tensor(rows, device=device), slot, valid)


def _decode_group(
    query: torch.Tensor, out: torch.Tensor, ctx: _Context, group: _DecodeGroup, scale: float
) -> None:
    """One-token requests in one padded batch: one gather, one SDPA; writes out[rows]."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = ctx.k_cache.shape[2]
    b = group.rows.shape[0]
    k, v = ctx.slots(group.slot)  # [B, S, H_kv, D]
    # The G query heads of a KV head act as G query rows of one attention, so K/V are
    # shared without repetition: q [B, H_kv, G, D] against k [B, H_kv, S, D].
    q = (
        query[group.rows]
        .to(ctx.decode_dtype)
        .view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    )
    o = F.scaled_dot_product_attention(
        q,
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=group.valid[:, None, None, :],
        scale=scale,
    )  # [B, H_kv, G, D]
    out[group.rows] = o.reshape(b, num_heads, head_dim).to(out.dtype)
