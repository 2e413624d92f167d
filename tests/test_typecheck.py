"""mypy (strict about untyped defs) on the pure engine core."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_engine_core_type_checks(tmp_path):
    # mypy cannot follow the `spur.* -> top-level folder` mapping of the
    # install; lay the namespace out with symlinks instead.
    spur = tmp_path / "spur"
    spur.mkdir()
    for name in ("actors", "configs", "cluster", "kernels"):
        (spur / name).symlink_to(ROOT / name)
    env = {**os.environ, "MYPYPATH": str(tmp_path)}
    res = subprocess.run(
        [
            sys.executable, "-m", "mypy", "-p", "spur.actors.engine",
            "-m", "spur.actors.step", "-m", "spur.actors.cache_spec",
            "--exclude", r"actor\.py$", "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(tmp_path / ".mypy_cache"),
        ],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
