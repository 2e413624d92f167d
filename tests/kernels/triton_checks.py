"""Triton kernel checks, run as a separate process by test_triton_kernels.py.

    python tests/kernels/triton_checks.py interpret OUT.json   # TRITON_INTERPRET=1
    python tests/kernels/triton_checks.py compile OUT.json     # sm_90 compile, no GPU

Why a separate process: Triton reads TRITON_INTERPRET when `@triton.jit`
decorates a kernel, i.e. when the kernel module is first imported, and both
modes are needed (interpreted kernels for CPU comparisons, real JITFunctions for
the Hopper compile). A subprocess per mode gets a clean interpreter whatever the
parent pytest process (or any other test module) imported or set before. Each
mode runs every check, records ok / traceback per check in OUT.json, and the
pytest side turns each record into one test result.

This module must not import triton (or spur.kernels' Triton modules) at import
time: the parent imports it for the list of check names.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


# --------------------------------------------------------------------------- store_kv


def _store_both(key, value, cache, slots, k_scale=1.0, v_scale=1.0):
    from spur.kernels.reference import store_kv_ref
    from spur.kernels.store_kv import store_kv_triton

    expected = cache.clone()
    store_kv_ref(key, value, expected, slots, k_scale, v_scale)
    store_kv_triton(key, value, cache, slots, k_scale, v_scale)
    # Bitwise equality: a copy (or an exactly representable quantization) must not change bits.
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8)), (
        f"store_kv mismatch, max diff {(cache.float() - expected.float()).abs().max()}"
    )


def _slots() -> torch.Tensor:
    # Out of order, with padding, touching the first and last slot of a 5x3 cache.
    return torch.tensor([4, -1, 0, 14, 7, -1, 9], dtype=torch.int64)


@check
def store_kv_fp32_fp16_strided_key():
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16):
        # key/value as strided views of a fused [tokens, 3 * heads, dim] projection.
        qkv = torch.randn((7, 9, 12), generator=gen).to(dtype)
        key, value = qkv[:, 3:6], qkv[:, 6:9]
        cache = torch.zeros((2, 5, 3, 3, 12), dtype=dtype)
        _store_both(key, value, cache, _slots())


@check
def store_kv_bf16_cache():
    # The interpreter converts fp32 -> bf16 by truncation, not round-to-nearest-even
    # as the GPU does, so feed values that are exact in bf16.
    gen = torch.Generator().manual_seed(2)
    key = torch.randn((7, 2, 8), generator=gen).bfloat16().float()
    value = torch.randn((7, 2, 8), generator=gen).bfloat16().float()
    cache = torch.zeros((2, 5, 3, 2, 8), dtype=torch.bfloat16)
    _store_both(key, value, cache, _slots())


@check
def store_kv_fp8_scalar_and_tensor_scales():
    # The interpreter's fp32 -> e4m3 rounding is wrong on ties and when rounding
    # carries into the exponent (124 -> 64), so feed values that are exact in e4m3
    # after dividing by power-of-two scales; rounding itself is covered on a GPU.
    # Values beyond 448 * scale check saturation (the kernel clamps, so it is exact).
    from spur.kernels import fp8

    gen = torch.Generator().manual_seed(3)
    k_scale, v_scale = 0.0625, 0.125
    key = fp8.dequantize(fp8.quantize(torch.randn((7, 2, 16), generator=gen) * 4, 1.0), 1.0)
    value = fp8.dequantize(fp8.quantize(torch.randn((7, 2, 16), generator=gen) * 4, 1.0), 1.0)
    key, value = key * k_scale, value * v_scale
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 0.0])
    for scales in ((k_scale, v_scale), (torch.tensor(k_scale), torch.tensor([v_scale]))):
        cache = torch.zeros((2, 5, 3, 2, 16), dtype=torch.uint8)
        _store_both(key, value, cache, _slots(), *scales)


# --------------------------------------------------------------------------- attention


def _compare(case, *, sliding_window=None, num_splits=None, atol=1e-5, out=None, scales=None):
    from spur.kernels.paged_attention import paged_attention_triton
    from spur.kernels.reference import paged_attention_ref

    k_scale, v_scale = scales or (case.k_scale, case.v_scale)
    kwargs = dict(scale=case.scale, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window)
    expected = paged_attention_ref(case.query, case.kv_cache, case.metadata, **kwargs)
    got = paged_attention_triton(
        case.query, case.kv_cache, case.metadata, out=out, num_splits=num_splits, **kwargs
    )
    assert got.dtype == case.query.dtype and got.shape == case.query.shape
    assert not got.isnan().any(), "NaN in output"
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)
    return got


@check
def unified_mixed_fp32_gqa_sliding():
    from kernel_cases import MIXED, make_case

    # GQA group 3 (not a power of two), head_dim 12 and block_size 3 (neither a power of two).
    case = make_case(MIXED, num_kv_heads=2, group=3, head_dim=12, block_size=3, pad_tokens=2)
    for window in (None, 1, 4):
        _compare(case, sliding_window=window)


@check
def unified_mixed_fp16():
    from kernel_cases import MIXED, make_case

    case = make_case(MIXED, dtype=torch.float16, cache_dtype=torch.float16, seed=4)
    _compare(case, atol=2e-3)
    _compare(case, sliding_window=5, atol=2e-3)


@check
def unified_fp8_cache_tensor_scales():
    from kernel_cases import FP8, MIXED, make_case

    for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        case = make_case(MIXED, dtype=dtype, cache_dtype=FP8, seed=5, block_size=4)
        _compare(case, atol=atol)
        scales = (torch.tensor(case.k_scale), torch.tensor([case.v_scale]))
        _compare(case, sliding_window=3, atol=atol, scales=scales)


@check
def unified_long_chunks_multiple_tiles():
    from kernel_cases import make_case

    # max_query_len * group >= 64 selects 64-row blocks; contexts span several KV tiles.
    # A request with no query token this step must be skipped.
    reqs = [(0, 30), (40, 25), (10, 1), (3, 0), (0, 2)]
    case = make_case(reqs, num_kv_heads=1, group=3, head_dim=16, block_size=16, seed=6)
    _compare(case)
    _compare(case, sliding_window=20)


@check
def unified_strided_query_and_out_buffer():
    from kernel_cases import MIXED, make_case

    case = make_case(MIXED, num_kv_heads=2, group=2, head_dim=8, seed=7, pad_tokens=3)
    # query as a strided view of a fused qkv tensor; out as a strided view too.
    fused = torch.randn((case.query.shape[0], 8, 8))
    fused[:, :4] = case.query
    case.query = fused[:, :4]
    out_store = torch.full((case.query.shape[0], 6, 8), 5.0)
    out = out_store[:, 1:5]
    got = _compare(case, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not out[case.metadata.num_actual_tokens :].any(), "padding rows must be zero"
    assert (out_store[:, 0] == 5.0).all() and (out_store[:, 5] == 5.0).all()


@check
def decode_no_split_and_splits():
    from kernel_cases import DECODES, make_case

    case = make_case(DECODES, num_kv_heads=2, group=4, head_dim=16, block_size=4, pad_tokens=1)
    _compare(case)
    _compare(case, num_splits=2)
    _compare(case, sliding_window=2)


@check
def decode_long_context_splits_fp16():
    from kernel_cases import make_case

    # Contexts of several 64-token tiles so each split gets real work; one split
    # count leaves empty splits (more splits than tiles for the short request).
    reqs = [(150, 1), (70, 1), (5, 1), (9, 0)]
    for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        case = make_case(reqs, dtype=dtype, cache_dtype=dtype, block_size=16, seed=8)
        for splits in (1, 2, 3):
            _compare(case, num_splits=splits, atol=atol)
        _compare(case, num_splits=3, sliding_window=70, atol=atol)


@check
def decode_fp8_cache():
    from kernel_cases import FP8, make_case

    case = make_case([(100, 1), (3, 1)], cache_dtype=FP8, block_size=16, group=1, seed=9)
    _compare(case)
    _compare(case, num_splits=2, sliding_window=33)


@check
def dispatch_through_package():
    from kernel_cases import MIXED, make_case

    from spur.kernels import paged_attention, select_backend, store_kv
    from spur.kernels.reference import paged_attention_ref

    assert select_backend("triton", "cpu") == "triton"
    case = make_case(MIXED, seed=10)
    got = paged_attention(
        case.query, case.kv_cache, case.metadata, scale=case.scale, backend="triton"
    )
    expected = paged_attention_ref(case.query, case.kv_cache, case.metadata, scale=case.scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    cache = torch.zeros((2, 2, 2, 1, 4))
    store_kv(torch.ones(1, 1, 4), torch.ones(1, 1, 4), cache, torch.tensor([3]), backend="triton")
    assert cache[:, 1, 1].eq(1).all() and cache.sum() == 8


@check
def launcher_errors_name_the_problem():
    from kernel_cases import DECODES, make_case

    from spur.kernels.paged_attention import paged_attention_triton
    from spur.kernels.store_kv import store_kv_triton

    case = make_case(DECODES)
    q, cache, meta = case.query, case.kv_cache, case.metadata
    one = torch.tensor(1.0)
    bad = [
        (lambda: paged_attention_triton(q.double(), cache, meta, scale=1.0), "query dtype"),
        (lambda: store_kv_triton(q[:, :2], q[:, :2], cache, meta.slot_mapping.int()), "int64"),
        (lambda: paged_attention_triton(q, cache, meta, scale=1.0, k_scale=one), "both"),
        (lambda: paged_attention_triton(q, cache, meta, scale=1.0, num_splits=0), "num_splits"),
    ]
    for fn, words in bad:
        try:
            fn()
        except ValueError as e:
            assert words in str(e), f"{words!r} not in {e}"
        else:
            raise AssertionError(f"no ValueError mentioning {words!r}")


# --------------------------------------------------------------------------- compile


def compile_all() -> dict[str, dict]:
    """Compile every kernel variant for sm_90; a failure is recorded with its traceback."""
    import triton
    from triton.backends.compiler import GPUTarget

    # importlib, not `from spur.kernels import ...`: those names are the public functions.
    modules = [
        importlib.import_module(f"spur.kernels.{m}") for m in ("store_kv", "paged_attention")
    ]
    paged_attention_mod = modules[1]
    results = {}
    target = GPUTarget("cuda", 90, 32)
    for module in modules:
        for label, kernel, signature, constexprs in module.compile_specs():
            start = time.perf_counter()
            try:
                src = triton.compiler.ASTSource(kernel, signature, constexprs)
                compiled = triton.compile(src, target=target)
                assert compiled.asm.get("cubin"), "no cubin produced"
                # Compiling is not launching: a block over Hopper's shared memory fails then.
                limit = paged_attention_mod.MAX_SHARED_BYTES
                assert compiled.metadata.shared <= limit, (
                    f"needs {compiled.metadata.shared} bytes of shared memory, sm_90 has {limit}"
                )
                # fp8 stores must round x / scale as torch does (div.full is up to 2 ulp
                # off: quotients halfway between two e4m3 values would flip; they are
                # checked bit for bit). Attention's own divisions are within tolerance.
                if "fp8" in label and module.__name__.endswith("store_kv"):
                    assert "div.full.f32" not in compiled.asm["ptx"], "approximate division"
                results[label] = {"ok": True, "detail": ""}
            except Exception:
                results[label] = {"ok": False, "detail": traceback.format_exc()}
            results[label]["module"] = module.__name__.rsplit(".", 1)[-1]
            results[label]["seconds"] = round(time.perf_counter() - start, 2)
    return results


def run_checks(names: list[str]) -> dict[str, dict]:
    torch.set_num_threads(1)
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            CHECKS[name]()
            results[name] = {"ok": True, "detail": ""}
        except Exception:
            results[name] = {"ok": False, "detail": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
    return results


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("interpret", "compile"):
        sys.stderr.write("usage: triton_checks.py interpret|compile OUT.json [CHECK ...]\n")
        return 2
    mode, out_path, names = argv[0], argv[1], argv[2:] or list(CHECKS)
    if "triton" in sys.modules:
        sys.stderr.write("triton was imported before the mode could be set\n")
        return 2
    if mode == "interpret":
        os.environ["TRITON_INTERPRET"] = "1"
        results = run_checks(names)
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        results = compile_all()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
