"""The CPU a benchmark ran on: model name, the x86 family / model / stepping and the
micro-architecture they name (a VM's "AMD EPYC" may be Zen 4 or Zen 5), and the flags
that decide torch's and oneDNN's fast paths (AVX2, AVX-512, AVX-512 BF16, AMX). Every
bench JSON and every BENCHMARKS.md round records it: sessions run on different CPU
classes. Under SPUR_CPU_TARGET the flags are those of the level the run emulated, and
`target` and `native_flags` say so (configs/cpu.py)."""

from __future__ import annotations

import logging
import os
from typing import Any

from spur.configs import cpu

logger = logging.getLogger(__name__)

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """{"model", "uarch", "family", "model_number", "stepping", "cores", "target",
    "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "native_flags"} from the
    given /proc/cpuinfo text, else this machine's as spur sees it; flags are False and
    the numbers None where it is unreadable, `uarch` None where `cpu.uarch` knows none.
    `native_flags`: those of FLAGS the CPU itself has (they differ from the others only
    under a target)."""
    here = cpu.here() if cpuinfo is None else cpu.parse(cpuinfo)
    return {
        "model": cpu.describe(here),
        "uarch": cpu.uarch(here),
        "family": here.family,
        "model_number": here.model_number,
        "stepping": here.stepping,
        "cores": os.cpu_count(),
        "target": here.target,
        **{f: f in here.flags for f in FLAGS},
        "native_flags": [f for f in FLAGS if f in here.native_flags],
    }


# The aggregate `cpu` line of /proc/stat, in this order (proc(5)); later fields (guest
# time) are already counted in user and nice.
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
STEAL_WARN_PCT = 2.0


def cpu_times(stat: str | None = None) -> dict[str, int] | None:
    """The machine's CPU time so far, in clock ticks by STAT_FIELDS, from the given
    /proc/stat text, else this machine's; None where it is unreadable (not Linux)."""
    if stat is None:
        try:
            with open("/proc/stat") as f:
                stat = f.readline()
        except OSError:
            return None
    for line in stat.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1 : 1 + len(STAT_FIELDS)]]
            values += [0] * (len(STAT_FIELDS) - len(values))  # old kernels: no steal
            return dict(zip(STAT_FIELDS, values, strict=True))
    return None


def host_share(
    before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, float] | None:
    """What the whole machine did between two `cpu_times` readings, in % of all its
    CPUs' time: `busy_pct` (every process, not only the bench's: neither idle nor
    waiting on I/O) and `steal_pct` (time the hypervisor gave to other guests, which a
    run on a shared host loses). None when a reading is missing or no tick passed."""
    if before is None or after is None:
        return None
    delta = {k: after[k] - before[k] for k in STAT_FIELDS}
    total = sum(delta.values())
    if total <= 0:
        return None
    busy = total - delta["idle"] - delta["iowait"]
    return {
        "busy_pct": round(100 * busy / total, 1),
        "steal_pct": round(100 * delta["steal"] / total, 2),
    }


def warn_steal(host: dict[str, float] | None, arm: str) -> None:
    """Warn (stderr, through logging) when the hypervisor took more than
    STEAL_WARN_PCT of the CPUs during the named arm (`host`: its `host_share`)."""
    if host and host.get("steal_pct", 0.0) > STEAL_WARN_PCT:
        logger.warning(
            "the hypervisor took %.1f%% of the CPUs during the %s arm: its figures are "
            "low by about as much or more; rerun on a quieter host to compare",
            host["steal_pct"],
            arm,
        )
