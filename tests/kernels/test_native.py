"""The native CPU decode kernel (kernels/cpu_decode_attention.c): built here, equal to
the dense oracle and to the SDPA path it replaces, and a clean fallback."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DECODES, FP8, MANY_DECODES, MIXED, dense_attention, make_case

from spur.kernels import native, paged_attention_ref


def test_native_kernel_builds_on_this_machine():
    """CI machines have gcc: a broken build must fail here, not fall back silently."""
    lib = native.build()
    assert all(getattr(lib, name) is not None for name in native.SYMBOLS.values())


@pytest.mark.parametrize("reqs", [MIXED, DECODES, MANY_DECODES], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("path", ["native", "sdpa"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decodes_match_dense_on_both_paths(reqs, sliding_window, path, dtype, atol, monkeypatch):
    """The cache is NaN everywhere but the requests' contexts: reading one stale cell
    shows up as NaN."""
    monkeypatch.setenv("SPUR_NATIVE_KERNELS", "1" if path == "native" else "0")
    case = make_case(reqs, dtype=dtype, cache_dtype=dtype, pad_tokens=2, seed=len(reqs))
    uses_native = native.decode_kernel(case.query, case.kv_cache) is not None
    assert uses_native == (path == "native")
    out = paged_attention_ref(
        case.query, case.kv_cache, case.metadata, scale=case.scale, sliding_window=sliding_window
    )
    n = case.metadata.num_actual_tokens
    expected = dense_attention(case, sliding_window)
    assert out.dtype == dtype
    torch.testing.assert_close(out[:n].double(), expected, atol=atol, rtol=atol)
    assert not out[n:].any(), "padding rows must be zero"


@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 3, 16), (128, 1, 8), (8, 4, 4)])
def test_every_compiled_head_dim(head_dim, group, block_size):
    """head_dim 64 and 128 run specialized copies of the loop, others the generic one."""
    case = make_case(
        MANY_DECODES, num_kv_heads=3, group=group, head_dim=head_dim, block_size=block_size
    )
    assert native.decode_kernel(case.query, case.kv_cache) is not None
    out = paged_attention_ref(case.query, case.kv_cache, case.metadata, scale=case.scale)
    n = case.metadata.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), dense_attention(case), atol=1e-5, rtol=1e-5)


def test_bf16_query_on_fp32_cache_writes_its_own_dtype():
    case = make_case(MANY_DECODES, dtype=torch.bfloat16, cache_dtype=torch.float32, seed=2)
    assert native.decode_kernel(case.query, case.kv_cache) is not None
    out = paged_attention_ref(case.query, case.kv_cache, case.metadata, scale=case.scale)
    assert out.dtype == torch.bfloat16
    n = case.metadata.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), dense_attention(case), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
def test_other_cache_dtypes_stay_on_sdpa(cache_dtype):
    case = make_case(DECODES, dtype=torch.float32, cache_dtype=cache_dtype)
    assert native.decode_kernel(case.query, case.kv_cache) is None


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path))  # no cached library to reuse
    with pytest.raises(RuntimeError, match="cannot run the C compiler"):
        native.build(cc=str(tmp_path / "no-such-cc"))


def test_failed_compile_shows_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        native.build(cc="false")
    assert not list(tmp_path.rglob("*.so")), "a failed build leaves no library behind"


def test_out_of_range_block_ids_are_refused_before_the_kernel_reads():
    """C has no bounds checks: a table that points past the cache is a clear error."""
    case = make_case(DECODES)
    num_blocks = case.kv_cache.shape[1]
    case.metadata.block_tables[0, 0] = num_blocks  # one past the end
    with pytest.raises(ValueError, match="outside"):
        paged_attention_ref(case.query, case.kv_cache, case.metadata, scale=case.scale)
