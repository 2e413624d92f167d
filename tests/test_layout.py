"""Rules of the layout (DESIGN.md section 3) that a test can enforce."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("cluster", "actors", "kernels", "configs")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_engine_core_imports_neither_torch_nor_ray():
    offenders = {}
    for path in sorted((ROOT / "actors" / "engine").glob("*.py")):
        if path.name == "actor.py":  # the Ray shell is allowed
            continue
        bad = _imports(path) & {"torch", "ray"}
        if bad:
            offenders[path.name] = bad
    assert not offenders, f"pure core files import {offenders}"


def test_importing_the_whole_core_loads_no_torch_or_ray():
    modules = [
        f"spur.actors.engine.{p.stem}"
        for p in sorted((ROOT / "actors" / "engine").glob("*.py"))
        if p.stem not in ("__init__", "actor")
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.check_output([sys.executable, "-c", code], text=True).strip()
    assert out == "[]"


def test_cluster_never_imports_torch():
    offenders = [
        str(p.relative_to(ROOT)) for p in (ROOT / "cluster").rglob("*.py") if "torch" in _imports(p)
    ]
    assert not offenders


def test_every_package_folder_is_installed():
    """A package missing from pyproject.toml works in an editable install and
    vanishes from a wheel; list every folder with an __init__.py."""
    declared = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {"spur"}  # the lazy top-level package (spur/__init__.py)
    for top in TOP_PACKAGES:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            found.add("spur." + ".".join(rel.parts))
    assert found == declared, f"missing: {found - declared}, stale: {declared - found}"


def test_top_level_spur_package_is_lazy():
    """`from spur import LLM, SamplingParams` works, and `import spur` or
    `import spur.configs` alone loads neither torch nor ray."""
    code = (
        "import sys, spur, spur.configs.schema\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
        "from spur import SamplingParams\n"
        "print(SamplingParams(max_tokens=3).max_tokens)\n"
        "print('LLM' in dir(spur), spur.LLM.__module__)\n"
    )
    out = subprocess.check_output([sys.executable, "-c", code], text=True, cwd="/")
    assert out.split("\n")[:3] == ["[]", "3", "True spur.actors.llm"]
