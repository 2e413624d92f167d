"""Random paged-attention cases and a naive dense oracle, shared by the kernel tests.

A case is a mixed batch: each request has (num_computed, num_new) tokens, its
whole context's K/V are drawn densely, scattered into a paged cache through a
random block table (non-contiguous, shuffled block ids), and the query holds
the new tokens. `dense_attention` recomputes the answer from the dense K/V with
explicit masks, float64 and repeat_interleave for GQA: nothing shared with the
paged code under test.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from spur.kernels import AttentionMetadata, build_attention_metadata
from spur.kernels import fp8 as fp8mod
from spur.kernels.metadata import random_block_tables
from spur.kernels.reference import store_kv_ref

FP8 = "fp8"


@dataclass
class Case:
    query: torch.Tensor  # [num_tokens (+pad), num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata
    keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim] float32 (as stored)
    values: list[torch.Tensor]
    k_scale: float
    v_scale: float
    scale: float

    def to(self, device: torch.device | str) -> Case:
        """A copy with query, cache and device-side metadata on `device` (the _cpu copies stay)."""
        m = self.metadata
        meta = replace(
            m,
            query_start_loc=m.query_start_loc.to(device),
            seq_lens=m.seq_lens.to(device),
            block_tables=m.block_tables.to(device),
            slot_mapping=m.slot_mapping.to(device),
        )
        return replace(
            self, query=self.query.to(device), kv_cache=self.kv_cache.to(device), metadata=meta
        )


def cache_dtype_of(name: torch.dtype | str) -> torch.dtype:
    return torch.uint8 if name == FP8 else name  # type: ignore[return-value]


def make_case(
    reqs: list[tuple[int, int]],
    *,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    spare_blocks: int = 3,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | str = torch.float32,
    pad_tokens: int = 0,
    seed: int = 0,
) -> Case:
    """Build a random case. reqs: per request (num_computed, num_new)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in reqs]
    tables, num_blocks = random_block_tables(seq_lens, block_size, spare_blocks, gen)
    need = [len(t) for t in tables]
    # Block tables one wider than needed so unused (0) entries exist.
    meta_all = build_attention_metadata(
        [0] * len(reqs), seq_lens, tables, block_size, max_blocks_per_req=max(need) + 1
    )

    is_fp8 = cache_dtype == FP8
    cache = torch.zeros(
        (2, num_blocks, block_size, num_kv_heads, head_dim), dtype=cache_dtype_of(cache_dtype)
    )
    # Poison every slot (0x7F is NaN in e4m3fn) so that reading outside a request's
    # context, or letting a masked position leak into the sums, shows up as NaN.
    cache.fill_(0x7F if is_fp8 else float("nan"))
    k_scale, v_scale = (0.05, 0.03) if is_fp8 else (1.0, 1.0)
    total = sum(seq_lens)
    k_all = torch.randn((total, num_kv_heads, head_dim), generator=gen)
    v_all = torch.randn((total, num_kv_heads, head_dim), generator=gen)
    store_kv_ref(k_all, v_all, cache, meta_all.slot_mapping, k_scale, v_scale)

    # What the cache holds, densely, as float32 (after rounding / quantization).
    if is_fp8:
        k_seen = fp8mod.dequantize(fp8mod.quantize(k_all, k_scale), k_scale)
        v_seen = fp8mod.dequantize(fp8mod.quantize(v_all, v_scale), v_scale)
    else:
        k_seen = k_all.to(cache.dtype).float()
        v_seen = v_all.to(cache.dtype).float()
    keys = list(k_seen.split(seq_lens))
    values = list(v_seen.split(seq_lens))

    num_new = [n for _, n in reqs]
    meta = build_attention_metadata(
        [c for c, _ in reqs],
        num_new,
        tables,
        block_size,
        num_padded_tokens=sum(num_new) + pad_tokens,
        max_blocks_per_req=max(need) + 1,
    )
    query = torch.randn((sum(num_new) + pad_tokens, num_kv_heads * group, head_dim), generator=gen)
    return Case(
        query=query.to(dtype),
        kv_cache=cache,
        metadata=meta,
        keys=keys,
        values=values,
        k_scale=k_scale,
        v_scale=v_scale,
        scale=head_dim**-0.5,
    )


def dense_attention(case: Case, sliding_window: int | None = None) -> torch.Tensor:
    """Naive causal attention per request from dense K/V, float64.

    Returns [num_actual_tokens, num_heads, head_dim] float64.
    """
    meta = case.metadata
    starts = meta.query_start_loc_cpu.tolist()
    outs = []
    for r in range(meta.num_reqs):
        q = case.query[starts[r] : starts[r + 1]].double()  # [L, H, D]
        k, v = case.keys[r].double(), case.values[r].double()  # [S, Hkv, D]
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        seq_len, q_len = k.shape[0], q.shape[0]
        scores = torch.einsum("lhd,shd->hls", q, k) * case.scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hls,shd->lhd", scores.softmax(-1), v))
    return torch.cat(outs) if outs else case.query.new_zeros((0, *case.query.shape[1:])).double()


# Mixed batches used across tests: (num_computed, num_new) per request, in an order
# that interleaves prefill chunks (with and without cached context) and decodes.
MIXED = [(0, 7), (9, 1), (5, 6), (0, 1), (13, 3), (2, 1)]
DECODES = [(4, 1), (0, 1), (17, 1), (8, 1)]
# More decodes than one length group of the reference (8), lengths unsorted, with a
# prefill chunk among them: the groups' rows must land back in scheduler order.
MANY_DECODES = (
    [((i * 13) % 37, 1) for i in range(10)] + [(6, 4)] + [((i * 7) % 29, 1) for i in range(11)]
)
