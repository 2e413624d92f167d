"""model.compute_dtype: auto picks per CPU flags (a pure function), and the setting
reaches the runner (weights widened, KV cache kept in model.dtype)."""

from __future__ import annotations

import pytest
import torch

from spur.actors.worker.compute_dtype import (
    cpu_flags,
    native_dtypes,
    pick_compute_dtype,
)

EPYC_AVX2 = "flags\t\t: fpu sse sse2 avx avx2 fma f16c"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16 avx512_fp16"
COOPER_LAKE = "flags\t\t: avx2 avx512f avx512_bf16"
GRAVITON3 = "Features\t: fp asimd bf16 asimdhp i8mm"


def test_flags_are_read_from_cpuinfo_text():
    assert {"avx2", "fma"} <= cpu_flags(EPYC_AVX2)
    assert "bf16" in cpu_flags(GRAVITON3)
    assert cpu_flags("model name : x") == set()


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        (EPYC_AVX2, ["float32"]),
        (COOPER_LAKE, ["float32", "bfloat16"]),
        (SAPPHIRE_RAPIDS, ["float32", "bfloat16", "float16"]),
        (GRAVITON3, ["float32", "bfloat16", "float16"]),
    ],
)
def test_native_dtypes_per_cpu(cpuinfo, native):
    assert native_dtypes(cpu_flags(cpuinfo)) == native


@pytest.mark.parametrize(
    ("cpuinfo", "model", "device", "expected"),
    [
        (EPYC_AVX2, "bfloat16", "cpu", "float32"),  # emulated bf16: compute in fp32
        (EPYC_AVX2, "float16", "cpu", "float32"),
        (EPYC_AVX2, "float32", "cpu", "float32"),
        (COOPER_LAKE, "bfloat16", "cpu", "bfloat16"),
        (COOPER_LAKE, "float16", "cpu", "float32"),
        (SAPPHIRE_RAPIDS, "bfloat16", "cpu", "bfloat16"),
        (EPYC_AVX2, "bfloat16", "cuda", "bfloat16"),  # a GPU computes its dtype
    ],
)
def test_auto_picks_per_cpu_flags(cpuinfo, model, device, expected):
    assert pick_compute_dtype(model, "auto", device, cpu_flags(cpuinfo)) == expected


def test_explicit_choices_and_their_errors():
    flags = cpu_flags(SAPPHIRE_RAPIDS)
    assert pick_compute_dtype("bfloat16", "float32", "cpu", flags) == "float32"
    assert pick_compute_dtype("bfloat16", "bfloat16", "cpu", cpu_flags(EPYC_AVX2)) == "bfloat16"
    with pytest.raises(ValueError, match=r"set model\.dtype: bfloat16"):
        pick_compute_dtype("float32", "bfloat16", "cpu", flags)
    with pytest.raises(ValueError, match="unknown"):
        pick_compute_dtype("float32", "fp8", "cpu", flags)


def test_schema_field_reaches_the_engine_args():
    from spur.cluster.app import engine_args
    from spur.configs.schema import EngineConfig

    assert engine_args(EngineConfig())["compute_dtype"] == "auto"
    cfg = EngineConfig.model_validate({"model": {"dtype": "bfloat16", "compute_dtype": "float32"}})
    assert engine_args(cfg)["compute_dtype"] == "float32"


def test_setting_reaches_the_runner(tiny_model_dir, caplog):
    """A bf16 model computed in float32: fp32 weights holding exactly the bf16 values,
    a bf16 KV cache, the choice reported in ModelInfo, and generation works. The start
    log names the CPU (model and micro-architecture) and the choice."""
    import logging

    from spur.actors.llm import LLM
    from spur.actors.step import SamplingParams
    from spur.configs import cpu

    path = str(tiny_model_dir("llama"))
    with caplog.at_level(logging.INFO, logger="spur.actors.worker.worker"):
        llm = LLM(path, dtype="bfloat16", compute_dtype="float32", block_size=4, num_kv_blocks=64)
    try:
        here = cpu.here()
        line = next(r.getMessage() for r in caplog.records if "computes natively" in r.getMessage())
        assert line.startswith(f"CPU {cpu.describe(here)} (")
        assert (cpu.uarch(here) or f"family {here.family}") in line
        assert line.endswith("model.dtype bfloat16, compute_dtype float32 -> float32")
        runner = llm.executor.worker.runner
        weights = [p for p in runner.model.parameters()]
        assert all(p.dtype == torch.float32 for p in weights)
        assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in weights)
        assert runner.kv_dtype == torch.bfloat16
        assert llm.info.compute_dtype == "float32"
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
