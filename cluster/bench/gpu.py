"""`spur bench gpu`: the GPU check (`actors/gpu_check.py`) in a fresh process.

The check is one script so that a bare GPU machine (no Ray, no pydantic, no
install) runs it as it is: `python3 actors/gpu_check.py`. This command runs the
same file with this environment's Python, in a child process: Triton reads
TRITON_INTERPRET (the --dry-run's CPU interpreter) when the kernels are first
imported, which only a fresh process guarantees, and cluster/ itself never
touches tensors. The child's log lines pass through to stderr; its stdout is
the JSON summary, returned as a dict.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# Beyond the check's own budget: start-up, imports, and the section in flight.
GRACE_S = 300.0


def script_path() -> Path:
    """Where `gpu_check.py` is (the installed `spur.actors` package; nothing imported)."""
    spec = importlib.util.find_spec("spur.actors")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("spur.actors is not importable: reinstall spur")
    return Path(next(iter(spec.submodule_search_locations))) / "gpu_check.py"


def command(
    *,
    dry_run: bool = False,
    skip: tuple[str, ...] = (),
    budget_s: float = 420.0,
    peak_tbs: float | None = None,
) -> list[str]:
    """The child's command line (see `actors/gpu_check.py --help`)."""
    cmd = [sys.executable, str(script_path()), "--budget-s", str(budget_s)]
    if dry_run:
        cmd.append("--dry-run")
    if skip:
        cmd += ["--skip", ",".join(skip)]
    if peak_tbs is not None:
        cmd += ["--peak-tbs", str(peak_tbs)]
    return cmd


def run(
    *,
    dry_run: bool = False,
    skip: tuple[str, ...] = (),
    budget_s: float = 420.0,
    peak_tbs: float | None = None,
) -> dict[str, Any]:
    """Run the check; returns its JSON summary (`ok` False when a section failed).

    Raises RuntimeError when it cannot run (no CUDA device without --dry-run: the
    message names the fix) or printed no summary.
    """
    cmd = command(dry_run=dry_run, skip=skip, budget_s=budget_s, peak_tbs=peak_tbs)
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, text=True, timeout=budget_s + GRACE_S, check=False
    )
    if proc.returncode == 2:
        raise RuntimeError(
            "the GPU check needs a CUDA device (see its message above): run it on a GPU "
            "machine, or add --dry-run for the tiny CPU run"
        )
    try:
        result: dict[str, Any] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(
            f"the GPU check exited with status {proc.returncode} without a JSON summary "
            "(its log is above)"
        ) from None
    return result
