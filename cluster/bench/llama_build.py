"""Build llama.cpp's `llama-server` and `llama-quantize` for the peer bench.

A bench-only step, never a runtime dependency of spur: the `llama-cpp-python`
sdist on PyPI vendors llama.cpp's full source (`vendor/llama.cpp`, with
`tools/server`), so `pip download` fetches it through the ordinary client and
cmake + ninja build the two targets the bench needs, once. The binaries are
cached under spur's cache directory like the C decode kernel
(`<cache>/llama_cpp/<version>-<key>/bin/`), keyed on the sdist version and the
CPU's flags (the build uses `-DGGML_NATIVE=ON`, so a binary only runs on the CPU
class it was built for; under SPUR_CPU_TARGET it is built for that x86-64 level
instead, `cmake_flags`, so that the peer runs the same class of code as spur).

`ensure_built()` is the one entry: it returns the bin folder, building if needed,
and raises RuntimeError naming the fix when pip, cmake, ninja or a C++ compiler is
missing or the build fails (the tail of the build log is in the message).
A full build takes a few minutes on a free 16-core machine and hours on two
cores shared with other work; the lock file makes a second caller wait for the
first instead of building twice, and a build that was stopped (killed, or failed)
resumes where it stopped on the next call (its work folder is kept until the
binaries are published).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from spur.configs import cache, cpu, env

logger = logging.getLogger(__name__)

VERSION = "0.3.36"
"""The llama-cpp-python sdist whose vendored llama.cpp is built (pinned: the bench's
figures name it)."""

TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DGGML_OPENMP=ON",
)
MTMD_PATCH = """
# spur: a text-only bench never calls the multimodal encoders the server links:
# build them unoptimized (a third of the build otherwise).
target_compile_options(mtmd PRIVATE -O0)
"""
"""Appended to tools/mtmd/CMakeLists.txt: llama-server links libmtmd (image and audio
encoders, 51 files) but a text workload never runs it; everything it does run (ggml,
libllama, common, the server) keeps the Release flags."""


# ggml's instruction sets for a build at an x86-64 level (SPUR_CPU_TARGET) instead of
# -march=native: the peer runs the same class of code as spur under that target.
LEVEL_FLAGS = {
    "x86-64-v3": ("-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                  "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"),
    "x86-64-v4": ("-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                  "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=OFF",
                  "-DGGML_AVX512_BF16=OFF"),
}  # fmt: skip


def cmake_flags(target: str) -> tuple[str, ...]:
    """CMAKE_FLAGS for a build at `target` (configs/cpu.py): native as they are, else
    ggml's native detection off and the level's instruction sets named."""
    if target == "native":
        return CMAKE_FLAGS
    flags = tuple(f for f in CMAKE_FLAGS if not f.startswith("-DGGML_NATIVE="))
    return (*flags, "-DGGML_NATIVE=OFF", *LEVEL_FLAGS[target])


def build_dir(version: str = VERSION) -> Path:
    """The cache folder for this sdist version on this CPU class (may not exist yet)."""
    here = cpu.here()
    key = hashlib.sha256(
        (
            version + " ".join(cmake_flags(here.target)) + MTMD_PATCH + " ".join(sorted(here.flags))
        ).encode()
    ).hexdigest()[:12]
    return env.cache_dir() / "llama_cpp" / f"{version}-{key}"


def binaries(version: str = VERSION) -> dict[str, Path] | None:
    """{target: path} of a finished build, or None when it is not built yet."""
    bin_dir = build_dir(version) / "bin"
    paths = {t: bin_dir / t for t in TARGETS}
    return paths if all(p.exists() for p in paths.values()) else None


def _need(tool: str, fix: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise RuntimeError(f"building llama.cpp needs {tool!r} on PATH: {fix}")
    return path


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    logger.info("llama.cpp build: %s", " ".join(cmd))
    with log.open("a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        done = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (log {log}):\n{tail}")


def _fetch_source(work: Path, log: Path, version: str, sdist: Path | None) -> Path:
    """Unpack the sdist (downloaded with pip unless given) and return vendor/llama.cpp."""
    if sdist is None:
        dl = work / "sdist"
        dl.mkdir(exist_ok=True)
        # pip prepares an sdist's metadata even to download it: in an isolated env,
        # which fetches its build backend (scikit-build-core); not in spur's own env.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += [f"llama-cpp-python=={version}", "-d", str(dl)]
        try:
            _run(cmd, log)
        except RuntimeError as exc:
            raise RuntimeError(
                f"could not download the llama-cpp-python {version} sdist with pip: {exc}\n"
                "fix: give the file with --llama-sdist PATH (or SPUR_LLAMA_SDIST)"
            ) from None
        found = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
        if not found:
            raise RuntimeError(f"pip download left no llama_cpp_python-*.tar.gz in {dl}")
        sdist = found[0]
    src = work / "src"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(src, members=members, filter="data")
    roots = list(src.glob("*/vendor/llama.cpp"))
    if not roots or not (roots[0] / "tools" / "server").is_dir():
        raise RuntimeError(f"{sdist} has no vendor/llama.cpp/tools/server: not the right sdist?")
    with (roots[0] / "tools" / "mtmd" / "CMakeLists.txt").open("a") as f:
        f.write(MTMD_PATCH)
    return roots[0]


def _interrupted(out: Path) -> Path | None:
    """The work folder of an earlier build of `out` that stopped before publishing
    (killed, or failed): ninja resumes it where it stopped. Callers hold the lock."""
    for work in sorted(out.parent.glob(f"{out.name.split('-')[0]}-*.*")):
        key = work / "key"
        if work.is_dir() and key.exists() and key.read_text().strip() == out.name:
            return work
    return None


def ensure_built(
    version: str = VERSION, sdist: Path | None = None, jobs: int | None = None
) -> Path:
    """The bin folder holding `llama-server` and `llama-quantize`, built if missing.

    sdist: a downloaded `llama_cpp_python-<version>.tar.gz` (default: `SPUR_LLAMA_SDIST`,
    else pip downloads it). Raises RuntimeError naming the fix on any failure.
    """
    out = build_dir(version)
    if binaries(version):
        return out / "bin"
    given = os.environ.get("SPUR_LLAMA_SDIST")
    sdist = sdist or (Path(given) if given else None)
    cmake = _need("cmake", "apt-get install cmake (or pip install cmake)")
    ninja = _need("ninja", "apt-get install ninja-build (or pip install ninja)")
    cxx = os.environ.get("CXX") or next(
        (p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None
    )
    if cxx is None:
        raise RuntimeError("llama.cpp needs a C++ compiler: apt-get install g++ or set CXX")
    out.parent.mkdir(parents=True, exist_ok=True)
    # A concurrent caller waits, then finds the build.
    with cache.lock(out.parent / f"{out.name}.lock"):
        if binaries(version):
            return out / "bin"
        work = _interrupted(out)
        if work is None:
            work = Path(tempfile.mkdtemp(prefix=f"{out.name}.", dir=out.parent))
            (work / "key").write_text(out.name)
        log = work / "build.log"
        build = work / "build"
        if (build / "build.ninja").exists():
            logger.warning("resuming the llama.cpp build in %s; log: %s", work, log)
        else:
            logger.warning("building llama.cpp %s (%s); log: %s", version, ", ".join(TARGETS), log)
            root = _fetch_source(work, log, version, sdist)
            cmd = [cmake, "-S", str(root), "-B", str(build), "-G", "Ninja"]
            cmd += [f"-DCMAKE_MAKE_PROGRAM={ninja}", f"-DCMAKE_CXX_COMPILER={cxx}"]
            _run([*cmd, *cmake_flags(cpu.here().target)], log)
        jobs = jobs or os.cpu_count() or 1
        _run([cmake, "--build", str(build), "-j", str(jobs), "--target", *TARGETS], log)
        bin_dir = work / "bin"
        bin_dir.mkdir()
        for target in TARGETS:
            shutil.copy2(build / "bin" / target, bin_dir / target)
        shutil.copy2(log, bin_dir / "build.log")
        final = work / "final"
        final.mkdir()
        os.replace(bin_dir, final / "bin")
        if out.exists():
            shutil.rmtree(out)
        os.replace(final, out)  # atomic publish: a reader never sees half a build
        shutil.rmtree(work, ignore_errors=True)
    return out / "bin"


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(ensure_built(sdist=Path(sys.argv[1]) if len(sys.argv) > 1 else None))
