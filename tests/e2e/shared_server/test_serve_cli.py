"""`spur serve` and `spur config` as a user runs them: real subprocesses, real exit
codes. Only the diff test needs the running server (the session's)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.slow

SPUR = [sys.executable, "-m", "spur.cluster.cli"]


def spur(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # Should a misuse ever get as far as starting Ray, it stays in this folder.
    env.update(RAY_TMPDIR=str(cwd), RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [*SPUR, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def test_serve_given_twice_is_a_usage_error(tmp_path: Path) -> None:
    res = spur("serve", "serve", cwd=tmp_path)
    assert res.returncode != 0
    assert "'serve' given twice; usage:" in res.stderr
    assert "Traceback" not in res.stderr


def test_serve_missing_config_names_the_file(tmp_path: Path) -> None:
    res = spur("serve", "missing.yaml", cwd=tmp_path)
    assert res.returncode != 0
    assert "missing.yaml" in res.stderr and "Traceback" not in res.stderr
    assert "spur is serving" not in res.stdout


def test_serve_invalid_config_names_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nlanes:\n  - name: chat\n    engine:\n      cache: {blok_size: 8}\n")
    res = spur("serve", str(bad), cwd=tmp_path)
    assert res.returncode != 0
    assert "lanes[0].engine.cache.blok_size" in res.stderr and "Traceback" not in res.stderr


def test_config_show_prints_the_resolved_yaml(tmp_path: Path) -> None:
    res = spur("config", "show", "local", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    shown = yaml.safe_load(res.stdout)
    (lane,) = shown["lanes"]
    assert lane["name"] == "chat" and shown["server"]["port"] == 8000
    # every default filled in
    assert lane["engine"]["cache"]["enable_prefix_caching"] is True
    assert "max_num_seqs" in lane["engine"]["scheduler"] and "router" in shown


def test_config_diff_against_the_running_server(spur_server: Any, tmp_path: Path) -> None:
    res = spur(
        "config", "diff", str(spur_server.config_path), "--url", spur_server.url, cwd=tmp_path
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no differences" in res.stdout

    changed = yaml.safe_load(spur_server.config_path.read_text())
    changed["lanes"][0]["max_ongoing_requests"] = 31
    changed["lanes"][0]["engine"]["cache"]["block_size"] = 32
    stale = tmp_path / "stale.yaml"
    stale.write_text(yaml.safe_dump(changed))
    res = spur("config", "diff", str(stale), "--url", spur_server.url, cwd=tmp_path)
    assert res.returncode != 0
    lines = res.stdout.splitlines()
    assert "lanes[0].max_ongoing_requests: file 31, running 32" in lines, res.stdout
    assert "lanes[0].engine.cache.block_size: file 32, running 16" in lines, res.stdout
    assert len(lines) == 2, res.stdout


def test_serve_printed_the_effective_config_and_the_endpoint(spur_server: Any) -> None:
    log = spur_server.log_path.read_text(errors="replace")
    assert "effective configuration:" in log
    assert f"spur is serving at {spur_server.base_url}\n" in log
    # the printed YAML has the defaults filled in (e.g. the router, absent from the file)
    assert "router:" in log and "policy: prefix" in log


def test_the_embedded_rays_processes_inherit_what_spur_serve_sets(spur_server: Any) -> None:
    """The variables `spur serve` sets for an embedded Ray reach the processes that read
    them (they inherit the environment as it is when `ray.init` starts the raylet):
    the HTTP proxy uses gRPC."""
    import psutil

    wanted = {"ProxyActor": "RAY_SERVE_PROXY_USE_GRPC"}  # process -> its variable, "1"
    seen = {}
    for pid, cmdline in spur_server.processes().items():
        for name, var in wanted.items():
            if f"ray::{name}" in cmdline:
                with contextlib.suppress(psutil.NoSuchProcess):
                    seen[name] = psutil.Process(pid).environ().get(var)
    assert seen == dict.fromkeys(wanted, "1"), seen


def test_bench_serve_pairs_both_arms_in_alternating_rounds(
    spur_server: Any, tmp_path: Path
) -> None:
    """`spur bench serve` against the running server: each round runs both arms on
    the same seeded work, and the level reports its median round."""
    import json

    res = spur(
        "bench", "serve", "--url", spur_server.url, "--model", "tiny",
        "--concurrency", "2", "--requests", "3", "--rounds", "2", "--json",
        "--plot", str(tmp_path / "serve.png"),
        cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)  # the progress bars went to stderr
    assert out["plot"] == str(tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
    assert "c=2 round 2" in res.stderr
    assert out["rounds"] == 2 and len(out["levels"]) == 1
    # The CPU that ran both arms, and that the server ran on it too.
    assert out["cpu"]["model"] and out["servers_on_this_host"] is True, out["cpu"]
    level = out["levels"][0]
    assert len(level["rounds"]) == 2
    for r in level["rounds"]:
        assert r["serve"]["errors"] == 0, r["serve"]["error_samples"]
        # ignore_eos: both arms generate exactly the requested tokens.
        assert r["serve"]["generated_tokens"] == r["offline"]["generated_tokens"] > 0
        for arm in ("serve", "offline"):  # the machine worked during each arm
            assert 0 < r[arm]["host_cpu"]["busy_pct"] <= 100, r[arm]["host_cpu"]
        lag = r["serve"]["client"]  # the HTTP arm watched its own event loop
        assert lag["loop_lag_ms_max"] is not None and lag["cpu_wait_s"] is not None, lag
        assert 0 <= lag["loop_lag_ms_p99"] <= lag["loop_lag_ms_max"]
        expected = round(r["serve"]["tokens_per_s"] / r["offline"]["tokens_per_s"], 3)
        assert r["serve_over_offline"] == expected
    assert level["round_ratios"] == [r["serve_over_offline"] for r in level["rounds"]]
    assert level["serve_over_offline"] == min(level["round_ratios"])  # lower median of two
    assert out["median_ratio"] == level["serve_over_offline"]
