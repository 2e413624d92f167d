"""The GPU check script (actors/gpu_check.py) runs where a device machine runs it.

That machine has torch, Triton and transformers but no Ray, no pydantic and no
install of spur. The dry run is the same script end to end on CPU with tiny
sizes; here it runs in a subprocess where importing `ray` or `pydantic` fails
and the installed `spur` is hidden, so only the checkout's own files are used.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spur.actors import gpu_check
from spur.cluster.bench import gpu as gpu_bench

SCRIPT = Path(__file__).resolve().parents[2] / "actors" / "gpu_check.py"

# Block some imports, hide the editable install's finder, import the runner's modules,
# then run the script as __main__ with the given arguments.
RUNNER = """
import importlib, json, runpy, sys
script, blocked, args = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
for name in blocked:
    sys.modules[name] = None
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code
for m in ("model_runner", "graph_runner", "cuda_graphs", "worker"):
    importlib.import_module("spur.actors.worker." + m)
loaded = sorted(m for m in ("ray", "pydantic") if sys.modules.get(m) is not None)
sys.stderr.write(f"LOADED={loaded} FROM={sys.modules['spur.kernels'].__file__}\\n")
sys.exit(code)
"""


def _dry_run(tmp_path: Path, blocked: list[str], *args: str) -> tuple[dict, str]:
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(SCRIPT), json.dumps(blocked),
         json.dumps(["--dry-run", "--out", str(out), *args])],
        cwd=tmp_path,  # not the checkout: its kernels/ must not be importable as `kernels`
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)  # stdout holds the JSON summary and nothing else
    assert summary == json.loads(out.read_text())
    assert "spur from the checkout" in proc.stderr
    assert f"FROM={SCRIPT.parents[1] / 'kernels' / '__init__.py'}" in proc.stderr
    assert summary["ok"] and summary["dry_run"]
    return summary, proc.stderr


def test_dry_run_end_to_end_without_ray_pydantic_or_install(tmp_path):
    summary, log = _dry_run(tmp_path, ["ray", "pydantic", "pydantic_core"])
    assert "LOADED=[]" in log  # the runner's modules imported too, without either
    kernels = summary["kernels"]
    assert kernels["ok"] and kernels["num_cases"] >= 15
    assert any("fp8" in c for c in kernels["cases"]) and any("gdn" in c for c in kernels["cases"])
    assert summary["bandwidth"]["ok"] and summary["bandwidth"]["decode"]
    engine = summary["engine"]
    assert engine["ok"] and engine["capture"]["enabled"]
    for level in ("batch1", "batch4"):
        n = level.removeprefix("batch")
        assert engine[level]["same_tokens_requests"] == f"{n}/{n}"
        assert engine[level]["graphs"]["graph_steps"] > 0  # the padded path served decodes
        assert engine[level]["eager"]["graph_steps"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_without_cuda_the_check_names_the_dry_run():
    with pytest.raises(RuntimeError, match="--dry-run"):
        gpu_check.run(dry_run=False)


def test_bench_command_runs_the_installed_script():
    cmd = gpu_bench.command(dry_run=True, skip=("engine", "kernels"), budget_s=60, peak_tbs=4.8)
    installed = Path(gpu_check.__file__)  # the script of the spur this CLI runs
    assert cmd[:2] == [sys.executable, str(installed)] and installed.is_file()
    assert cmd[2:] == [
        "--budget-s",
        "60",
        "--dry-run",
        "--skip",
        "engine,kernels",
        "--peak-tbs",
        "4.8",
    ]
    assert gpu_check.peak_for("NVIDIA H200") == 4.8 and gpu_check.peak_for("Tesla T4") is None


INJECT = """
import json, sys
from spur.actors import gpu_check
from spur.actors.worker.model_runner import ModelRunner

def boom(*args, **kwargs):
    raise RuntimeError("injected failure")

gpu_check._check_store = boom  # the store_kv cases
gpu_check._decode_shape = boom  # every bandwidth shape
ModelRunner.capture_decode_graphs = boom  # graph capture
sys.exit(gpu_check.main(json.loads(sys.argv[1])))
"""


def test_a_failure_leaves_every_other_figure(tmp_path, monkeypatch):
    """One run on a lent device is all there is: a failing kernel case, bandwidth shape
    or graph capture used to throw away its whole section's figures (the passing
    cases' differences, the eager engine's tokens/s). Each is recorded where it failed,
    and the summary is on disk after every section."""
    out = tmp_path / "summary.json"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    proc = subprocess.run(
        [sys.executable, "-c", INJECT, json.dumps(["--dry-run", "--out", str(out)])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-4000:]  # not ok, but a summary
    summary = json.loads(out.read_text())
    assert not summary["ok"] and "partial" not in summary
    kernels = summary["kernels"]
    assert not kernels["ok"] and kernels["failed"]
    assert all(name.startswith("store_kv") for name in kernels["failed"])
    passed = [c for c in kernels["cases"].values() if c["ok"]]
    assert len(passed) >= 10 and all("max_abs_diff" in c for c in passed)
    bandwidth = summary["bandwidth"]
    assert not bandwidth["ok"] and all("error" in r for r in bandwidth["decode"].values())
    engine = summary["engine"]
    assert not engine["ok"] and "injected failure" in engine["capture"]["error"]
    for level in ("batch1", "batch4"):  # the eager arm still measured
        assert engine[level]["eager"]["tokens_per_s"] > 0 and "graphs" not in engine[level]
