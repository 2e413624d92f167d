"""Every `from spur.X import name` in the project resolves, the lazy ones inside
functions included: a renamed helper otherwise breaks a command that no test runs
end to end (`spur bench autoscale` imported a `_free_port` that had moved)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "cluster", "configs", "kernels", "spur")


def _imports() -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) of every `from spur... import name` in the code."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spur"):
                    for alias in node.names:
                        rel = str(path.relative_to(ROOT))
                        found.append((rel, node.lineno, node.module or "", alias.name))
    return found


def test_every_spur_import_names_something_that_exists() -> None:
    imports = _imports()
    assert len(imports) > 200, len(imports)  # the scan saw the code
    missing = []
    for rel, line, module, name in imports:
        mod = importlib.import_module(module)
        if name == "*" or hasattr(mod, name):
            continue
        try:  # a submodule: `from spur.cluster import app`
            importlib.import_module(f"{module}.{name}")
        except ModuleNotFoundError:
            missing.append(f"{rel}:{line}: from {module} import {name}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)
