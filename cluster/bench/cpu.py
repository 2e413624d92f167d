"""The CPU a benchmark ran on: model name and the flags that decide torch's and
oneDNN's fast paths (AVX2, AVX-512, AVX-512 BF16, AMX). Every bench JSON and
every BENCHMARKS.md round records it: sessions run on different CPU classes. Under
SPUR_CPU_TARGET the flags are those of the level the run emulated, and `target` and
`native_flags` say so (configs/cpu.py)."""

from __future__ import annotations

import os
from typing import Any

from spur.configs import cpu

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """{"model", "cores", "target", "avx2", "avx512f", "avx512_bf16", "amx_tile",
    "amx_bf16", "native_flags"} from the given /proc/cpuinfo text, else this machine's
    as spur sees it; flags are False where it is unreadable. `native_flags`: those of
    FLAGS the CPU itself has (they differ from the others only under a target)."""
    here = cpu.here() if cpuinfo is None else cpu.parse(cpuinfo)
    return {
        "model": cpu.describe(here),
        "cores": os.cpu_count(),
        "target": here.target,
        **{f: f in here.flags for f in FLAGS},
        "native_flags": [f for f in FLAGS if f in here.native_flags],
    }
