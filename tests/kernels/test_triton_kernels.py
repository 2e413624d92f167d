"""Triton kernels: against the torch reference in the interpreter, compiled for Hopper,
and (with a GPU) against the reference on CUDA.

How TRITON_INTERPRET is handled: Triton reads the variable when `@triton.jit`
decorates a kernel, i.e. when spur.kernels is first imported, and this pytest
process may already have imported it (the reference tests, the model tests). So
no check here runs Triton in-process on CPU. The module fixture starts two
subprocesses of tests/kernels/triton_checks.py, in parallel, one with
TRITON_INTERPRET=1 (the interpreter comparisons) and one with the variable
removed (the sm_90 compile); each writes ok / traceback per check to JSON, and
the tests below report those records one by one. The outcome does not depend on
what the parent imported or on the parent's own environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton_checks
from kernel_cases import FP8, MIXED, make_case

SCRIPT = Path(__file__).with_name("triton_checks.py")
TIMEOUT_S = 300


def _start(mode: str, out: Path) -> subprocess.Popen:
    env = dict(os.environ)
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("SPUR_ATTENTION_BACKEND", None)  # the checks pick backends explicitly
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), mode, str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """{mode: {check: {"ok", "detail", ...}}}, or {mode: {"__crash__": log}}."""
    tmp = tmp_path_factory.mktemp("triton_checks")
    procs = {mode: _start(mode, tmp / f"{mode}.json") for mode in ("interpret", "compile")}
    found = {}
    for mode, proc in procs.items():
        try:
            log, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            log = f"timed out after {TIMEOUT_S} s\n" + (proc.communicate()[0] or "")
        path = tmp / f"{mode}.json"
        found[mode] = json.loads(path.read_text()) if path.exists() else {"__crash__": log}
    return found


def _record(results: dict, mode: str, name: str) -> dict:
    runs = results[mode]
    assert "__crash__" not in runs, f"triton_checks.py {mode} crashed:\n{runs['__crash__']}"
    assert name in runs, f"{name} missing from the {mode} results"
    return runs[name]


@pytest.mark.parametrize("name", list(triton_checks.CHECKS))
def test_interpreted_kernel_matches_reference(results, name):
    record = _record(results, "interpret", name)
    assert record["ok"], record["detail"]


@pytest.mark.parametrize("module", ["store_kv", "paged_attention"])
def test_kernels_compile_for_hopper(results, module):
    runs = results["compile"]
    assert "__crash__" not in runs, f"triton_checks.py compile crashed:\n{runs['__crash__']}"
    mine = {label: r for label, r in runs.items() if r["module"] == module}
    assert mine, f"no compile specs from spur.kernels.{module}"
    failed = {label: r["detail"] for label, r in mine.items() if not r["ok"]}
    assert not failed, "\n".join(f"--- {label}\n{detail}" for label, detail in failed.items())


def test_triton_backend_on_cpu_names_the_fix(monkeypatch):
    from spur.kernels import paged_attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_case(MIXED)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        paged_attention(case.query, case.kv_cache, case.metadata, scale=1.0, backend="triton")


# --------------------------------------------------------------------------- real GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "atol"),
    [
        (torch.bfloat16, torch.bfloat16, 2e-2),
        (torch.float16, torch.float16, 3e-3),
        (torch.float32, torch.float32, 1e-5),
        (torch.bfloat16, FP8, 2e-2),
    ],
)
@pytest.mark.parametrize("sliding_window", [None, 100])
def test_gpu_attention_matches_reference(dtype, cache_dtype, atol, sliding_window):
    from spur.kernels.paged_attention import paged_attention_triton
    from spur.kernels.reference import paged_attention_ref

    reqs = [(0, 300), (700, 1), (37, 90), (0, 1), (1500, 1), (260, 17), (5, 0)]
    decodes = [(n, 1) for n in (1, 64, 65, 999, 2048, 3)]
    for batch in (reqs, decodes):
        shape = dict(num_kv_heads=4, group=4, head_dim=128, block_size=16, pad_tokens=5)
        case = make_case(batch, dtype=dtype, cache_dtype=cache_dtype, seed=len(batch), **shape)
        case = case.to("cuda")
        kwargs = dict(
            scale=case.scale,
            k_scale=case.k_scale,
            v_scale=case.v_scale,
            sliding_window=sliding_window,
        )
        expected = paged_attention_ref(case.query, case.kv_cache, case.metadata, **kwargs)
        for splits in (None, 1, 5):
            got = paged_attention_triton(
                case.query, case.kv_cache, case.metadata, num_splits=splits, **kwargs
            )
            torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.uint8, FP8])
def test_gpu_store_kv_bitwise(cache_dtype):
    from spur.kernels.reference import store_kv_ref
    from spur.kernels.store_kv import store_kv_triton

    storage = torch.float8_e4m3fn if cache_dtype == FP8 else cache_dtype
    gen = torch.Generator().manual_seed(0)
    key = (torch.randn((300, 8, 128), generator=gen) * 30).cuda()
    value = (torch.randn((300, 8, 128), generator=gen) * 30).cuda()
    slots = torch.randperm(64 * 16, generator=gen)[:300].cuda()
    slots[::7] = -1
    expected = torch.zeros((2, 64, 16, 8, 128), dtype=storage, device="cuda")
    got = expected.clone()
    store_kv_ref(key, value, expected, slots, 0.05, 0.1)
    store_kv_triton(key, value, got, slots, 0.05, 0.1)
    # Hardware and torch both round to nearest even and saturate: bits must agree.
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
