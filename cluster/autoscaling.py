"""Replica autoscaling of a lane on LLM signals: spur's Ray Serve autoscaling policy.

    engine replica ── record_autoscaling_stats() ──> Serve controller (averages each
    {waiting, running, kv_usage, tokens_per_s,        metric per replica over
     spare_demand, target_*}                          look_back_period_s)
                                                          │
                        policy(ctx) ─> desired_replicas(loads, ...) ─> Decision
                                                          │
                     Serve's wrapper: upscale_delay_s / downscale_delay_s, min / max

`desired_replicas` is the pure decision (ints and floats in, a Decision out; no Ray):

- demand = every replica's running + waiting requests + the lane's requests now on
  its spare + the requests Serve holds at its handles because every replica is at
  max_ongoing_requests (traffic the lane could not hold is its demand: a saturated
  lane scales up instead of living on the spare or in Serve's queue); those queued
  requests count as waiting too;
- want = ceil(demand / target_ongoing_requests), and one more than now when the
  mean waiting queue or the mean KV usage is above its high mark;
- a scale-down is only asked while nothing waits, nothing sits on the spare and the
  mean KV usage is below its low mark, and then by one replica at a time;
- with no report from any replica (a metrics outage, or replicas still starting)
  the lane holds: silence is not idleness;
- "holding" means Serve's current target, not the replicas running now: Serve
  compares the number returned with its target, so returning the running count
  while a replica starts would ask to cancel it (and, with every replica restarting
  and none running, to drop straight to min_replicas); while a replica starts, a
  quiet lane asks for what its demand needs, never fewer than run now (a replica
  that can never be placed, or fails every start, would otherwise pin the lane at
  its peak size), and a lane under any pressure holds;
- the result is clamped to [min_replicas, max_replicas].

Serve applies the delays itself (`AutoscalingConfig.upscale_delay_s`,
`downscale_delay_s`): the policy must keep asking for the same direction for that
long before anything changes, which is what stops flapping. The lane's targets
travel with the replicas' stats (`target_metrics`), so the same policy function
serves every lane and the Helm chart only names its import path:
`spur.cluster.autoscaling:policy`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

POLICY_IMPORT_PATH = "spur.cluster.autoscaling:policy"
"""What `AutoscalingPolicy(policy_function=...)` and the chart's serveConfigV2 name."""

LOAD_METRICS = ("waiting", "running", "kv_usage", "tokens_per_s", "spare_demand")
"""Per-replica stats the engine reports (record_autoscaling_stats)."""

TARGET_FIELDS = (
    "target_ongoing_requests",
    "waiting_per_replica_high",
    "kv_usage_high",
    "kv_usage_low",
)
"""AutoscalingConfig fields the policy reads; reported by every replica as
`target_<field>` metrics (constant per lane)."""


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load, averaged over Serve's look-back window."""

    waiting: float
    """Requests queued in the engine, not scheduled yet."""
    running: float
    """Requests in the running batch."""
    kv_usage: float = 0.0
    """Fraction of the KV pool's blocks in use, 0..1."""
    tokens_per_s: float = 0.0
    """Generated tokens per second (reported; not a scaling input on its own)."""


@dataclass(frozen=True)
class Targets:
    """A lane's scaling targets (the AutoscalingConfig fields of the same names)."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 16.0
    waiting_per_replica_high: float = 2.0
    kv_usage_high: float = 0.9
    kv_usage_low: float = 0.5


@dataclass(frozen=True)
class Decision:
    """The policy's answer: replicas wanted now and why (before Serve's delays)."""

    replicas: int
    reason: str
    """"demand" | "waiting" | "kv_pressure" | "idle" | "hold" | "bounds"."""
    demand: float
    """Running + waiting requests of the lane, its spare traffic included."""


def desired_replicas(
    loads: Sequence[ReplicaLoad],
    *,
    current: int,
    spare_demand: float,
    targets: Targets,
    target: int | None = None,
    queued: float = 0.0,
) -> Decision:
    """Replicas the lane should run (pure; see the module docstring).

    Args:
        loads: the running replicas' loads (may be shorter than `current` while a new
            replica has not reported yet; such a replica adds no demand and is left out
            of the mean waiting and KV usage, so a starting replica does not dilute
            the pressure that asked for it).
        current: replicas Serve runs now (>= 0).
        spare_demand: the lane's requests in flight on its spare (>= 0).
        targets: the lane's bounds and targets.
        target: Serve's current target (running plus starting replicas); None: `current`.
            A hold returns it; while it exceeds `current` a quiet lane asks for
            max(its demand's replicas, `current`), cancelling starts it does not need.
        queued: requests Serve holds at the lane's handles, no replica free (>= 0).
    """
    base = current if target is None else max(current, target)
    queued = max(0.0, queued)
    if not loads and spare_demand <= 0 and queued <= 0 and base > 0:
        # Nobody reported: nothing is known about the load, so nothing changes.
        held = min(max(base, targets.min_replicas), targets.max_replicas)
        return Decision(held, "no_metrics" if held == base else "bounds", 0.0)
    demand = sum(r.running + r.waiting for r in loads) + max(0.0, spare_demand) + queued
    n = max(len(loads), 1)
    mean_waiting = (sum(r.waiting for r in loads) + queued) / n
    mean_kv = sum(r.kv_usage for r in loads) / n
    by_demand = math.ceil(demand / targets.target_ongoing_requests - 1e-9) if demand else 0
    want, reason = by_demand, "demand"
    # Pressure asks one replica more than run now; one already starting answers it.
    if mean_waiting > targets.waiting_per_replica_high and want <= current:
        want, reason = max(base, current + 1), "waiting"
    if loads and mean_kv > targets.kv_usage_high and want <= current:
        want, reason = max(base, current + 1), "kv_pressure"
    if want < base:
        # Quiet, and staying so on one replica fewer: the lane's KV held by n - 1 replicas
        # must stay under the high mark, or the next tick adds the replica back (1 <-> 2
        # at 0.95 of one replica's KV with the default marks).
        fewer = mean_kv * n / (n - 1) if n > 1 else 0.0
        quiet = (
            mean_waiting == 0
            and spare_demand <= 0
            and mean_kv < targets.kv_usage_low
            and fewer <= targets.kv_usage_high
        )
        if not quiet:
            want, reason = base, "hold"
        elif base == current:  # one replica at a time
            want, reason = current - 1, "idle"
        else:  # quiet while replicas start: keep those the demand needs
            want, reason = max(want, current), "idle"
    elif want == current:
        reason = "hold"
    bounded = min(max(want, targets.min_replicas), targets.max_replicas)
    if bounded != want:
        reason = "bounds"
    return Decision(bounded, reason, demand)


def target_metrics(autoscaling: Mapping[str, Any] | None) -> dict[str, float]:
    """The `target_<field>` metrics a lane's replicas report (its AutoscalingConfig as a
    dict; {} without autoscaling)."""
    if not autoscaling:
        return {}
    return {f"target_{f}": float(autoscaling[f]) for f in TARGET_FIELDS if f in autoscaling}


def _per_replica(metrics: Mapping[str, Mapping[Any, float]]) -> dict[Any, dict[str, float]]:
    out: dict[Any, dict[str, float]] = {}
    for name, by_replica in metrics.items():
        for replica, value in by_replica.items():
            out.setdefault(replica, {})[name] = float(value)
    return out


def decide_from_metrics(
    metrics: Mapping[str, Mapping[Any, float]],
    *,
    current: int,
    min_replicas: int,
    max_replicas: int,
    running: Sequence[Any] | None = None,
    target: int | None = None,
    queued: float = 0.0,
) -> Decision:
    """`desired_replicas` from Serve's aggregated metrics ({metric: {replica: value}}).

    Only replicas in `running` count (a stopped replica's last samples may linger);
    the lane's spare demand is the largest any replica reports (each reports the same
    lane-wide figure); targets likewise, with `Targets`' defaults for missing ones."""
    per = _per_replica(metrics)
    if running is not None:
        keep = set(running)
        per = {r: m for r, m in per.items() if r in keep}
    loads = [
        ReplicaLoad(
            waiting=m.get("waiting", 0.0),
            running=m.get("running", 0.0),
            kv_usage=m.get("kv_usage", 0.0),
            tokens_per_s=m.get("tokens_per_s", 0.0),
        )
        for m in per.values()
    ]
    defaults = Targets()
    given: dict[str, float] = {}
    for field in TARGET_FIELDS:
        values = [m[f"target_{field}"] for m in per.values() if f"target_{field}" in m]
        given[field] = max(values) if values else getattr(defaults, field)
    targets = Targets(min_replicas=min_replicas, max_replicas=max_replicas, **given)
    spare = max((m.get("spare_demand", 0.0) for m in per.values()), default=0.0)
    return desired_replicas(
        loads, current=current, spare_demand=spare, targets=targets, target=target, queued=queued
    )


def policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve's `policy_function` (AutoscalingContext -> (replicas, policy state)).

    Serve wraps it: its upscale / downscale delays and the min / max bounds apply to
    the number returned. The state carries the last decision for debugging."""
    metrics = ctx.aggregated_metrics or {}
    decision = decide_from_metrics(
        metrics,
        current=int(ctx.current_num_replicas),
        min_replicas=int(ctx.capacity_adjusted_min_replicas),
        max_replicas=int(ctx.capacity_adjusted_max_replicas),
        running=list(ctx.running_replicas) if ctx.running_replicas is not None else None,
        target=int(ctx.target_num_replicas),
        queued=float(ctx.total_queued_requests or 0.0),
    )
    state = dict(ctx.policy_state or {})
    state["spur"] = {
        "replicas": decision.replicas,
        "reason": decision.reason,
        "demand": decision.demand,
    }
    return decision.replicas, state
