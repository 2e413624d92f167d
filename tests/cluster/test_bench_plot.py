"""`spur bench engine --plot` (the step profile as stacked bars) and `spur bench spec
--plot` (ITL and tokens/s, speculation off and on): cluster/bench/plot.py."""

from __future__ import annotations

import json
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
    assert got == {
        "matmuls_s": 32.6,
        "kv_read_floor_s": 0.0,
        "outside_matmuls_s": pytest.approx(51.3),
    }


def test_the_kv_read_floor_is_carved_out_of_the_rest():
    got = plot.engine_segments({"elapsed_s": 62.0, "profile": PROFILE, "kv_read_floor_s": 6.2})
    assert sum(got.values()) == pytest.approx(62.0)
    assert got["kv_read_floor_s"] == 6.2 and got["outside_matmuls_s"] == pytest.approx(11.8)
    # never more than the rest it is part of
    got = plot.engine_segments({"elapsed_s": 62.0, "profile": PROFILE, "kv_read_floor_s": 99})
    assert got["kv_read_floor_s"] == 18.0 and got["outside_matmuls_s"] == 0.0


def test_profile_plot_draws_every_run(tmp_path: Path):
    pytest.importorskip("matplotlib", reason="the bench extra (and the test extra) has it")
    runs = [
        ("before", _result({"elapsed_s": 83.9, "matmul_s": 32.6}, 2.65, 6.82)),
        ("after", _result({"elapsed_s": 62.0, "profile": PROFILE}, 3.4, 6.35)),
        (
            "with the K/V floor",
            _result(
                {
                    "elapsed_s": 62.0,
                    "profile": PROFILE,
                    "kv_read_floor_s": 6.2,
                    "matmul_share_bound": 0.82,
                },
                3.4,
                6.35,
            ),
        ),
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


def _arm(tps: float, p50: float, p99: float, drafts: int = 0, kept: int = 0) -> dict:
    return {
        "tokens_per_s": tps,
        "itl_ms_p50": p50,
        "itl_ms_p99": p99,
        "draft_tokens": drafts,
        "accepted_tokens": kept,
        "acceptance_rate": round(kept / drafts, 3) if drafts else None,
    }


def _level(speedup: float, off: dict, on: dict) -> dict:
    return {"speedup": speedup, "identical_tokens": True, "off": [off, off], "on": [on, on]}


# The shape of `spur bench spec --json` (figures of a real run, rounded).
SPEC = {
    "bench": "spec",
    "model": "SmolLM2-135M-Instruct",
    "dtype": "float32",
    "rounds": 2,
    "speculative": {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8},
    "cpu": {"model": "Intel(R) Xeon(R) Processor", "cores": 2},
    "results": {
        "repeat": {
            "levels": {
                "16": _level(1.02, _arm(87.6, 109.2, 145.5), _arm(89.0, 109.6, 144.5, 34, 30)),
                "1": _level(2.32, _arm(21.1, 45.5, 66.2), _arm(49.0, 16.8, 70.1, 856, 776)),
            }
        },
        "chat": {
            "levels": {
                "1": _level(1.21, _arm(23.3, 41.8, 53.3), _arm(28.1, 40.7, 82.1, 283, 156)),
                "16": _level(0.99, _arm(150.4, 96.1, 136.3), _arm(148.3, 97.3, 128.2)),
            }
        },
    },
}


def test_spec_levels_sort_by_concurrency_and_arms_take_the_median():
    levels = plot.spec_levels(SPEC)
    assert [c for c, _ in levels["repeat"]] == [1, 16]
    assert plot.spec_arm(levels["repeat"][0][1], "on", "itl_ms_p50") == 16.8
    assert plot.spec_arm(levels["chat"][1][1], "on", "acceptance_rate") is None


def test_spec_plot_writes_a_png(tmp_path: Path):
    pytest.importorskip("matplotlib", reason="the bench extra (and the test extra) has it")
    out = plot.spec_itl(SPEC, tmp_path / "sub" / "spec.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 600 and height > 400


def test_spec_plot_refuses_another_bench(tmp_path: Path):
    out = tmp_path / "spec.png"
    with pytest.raises(ValueError, match=r"not a `spur bench spec` result .bench is 'engine'."):
        plot.spec_itl(_result({"elapsed_s": 1.0}, 1.0, None), out)
    with pytest.raises(ValueError, match="without its levels"):
        plot.spec_itl({"bench": "spec", "results": {"chat": {}}}, out)
    for empty in ({}, {"chat": {"levels": {}}}):  # no workload, or one without levels
        with pytest.raises(ValueError, match="no workload ran"):
            plot.spec_itl({"bench": "spec", "results": empty}, out)
    assert not out.exists()


def _spur(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spur.cluster.cli", "bench", "spec", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plot_from_redraws_an_earlier_spec_run(tmp_path: Path):
    pytest.importorskip("matplotlib", reason="the bench extra (and the test extra) has it")
    run = tmp_path / "run.json"
    run.write_text(json.dumps(SPEC))
    png = tmp_path / "spec.png"
    r = _spur("--plot", str(png), "--plot-from", str(run), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_plot_from_is_a_usage_error(tmp_path: Path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(SPEC))
    png = tmp_path / "spec.png"
    r = _spur("--plot-from", str(run), "--json")
    assert r.returncode == 2 and "give --plot" in r.stderr and r.stdout == ""
    other = tmp_path / "engine.json"
    other.write_text(json.dumps(_result({"elapsed_s": 1.0}, 1.0, None)))
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    for path, says in (
        (tmp_path / "missing.json", "cannot read"),
        (garbled, "cannot read"),
        (other, "not a `spur bench spec` result"),
    ):
        r = _spur("--plot", str(png), "--plot-from", str(path), "--json")
        assert r.returncode == 2, r.stderr
        assert f"--plot-from {path}" in r.stderr and says in r.stderr and r.stdout == ""
    assert not png.exists()
