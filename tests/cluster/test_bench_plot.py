"""`spur bench engine --plot`: the step profile as stacked bars (cluster/bench/plot.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spur.cluster.bench import plot

PROFILE = {
    "prepare_s": 1.0,
    "forward_s": 50.0,
    "logits_s": 6.0,
    "sample_s": 2.0,
    "engine_s": 3.0,
    "steps": 259,
    "matmuls_s": 38.0,
    "outside_matmuls_s": 18.0,
}


def _result(spur: dict, ratio: float, ceiling: float | None) -> dict:
    entry = {"spur": spur, "hf": {"elapsed_s": 240.0}, "throughput_ratio": ratio}
    if ceiling:
        entry["matmul_ceiling_ratio"] = ceiling
    return {"bench": "engine", "model": "SmolLM2-135M-Instruct", "results": {"float32": entry}}


def test_segments_of_a_profiled_run_add_up_to_its_time():
    got = plot.engine_segments({"elapsed_s": 62.0, "profile": PROFILE})
    assert sum(got.values()) == pytest.approx(62.0)
    assert got["matmuls_s"] == 38.0 and got["outside_matmuls_s"] == 18.0


def test_an_older_run_splits_into_its_floor_and_the_rest():
    got = plot.engine_segments({"elapsed_s": 83.9, "matmul_s": 32.6})
    assert got == {"matmuls_s": 32.6, "outside_matmuls_s": pytest.approx(51.3)}


def test_profile_plot_draws_every_run(tmp_path: Path):
    pytest.importorskip("matplotlib", reason="the bench extra (and the test extra) has it")
    runs = [
        ("before", _result({"elapsed_s": 83.9, "matmul_s": 32.6}, 2.65, 6.82)),
        ("after", _result({"elapsed_s": 62.0, "profile": PROFILE}, 3.4, 6.35)),
    ]
    out = plot.engine_profile(runs, tmp_path / "sub" / "engine.png")
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 400 and height > 300


def test_a_bad_plot_with_is_a_usage_error_before_the_bench_runs(tmp_path: Path):
    bad = tmp_path / "nope.json"
    for spec in ("no-equals-sign", f"x={bad}"):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "spur.cluster.cli",
                "bench",
                "engine",
                "--plot",
                str(tmp_path / "p.png"),
                "--plot-with",
                spec,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, r.stderr
        assert "--plot-with" in r.stderr and r.stdout == ""
