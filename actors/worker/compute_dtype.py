"""Which dtype the matmuls and activations run in: `model.compute_dtype`.

`model.dtype` is the dtype the model is served in: its weights' values (rounded to
it at load) and, with `cache.kv_cache_dtype: auto`, the KV cache. The compute dtype
is what the arithmetic runs in. On a CPU without native bfloat16 arithmetic (no
AVX-512 BF16, no AMX) torch's bf16 matmuls are emulated and about twice as slow as
float32 (issue 14: an AVX2-only AMD EPYC served bf16 at half its fp32 tokens/s), so
there `auto` computes a bf16 model in float32: the weights are widened once at load
(exactly: every bf16 value is a float32 value; twice the weight memory), the KV
cache stays in bf16. Where the CPU has the units, `auto` keeps bf16.

Pure functions of the CPU's flags (tested without the CPU they describe); the
worker reads the CPU's flags once at start (configs/cpu.py) and logs the choice.
"""

from __future__ import annotations

from collections.abc import Iterable

from spur.configs import cpu

COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")

# Flags (x86 /proc/cpuinfo "flags", aarch64 "Features") that mean a dtype's matmuls
# run on native units rather than through float32 emulation.
NATIVE_FLAGS = {
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),  # bf16: aarch64 BFloat16 (BFMMLA)
    "float16": ("avx512_fp16", "amx_fp16", "asimdhp"),
}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from the given /proc/cpuinfo text, or this machine's as
    spur's choices see them (configs/cpu.py: narrowed to SPUR_CPU_TARGET); empty if
    unreadable."""
    if cpuinfo is None:
        return set(cpu.here().flags)
    return set(cpu.parse(cpuinfo).flags)


def native_dtypes(flags: Iterable[str]) -> list[str]:
    """Floating dtypes this CPU computes natively: float32 always, then those of
    NATIVE_FLAGS whose flags it has."""
    have = set(flags)
    return ["float32"] + [d for d, need in NATIVE_FLAGS.items() if have.intersection(need)]


def pick_compute_dtype(
    model_dtype: str, requested: str, device_type: str, flags: Iterable[str]
) -> str:
    """The dtype to compute a `model_dtype` model in.

    `requested` "auto": the model's dtype on CUDA, or on a CPU that computes it
    natively (see native_dtypes); otherwise float32. An explicit dtype must be the
    model's or float32 (computing in a narrower dtype than the weights would change
    what model.dtype means). Raises ValueError naming the fix otherwise.
    """
    if requested not in COMPUTE_DTYPES:
        raise ValueError(
            f"compute_dtype {requested!r} is unknown: use one of {', '.join(COMPUTE_DTYPES)}"
        )
    if requested != "auto":
        if requested not in (model_dtype, "float32"):
            raise ValueError(
                f"compute_dtype {requested} with model.dtype {model_dtype}: the compute dtype "
                f"is the model's or float32; set model.dtype: {requested} to serve a "
                f"{requested} model"
            )
        return requested
    if device_type != "cpu" or model_dtype == "float32":
        return model_dtype
    return model_dtype if model_dtype in native_dtypes(flags) else "float32"
