"""The CPU fields every bench JSON records (model name and fast-path flags)."""

from __future__ import annotations

from spur.cluster.bench.cpu import FLAGS, cpu_info

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
    epyc = cpu_info("model name\t: AMD EPYC 7B13\nflags\t\t: fpu avx avx2 fma\n")
    assert epyc["model"] == "AMD EPYC 7B13" and epyc["avx2"]
    assert not any(epyc[f] for f in FLAGS if f != "avx2")


def test_cpu_info_of_this_machine_has_every_field():
    info = cpu_info()
    assert set(info) == {"model", "cores", "target", *FLAGS, "native_flags"} and info["model"]


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
