"""The CPU as spur's choices see it: /proc/cpuinfo, optionally narrowed to an x86-64 level.

Every choice spur makes from the CPU reads it here: the compute dtype
(actors/worker/compute_dtype.py), which native linears serve and the C++ build's
`-march` (kernels/native.py), the llama.cpp peer's build and what every bench JSON
records (cluster/bench).

`SPUR_CPU_TARGET` (configs/env.py) narrows the CPU to an x86-64 micro-architecture
level, so that one machine runs, tests and benches the code path of an older CPU
class:

- `x86-64-v3`: AVX2 + FMA, no AVX-512 (AMD EPYC before Zen 4, Intel before Skylake-SP);
- `x86-64-v4`: AVX-512 F / BW / CD / DQ / VL, without BF16, VNNI or AMX (Skylake-SP);
- `native` (the default): the CPU as it is.

The narrowing covers spur's own code (flags, native build) and, through `torch_isa_env`
set before torch loads (`spur`'s command line does it), torch's: ATen's vectorised
kernels, oneDNN and MKL. What it cannot narrow is the machine itself: its caches,
memory bandwidth and clock stay this CPU's. Pure: no torch, no Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from spur.configs import env

TARGETS = ("native", "x86-64-v3", "x86-64-v4")

# The flags each level needs (x86-64 psABI), and the AVX-512 subsets v4 keeps.
V4_AVX512 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
NEEDS = {
    "x86-64-v3": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}),
    "x86-64-v4": frozenset({"avx2", "fma"}) | V4_AVX512,
}
# Flags past v3: any AVX-512 or AMX unit, and the VEX encodings of later extensions.
ABOVE_V3 = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10")

# What torch's libraries are capped at for a level: ATen's CPU dispatch, oneDNN's ISA
# and MKL's instructions. Read once, when each library loads.
TORCH_ISA = {
    "x86-64-v3": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "x86-64-v4": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
}


@dataclass(frozen=True)
class Cpu:
    """model and vendor as /proc/cpuinfo names them; flags as spur's choices see them
    (narrowed to `target`); `native_flags` as the CPU has them; x86's `family`,
    `model_number` and `stepping` (None where /proc/cpuinfo has none: aarch64)."""

    model: str
    vendor: str
    flags: frozenset[str]
    target: str = "native"
    native_flags: frozenset[str] = frozenset()
    family: int | None = None
    model_number: int | None = None
    stepping: int | None = None


# (vendor, family, first model, last model) -> the micro-architecture. A VM's model
# name is often generic ("AMD EPYC"): Zen 4 and Zen 5 then read alike, with the same
# AVX-512 BF16 flags, while Zen 4 runs each 512-bit operation as two 256-bit halves
# (about half Zen 5's bf16 arithmetic a core: BENCHMARKS.md, thirty-second round).
# Only the classes spur has run on or is measured against; others are None, and the
# family and model numbers stay on record.
UARCHS = (
    ("AuthenticAMD", 0x17, 0x30, 0x7F, "zen2"),
    ("AuthenticAMD", 0x19, 0x00, 0x0F, "zen3"),
    ("AuthenticAMD", 0x19, 0x10, 0x1F, "zen4"),
    ("AuthenticAMD", 0x19, 0x20, 0x5F, "zen3"),
    ("AuthenticAMD", 0x19, 0x60, 0x7F, "zen4"),
    ("AuthenticAMD", 0x19, 0xA0, 0xAF, "zen4"),
    ("AuthenticAMD", 0x1A, 0x00, 0xFF, "zen5"),
    ("GenuineIntel", 6, 0x55, 0x55, "skylake-sp"),  # also Cascade and Cooper Lake
    ("GenuineIntel", 6, 0x6A, 0x6A, "icelake-sp"),
    ("GenuineIntel", 6, 0x8F, 0x8F, "sapphirerapids"),
    ("GenuineIntel", 6, 0xCF, 0xCF, "emeraldrapids"),
    ("GenuineIntel", 6, 0xAD, 0xAD, "graniterapids"),
)


def uarch(cpu: Cpu) -> str | None:
    """The micro-architecture `cpu`'s vendor, family and model number name (UARCHS),
    or None where they are unknown or not listed."""
    for vendor, family, first, last, name in UARCHS:
        if (
            cpu.vendor == vendor
            and cpu.family == family
            and cpu.model_number is not None
            and first <= cpu.model_number <= last
        ):
            return name
    return None


def parse(cpuinfo: str) -> Cpu:
    """/proc/cpuinfo text -> Cpu (first processor's model, vendor, flags, family,
    model number and stepping; x86's "flags" or aarch64's "Features"). Missing fields
    are empty, or None for the numbers."""
    model = vendor = ""
    flags: frozenset[str] | None = None
    numbers: dict[str, int | None] = {"cpu family": None, "model": None, "stepping": None}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = frozenset(value.split())
        elif key in numbers and numbers[key] is None and value.strip().isdigit():
            numbers[key] = int(value.strip())
    flags = flags or frozenset()
    return Cpu(
        model,
        vendor,
        flags,
        native_flags=flags,
        family=numbers["cpu family"],
        model_number=numbers["model"],
        stepping=numbers["stepping"],
    )


def narrow(cpu: Cpu, target: str) -> Cpu:
    """`cpu` as a CPU of the x86-64 level `target` sees itself: the flags above it
    removed. Raises ValueError naming the fix for an unknown target, or one this CPU
    cannot run (no level narrows an aarch64 CPU)."""
    if target not in TARGETS:
        raise ValueError(
            f"SPUR_CPU_TARGET={target!r} is unknown: use one of {', '.join(TARGETS)} (or unset it)"
        )
    if target == "native":
        return cpu
    missing = sorted(NEEDS[target] - cpu.native_flags)
    if missing:
        raise ValueError(
            f"SPUR_CPU_TARGET={target}: this CPU ({cpu.model or 'unknown'}) lacks "
            f"{', '.join(missing)}, so it cannot run that level's code; unset SPUR_CPU_TARGET "
            "or pick a lower level"
        )
    kept = {f for f in cpu.native_flags if not f.startswith(ABOVE_V3)}
    if target == "x86-64-v4":
        kept |= V4_AVX512
    return dataclasses.replace(cpu, flags=frozenset(kept), target=target)


@functools.cache
def here() -> Cpu:
    """This machine's CPU narrowed to SPUR_CPU_TARGET, read once per process."""
    text = ""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
    cpu = parse(text)
    if not cpu.model:
        model = platform.processor() or platform.machine()
        cpu = dataclasses.replace(cpu, model=model)
    return narrow(cpu, env.cpu_target())


def older_levels(cpu: Cpu) -> list[str]:
    """The levels below `cpu` it can run as (`narrow` accepts them and leaves fewer
    flags): the older CPU classes whose code paths `make test` tests on this machine."""
    out = []
    for target in TARGETS[1:]:
        with contextlib.suppress(ValueError):
            if narrow(cpu, target).flags != cpu.native_flags:
                out.append(target)
    return out


def march_flags(target: str) -> list[str]:
    """The compiler's -march for code built for `target` on this machine (tuned for it)."""
    if target == "native":
        return ["-march=native"]
    return [f"-march={target}", "-mtune=native"]


def torch_isa_env(target: str) -> dict[str, str]:
    """Environment variables that cap torch's libraries at `target` ({} for native)."""
    return dict(TORCH_ISA.get(target, {}))


def export_torch_isa() -> dict[str, str]:
    """Put `torch_isa_env(SPUR_CPU_TARGET)` into this process's environment (variables
    already set are kept), before torch loads here and in the processes it starts (Ray's
    workers, `spur serve` under a bench). Returns what it set. Raises RuntimeError naming
    the fix when torch is already loaded, as its libraries read them only at load."""
    wanted = torch_isa_env(here().target)
    todo = {k: v for k, v in wanted.items() if os.environ.get(k) is None}
    if todo and "torch" in sys.modules:
        names = ", ".join(f"{k}={v}" for k, v in todo.items())
        raise RuntimeError(
            f"SPUR_CPU_TARGET={here().target} needs {names} before torch loads, and torch "
            "is loaded: set them in the environment"
        )
    os.environ.update(todo)
    return todo


def describe(cpu: Cpu) -> str:
    """One line for logs and bench records: the model, and the level it runs as."""
    return cpu.model if cpu.target == "native" else f"{cpu.model} (as {cpu.target})"


if __name__ == "__main__":  # `make test`: the levels to rerun the older-class tests as
    if sys.argv[1:] != ["--older-levels"]:
        sys.exit("usage: python -m spur.configs.cpu --older-levels")
    text = ""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
    print(" ".join(older_levels(parse(text))))
