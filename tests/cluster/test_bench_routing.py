"""`spur bench routing --json` end to end on a small workload, run as the CLI in a
process of its own: a real local multi-node cluster, the tiny model, two arms.
Speed goals are not asserted here (they live in BENCHMARKS.md); the routing itself
is: the prefix router reaches the oracle's hit rate, measured by the engines. Its
stdout must be exactly one JSON document (`| jq` works): Ray's log lines go to
stderr."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from e2e.conftest import build_tiny_model

from spur.cluster.fake_cluster import ray_test_env, stop_session

pytestmark = pytest.mark.slow


def test_bench_routing_quick_prints_only_json(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="spur-bt-", dir="/tmp"))
    env = {**ray_test_env(ray_tmpdir), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "spur.cluster.cli", "bench", "routing", "--model", str(model)]
    cmd += ["--replicas", "2", "--quick", "--arms", "round_robin,prefix", "--json"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=900)
    finally:  # a hung or finished run: nothing of its cluster may outlive it
        leftovers = stop_session(proc, signal.SIGTERM, 30)
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    err = stderr.decode(errors="replace")[-4000:]
    assert proc.returncode == 0, err
    out = json.loads(stdout)  # strict: one document, not a log line before or after it
    assert not leftovers, leftovers
    arms = {a["arm"]: a for a in out["arms"]}
    assert set(arms) == {"round_robin", "prefix"}
    assert out["cpu"]["model"] and "avx2" in out["cpu"], out["cpu"]  # which CPU ran it
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
