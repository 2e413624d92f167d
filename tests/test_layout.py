"""Rules of the layout (docs/architecture.md, "Layers") that a test can enforce."""

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


def _spur_imports(path: Path) -> set[str]:
    """Every `spur.*` module a file imports, at any depth (function bodies too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {n for n in names if n.startswith("spur.")}


def _offenders(files: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """file -> the imported spur modules under any of the `forbidden` prefixes."""
    found = {}
    for path in files:
        imported = _spur_imports(path)
        bad = sorted(m for m in imported if any(m == f or m.startswith(f + ".") for f in forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def _py(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_contract_modules_import_only_the_standard_library():
    """The step contract and the cache spec are what the engine and the worker
    share: they must not pull either side (or torch, ray, pydantic) in."""
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    for rel in ("actors/step.py", "actors/cache_spec.py", "configs/defaults.py"):
        extra = _imports(ROOT / rel) - allowed
        assert not extra, f"{rel} imports {sorted(extra)}: keep it standard library only"


def test_worker_never_imports_the_engine():
    """The worker talks to the engine only through `spur.actors.step` and
    `spur.actors.cache_spec`."""
    assert not _offenders(_py("actors/worker"), ("spur.actors.engine",))


def test_configs_import_nothing_above_them():
    """The config layer is the bottom one: shared defaults live in
    `configs/defaults.py`, not in the modules that read them."""
    assert not _offenders(_py("configs"), ("spur.actors", "spur.cluster", "spur.kernels"))


def test_kernels_import_neither_actors_nor_cluster():
    assert not _offenders(_py("kernels"), ("spur.actors", "spur.cluster"))


CORE = ROOT / "actors" / "engine" / "core"
SHELL = ROOT / "actors" / "engine" / "shell"


def test_engine_folder_holds_only_core_and_shell():
    """Every engine module sits in core/ or shell/, so the folder says which rules apply."""
    loose = [p.name for p in (ROOT / "actors" / "engine").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"put {loose} in actors/engine/core/ (pure) or actors/engine/shell/"


def test_engine_core_is_pure():
    """The core is plain Python: no torch, no Ray, no asyncio, and nothing from the
    layers around it (the shell, the worker, the cluster, the kernels)."""
    offenders = {}
    for path in sorted(CORE.glob("*.py")):
        bad = _imports(path) & {"torch", "ray", "asyncio"}
        if bad:
            offenders[path.name] = sorted(bad)
    assert not offenders, f"pure core files import {offenders}"
    outer = (
        "spur.actors.engine.shell",
        "spur.actors.worker",
        "spur.actors.builder",
        "spur.actors.llm",
        "spur.cluster",
        "spur.kernels",
    )
    assert not _offenders(sorted(CORE.glob("*.py")), outer)


def test_engine_shell_uses_ray_only_in_its_actor():
    """The shell's asyncio loop, output processing and metrics run without Ray
    (the offline LLM class and unit tests use them); only shell/actor.py is Ray's."""
    offenders = {}
    for path in sorted(SHELL.glob("*.py")):
        bad = _imports(path) & ({"torch", "ray"} if path.name != "actor.py" else set())
        if bad:
            offenders[path.name] = sorted(bad)
    assert not offenders, f"shell files import {offenders}"


def test_importing_the_whole_core_loads_no_torch_or_ray():
    modules = [
        f"spur.actors.engine.{p.parent.name}.{p.stem}"
        for p in sorted([*CORE.glob("*.py"), *SHELL.glob("*.py")])
        if p.stem not in ("__init__", "actor")
    ] + ["spur.actors.step", "spur.actors.cache_spec"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.check_output([sys.executable, "-c", code], text=True).strip()
    assert out == "[]"


def test_clusters_pure_modules_load_no_ray():
    """The API shapes, errors, auth, lanes, failover and routing policy are plain
    Python (their unit tests run without a cluster); Ray stays in the modules that
    deploy or call actors (app, ingress, server, routing/index_actor, ...)."""
    modules = [
        f"spur.cluster.{name}"
        for name in (
            "api_requests",
            "api_responses",
            "errors",
            "auth",
            "lanes",
            "failover",
            "fanout",
            "readiness",
            "metrics",
            "routing.kv_index",
            "routing.policy",
        )
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
    vanishes from a wheel; list every folder with an __init__.py, and every folder of
    data only (kernels/cpu: C++ sources) with its package data."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(setuptools["packages"])
    found = {"spur"}  # the lazy top-level package (spur/__init__.py)
    for top in TOP_PACKAGES:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            found.add("spur." + ".".join(rel.parts))
    data_only = declared - found
    for name in data_only:
        folder = ROOT.joinpath(*name.split(".")[1:])
        assert folder.is_dir() and not list(folder.glob("*.py")), f"{name}: no such data folder"
        globs = setuptools["package-data"].get(name, [])
        assert globs and all(list(folder.glob(g)) for g in globs), f"{name}: no package data"
    assert found | data_only == declared, f"missing: {found - declared}"


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
