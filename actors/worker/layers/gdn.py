"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) over states kept in the paged pool.

Per layer and step (flattened batch of `n` tokens from several requests):

```
hidden [n, hidden]
  -> in_proj_qkv (Qwen3.5) | in_proj_qkvz (Qwen3-Next, per-key-head interleaved)
       mixed [n, conv_dim] = [q | k | v] (this rank's heads), z [n, Hv, dv]
  -> in_proj_b / in_proj_a | in_proj_ba      b, a [n, Hv]
  -> causal conv1d + SiLU over each request's tokens, continuing from its conv state
  -> q, k [n, Hk, dk] (L2-normalised in the rule), v [n, Hv, dv]
     g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)          [n, Hv] fp32
  -> gated delta rule per request, continuing from its recurrent state   [n, Hv, dv]
  -> gated RMSNorm(out, z) -> out_proj (all-reduce over TP)              [n, hidden]
```

State of one request in one layer (one block of a state group, see
`actors/worker/cache_layout.py`):

```
conv_state       [conv_kernel - 1, conv_dim]     the last K-1 pre-conv inputs
recurrent_state  [Hv, dk, dv]                    S, so that out_t = q_t^T S_t
```

The runner hands each layer its pool views (`conv [num_blocks, K-1, C]`,
`ssm [num_blocks, Hv, dk, dv]`) and its state group's `GDNMetadata`
(kernels/gdn_reference.py): per request the block its state is read from (src)
and the block the new state is written to (dst: the same block while the request
stays inside it, a new block when it crosses one, so that the old one can stay
cached), and whether there is a state to continue from (no: a fresh prompt or a
recompute after preemption; start from zeros).

`Hk`, `Hv` are per TP rank: key and value heads are split across ranks like
attention heads (both must divide by the TP size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spur import kernels
from spur.actors.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    check_shape,
    set_weight_attrs,
)
from spur.actors.worker.layers.norm import GatedRMSNorm
from spur.actors.worker.layers.parallel_state import SINGLE, TPGroup
from spur.kernels import GDNMetadata


@dataclass(frozen=True)
class GDNShape:
    """Per-rank sizes of one Gated DeltaNet layer."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, recurrent state) shapes of one request in one layer."""
        return (
            (self.conv_kernel - 1, self.conv_dim),
            (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )

    @classmethod
    def of(cls, config: Any, tp: TPGroup = SINGLE) -> GDNShape:
        return cls(
            num_k_heads=tp.split(config.linear_num_key_heads, "linear_num_key_heads"),
            num_v_heads=tp.split(config.linear_num_value_heads, "linear_num_value_heads"),
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
        )


class _HeadSplitParam(nn.Module):
    """Holds one parameter split along dim 0 by TP rank in `parts` (each part
    sliced separately), e.g. conv1d.weight over [q | k | v] or A_log over heads."""

    def __init__(self, shape: tuple[int, ...], parts: list[int], tp: TPGroup) -> None:
        super().__init__()
        self.parts = parts
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(*shape), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter is not fused, got shard id {shard_id!r}")
        loaded = loaded.reshape(sum(self.parts), *param.shape[1:])  # conv1d: [C, 1, K] -> [C, K]
        check_shape(loaded, (sum(self.parts), *param.shape[1:]))
        offset = 0
        for part in torch.split(loaded, self.parts, dim=0):
            n = part.shape[0] // self.tp.size
            param.data.narrow(0, offset, n).copy_(part.narrow(0, self.tp.rank * n, n))
            offset += n


class GatedDeltaNet(nn.Module):
    """One linear-attention mixer. `layout` is "qwen3_5" (separate in_proj_qkv /
    z / b / a) or "qwen3_next" (in_proj_qkvz and in_proj_ba, grouped per key head).

    forward: `hidden [n, hidden]` -> `[n, hidden]`; reads and writes the
    request states in `state` (mutated) as `meta` says.
    """

    def __init__(
        self, config: Any, *, layout: str, tp: TPGroup = SINGLE, backend: str | None = None
    ) -> None:
        super().__init__()
        self.backend = backend  # "torch" | "triton" (resolved), None: by device
        if layout not in ("qwen3_5", "qwen3_next"):
            raise ValueError(f"unknown Gated DeltaNet layout {layout!r}")
        self.layout = layout
        self.tp = tp
        hidden = config.hidden_size
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        if hv % hk:
            raise ValueError(
                f"linear_num_value_heads={hv} must be a multiple of linear_num_key_heads={hk}"
            )
        self.shape = s = GDNShape.of(config, tp)
        dk, dv = s.head_k_dim, s.head_v_dim
        key_dim, value_dim = hk * dk, hv * dv
        if layout == "qwen3_5":
            self.in_proj_qkv = MergedColumnParallelLinear(
                hidden, [key_dim, key_dim, value_dim], bias=False, tp=tp
            )
            self.in_proj_z = ColumnParallelLinear(hidden, value_dim, bias=False, tp=tp)
            self.in_proj_b = ColumnParallelLinear(hidden, hv, bias=False, tp=tp)
            self.in_proj_a = ColumnParallelLinear(hidden, hv, bias=False, tp=tp)
        else:
            # Rows grouped per key head: [q_h | k_h | v of its value heads | z of them];
            # a rank's key heads are one contiguous block of rows.
            self.in_proj_qkvz = ColumnParallelLinear(
                hidden, 2 * key_dim + 2 * value_dim, bias=False, tp=tp
            )
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * hv, bias=False, tp=tp)
        self.conv1d = _HeadSplitParam(
            (s.conv_dim, s.conv_kernel), [key_dim, key_dim, value_dim], tp
        )
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads), requires_grad=False)
        for p in (self.A_log, self.dt_bias):
            set_weight_attrs(p, weight_loader=_split_loader(tp))
        self.norm = GatedRMSNorm(dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, hidden, bias=False, tp=tp)

    def _project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """mixed [n, conv_dim], z [n, Hv, dv], b [n, Hv], a [n, Hv]."""
        s = self.shape
        n = x.shape[0]
        if self.layout == "qwen3_5":
            mixed = self.in_proj_qkv(x)
            z = self.in_proj_z(x).view(n, s.num_v_heads, s.head_v_dim)
            return mixed, z, self.in_proj_b(x), self.in_proj_a(x)
        r = s.num_v_heads // s.num_k_heads
        dk, dv = s.head_k_dim, s.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(n, s.num_k_heads, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        ba = self.in_proj_ba(x).view(n, s.num_k_heads, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return (
            mixed,
            z.reshape(n, s.num_v_heads, dv),
            b.reshape(n, s.num_v_heads),
            a.reshape(n, s.num_v_heads),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor] | None,
        meta: GDNMetadata | None,
    ) -> torch.Tensor:
        """`hidden_states [n, hidden]` -> `[n, hidden]`; `state` = this layer's
        (conv, ssm) pool views, mutated as `meta` says. With `meta` None (a dummy
        run) nothing is read or written and the mixer's output is zero."""
        s = self.shape
        n = hidden_states.shape[0]
        mixed, z, b, a = self._project(hidden_states)
        if meta is None or state is None:
            core = hidden_states.new_zeros(n, s.num_v_heads, s.head_v_dim)
        else:
            conv_state, ssm_state = state
            mixed = kernels.causal_conv1d_varlen(
                mixed, self.conv1d.weight, None, conv_state, meta, "silu", backend=self.backend
            )  # [n, conv_dim]
            q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
            beta = b.sigmoid()  # [n, Hv]
            # In float32: exp(A_log) must not overflow for fp16 models.
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [n, Hv]
            core = kernels.gated_delta_rule_varlen(
                q.reshape(n, s.num_k_heads, s.head_k_dim),
                k.reshape(n, s.num_k_heads, s.head_k_dim),
                v.reshape(n, s.num_v_heads, s.head_v_dim),
                g,
                beta,
                ssm_state,
                meta,
                use_qk_l2norm=True,
                backend=self.backend,
            )  # [n, Hv, dv]
        out = self.norm(core, z).reshape(n, s.value_dim)
        return self.out_proj(out)  # [n, hidden]


def _split_loader(tp: TPGroup) -> Any:
    """weight_loader of a per-value-head vector (A_log, dt_bias): this rank's heads."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter is not fused, got shard id {shard_id!r}")
        n = param.shape[0]
        check_shape(loaded, (n * tp.size,))
        param.data.copy_(loaded.narrow(0, tp.rank * n, n))

    return load
