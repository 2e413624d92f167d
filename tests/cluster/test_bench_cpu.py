"""The CPU fields every bench JSON records (model name and fast-path flags)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spur.cluster.bench import cpu as bench_cpu
from spur.cluster.bench.cpu import FLAGS, STAT_FIELDS, cpu_info, cpu_times, host_share

SAMPLE = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16
"""


def test_cpu_info_reads_model_and_flags():
    info = cpu_info(SAMPLE)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert all(info[f] for f in FLAGS)
    assert info["uarch"] is None and info["family"] is None  # SAMPLE has no numbers
    genoa = cpu_info(
        "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
        "stepping\t: 1\nflags\t\t: avx2 avx512f avx512_bf16\n"
    )
    assert (genoa["uarch"], genoa["family"], genoa["model_number"], genoa["stepping"]) == (
        "zen4",
        25,
        17,
        1,
    )
    epyc = cpu_info("model name\t: AMD EPYC 7B13\nflags\t\t: fpu avx avx2 fma\n")
    assert epyc["model"] == "AMD EPYC 7B13" and epyc["avx2"]
    assert not any(epyc[f] for f in FLAGS if f != "avx2")


def test_cpu_info_of_this_machine_has_every_field():
    info = cpu_info()
    numbers = {"uarch", "family", "model_number", "stepping"}
    assert set(info) == {"model", *numbers, "cores", "target", *FLAGS, "native_flags"}
    assert info["model"]


def test_cpu_info_records_an_emulated_level():
    """Under SPUR_CPU_TARGET the flags are the level's and the model and target say so."""
    from spur.configs import cpu

    zen5 = cpu.parse(
        "model name\t: AMD EPYC 9B45\nflags\t\t: avx avx2 fma f16c bmi1 bmi2 movbe "
        "avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16\n"
    )
    as_v3 = cpu.narrow(zen5, "x86-64-v3")
    assert cpu.describe(as_v3) == "AMD EPYC 9B45 (as x86-64-v3)"
    assert not as_v3.flags & {"avx512f", "avx512_bf16"}
    assert {"avx512f", "avx512_bf16"} <= as_v3.native_flags


def test_host_share_is_busy_and_stolen_time_of_all_cpus():
    before = cpu_times("cpu  100 50 20 800 10 0 5 15 0 0\ncpu0 50 25 10 400 5 0 2 8 0 0\n")
    after = cpu_times("cpu  160 90 40 860 20 0 5 25 7 0\n")
    assert before == dict(zip(STAT_FIELDS, (100, 50, 20, 800, 10, 0, 5, 15), strict=True))
    # 200 ticks passed: 60 + 40 + 20 + 10 (steal) busy, 60 idle, 10 waiting on I/O.
    assert host_share(before, after) == {"busy_pct": 65.0, "steal_pct": 5.0}
    assert host_share(before, before) is None  # no tick passed
    assert host_share(None, after) is None and cpu_times("intr 1 2\n") is None
    old_kernel = cpu_times("cpu  1 2 3 4\n")  # no iowait, irq, softirq or steal fields
    assert old_kernel is not None and old_kernel["steal"] == 0


def test_host_share_of_this_machine_while_it_works():
    import time

    before = cpu_times()
    if before is None:
        pytest.skip("no /proc/stat here")
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline:  # busy: this thread holds a CPU
        pass
    share = host_share(before, cpu_times())
    assert share is not None
    assert 0.0 <= share["steal_pct"] <= share["busy_pct"] <= 100.0
    assert share["busy_pct"] >= 100.0 / (os.cpu_count() or 1) / 2  # at least half a CPU


def test_an_arm_the_hypervisor_took_cpu_from_is_named_on_stderr(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger=bench_cpu.__name__):
        bench_cpu.warn_steal({"busy_pct": 99.0, "steal_pct": 1.0}, "quiet")
        bench_cpu.warn_steal(None, "unread")
        bench_cpu.warn_steal({"busy_pct": 99.0, "steal_pct": 7.5}, "fp32 c=16 round 2 spur")
    assert len(caplog.records) == 1
    assert "7.5% of the CPUs during the fp32 c=16 round 2 spur arm" in caplog.messages[0]


def test_client_lag_sees_a_loop_kept_from_running() -> None:
    """A loop blocked for 0.2 s (as when its thread waits for a CPU) wakes its
    watcher that much late; the summary reads it, and nothing when no sample."""
    import asyncio
    import time

    async def arm() -> bench_cpu.ClientLag:
        async with bench_cpu.ClientLag(interval_s=0.005) as lag:
            await asyncio.sleep(0.03)
            time.sleep(0.2)  # the loop's thread is busy: no timer can fire
            await asyncio.sleep(0.03)
        return lag

    summary = asyncio.run(arm()).summary()
    assert summary["loop_lag_ms_max"] is not None and summary["loop_lag_ms_max"] >= 150.0
    assert summary["loop_lag_ms_p99"] is not None
    assert summary["loop_lag_ms_p99"] <= summary["loop_lag_ms_max"]
    if os.path.exists("/proc/self/schedstat"):  # Linux: the run-queue wait is read
        assert summary["cpu_wait_s"] is not None and summary["cpu_wait_s"] >= 0.0
    empty = bench_cpu.ClientLag().summary()
    assert empty == {"loop_lag_ms_p99": None, "loop_lag_ms_max": None, "cpu_wait_s": None}


def test_favour_client_lowers_the_server_session_not_the_bench() -> None:
    """A process the bench started in its own session gets autogroup nice 10; the
    bench's own autogroup keeps its nice."""
    import subprocess

    mine = Path("/proc/self/autogroup")
    if not mine.exists():
        pytest.skip("this kernel has no session autogroups")
    before = mine.read_text()
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        nice = bench_cpu.favour_client(proc.pid)
        theirs = Path(f"/proc/{proc.pid}/autogroup").read_text()
        if bench_cpu.autogroups_enabled():
            assert nice == bench_cpu.SERVER_AUTOGROUP_NICE
            assert theirs.split()[-2:] == ["nice", str(bench_cpu.SERVER_AUTOGROUP_NICE)]
        else:
            assert nice is None  # nothing to gain: left as it was
        assert mine.read_text() == before
    finally:
        proc.kill()
        proc.wait()
    assert bench_cpu.favour_client(proc.pid) is None  # gone: nothing to change


def test_an_arm_whose_client_waited_is_named_on_stderr(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger=bench_cpu.__name__):
        bench_cpu.warn_client_lag({"loop_lag_ms_max": 12.0, "cpu_wait_s": 0.01}, "quiet")
        bench_cpu.warn_client_lag(None, "unread")
        bench_cpu.warn_client_lag({"loop_lag_ms_max": 393.0, "cpu_wait_s": 1.2}, "bf16 c=16 spur")
    assert len(caplog.records) == 1
    assert "up to 393 ms late during the bf16 c=16 spur arm" in caplog.messages[0]
    assert "waited 1.20 s for a CPU" in caplog.messages[0]


def test_serve_bench_knows_a_local_server_from_a_remote_one():
    from spur.cluster.bench.serve import _is_local

    for url in ("http://127.0.0.1:8000", "http://localhost:8000/", "http://[::1]:8000"):
        assert _is_local(url), url
    for url in ("http://10.0.0.5:8000", "https://spur.example.com", "http://128.0.0.1"):
        assert not _is_local(url), url
