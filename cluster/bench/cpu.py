"""The CPU a benchmark ran on: model name, the x86 family / model / stepping and the
micro-architecture they name (a VM's "AMD EPYC" may be Zen 4 or Zen 5), and the flags
that decide torch's and oneDNN's fast paths (AVX2, AVX-512, AVX-512 BF16, AMX). Every
bench JSON and every BENCHMARKS.md round records it: sessions run on different CPU
classes. Under SPUR_CPU_TARGET the flags are those of the level the run emulated, and
`target` and `native_flags` say so (configs/cpu.py).

Also what else used the CPUs while a bench ran (`host_share`), and whether the bench's
own HTTP client got the CPU when a token arrived (`ClientLag`, `favour_client`): a
client sharing the cores with the servers it measures times its own waits for a CPU
as the servers' latency unless it is served first."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from spur.cluster.bench.stats import percentile
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


SERVER_AUTOGROUP_NICE = 10
"""The autogroup nice `favour_client` gives a server's session: CPU weight 110 against
the client's 1024 (nice 0), so a client that wakes for a token runs within a
scheduler slice while the servers keep both cores busy. The servers lose only the
client's own CPU time, which they lose anyway."""


def autogroups_enabled() -> bool:
    """Whether the kernel schedules by session autogroup (sched_autogroup_enabled=1):
    then CPU time is first shared out between sessions, whatever the processes' nice."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def favour_client(pid: int, nice: int = SERVER_AUTOGROUP_NICE) -> int | None:
    """Give the session that `pid` leads (a server the bench started with
    `start_new_session`, with every process it forks, Ray's workers included) the
    autogroup nice `nice`, so that the bench's client, in its own session, is not
    kept off the CPU by the servers it measures.

    Measured on a 2-core VM (BENCHMARKS.md, "Where spur's ITL tail came from"):
    with the two sessions at equal weight, `spur serve` at 16 streams kept the
    client waiting on the run queue for up to 0.4 s at a time (`ClientLag`), and
    every stream's next token was then timed 0.1-0.9 s late, then a burst. Returns
    the nice set, or None where the kernel does not schedule by autogroup or the
    process is gone (nothing changed: `ClientLag` then shows what the client
    waited). Raising a nice needs no privilege."""
    if not autogroups_enabled():
        return None
    try:
        Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")
    except OSError as exc:
        logger.warning("could not lower the autogroup priority of pid %d: %s", pid, exc)
        return None
    return nice


def _cpu_wait_s() -> float | None:
    """Seconds this thread has waited on a run queue so far (schedstat), or None."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


CLIENT_LAG_WARN_MS = 50.0


class ClientLag:
    """How late the bench client's event loop woke while an arm ran: a task asks to
    wake every `interval_s` and records how much later it did (`loop_lag_ms_p99`,
    `loop_lag_ms_max`); `cpu_wait_s` is the time the loop's thread spent runnable but
    waiting for a CPU over the arm (None where schedstat is unreadable). A token that
    arrives meanwhile is timed that much late, so a large lag means the arm's TTFT
    and ITL tails measure the client, not the server.

    Use within the loop: `async with ClientLag() as lag: ...`, then `lag.summary()`."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._wait0: float | None = None
        self._wait1: float | None = None

    async def _watch(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, time.perf_counter() - start - self.interval_s))

    async def __aenter__(self) -> ClientLag:
        self._wait0 = _cpu_wait_s()
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._wait1 = _cpu_wait_s()

    def summary(self) -> dict[str, float | None]:
        """{"loop_lag_ms_p99", "loop_lag_ms_max", "cpu_wait_s"} over the arm."""
        lags = sorted(self.lags)
        p99 = percentile(lags, 99)
        wait = None
        if self._wait0 is not None and self._wait1 is not None:
            wait = round(self._wait1 - self._wait0, 3)
        return {
            "loop_lag_ms_p99": round(p99 * 1e3, 1) if p99 is not None else None,
            "loop_lag_ms_max": round(lags[-1] * 1e3, 1) if lags else None,
            "cpu_wait_s": wait,
        }


def warn_client_lag(client: dict[str, float | None] | None, arm: str) -> None:
    """Warn (stderr) when the client's loop woke more than CLIENT_LAG_WARN_MS late
    during the named arm (`client`: its `ClientLag.summary()`)."""
    worst = (client or {}).get("loop_lag_ms_max")
    if worst is not None and worst > CLIENT_LAG_WARN_MS:
        logger.warning(
            "the bench's client woke up to %.0f ms late during the %s arm (it waited "
            "%.2f s for a CPU): that arm's TTFT and ITL tails include the client's waits",
            worst,
            arm,
            (client or {}).get("cpu_wait_s") or 0.0,
        )
