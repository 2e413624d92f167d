"""The serving image's build context (helm/Dockerfile and its .dockerignore) holds
everything the package needs: a wheel built from exactly the folders the Dockerfile
copies installs every package of pyproject.toml. No docker here: the context is
rebuilt from the Dockerfile's COPY lines and built with pip, offline."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "helm" / "Dockerfile"


def _copied() -> list[str]:
    """The sources of the Dockerfile's COPY lines (repository-relative)."""
    sources: list[str] = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            words = [w for w in line.split()[1:] if not w.startswith("--")]
            sources += words[:-1]
    return sources


def _let_through() -> set[str]:
    """What the .dockerignore re-includes after excluding everything (`**`)."""
    lines = (REPO / "helm" / "Dockerfile.dockerignore").read_text().splitlines()
    assert "**" in lines, "the context filter must start from nothing"
    return {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}


def test_every_package_folder_is_in_the_build_context() -> None:
    """pyproject's package-dir maps each top-level package to a folder: each must be
    copied by the Dockerfile and let through by its .dockerignore."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {d.split("/")[0] for d in tool["package-dir"].values()}
    copied, allowed = set(_copied()), _let_through()
    assert folders <= copied, f"helm/Dockerfile does not COPY {sorted(folders - copied)}"
    assert copied <= allowed, f"the .dockerignore filters out {sorted(copied - allowed)}"


def test_a_wheel_builds_from_the_dockerfile_context(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for src in _copied():
        path = REPO / src
        if path.is_dir():
            shutil.copytree(path, ctx / src, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, ctx / src)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*cmd, "-q", "-w", str(out), str(ctx)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = out.glob("spur-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in tool["packages"]:
        init = package.replace(".", "/") + "/__init__.py"
        if package != "spur.kernels.cpu":  # C++ sources only (package data)
            assert init in names, f"{init} is missing from the image's wheel"
    assert any(re.fullmatch(r"spur/configs/[^/]+\.yaml", n) for n in names)
