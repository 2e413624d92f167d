"""The torch reference (the CPU serving path) against a naive dense oracle."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DECODES, FP8, MANY_DECODES, MIXED, dense_attention, make_case

from spur.actors.worker.compute_dtype import cpu_flags
from spur.kernels import (
    build_attention_metadata,
    native,
    paged_attention,
    paged_attention_ref,
    reference,
    select_backend,
    store_kv,
    store_kv_ref,
)
from spur.kernels import fp8 as fp8mod

# (query dtype, cache dtype, atol against the dense oracle on what the cache holds)
DTYPES = [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, 2e-2),
    (torch.float16, torch.float16, 2e-3),
    (torch.float32, FP8, 1e-5),
    (torch.bfloat16, FP8, 2e-2),
]


@pytest.mark.parametrize(("dtype", "cache_dtype", "atol"), DTYPES)
@pytest.mark.parametrize("reqs", [MIXED, DECODES, MANY_DECODES, [(0, 9)], [(11, 5)]], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_reference_matches_dense(reqs, dtype, cache_dtype, atol, sliding_window):
    case = make_case(reqs, dtype=dtype, cache_dtype=cache_dtype, pad_tokens=2, seed=len(reqs))
    out = paged_attention_ref(
        case.query,
        case.kv_cache,
        case.metadata,
        scale=case.scale,
        k_scale=case.k_scale,
        v_scale=case.v_scale,
        sliding_window=sliding_window,
    )
    n = case.metadata.num_actual_tokens
    assert out.dtype == dtype and out.shape == case.query.shape
    expected = dense_attention(case, sliding_window)
    torch.testing.assert_close(out[:n].double(), expected, atol=atol, rtol=atol)
    assert not out[n:].any(), "padding rows must be zero"


# Prefill chunks (fresh, and after a computed prefix) next to decodes, at the head
# sizes of the kernels' SIMD paths, block sizes 16 and 8; 40 tokens make tiles of 16,
# 16 and 8, 17 an odd count of keys in the last tile.
PREFILLS = [(0, 40), (9, 1), (21, 30), (0, 1), (33, 17)]


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# group: query heads a KV head; the tiles take them 4, 3, 2 or 1 at once (G 8: two
# blocks of 4; G 5: five of 1)
@pytest.mark.parametrize(
    ("head_dim", "group", "block_size"),
    [(64, 3, 16), (128, 4, 8), (64, 1, 16), (128, 2, 16), (64, 8, 16), (64, 5, 8)],
)
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_prefill_chunks_in_the_native_kernels(
    dtype, atol, head_dim, group, block_size, sliding_window
):
    """Prefill chunks take prefill_attention's tiles (bf16 on AVX-512 BF16 builds), else
    the decode kernel with one plan entry per query token (contexts up to
    NATIVE_PREFILL_MAX_CONTEXT), else SDPA; every path matches the dense oracle."""
    case = make_case(
        PREFILLS,
        dtype=dtype,
        cache_dtype=dtype,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        pad_tokens=3,
        seed=head_dim,
    )
    n = case.metadata.num_actual_tokens
    expected = dense_attention(case, sliding_window)
    lib = native.decode_kernel(case.query, case.kv_cache)
    assert lib is not None
    tiles = native.prefill_tiles(lib, case.query, case.kv_cache)
    assert tiles == (dtype == torch.bfloat16 and native._built(lib, "prefill_tiles"))
    paths = {"per-token": reference.NATIVE_PREFILL_MAX_CONTEXT, "sdpa": 0}
    outs = {}
    for path in ["tiles", *paths] if tiles else paths:
        case.metadata.memo.clear()
        with pytest.MonkeyPatch.context() as mp:
            if path != "tiles":
                mp.setattr(native, "prefill_tiles", lambda *args: False)
                mp.setattr(reference, "NATIVE_PREFILL_MAX_CONTEXT", paths[path])
            outs[path] = paged_attention_ref(
                case.query,
                case.kv_cache,
                case.metadata,
                scale=case.scale,
                sliding_window=sliding_window,
            )
        torch.testing.assert_close(outs[path][:n].double(), expected, atol=atol, rtol=atol)
        assert not outs[path][n:].any(), "padding rows must be zero"
    # The paths round differently: equal outputs would mean one path ran twice.
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not torch.equal(outs[a], outs[b]), (a, b)


def test_prefill_tiles_serve_bf16_on_cpus_with_avx512_bf16():
    """Where the CPU has AVX-512 BF16 the build has the tiles and bf16 prefill takes
    them (elsewhere the test above checks the other paths, and this one says so)."""
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("no AVX-512 BF16 on this CPU: bf16 prefill runs in the decode kernel")
    case = make_case(PREFILLS, dtype=torch.bfloat16, cache_dtype=torch.bfloat16, head_dim=64)
    lib = native.decode_kernel(case.query, case.kv_cache)
    assert lib is not None and native.prefill_tiles(lib, case.query, case.kv_cache)


def test_plan_prefills_refuses_a_chunk_longer_than_its_context():
    with pytest.raises(ValueError, match="1 to context tokens"):
        native.plan_prefills(
            torch.zeros(1, 4, dtype=torch.int32),
            [(0, 0, 40, 11)],
            None,
            num_blocks=4,
            block_size=16,
        )


@pytest.mark.parametrize("group", [1, 3])
def test_gqa_group_sizes(group):
    case = make_case(MIXED, num_kv_heads=3, group=group, head_dim=8, block_size=8)
    out = paged_attention_ref(case.query, case.kv_cache, case.metadata, scale=case.scale)
    torch.testing.assert_close(out.double(), dense_attention(case), atol=1e-5, rtol=1e-5)


def test_fp8_close_to_unquantized():
    """fp8 error stays within e4m3's ~2**-4 relative step, end to end."""
    exact = make_case(MIXED, seed=3)
    quant = make_case(MIXED, cache_dtype=FP8, seed=3)
    out = paged_attention_ref(
        quant.query,
        quant.kv_cache,
        quant.metadata,
        scale=quant.scale,
        k_scale=quant.k_scale,
        v_scale=quant.v_scale,
    )
    torch.testing.assert_close(out.double(), dense_attention(exact), atol=0.08, rtol=0.1)


def test_out_buffer_and_tensor_scales():
    case = make_case(MIXED, cache_dtype=FP8)
    out = torch.full_like(case.query, 7.0)
    res = paged_attention(
        case.query,
        case.kv_cache,
        case.metadata,
        scale=case.scale,
        k_scale=torch.tensor(case.k_scale),
        v_scale=torch.tensor([case.v_scale]),
        out=out,
        backend="torch",
    )
    assert res is out
    torch.testing.assert_close(out.double(), dense_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8])
def test_store_kv_skips_padding_slots(cache_dtype):
    num_blocks, block_size, heads, dim = 4, 4, 2, 8
    storage = torch.uint8 if cache_dtype == FP8 else cache_dtype
    cache = torch.zeros((2, num_blocks, block_size, heads, dim), dtype=storage)
    gen = torch.Generator().manual_seed(0)
    key, value = (
        torch.randn(5, heads, dim, generator=gen),
        torch.randn(5, heads, dim, generator=gen),
    )
    slots = torch.tensor([13, -1, 2, 7, -1], dtype=torch.int64)
    k_scale, v_scale = (0.02, 0.04) if cache_dtype == FP8 else (1.0, 1.0)
    store_kv(key, value, cache, slots, k_scale, v_scale, backend="torch")

    if cache_dtype == FP8:
        got = fp8mod.dequantize(cache, 1.0).flatten(1, 2)  # [2, slots, heads, dim]
        got[0] *= k_scale
        got[1] *= v_scale
        # Half an e4m3 step: 1/16 relative for normals; below 2^-6 (times the scale)
        # the subnormals' absolute step is 2^-9, so values there round by up to 2^-10.
        atol, rtol = 2**-10 * max(k_scale, v_scale), 0.07
    else:
        got = cache.float().flatten(1, 2)
        atol, rtol = (0.0, 0.0) if cache_dtype == torch.float32 else (0.0, 8e-3)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(got[0, slot], key[row], atol=atol, rtol=rtol)
            torch.testing.assert_close(got[1, slot], value[row], atol=atol, rtol=rtol)
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert not got[:, untouched].any()


def test_store_kv_fp8_saturates():
    cache = torch.zeros((2, 1, 2, 1, 4), dtype=torch.uint8)
    key = torch.tensor([[[1e6, -1e6, 0.5, 3.0]]])
    store_kv_ref(key, key, cache, torch.tensor([1]), 1.0, 1.0)
    got = fp8mod.dequantize(cache[0, 0, 1, 0], 1.0)
    assert got.tolist() == [448.0, -448.0, 0.5, 3.0]


def test_build_metadata_slots_and_padding():
    meta = build_attention_metadata(
        [5, 0], [2, 3], [[4, 9], [1]], block_size=4, num_padded_tokens=7
    )
    # request 0: positions 5, 6 -> block 9 (second), offsets 1, 2; request 1: 0..2 -> block 1.
    assert meta.slot_mapping.tolist() == [37, 38, 4, 5, 6, -1, -1]
    assert meta.query_start_loc.tolist() == [0, 2, 5]
    assert meta.seq_lens.tolist() == [7, 3]
    assert meta.block_tables.tolist() == [[4, 9], [1, 0]]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (3, 7, 5)
    meta.check(block_size=4)
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([5], [4], [[1, 2]], block_size=4)


def test_argument_errors_name_the_problem():
    case = make_case(DECODES)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_ref(case.query[:, :3], case.kv_cache, case.metadata, scale=1.0)
    with pytest.raises(ValueError, match="kv_cache must be"):
        paged_attention_ref(case.query, case.kv_cache[0], case.metadata, scale=1.0)
    with pytest.raises(ValueError, match="out must match"):
        paged_attention_ref(
            case.query, case.kv_cache, case.metadata, scale=1.0, out=case.query.half()
        )
    with pytest.raises(ValueError, match="slot_mapping must be a 1-D int64"):
        store_kv_ref(
            case.query[:, :2], case.query[:, :2], case.kv_cache, torch.zeros(4, dtype=torch.int32)
        )


def test_select_backend(monkeypatch):
    monkeypatch.delenv("SPUR_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend("auto", "cpu") == "torch"
    assert select_backend("auto", torch.device("cuda", 0)) == "triton"
    assert select_backend("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", "cpu")
    with pytest.raises(ValueError, match="use one of"):
        select_backend("flash", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton", "cpu") == "triton"
    monkeypatch.setenv("SPUR_ATTENTION_BACKEND", "torch")
    assert select_backend("triton", "cuda") == "torch"
