"""The CPU a benchmark ran on: model name and the flags that decide torch's and
oneDNN's fast paths (AVX2, AVX-512, AVX-512 BF16, AMX). Every bench JSON and
every BENCHMARKS.md round records it: sessions run on different CPU classes."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """{"model", "cores", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    from /proc/cpuinfo (or the given text); flags are False where it is unreadable."""
    if cpuinfo is None:
        cpuinfo = ""
        with contextlib.suppress(OSError):
            cpuinfo = Path("/proc/cpuinfo").read_text()
    model, flags = platform.processor() or platform.machine(), set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return {"model": model, "cores": os.cpu_count(), **{f: f in flags for f in FLAGS}}
