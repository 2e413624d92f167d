"""Replica choice for one request (pure Python).

Cost of sending a request with `n` full prompt blocks to replica r, in KV blocks:

    cost(r) = (n - matched(r))                 prefill blocks r must compute
            + load_weight * load(r)            its running + queued requests
            + kv_usage_weight * kv_usage(r)    how full its pool is

The cheapest replica wins (ties: fewer requests, then the order given). This is
`RouterConfig`'s score `matched - load_weight*load - kv_usage_weight*kv_usage`
shifted by the constant n. Guards, in order:

- affinity: a session already bound to a healthy candidate goes there;
- hot spot: when the winner has more than `hot_spot_margin` requests beyond the
  least loaded candidate, the least loaded one wins instead (reason "load").

The reason of a decision is "affinity", "prefix" (the winner holds at least one
block of the chain) or "load" (nothing matched, or the hot-spot guard fired).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    replica_id: str
    matched_blocks: int
    load: int
    kv_usage: float


@dataclass(frozen=True)
class Weights:
    load_weight: float = 1.0
    kv_usage_weight: float = 8.0
    hot_spot_margin: float = 8.0


@dataclass(frozen=True)
class Decision:
    ranked: list[str]
    """Replica ids, best first (the router tries them in this order)."""
    reason: str
    matched_blocks: int
    """Blocks of the chain the chosen replica holds."""


def cost(c: Candidate, num_blocks: int, w: Weights) -> float:
    return (num_blocks - c.matched_blocks) + w.load_weight * c.load + w.kv_usage_weight * c.kv_usage


def choose(
    candidates: Sequence[Candidate],
    num_blocks: int,
    weights: Weights,
    *,
    affinity: str | None = None,
) -> Decision:
    """Rank `candidates` for a request whose chain has `num_blocks` blocks.
    `affinity` is the replica a session is bound to, if any."""
    if not candidates:
        raise ValueError("no candidate replicas to choose from")
    order = {c.replica_id: i for i, c in enumerate(candidates)}
    ranked = sorted(
        candidates, key=lambda c: (cost(c, num_blocks, weights), c.load, order[c.replica_id])
    )
    least = min(candidates, key=lambda c: (c.load, c.kv_usage, order[c.replica_id]))
    best = ranked[0]
    reason = "prefix" if best.matched_blocks > 0 else "load"
    if affinity is not None and affinity in order:
        bound = candidates[order[affinity]]
        if bound.load - least.load <= weights.hot_spot_margin:
            best, reason = bound, "affinity"
    if reason != "affinity" and best.load - least.load > weights.hot_spot_margin:
        best, reason = least, "load"
    rest = [c.replica_id for c in ranked if c.replica_id != best.replica_id]
    return Decision([best.replica_id, *rest], reason, best.matched_blocks)
