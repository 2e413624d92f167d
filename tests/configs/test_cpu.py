"""configs/cpu.py: the CPU as spur's choices see it, and SPUR_CPU_TARGET's narrowing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spur.configs import cpu

ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC 9B45
stepping\t: 1
flags\t\t: fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe avx512f avx512dq avx512cd avx512bw \
avx512vl avx512_bf16 avx512_vnni avx512vbmi amx_tile avx_vnni
processor\t: 1
model name\t: something else
"""
EPYC_AVX2 = (
    "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n"
    "flags\t\t: avx avx2 fma f16c bmi1 bmi2 movbe\n"
)
GRAVITON = "CPU implementer\t: 0x41\nFeatures\t: fp asimd bf16 sve\n"


def test_parse_reads_the_first_processor():
    got = cpu.parse(ZEN5)
    assert (got.model, got.vendor, got.target) == ("AMD EPYC 9B45", "AuthenticAMD", "native")
    assert {"avx512_bf16", "amx_tile", "avx2"} <= got.flags and got.flags == got.native_flags
    assert (got.family, got.model_number, got.stepping) == (26, 2, 1)
    assert cpu.parse(GRAVITON).flags == {"fp", "asimd", "bf16", "sve"}
    assert cpu.parse(GRAVITON).family is None  # aarch64: no x86 numbers
    assert cpu.parse("") == cpu.Cpu("", "", frozenset(), "native", frozenset())


# A VM that calls both "AMD EPYC" with the same AVX-512 BF16 flags: Zen 4 (family 25,
# model 17: Genoa) and Zen 5 (family 26) are told apart by their numbers alone.
@pytest.mark.parametrize(
    ("vendor", "family", "model", "uarch"),
    [
        ("AuthenticAMD", 25, 17, "zen4"),
        ("AuthenticAMD", 25, 1, "zen3"),
        ("AuthenticAMD", 25, 0xA0, "zen4"),
        ("AuthenticAMD", 26, 2, "zen5"),
        ("AuthenticAMD", 23, 49, "zen2"),
        ("GenuineIntel", 6, 0x8F, "sapphirerapids"),
        ("GenuineIntel", 6, 0x55, "skylake-sp"),
        ("GenuineIntel", 25, 17, None),  # an AMD family number on an Intel part
        ("AuthenticAMD", 99, 1, None),  # not listed: None, the numbers stay on record
    ],
)
def test_uarch_from_vendor_family_and_model(vendor, family, model, uarch):
    text = (
        f"vendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        "model name\t: AMD EPYC\nflags\t\t: avx avx2 fma f16c bmi1 bmi2 movbe avx512f avx512_bf16\n"
    )
    got = cpu.parse(text)
    assert (got.family, got.model_number) == (family, model)
    assert cpu.uarch(got) == uarch
    assert cpu.uarch(cpu.narrow(got, "x86-64-v3")) == uarch  # a level keeps the CPU's numbers


def test_v3_drops_every_avx512_and_amx_flag():
    got = cpu.narrow(cpu.parse(ZEN5), "x86-64-v3")
    assert got.target == "x86-64-v3" and got.model == "AMD EPYC 9B45"
    assert {"avx2", "fma", "f16c", "bmi2"} <= got.flags
    assert not {f for f in got.flags if f.startswith(("avx512", "amx"))}
    assert "avx_vnni" not in got.flags
    assert "avx512_bf16" in got.native_flags  # what the CPU really has stays on record


def test_v4_keeps_avx512_core_only():
    got = cpu.narrow(cpu.parse(ZEN5), "x86-64-v4")
    assert {f for f in got.flags if f.startswith("avx512")} == cpu.V4_AVX512
    assert "amx_tile" not in got.flags


SKYLAKE_SP = (
    "vendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6148\n"
    "flags\t\t: avx avx2 fma f16c bmi1 bmi2 movbe avx512f avx512dq avx512cd avx512bw avx512vl\n"
)


@pytest.mark.parametrize(
    ("text", "levels"),
    [
        (ZEN5, ["x86-64-v3", "x86-64-v4"]),
        (SKYLAKE_SP, ["x86-64-v3"]),  # as v4 it is itself
        (EPYC_AVX2, []),
        (GRAVITON, []),
    ],
)
def test_older_levels_are_those_below_the_cpu(text, levels):
    assert cpu.older_levels(cpu.parse(text)) == levels


def test_older_levels_on_the_command_line():
    """What `make test` loops over: this machine's older levels, one line."""
    out = subprocess.run(
        [sys.executable, "-m", "spur.configs.cpu", "--older-levels"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    with open("/proc/cpuinfo") as f:
        assert out == cpu.older_levels(cpu.parse(f.read()))


def test_native_is_the_cpu_itself():
    zen5 = cpu.parse(ZEN5)
    assert cpu.narrow(zen5, "native") is zen5


@pytest.mark.parametrize(
    ("text", "target", "says"),
    [
        (ZEN5, "x86-64-v5", "unknown: use one of native, x86-64-v3, x86-64-v4"),
        (EPYC_AVX2, "x86-64-v4", "lacks avx512bw, avx512cd, avx512dq, avx512f, avx512vl"),
        (GRAVITON, "x86-64-v3", "lacks avx, avx2"),
    ],
)
def test_a_target_the_cpu_cannot_run_is_refused_with_the_fix(text, target, says):
    with pytest.raises(ValueError, match="SPUR_CPU_TARGET") as err:
        cpu.narrow(cpu.parse(text), target)
    assert says in str(err.value)
    assert "unset" in str(err.value)


def test_build_flags_per_target():
    assert cpu.march_flags("native") == ["-march=native"]
    assert cpu.march_flags("x86-64-v3") == ["-march=x86-64-v3", "-mtune=native"]
    assert cpu.torch_isa_env("native") == {}
    assert cpu.torch_isa_env("x86-64-v3")["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_here_follows_the_environment(monkeypatch):
    monkeypatch.setenv("SPUR_CPU_TARGET", "native")
    cpu.here.cache_clear()
    try:
        assert cpu.here().target == "native" and cpu.here().flags == cpu.here().native_flags
    finally:
        monkeypatch.undo()
        cpu.here.cache_clear()


def test_torch_loaded_before_the_caps_is_an_error(monkeypatch):
    """In this process torch is loaded: a target whose caps are not in the environment
    cannot take effect any more, and says which variables to set."""
    import torch  # noqa: F401  (loaded, whichever tests ran before)

    if "avx2" not in cpu.here().native_flags:
        pytest.skip("x86-64-v3 needs an AVX2 CPU")
    monkeypatch.setenv("SPUR_CPU_TARGET", "x86-64-v3")
    for var in cpu.torch_isa_env("x86-64-v3"):
        monkeypatch.delenv(var, raising=False)
    cpu.here.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="ATEN_CPU_CAPABILITY=avx2"):
            cpu.export_torch_isa()
    finally:
        monkeypatch.undo()
        cpu.here.cache_clear()


@pytest.mark.slow
def test_v3_caps_torch_and_builds_the_avx2_ops():
    """A fresh process under x86-64-v3: torch dispatches AVX2 kernels, the native ops are
    built for AVX2 (decode lanes 8 and 1; float32 panels 16 wide; no AVX-512 BF16 op), the
    worker's choices see no AVX-512, and a bf16 model computes in float32."""
    if "avx2" not in cpu.here().native_flags:
        pytest.skip("x86-64-v3 needs an AVX2 CPU")
    code = """
from spur.configs import cpu
cpu.export_torch_isa()
import torch
from spur.kernels import native
from spur.actors.worker.compute_dtype import cpu_flags, pick_compute_dtype
lib = native.build()
print(torch.backends.cpu.get_cpu_capability())
print(native.decode_lanes(lib), lib.linear_f32_panel_width(), bool(lib.small_linear_supported()))
print(sorted(f for f in cpu_flags() if f.startswith("avx512")))
print(pick_compute_dtype("bfloat16", "auto", "cpu", cpu_flags()))
"""
    env = {**os.environ, "SPUR_CPU_TARGET": "x86-64-v3"}
    for var in cpu.torch_isa_env("x86-64-v3"):
        env.pop(var, None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:4] == ["AVX2", "[8, 1] 16 False", "[]", "float32"]
