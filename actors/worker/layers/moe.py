"""Sparse mixture of experts with a sigmoid-gated shared expert (Qwen3-Next).

```
x [n, hidden]
  router   p = softmax(x @ W_gate^T) (fp32)  -> top-k experts per token,
           weights renormalised to sum 1 (norm_topk_prob), cast to x's dtype
  experts  y = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))      e = chosen experts
  shared   y += sigmoid(x @ w_sg^T) * down_s(silu(gate_s(x)) * up_s(x))
```

Tensor parallelism: every expert's (and the shared expert's) intermediate width
is split across ranks like a dense MLP; the router and the shared-expert gate are
replicated, so every rank routes identically. Partial expert sums are reduced
once per layer, the shared expert's with them.

Checkpoint names: `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight` (gate/up are fused into
`gate_up_proj` by the model's `packed_modules_mapping`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spur.actors.worker.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    default_weight_loader,
    set_weight_attrs,
)
from spur.actors.worker.layers.parallel_state import SINGLE, TPGroup


class ExpertMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` whose partial sums are NOT reduced: the
    MoE block reduces once for all experts."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], bias=False, tp=tp
        )
        self.down_proj = RowParallelLinear(
            intermediate, hidden, bias=False, reduce_results=False, tp=tp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # [m, hidden], partial over TP


class _Replicated(nn.Module):
    """A bias-free linear whose weight every rank holds whole (router, gates)."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """forward: `x [n, hidden] -> [n, hidden]` (identical on every TP rank)."""

    def __init__(self, config: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        hidden = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", True))
        self.gate = _Replicated(self.num_experts, hidden)
        self.experts = nn.ModuleList(
            ExpertMLP(hidden, config.moe_intermediate_size, tp) for _ in range(self.num_experts)
        )
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        self.shared_expert = ExpertMLP(hidden, shared, tp) if shared else None
        self.shared_expert_gate = _Replicated(1, hidden) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [n, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [n, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # Experts in ascending order, each over the tokens that chose it (as
        # transformers sums them, so the fp32 result matches closely).
        hit = torch.unique(chosen).tolist()
        for e in hit:
            token, slot = torch.where(chosen == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.tp.all_reduce(out)
