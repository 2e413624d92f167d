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
`ssm [num_blocks, Hv, dk, dv]`) and a `StateMetadata` saying, per request, which
block holds its state (read, then overwritten in place; the runner has already
copied the previous block's state there when the request crossed a block) and
whether there is a state to continue from (no: a fresh prompt or a recompute
after preemption; start from zeros).

`Hk`, `Hv` are per TP rank: key and value heads are split across ranks like
attention heads (both must divide by the TP size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spur.actors.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    check_shape,
    set_weight_attrs,
)
from spur.actors.worker.layers.norm import GatedRMSNorm
from spur.actors.worker.layers.parallel_state import SINGLE, TPGroup


@dataclass
class StateMetadata:
    """Where each scheduled request's state lives this step (one state group).

    Requests are in the step's order, as in `AttentionMetadata`.
    """

    num_reqs: int
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, CPU
    slots: torch.Tensor  # [num_reqs] int64 on the model's device: block holding the state
    slots_cpu: torch.Tensor  # [num_reqs] int64, CPU copy
    has_initial_state_cpu: torch.Tensor  # [num_reqs] bool, CPU: continue from the slot's state

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]


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

    def __init__(self, config: Any, *, layout: str, tp: TPGroup = SINGLE) -> None:
        super().__init__()
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
        meta: StateMetadata | None,
    ) -> torch.Tensor:
        s = self.shape
        n = hidden_states.shape[0]
        mixed, z, b, a = self._project(hidden_states)
        beta = b.sigmoid()  # [n, Hv]
        # In float32: A_log.exp() overflows nothing there, even for fp16 models.
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [n, Hv]
        core = torch.zeros(
            n, s.num_v_heads, s.head_v_dim, dtype=hidden_states.dtype, device=hidden_states.device
        )
        if meta is not None and state is not None:
            conv_state, ssm_state = state
            gated_delta_net_varlen(
                mixed,
                beta,
                g,
                self.conv1d.weight,
                conv_state,
                ssm_state,
                meta.query_start_loc_cpu,
                meta.slots_cpu,
                meta.has_initial_state_cpu,
                key_dim=s.key_dim,
                head_k_dim=s.head_k_dim,
                head_v_dim=s.head_v_dim,
                out=core,
            )
        out = self.norm(core, z).reshape(n, s.value_dim)
        return self.out_proj(out)  # [n, hidden]


def _split_loader(tp: TPGroup) -> Any:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter is not fused, got shard id {shard_id!r}")
        n = param.shape[0]
        check_shape(loaded, (n * tp.size,))
        param.data.copy_(loaded.narrow(0, tp.rank * n, n))

    return load


# -- the mixer's core over a flattened batch ------------------------------------------
def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gated_delta_net_varlen(
    mixed: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    slots_cpu: torch.Tensor,
    has_initial_state_cpu: torch.Tensor,
    *,
    key_dim: int,
    head_k_dim: int,
    head_v_dim: int,
    out: torch.Tensor,
) -> None:
    """Conv + gated delta rule of every request of a flattened batch, in place.

    mixed [n, C] (pre-conv q | k | v), beta [n, Hv], g [n, Hv] fp32 (log decay),
    conv_weight [C, K]; conv_pool [num_blocks, K-1, C], ssm_pool [num_blocks, Hv,
    dk, dv] (mutated: each request's slot ends holding its state after its last
    token); out [n, Hv, dv] (written). Single-token requests go through the
    recurrent form together, longer ones one by one through the chunked form.
    """
    qsl = query_start_loc_cpu.tolist()
    slots = slots_cpu.tolist()
    init = has_initial_state_cpu.tolist()
    decodes = [r for r in range(len(slots)) if qsl[r + 1] - qsl[r] == 1]
    prefills = [r for r in range(len(slots)) if qsl[r + 1] - qsl[r] > 1]
    dev = mixed.device
    if decodes:
        rows = torch.tensor([qsl[r] for r in decodes], device=dev)
        idx = torch.tensor([slots[r] for r in decodes], device=dev)
        keep = torch.tensor([init[r] for r in decodes], device=dev, dtype=torch.bool)
        conv_state = conv_pool[idx].to(conv_weight.dtype) * keep[:, None, None]  # [D, K-1, C]
        x = mixed[rows]  # [D, C]
        window = torch.cat([conv_state, x[:, None, :].to(conv_weight.dtype)], dim=1)  # [D, K, C]
        conv_pool[idx] = window[:, 1:].to(conv_pool.dtype)
        y = F.silu((window * conv_weight.t()[None]).sum(dim=1)).to(mixed.dtype)  # [D, C]
        s0 = ssm_pool[idx].float() * keep[:, None, None, None]
        o, s1 = _recurrent_step(y, beta[rows], g[rows], s0, key_dim, head_k_dim, head_v_dim)
        ssm_pool[idx] = s1.to(ssm_pool.dtype)
        out[rows] = o.to(out.dtype)
    for r in prefills:
        lo, hi = qsl[r], qsl[r + 1]
        slot = slots[r]
        k1 = conv_weight.shape[1] - 1
        x = mixed[lo:hi].to(conv_weight.dtype)  # [m, C]
        if init[r]:
            prev = conv_pool[slot].to(conv_weight.dtype)
        else:
            prev = torch.zeros(k1, x.shape[1], dtype=x.dtype, device=dev)
        window = torch.cat([prev, x], dim=0)  # [K-1+m, C]
        conv_pool[slot] = window[-k1:].to(conv_pool.dtype)
        y = F.conv1d(window.t()[None], conv_weight[:, None, :], groups=x.shape[1])[0].t()
        y = F.silu(y).to(mixed.dtype)  # [m, C]
        s0 = ssm_pool[slot].float() if init[r] else None
        o, s1 = _chunk_rule(y, beta[lo:hi], g[lo:hi], s0, key_dim, head_k_dim, head_v_dim)
        ssm_pool[slot] = s1.to(ssm_pool.dtype)
        out[lo:hi] = o.to(out.dtype)


def _split_qkv(
    y: torch.Tensor, key_dim: int, dk: int, dv: int, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[m, C] -> q, k [m, Hv, dk] (repeated over value heads, L2-normed, q scaled)
    and v [m, Hv, dv], all fp32."""
    m = y.shape[0]
    q, k, v = y.float().split([key_dim, key_dim, y.shape[1] - 2 * key_dim], dim=-1)
    q = q.reshape(m, -1, dk)
    k = k.reshape(m, -1, dk)
    rep = num_v_heads // q.shape[1]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=1)
        k = k.repeat_interleave(rep, dim=1)
    q = _l2norm(q) * dk**-0.5
    return q, _l2norm(k), v.reshape(m, num_v_heads, dv)


def _recurrent_step(
    y: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor,
    key_dim: int,
    dk: int,
    dv: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: y [D, C], beta/g [D, Hv], state [D, Hv, dk, dv] fp32."""
    q, k, v = _split_qkv(y, key_dim, dk, dv, beta.shape[1])  # [D, Hv, *]
    state = state * g.float().exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(dim=-2)  # [D, Hv, dv]
    delta = (v - kv_mem) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def _chunk_rule(
    y: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor | None,
    key_dim: int,
    dk: int,
    dv: int,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's m tokens, chunked form: y [m, C] -> out [m, Hv, dv], final state."""
    num_v = beta.shape[1]
    q, k, v = _split_qkv(y, key_dim, dk, dv, num_v)
    m = y.shape[0]
    # [Hv, m, d]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    b = beta.float().t()
    decay = g.float().t()
    pad = (chunk - m % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    b, decay = F.pad(b, (0, pad)), F.pad(decay, (0, pad))
    nc = (m + pad) // chunk
    v_beta = v * b[..., None]
    k_beta = k * b[..., None]
    q, k, k_beta, v_beta = (t.reshape(num_v, nc, chunk, -1) for t in (q, k, k_beta, v_beta))
    decay = decay.reshape(num_v, nc, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=y.device).triu(1)
    cum = decay.cumsum(dim=-1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    s = torch.zeros(num_v, dk, dv, dtype=torch.float32, device=y.device) if state is None else state
    out = torch.zeros_like(new_v)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(nc):
        vn = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ vn
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ vn
    out = out.reshape(num_v, -1, dv)[:, :m].transpose(0, 1)  # [m, Hv, dv]
    return out, s
