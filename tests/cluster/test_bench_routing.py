"""`spur bench routing` end to end on a small workload: a real local multi-node
cluster, the tiny model, two arms. Speed goals are not asserted here (they live
in BENCHMARKS.md); the routing itself is: the prefix router reaches the oracle's
hit rate, measured by the engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e.conftest import build_tiny_model

pytestmark = pytest.mark.slow


def test_bench_routing_quick(tmp_path: Path) -> None:
    from spur.cluster.bench import routing

    model = build_tiny_model(tmp_path / "tiny")
    out = routing.run(model=str(model), replicas=2, quick=True, arms=("round_robin", "prefix"))
    json.dumps(out)
    arms = {a["arm"]: a for a in out["arms"]}
    assert set(arms) == {"round_robin", "prefix"}
    for a in arms.values():
        assert a["requests"] == out["workload"]["requests"] == 8
        assert a["tokens_per_s"] > 0 and a["ttft_ms_p50"] is not None
    # The working set does not fit one replica but fits the lane.
    ws = out["workload"]["working_set_blocks"]
    assert out["blocks_per_replica"] < ws <= 2 * out["blocks_per_replica"]
    assert out["ratios"]["prefix"]["hit_vs_oracle"] >= 0.9
    assert arms["prefix"]["decisions"].get("prefix", 0) >= 1
    assert set(out["goals"]) == {
        "hit_rate_at_least_0.9_of_oracle",
        "ttft_p50_at_most_half_of_round_robin",
        "throughput_at_least_1.3x_round_robin",
    }


def test_pool_sizing_refuses_a_workload_that_fits_one_replica() -> None:
    from spur.cluster.bench.routing import pool_blocks

    assert pool_blocks(256, 42, 4) == 96
    with pytest.raises(ValueError, match="fits in one replica"):
        pool_blocks(40, 30, 4)
