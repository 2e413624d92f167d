"""Decoder self-attention over the paged KV cache.

Per layer and step (flattened batch of `n` tokens from several requests):

```
hidden [n, hidden]
  -> qkv_proj                     [n, (Hq + 2 Hkv) * d]    (this rank's heads)
  -> split, view                  q [n, Hq, d], k/v [n, Hkv, d]
  -> q_norm / k_norm (Qwen3)      per-head RMSNorm over d
  -> RoPE at positions            q, k
  -> store_kv(k, v)               into kv_cache at attn_metadata.slot_mapping
  -> paged_attention(q)           [n, Hq, d]  over each request's cached context
  -> o_proj (all-reduce over TP)  [n, hidden]
```

`Hq`, `Hkv` are per TP rank. The attention metadata comes in as an argument on
every call; nothing is read from a global.
"""

from __future__ import annotations

import torch
from torch import nn

from spur import kernels
from spur.actors.worker.layers.linear import QKVParallelLinear, RowParallelLinear
from spur.actors.worker.layers.norm import RMSNorm
from spur.actors.worker.layers.parallel_state import SINGLE, TPGroup
from spur.actors.worker.layers.rotary import RotaryEmbedding
from spur.kernels import AttentionMetadata, native


class PagedAttention(nn.Module):
    """Stores this step's K/V into the paged cache, then attends over it.

    Args:
        num_heads: query heads on this rank.
        num_kv_heads: KV heads on this rank (divides num_heads).
        head_dim: features per head.
        scale: softmax scale, usually `head_dim ** -0.5`.
        sliding_window: attend to at most this many most recent positions.
        backend: "torch" or "triton" (already resolved with
            `spur.kernels.select_backend`); None lets the kernels choose by
            device.

    `k_scale` / `v_scale` are the per-tensor fp8 KV-cache scales (1.0 for a
    cache in the model dtype); the runner may overwrite them.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float,
        sliding_window: int | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend = backend
        self.k_scale: float | torch.Tensor = 1.0
        self.v_scale: float | torch.Tensor = 1.0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """Attention output `[n, num_heads, head_dim]` for `query [n, num_heads, head_dim]`.

        key/value: `[n, num_kv_heads, head_dim]`, written into `kv_cache`
        `[2, num_blocks, block_size, num_kv_heads, head_dim]` (mutated) at
        `attn_metadata.slot_mapping` before attending. With `attn_metadata`
        None (a dummy run for warm-up or memory profiling) nothing is stored
        and the output is zeros.
        """
        if attn_metadata is None or kv_cache is None:
            return torch.zeros_like(query)
        kernels.store_kv(
            key,
            value,
            kv_cache,
            attn_metadata.slot_mapping,
            self.k_scale,
            self.v_scale,
            backend=self.backend,
        )
        return self.attend(query, kv_cache, attn_metadata)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Attention of `query [n, num_heads, head_dim]` over a cache that already holds
        this step's K/V (forward without the store)."""
        return kernels.paged_attention(
            query,
            kv_cache,
            attn_metadata,
            scale=self.scale,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            sliding_window=self.sliding_window,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"sliding_window={self.sliding_window}, backend={self.backend}"
        )


class CausalSelfAttention(nn.Module):
    """Projections + optional q/k RMSNorm + RoPE + paged attention + output projection.

    Args:
        hidden_size: model width.
        num_heads, num_kv_heads: total heads over all TP ranks.
        head_dim: features per head.
        rotary: shared RoPE object of the model.
        qkv_bias / o_bias: whether those projections have biases.
        qk_norm_eps: when set, RMSNorm each q and k head over head_dim (Qwen3)
            with this epsilon, before RoPE.
        sliding_window, backend: see `PagedAttention`.
        tp: tensor-parallel group; heads are split across it.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        sliding_window: int | None = None,
        backend: str | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias, tp=tp
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias, tp=tp)
        if qk_norm_eps is not None:
            self.q_norm: RMSNorm | None = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            scale=head_dim**-0.5,
            sliding_window=sliding_window,
            backend=backend,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """`hidden_states [n, hidden]` at `positions [n]` -> `[n, hidden]`; writes kv_cache."""
        n = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [n, q_size + 2 * kv_size]
        lib = self._fused_rope_store(qkv, positions, kv_cache, attn_metadata)
        if lib is not None:
            assert kv_cache is not None and isinstance(attn_metadata, AttentionMetadata)
            q = lib.rope_store_kv(
                qkv,
                positions,
                self.rotary.cos_sin_cache(qkv.device),
                kv_cache,
                attn_metadata.slot_mapping,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.rotary.rotary_dim,
            )  # [n, Hq, d], this step's K/V now in kv_cache
            out = self.attn.attend(q, kv_cache, attn_metadata)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, self.num_heads, self.head_dim)  # [n, Hq, d]
            k = k.view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, d]
            v = v.view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, d]
            if self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q, k = self.rotary(positions, q, k)
            out = self.attn(q, k, v, kv_cache, attn_metadata)  # [n, Hq, d]
        return self.o_proj(out.reshape(n, self.q_size))  # [n, hidden]

    def _fused_rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ):
        """The native ops when RoPE and the KV store can run as one pass over qkv: on
        CPU, the torch backend, float32 / bfloat16 activations and cache, no q/k norm
        between the projection and RoPE, int64 positions; else None."""
        if kv_cache is None or not isinstance(attn_metadata, AttentionMetadata):
            return None
        if self.q_norm is not None or qkv.dim() != 2 or qkv.stride(-1) != 1:
            return None
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            return None
        backend = self.attn.backend or kernels.select_backend("auto", qkv.device)
        if backend != "torch":
            return None
        if attn_metadata.slot_mapping.dtype != torch.int64:
            return None
        return native.usable(qkv, kv_cache)
