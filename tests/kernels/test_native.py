"""The native CPU ops (kernels/cpu_ops.cpp, a torch C++ extension): built here, each
equal to its torch reference (decode attention: to the dense oracle and to the SDPA
path it replaces), and a clean fallback."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DECODES, FP8, MANY_DECODES, MIXED, dense_attention, make_case

from spur.actors.worker.compute_dtype import cpu_flags
from spur.kernels import native, paged_attention_ref


@pytest.fixture
def native_switch(monkeypatch):
    """`set(on)`: SPUR_NATIVE_KERNELS for this test. spur reads it once per process
    (`native.enabled`), so each change is read again, and so is the restored value."""

    def set_(on: bool) -> None:
        monkeypatch.setenv("SPUR_NATIVE_KERNELS", "1" if on else "0")
        native.reread_switch()

    yield set_
    native.reread_switch()  # monkeypatch restores the variable after this teardown


def test_native_kernel_builds_on_this_machine():
    """CI machines have g++ and ninja: a broken build must fail here, not fall back
    silently."""
    lib = native.build()
    for name in ("decode_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        assert getattr(lib, name) is not None
    assert lib.rope_store_kv is not None


def test_the_ops_run_on_torchs_thread_team():
    """Built without OpenMP, at::parallel_for runs on the calling thread alone (ATen's
    OpenMP backend is a pragma in its headers): every op would use one core."""
    lib = native.build()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert lib.parallel_team(64) == 2
        torch.set_num_threads(1)
        assert lib.parallel_team(64) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("reqs", [MIXED, DECODES, MANY_DECODES], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("path", ["native", "sdpa"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decodes_match_dense_on_both_paths(reqs, sliding_window, path, dtype, atol, native_switch):
    """The cache is NaN everywhere but the requests' contexts: reading one stale cell
    shows up as NaN."""
    native_switch(path == "native")
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


def _geometry_case(head_dim: int, group: int, block_size: int, dtype: torch.dtype):
    """MANY_DECODES over 3 KV heads of the given geometry, cache in the query's dtype."""
    return make_case(
        MANY_DECODES,
        num_kv_heads=3,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        cache_dtype=dtype,
    )


@pytest.mark.parametrize(
    ("head_dim", "group", "block_size"),
    [
        (64, 3, 16),
        (64, 3, 32),
        (64, 4, 16),
        (64, 2, 16),
        (128, 4, 8),
        (128, 8, 16),
        (128, 1, 8),
        (8, 4, 4),
    ],
)
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_every_compiled_head_dim(head_dim, group, block_size, dtype, atol, sliding_window):
    """head_dim 64 and 128 run the widest SIMD path the CPU has (AVX-512 or AVX2:
    block_size 32 is split into runs of 16 or 8 rows; bf16 rows widened into its
    scratch; a sliding window starts mid-block), else specialized copies of the loop
    for 3 / 4 (64) and 4 / 8 (128) query heads per KV head; other head sizes the
    generic loop."""
    case = _geometry_case(head_dim, group, block_size, dtype)
    assert native.decode_kernel(case.query, case.kv_cache) is not None
    out = paged_attention_ref(
        case.query, case.kv_cache, case.metadata, scale=case.scale, sliding_window=sliding_window
    )
    n = case.metadata.num_actual_tokens
    expected = dense_attention(case, sliding_window)
    torch.testing.assert_close(out[:n].double(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 3, 16), (128, 8, 32)])
def test_bf16_decode_over_a_wide_range_of_scores(head_dim, group, block_size):
    """The bf16 path's softmax is one pass: its sums are kept relative to the largest
    score seen so far and rescaled whenever a later run of rows brings a larger one.
    With the scale 8x (scores spread over about +-25 instead of +-3), most runs rescale
    and most probabilities underflow next to the largest; the output still matches the
    dense oracle (and the float32-cache path, which computes the softmax in two passes)."""
    case = _geometry_case(head_dim, group, block_size, torch.bfloat16)
    case = dataclasses.replace(case, scale=case.scale * 8)
    assert native.decode_kernel(case.query, case.kv_cache) is not None
    out = paged_attention_ref(case.query, case.kv_cache, case.metadata, scale=case.scale)
    n = case.metadata.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), dense_attention(case), atol=2e-2, rtol=2e-2)
    two_pass = paged_attention_ref(
        case.query.float(), case.kv_cache.float(), case.metadata, scale=case.scale
    )
    torch.testing.assert_close(out[:n].float(), two_pass[:n], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("head_dim", "group", "block_size"), [(64, 3, 16), (64, 3, 32), (128, 4, 8), (128, 8, 16)]
)
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_every_decode_path_of_the_build(head_dim, group, block_size, dtype, atol, sliding_window):
    """Each of the build's decode paths (decode_lanes: 16 = AVX-512, 8 = AVX2 + FMA,
    1 = the plain loop) matches the dense oracle, so the narrower CPUs' paths are
    tested wherever the suite runs (blocks of 8 to 32 rows: whole and split runs)."""
    lib = native.build()
    lanes = native.decode_lanes(lib)
    assert lanes[-1] == 1 and lanes == sorted(lanes, reverse=True)
    flags = cpu_flags()
    assert (8 in lanes) == {"avx2", "fma"}.issubset(flags)
    assert (16 in lanes) == ("avx512f" in flags)
    case = _geometry_case(head_dim, group, block_size, dtype)
    m = case.metadata
    starts, seq_lens = m.query_start_loc_cpu.tolist(), m.seq_lens_cpu.tolist()
    decodes = [r for r in range(m.num_reqs) if starts[r + 1] - starts[r] == 1]
    window = sliding_window or max(seq_lens)
    firsts = [max(0, seq_lens[r] - window) for r in decodes]
    plan = native.plan_decodes(
        m.block_tables,
        decodes,
        [starts[r] for r in decodes],
        firsts,
        [seq_lens[r] for r in decodes],
        num_blocks=case.kv_cache.shape[1],
        block_size=block_size,
    )
    rows = plan.rows.long()
    expected = dense_attention(case, sliding_window)[rows]
    k_cache, v_cache = case.kv_cache.unbind(0)
    for n in lanes:
        out = torch.zeros_like(case.query)
        native.decode_attention(lib, case.query, out, k_cache, v_cache, plan, case.scale, n)
        torch.testing.assert_close(out[rows].double(), expected, atol=atol, rtol=atol)
    with pytest.raises(RuntimeError, match="decode_lanes"):
        native.decode_attention(lib, case.query, out, k_cache, v_cache, plan, case.scale, 4)


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


def test_every_part_of_the_source_is_built_and_keyed():
    """cpu_ops.cpp includes each ops family under kernels/cpu/ once, and the build's key
    hashes them all: a change to any part is a new build, never a stale library. The
    parts ship with the package (pyproject's package data)."""
    import re
    import tomllib
    from pathlib import Path

    included = re.findall(r'^#include "cpu/([^"]+)"$', native.SOURCE.read_text(), re.M)
    parts = sorted(p.name for p in native.PARTS.glob("*.h"))
    assert parts and sorted(included) == parts and len(set(included)) == len(included)
    text = native.source_bytes()
    for p in native.PARTS.glob("*.h"):
        assert p.read_bytes() in text, f"{p.name} is not in the build's key"
    pyproject = Path(native.__file__).resolve().parents[1] / "pyproject.toml"
    if pyproject.exists():  # a checkout, not an installed wheel
        data = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
        assert "spur.kernels.cpu" in data["packages"]
        assert data["package-data"]["spur.kernels.cpu"] == ["*.h"]


def test_a_build_killed_midway_does_not_hang_the_next():
    """A builder killed while compiling leaves torch's `lock` file in the build folder, and
    torch's loader waits for that file to go, forever, even for an up-to-date library.
    The next build (another process: this one has its library loaded) removes it under
    its own flock, says so, and loads within the deadline."""
    import subprocess
    import sys

    folder = native.build_folder()
    if folder is None:
        pytest.skip("no C++ compiler")
    native.build()  # the library is built: the other process only loads it
    stale = folder / "lock"
    stale.touch()
    try:
        run = subprocess.run(
            [sys.executable, "-c", "from spur.kernels import native; native.build(); print('ok')"],
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        left = stale.exists()
        stale.unlink(missing_ok=True)  # never leave the suite's own build wedged
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    assert not left
    assert "left by a build that did not finish" in run.stderr


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path))  # no cached library to reuse
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        native.build(cxx=str(tmp_path / "no-such-c++"))


def test_failed_compile_shows_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path))
    monkeypatch.delitem(native._state, "loaded", raising=False)  # as in a fresh process
    with pytest.raises(RuntimeError, match="failed"):
        native.build(cxx="false")
    assert not list(tmp_path.rglob("*.so")), "a failed build leaves no library behind"


def test_a_second_build_in_one_process_is_refused_and_the_first_still_serves():
    """Loading a second library that registers spur_cpu would abort the process (a
    static initializer throws), and so would building the loaded one again after a
    failed build of its name (torch's versioner writes and loads a `_v1` file): the
    loaded build is returned as it is, another is a clear error."""
    lib = native.build()
    with pytest.raises(RuntimeError, match="restart the process"):
        native.build(cxx="false")  # another compiler: another build
    assert native.build() is lib
    x = torch.randn(3, 8)
    torch.testing.assert_close(lib.silu_and_mul(x), F.silu(x[:, :4]) * x[:, 4:])


def test_switch_off_means_no_ops(native_switch):
    native_switch(False)
    assert native.ops() is None
    assert native.usable(torch.zeros(2)) is None


def test_the_switch_is_read_once_until_reread(native_switch, monkeypatch):
    """Every native op asks the switch: it is read from the environment once per
    process, and again after `reread_switch` (in-process A/Bs)."""
    native_switch(True)
    assert native.enabled()
    monkeypatch.setenv("SPUR_NATIVE_KERNELS", "off")
    assert native.enabled()
    native.reread_switch()
    assert not native.enabled() and native.ops() is None


def test_out_of_range_block_ids_are_refused_before_the_kernel_reads():
    """C has no bounds checks: a table that points past the cache is a clear error."""
    case = make_case(DECODES)
    num_blocks = case.kv_cache.shape[1]
    case.metadata.block_tables[0, 0] = num_blocks  # one past the end
    with pytest.raises(ValueError, match="outside"):
        paged_attention_ref(case.query, case.kv_cache, case.metadata, scale=case.scale)


def test_out_of_range_block_ids_in_a_prefill_chunk_are_refused():
    case = make_case(
        [(0, 20), (5, 1)],
        dtype=torch.bfloat16,
        cache_dtype=torch.bfloat16,
        head_dim=64,
        block_size=16,
    )
    case.metadata.block_tables[0, 1] = case.kv_cache.shape[1]
    with pytest.raises(ValueError, match="outside"):
        paged_attention_ref(case.query, case.kv_cache, case.metadata, scale=case.scale)


def test_prefill_attention_refuses_what_it_does_not_serve():
    lib = native.ops()
    assert lib is not None
    if not lib.prefill_tiles_supported():
        with pytest.raises(RuntimeError, match="built without AVX-512 BF16"):
            lib.prefill_attention(*_prefill_args(torch.bfloat16, 64))
        return
    with pytest.raises(RuntimeError, match="bf16 q, out and caches"):
        lib.prefill_attention(*_prefill_args(torch.float32, 64))
    with pytest.raises(RuntimeError, match="head_dim 64 or 128, got 32"):
        lib.prefill_attention(*_prefill_args(torch.bfloat16, 32))
    q, out, k, v, tables, chunks, scale = _prefill_args(torch.bfloat16, 64)
    with pytest.raises(RuntimeError, match=r"chunks \[C, 4\]"):
        lib.prefill_attention(q, out, k, v, tables, chunks[:, :3].contiguous(), scale)
    longer = torch.tensor([[0, 20, 11, 0]], dtype=torch.int32)  # more tokens than context
    with pytest.raises(RuntimeError, match="1 to context tokens within q's rows"):
        lib.prefill_attention(q, out, k, v, tables, longer, scale)
    # a context past what its table row covers (the tiles read table[pos / block_size])
    beyond = torch.tensor([[0, 20, tables.shape[1] * 16 + 1, 0]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="within q's rows and its table's"):
        lib.prefill_attention(q, out, k, v, tables, beyond, scale)


def test_decode_attention_refuses_metadata_outside_its_tensors():
    """The kernel takes rows, windows and tables as offsets: metadata that does not fit
    (a query_start_loc past the query, a window past the table) is an error, not a
    write past the end of `out` (AddressSanitizer showed both)."""
    lib = native.ops()
    assert lib is not None
    bs, kv_heads, head_dim, group, num_blocks = 16, 1, 64, 3, 4
    k, v = torch.randn(2, num_blocks, bs, kv_heads, head_dim).unbind(0)
    q = torch.randn(1, kv_heads * group, head_dim)
    out = torch.zeros_like(q)
    tables = torch.tensor([[1, 2]], dtype=torch.int32)

    def run(row: int, first: int, length: int) -> None:
        plan = native.plan_decodes(
            tables, [0], [row], [first], [length], num_blocks=num_blocks, block_size=bs
        )
        native.decode_attention(lib, q, out, k, v, plan, head_dim**-0.5)

    run(0, 0, 20)  # fits
    for row, first, length in ((40, 0, 20), (-1, 0, 20), (0, 21, 20)):
        with pytest.raises(RuntimeError, match=r"decode_attention: request 0 \(row"):
            run(row, first, length)
    plan = native.plan_decodes(tables, [0], [0], [0], [20], num_blocks=num_blocks, block_size=bs)
    wide = dataclasses.replace(plan, lens=torch.tensor([33], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="its table's 32 positions"):
        native.decode_attention(lib, q, out, k, v, wide, head_dim**-0.5)


def _prefill_args(dtype: torch.dtype, head_dim: int) -> tuple:
    case = make_case([(0, 20)], dtype=dtype, cache_dtype=dtype, head_dim=head_dim, block_size=16)
    plan = native.plan_prefills(
        case.metadata.block_tables,
        [(0, 0, 20, 20)],
        None,
        num_blocks=case.kv_cache.shape[1],
        block_size=16,
    )
    k, v = case.kv_cache.unbind(0)
    return case.query, torch.empty_like(case.query), k, v, plan.tables, plan.chunks, case.scale


# --------------------------------------------------------------------------- fused ops
# Each against the torch path it replaces (the layer with SPUR_NATIVE_KERNELS=0).
# float32: equal up to summation order; bfloat16: the same rounding points, so at
# most one bf16 step apart where a float32 sum lands on the other side of a tie.

TOLS = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _both_paths(native_switch, fn):
    native_switch(False)
    expected = fn()
    native_switch(True)
    return fn(), expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_residual(dtype, rows, native_switch):
    from spur.actors.worker.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(96, generator=gen)).to(dtype)
    x = (3 * torch.randn(rows, 96, generator=gen)).to(dtype)
    res = torch.randn(rows, 96, generator=gen).to(dtype)
    x0, res0 = x.clone(), res.clone()
    (got, got_res), (exp, exp_res) = _both_paths(native_switch, lambda: norm(x, res))
    assert native.usable(x) is not None
    tol = TOLS[dtype]
    torch.testing.assert_close(got, exp, atol=tol, rtol=tol)
    assert torch.equal(got_res, exp_res), "the residual sum rounds once, as torch's add"
    got1, exp1 = _both_paths(native_switch, lambda: norm(x))
    torch.testing.assert_close(got1, exp1, atol=tol, rtol=tol)
    assert torch.equal(x, x0) and torch.equal(res, res0), "inputs are not mutated"


def test_zero_centered_norm_keeps_its_own_formula(native_switch):
    from spur.actors.worker.layers.norm import ZeroCenteredRMSNorm

    norm = ZeroCenteredRMSNorm(32, eps=1e-6)
    norm.weight.data = torch.full((32,), 0.5)
    x = torch.randn(4, 32)
    got, expected = _both_paths(native_switch, lambda: norm(x))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [80, 86])  # 86: bf16's 16-wide steps end in a scalar tail
def test_silu_and_mul(dtype, width, native_switch):
    from spur.actors.worker.layers.activation import GatedActivation

    act = GatedActivation("silu")
    x = (4 * torch.randn(37, 2 * width, generator=torch.Generator().manual_seed(1))).to(dtype)
    x[0, :width] = torch.linspace(-120, 120, width)  # exp's clamped range and its overflow
    got, expected = _both_paths(native_switch, lambda: act(x))
    assert got.shape == (37, width)
    tol = TOLS[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_bf16_silu_rounds_like_torch():
    """The 16-wide bf16 path (a vector exp, then g * (1 / (1 + e^-g)), torch's sigmoid
    form) against torch's F.silu(gate) * up over a million products across exp's whole
    range: an exp that is not torch's own (Sleef's) moves a float result across a bf16
    rounding boundary now and then, so the two may differ in about 1 value in 1000 and
    then by a rounding step or two; where float's e^-g overflows both give 0, and where
    torch's result is below 1e-30 (gates near -88.5) so is ours: each exp (Sleef's,
    libmvec's AVX2 or AVX-512 one, ours) ends its range a little differently. Every gate
    bf16 can hold from -130 to 130 (2053 values, up 1) gives torch's silu but two,
    besides gates near -88 whose silu is below 1e-30: there the scalar loop of builds
    without AVX-512 BF16 (libmvec's exp) gives -0."""
    lib = native.ops()
    if lib is None:
        pytest.skip("native ops not built here")
    x = (8 * torch.randn(1024, 2 * 1024, generator=torch.Generator().manual_seed(5))).to(
        torch.bfloat16
    )
    x[0, :1024] = torch.linspace(-120, 120, 1024)
    got, ref = lib.silu_and_mul(x), F.silu(x[:, :1024]) * x[:, 1024:]
    assert not got.isnan().any()
    diff = got != ref
    assert diff.float().mean().item() < 2e-3, diff.sum().item()
    g, r = got[diff].float(), ref[diff].float()
    tiny = r.abs() < 1e-30  # gates near -88.5, where torch's sigmoid is a denormal
    assert (g[tiny].abs() < 1e-30).all()
    assert ((g - r).abs()[~tiny] <= r.abs()[~tiny] * 2**-6).all()
    gates = torch.arange(-130, 130, 2**-7).to(torch.bfloat16).unique()
    grid = torch.cat([gates[None], torch.ones_like(gates)[None]], 1)
    got, ref = lib.silu_and_mul(grid)[0], F.silu(gates)
    tiny = ref.abs() < 1e-30
    wrong = got != ref
    assert wrong[~tiny].sum().item() <= 2
    assert (got[wrong & tiny].abs() < 1e-30).all()


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rope_fused_with_the_kv_store(dtype, cache_dtype, rotary_fraction, native_switch):
    """The attention layer's fused path against RoPE + store_kv in torch: same q,
    same cache bytes written (padding slots -1 write nothing), same output."""
    from spur.actors.worker.layers.attention import CausalSelfAttention
    from spur.actors.worker.layers.rotary import RotaryEmbedding
    from spur.kernels import build_attention_metadata

    gen = torch.Generator().manual_seed(7)
    head_dim, heads, kv_heads, hidden = 32, 4, 2, 64
    rotary = RotaryEmbedding(
        head_dim, int(head_dim * rotary_fraction), 256, {"rope_type": "default", "rope_theta": 1e4}
    )
    layer = CausalSelfAttention(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rotary=rotary,
        backend="torch",
    ).to(dtype)
    for p in layer.parameters():
        p.data = (0.2 * torch.randn(p.shape, generator=gen)).to(dtype)
    # Two requests: a 5-token prefill chunk after 3 cached tokens, and one decode at 40.
    meta = build_attention_metadata(
        [3, 39], [5, 1], [[4, 1], [0, 2, 3, 5, 6]], 8, num_padded_tokens=7
    )
    positions = torch.tensor([3, 4, 5, 6, 7, 39, 0])
    x = torch.randn(7, hidden, generator=gen).to(dtype)
    cache0 = torch.randn(2, 8, 8, kv_heads, head_dim, generator=gen).to(cache_dtype)

    def run():
        cache = cache0.clone()
        fused = layer._fused_rope_store(layer.qkv_proj(x), positions, cache, meta) is not None
        return layer(positions, x, cache, meta), cache, fused

    (out, cache, fused), (exp_out, exp_cache, ref_fused) = _both_paths(native_switch, run)
    assert fused and not ref_fused
    tol = TOLS[dtype if cache_dtype == dtype else torch.bfloat16]
    torch.testing.assert_close(cache, exp_cache, atol=tol, rtol=tol)
    untouched = torch.ones(8 * 8, dtype=torch.bool)
    untouched[meta.slot_mapping[meta.slot_mapping >= 0]] = False
    flat, flat0 = cache.view(2, 64, -1), cache0.view(2, 64, -1)
    assert torch.equal(flat[:, untouched], flat0[:, untouched]), "only the step's slots change"
    torch.testing.assert_close(out[:6], exp_out[:6], atol=5 * tol, rtol=5 * tol)


def test_rope_store_refuses_a_slot_past_the_cache():
    lib = native.ops()
    qkv = torch.randn(2, (2 + 2) * 8)
    cache = torch.zeros(2, 2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        lib.rope_store_kv(
            qkv, torch.tensor([0, 1]), torch.zeros(16, 8), cache, torch.tensor([0, 8]), 2, 1, 8, 8
        )


def _small_linear_lib():
    lib = native.ops()
    if lib is None or not lib.small_linear_supported():
        pytest.skip("this CPU or build has no AVX-512 BF16")
    return lib


# 1-4: one chunk of rows; more: chunks of 6 (16, 33 and the op's bound 64 end shorter)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 16, 33, native.SMALL_LINEAR_OP_ROWS])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 32), (17, 64), (100, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear_is_a_bf16_linear(rows, out_features, in_features, with_bias):
    """Against float64 math rounded once to bf16 (what oneDNN's bf16 matmul computes up
    to its float32 summation order): within one bf16 step of it, and of F.linear. The
    op is called directly, so every row count it takes is tested whatever bound this
    CPU's dispatch uses."""
    lib = _small_linear_lib()
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    got = lib.small_linear(x, w, b)
    assert got is not None and got.dtype == torch.bfloat16
    assert got.shape == (rows, out_features)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    step = exact.abs().clamp_min(0.05) * 2**-7  # one bf16 step (8 significant bits)
    assert ((got.double() - exact).abs() <= step).all()
    torch_out = torch.nn.functional.linear(x, w, b).double()
    assert ((got.double() - torch_out).abs() <= 2 * step).all()


def test_small_linear_keeps_leading_dims_and_leaves_other_cases_to_torch():
    _small_linear_lib()
    w = torch.randn(8, 64).to(torch.bfloat16)
    x = torch.randn(1, 2, 64).to(torch.bfloat16)
    got = native.small_linear(x, w)
    assert got is not None and got.shape == (1, 2, 8)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=0.05, rtol=0.02)
    most = torch.randn(native.bf16_linear_rows(), 64).to(torch.bfloat16)
    assert native.small_linear(most, w) is not None
    many = torch.randn(native.bf16_linear_rows() + 1, 64).to(torch.bfloat16)
    assert native.small_linear(many, w) is None  # a batch: oneDNN's brgemm / AMX tiles
    assert native.small_linear(x[..., :48], w[:, :48]) is None  # K not a multiple of 32
    assert native.small_linear(x, w.T.contiguous().T) is None  # weight not row-major


def test_small_linear_refuses_more_rows_than_the_op_takes():
    lib = _small_linear_lib()
    x = torch.randn(native.SMALL_LINEAR_OP_ROWS + 1, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"1 to {native.SMALL_LINEAR_OP_ROWS} rows"):
        lib.small_linear(x, torch.randn(8, 64).to(torch.bfloat16), None)


def test_bf16_linear_rows_depend_on_amx():
    """oneDNN's AMX tiles take bf16 batches past 4 rows; without AMX the op serves 16."""
    assert native.bf16_linear_rows(["avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]) == 4
    assert native.bf16_linear_rows(["avx512f", "avx512_bf16"]) == 16
    assert native.bf16_linear_rows() in (4, 16)


def test_small_linear_is_off_with_the_native_ops(native_switch):
    native_switch(False)
    x, w = torch.randn(1, 64).to(torch.bfloat16), torch.randn(8, 64).to(torch.bfloat16)
    assert native.small_linear(x, w) is None


def _linear_f32_lib(monkeypatch):
    """The build's ops, with small_linear sending float32 to linear_f32 whatever the CPU's
    vendor (the choice itself: test_linear_f32_serves_every_vendor_but_intel)."""
    lib = native.build()
    if not lib.linear_f32_supported():
        pytest.skip("linear_f32 needs AVX2 + FMA or AVX-512; this CPU has neither")
    monkeypatch.setitem(native._state, "linear_f32_here", True)
    return lib


def test_linear_f32_serves_every_vendor_but_intel(monkeypatch):
    amd = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: avx2 avx512f\n"
    assert native.cpu_vendor(amd) == "AuthenticAMD" and native.linear_f32_serves("AuthenticAMD")
    assert native.cpu_vendor("vendor_id : GenuineIntel") == "GenuineIntel"
    assert not native.linear_f32_serves("GenuineIntel")  # MKL's tuned sgemm keeps it
    assert native.cpu_vendor("flags : neon") == "" and native.linear_f32_serves("")
    lib = native.build()
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    monkeypatch.setitem(native._state, "linear_f32_here", False)
    assert native.small_linear(x, w) is None  # an Intel CPU: torch's F.linear
    monkeypatch.setitem(native._state, "linear_f32_here", True)
    assert (native.small_linear(x, w) is not None) == bool(lib.linear_f32_supported())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 16, 33, 64, 65, 100, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 8), (17, 64), (100, 576), (7, 1544)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_f32_is_a_float32_linear(rows, out_features, in_features, with_bias, monkeypatch):
    """Against float64 math and F.linear, within float32 summation error. Up to 64 rows
    (native.LINEAR_F32_UNIT_ROWS): row chunks of 4, units of 3 (AVX2) or 4 (AVX-512)
    weight rows with a partial last one, K of one to 193 vectors; on AVX-512, K = 8 and
    1544 end with a masked half vector. Past it (65, 100, 300): the packed GEMM's
    tiles of up to 6 or 12 rows split evenly (65 rows: 11 x 5 + 10 on AVX-512), panels
    of 16 or 32 columns with a partial one (17, 100) or only part of one (1, 7)."""
    _linear_f32_lib(monkeypatch)
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    got = native.small_linear(x, w, b)
    assert got is not None and got.dtype == torch.float32
    assert got.shape == (rows, out_features)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)


def _panels_lib(monkeypatch):
    """_linear_f32_lib, with this build's panels packed whatever PACKED_PANEL_WIDTHS
    says (32 columns on AVX-512 builds, 16 on AVX2: both packed at load)."""
    lib = _linear_f32_lib(monkeypatch)
    monkeypatch.setattr(native, "PACKED_PANEL_WIDTHS", (lib.linear_f32_panel_width(),))
    return lib


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12, 13, 16, 24, 25, 33, 64, 65, 300])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(1, 8), (17, 64), (100, 576), (33, 1544), (96, 64)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_f32_panels_is_a_float32_linear(
    rows, out_features, in_features, with_bias, monkeypatch
):
    """The weight packed once (pack_linear_f32) against float64 math and F.linear, within
    float32 summation error: tiles of every size from 1 row to kPackMR (12 and 13 rows:
    one tile and two of 7 and 6; 25: three), panels of 16 or 32 columns with a partial
    last one (17, 100, 33), only part of one (1) or whole ones only (96: packed
    without a padded copy), K of one to 193 vectors."""
    lib = _panels_lib(monkeypatch)
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    panels = native.pack_linear_f32(w)
    pw = lib.linear_f32_panel_width()
    assert panels is not None and pw in (16, 32)
    assert panels.shape == (-(-out_features // pw), in_features, pw)
    assert torch.equal(native.unpack_linear_f32(panels, out_features), w)
    got = native.linear_f32_panels(x, panels, b, out_features)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_linear_f32_panels_shapes_and_refusals(monkeypatch):
    lib = _panels_lib(monkeypatch)
    w = torch.randn(40, 64)
    panels = native.pack_linear_f32(w)
    x = torch.randn(2, 3, 64)
    got = native.linear_f32_panels(x, panels, None, 40)  # leading dims kept
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-5)
    assert native.linear_f32_panels(torch.randn(0, 64), panels, None, 40).shape == (0, 40)
    with pytest.raises(RuntimeError):  # rows of K = 0 against K = 64: an error, not garbage
        native.linear_f32_panels(torch.randn(3, 0), panels, None, 40)
    strided = torch.randn(64, 5).T  # x with a non-unit inner stride: copied first
    torch.testing.assert_close(
        native.linear_f32_panels(strided, panels, None, 40),
        torch.nn.functional.linear(strided, w),
        atol=1e-4,
        rtol=1e-5,
    )
    with native.torch_linears():  # benches: torch's F.linear on the unpacked weight
        assert torch.equal(
            native.linear_f32_panels(x, panels, None, 40), torch.nn.functional.linear(x, w)
        )
    assert native.pack_linear_f32(w[:, :60].contiguous()) is None  # K not a multiple of 8
    assert native.pack_linear_f32(w.to(torch.bfloat16)) is None  # float32 only
    monkeypatch.setattr(native, "PACKED_PANEL_WIDTHS", ())
    assert native.pack_linear_f32(w) is None  # a build whose panels would not pay
    monkeypatch.setattr(native, "PACKED_PANEL_WIDTHS", (lib.linear_f32_panel_width(),))
    monkeypatch.setitem(native._state, "linear_f32_here", False)
    assert native.pack_linear_f32(w) is None  # an Intel CPU: MKL keeps the [N, K] weight
    with pytest.raises(RuntimeError, match="pack_linear_f32"):
        lib.linear_f32_panels(torch.randn(2, 64), panels, None, 80)  # n of another weight
    with pytest.raises(RuntimeError, match="bias"):
        lib.linear_f32_panels(torch.randn(2, 64), panels, torch.randn(39), 40)


def _bf16_panels_lib(monkeypatch):
    """The build's ops with bf16 weights packed whatever the CPU (AMX ones keep [N, K]
    weights: test_bf16_panels_are_not_packed_with_amx)."""
    lib = _small_linear_lib()
    monkeypatch.setitem(native._state, "bf16_panels_here", True)
    return lib


def _bf16_exact(x, w, b):
    return x.double() @ w.double().T + (b.double() if b is not None else 0.0)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 12, 13, 16, 24, 25, 33, 64, 65, 300])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(1, 2), (17, 64), (100, 576), (33, 1538), (96, 64)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_bf16_panels_is_a_bf16_linear(
    rows, out_features, in_features, with_bias, monkeypatch
):
    """The weight packed once (pack_linear_bf16) against float64 math rounded once to
    bf16: within one bf16 step of it, and of F.linear (oneDNN's float32 sums). Tiles of
    every size from 1 row to 12 (1-4 rows: K split in 4, 3 or 2 parts with their own
    sums; 13 rows: two tiles of 7 and 6, the last prefetching the next panel; 25:
    three), panels with a partial last one (17, 100, 33) or only part of one (1), K of
    one pair to 769; 96 rows fill their panels (packed without a padded copy)."""
    _bf16_panels_lib(monkeypatch)
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    panels = native.pack_linear(w)
    assert panels is not None and panels.dtype == torch.bfloat16
    assert panels.shape == (-(-out_features // 32), in_features // 2, 32, 2)
    assert torch.equal(native.unpack_linear(panels, out_features), w)
    got = native.linear_panels(x, panels, b, out_features)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    exact = _bf16_exact(x, w, b)
    step = exact.abs().clamp_min(0.05) * 2**-7  # one bf16 step (8 significant bits)
    assert ((got.double() - exact).abs() <= step).all()
    torch_out = torch.nn.functional.linear(x, w, b).double()
    assert ((got.double() - torch_out).abs() <= 2 * step).all()
    # the LM head's form: the same bf16-rounded values, written as float32
    wide = native.linear_panels_float(x, panels, b, out_features)
    assert wide.dtype == torch.float32 and torch.equal(wide, got.float())


def test_linear_bf16_panels_shapes_and_refusals(monkeypatch):
    lib = _bf16_panels_lib(monkeypatch)
    w = torch.randn(40, 64).to(torch.bfloat16)
    panels = native.pack_linear(w)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    got = native.linear_panels(x, panels, None, 40)  # leading dims kept
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=0.05, rtol=0.02)
    assert native.linear_panels(x[:0], panels, None, 40).shape == (0, 3, 40)
    assert torch.equal(native.linear_panels_float(x, panels, None, 40), got.float())
    empty = native.linear_panels_float(x[:0], panels, None, 40)
    assert empty.shape == (0, 3, 40) and empty.dtype == torch.float32
    strided = torch.randn(64, 5).to(torch.bfloat16).T  # non-unit inner stride: copied first
    torch.testing.assert_close(
        native.linear_panels(strided, panels, None, 40),
        torch.nn.functional.linear(strided, w),
        atol=0.05,
        rtol=0.02,
    )
    with native.torch_linears():  # benches: torch's F.linear on the unpacked weight
        assert torch.equal(
            native.linear_panels(x, panels, None, 40), torch.nn.functional.linear(x, w)
        )
        assert torch.equal(
            native.linear_panels_float(x, panels, None, 40),
            torch.nn.functional.linear(x, w).float(),
        )
    ids = torch.tensor([0, 39, 31, 32, 5])  # a tied embedding's rows, across panels
    assert torch.equal(native.linear_panel_rows(panels, ids), w[ids])
    assert native.pack_linear(w[:, :63].contiguous()) is None  # K odd
    assert native.pack_linear(w.to(torch.float16)) is None  # bf16 / float32 only
    monkeypatch.setitem(native._state, "bf16_panels_here", False)
    assert native.pack_linear(w) is None  # an AMX CPU or a build without AVX-512 BF16
    with pytest.raises(RuntimeError, match="pack_linear_bf16"):
        lib.linear_bf16_panels(x[0], panels, None, 80)  # n of another weight
    with pytest.raises(RuntimeError, match="bias"):
        lib.linear_bf16_panels(x[0], panels, torch.randn(39).to(torch.bfloat16), 40)
    with pytest.raises(RuntimeError, match="even K"):
        lib.linear_bf16_panels(torch.randn(2, 63).to(torch.bfloat16), panels, None, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_rows_are_the_weights_rows(monkeypatch, dtype):
    """A tied embedding's lookup on the packed LM head weight: the rows bit for bit, in
    both layouts, for ids in any panel and lane, in the ids' shape; ids past the
    panels raise and name the range."""
    packed = _panels_lib if dtype == torch.float32 else _bf16_panels_lib
    lib = packed(monkeypatch)
    w = torch.randn(1000, 576).to(dtype)  # 1000 rows: a partial last panel
    panels = native.pack_linear(w)
    assert panels is not None
    ids = torch.cat([torch.tensor([0, 31, 32, 999]), torch.randint(0, 1000, (60,))])
    assert torch.equal(native.linear_panel_rows(panels, ids), w[ids])
    assert torch.equal(lib.panel_rows(panels, ids), w[ids])
    grid = ids[:60].view(6, 10)  # leading dims kept, as F.embedding keeps them
    assert torch.equal(native.linear_panel_rows(panels, grid), w[grid])
    assert native.linear_panel_rows(panels, ids[:0]).shape == (0, 576)
    rows = panels.shape[0] * panels.shape[2]
    for bad in (-1, rows):
        with pytest.raises(RuntimeError, match=rf"id {bad} outside \[0, {rows}\)"):
            lib.panel_rows(panels, torch.tensor([3, bad]))
    with pytest.raises(RuntimeError, match="int64"):
        lib.panel_rows(panels, ids.to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_panels_argmax_is_the_argmax_of_the_logits(monkeypatch, dtype, threads):
    """A greedy LM head without its logits: the index of each row's first maximal
    output, exactly argmax_rows of linear_panels_float's logits, at decode's row counts
    and past them, with ties across panels and lanes (the lowest index wins), a NaN
    output (the first NaN wins) and rows of -inf (0), on one thread and on two (each
    thread folds its own panels, then they merge)."""
    packed = _panels_lib if dtype == torch.float32 else _bf16_panels_lib
    lib = packed(monkeypatch)
    if not lib.panels_argmax_supported():
        assert native.panels_argmax(torch.randn(2, 8), torch.zeros(1, 8, 16), 16) is None
        pytest.skip("this build has no panels_argmax (AVX-512 builds have it)")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(7)
        w = torch.randn(1000, 64, generator=g).to(dtype)  # 1000: a partial last panel
        w[500] = w[3]  # equal logits at 3 and 500 (other panels, other lanes)
        w[17] = w[3]  # and at 17 (the same panel, another lane)
        panels = native.pack_linear(w)
        for rows in (1, 5, 13, 64, 130):
            x = torch.randn(rows, 64, generator=g).to(dtype)
            x[0] = w[3]  # row 0's largest logit is the tie 3 = 17 = 500 (its own square)
            want = lib.argmax_rows(native.linear_panels_float(x, panels, None, 1000))
            got = native.panels_argmax(x, panels, 1000)
            assert torch.equal(got, want), (rows, got, want)
            assert int(got[0]) == 3
        w_nan = w.clone()
        w_nan[[640, 900]] = float("nan")
        x = torch.randn(4, 64, generator=g).to(dtype)
        p_nan = native.pack_linear(w_nan)
        assert native.panels_argmax(x, p_nan, 1000).tolist() == [640] * 4
        w_inf = torch.zeros(1000, 64, dtype=dtype)
        w_inf[:, 0] = float("-inf")
        x = torch.zeros(3, 64, dtype=dtype)
        x[:, 0] = 1.0
        assert native.panels_argmax(x, native.pack_linear(w_inf), 1000).tolist() == [0] * 3
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="panels_argmax: x"):
        lib.panels_argmax(torch.randn(2, 32).to(dtype), panels, 1000)  # K 32, panels' 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_gate_up_silu_is_silu_and_mul_of_the_gate_up_linear(monkeypatch, dtype, threads):
    """The MLP's SiLU in the gate_up panels' epilogue (decoder_stack takes it): bit for
    bit silu_and_mul of the panels' linear, in both panel layouts, at decode's and
    prefill's row counts, with and without a bias, with gates past exp's overflow
    (-90) and large ones, on one thread and on two (each computes its own gate and up
    panels)."""
    packed = _panels_lib if dtype == torch.float32 else _bf16_panels_lib
    lib = packed(monkeypatch)
    linear = lib.linear_f32_panels if dtype == torch.float32 else lib.linear_bf16_panels
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(11)
        for d, k in ((32, 64), (96, 576), (1536, 576)):
            w = (torch.randn(2 * d, k, generator=g) * 0.2).to(dtype)
            bias = torch.randn(2 * d, generator=g).to(dtype)
            bias[:4] = torch.tensor([-90.0, -89.0, 30.0, 90.0])  # gates past the overflow
            panels = native.pack_linear(w)
            for rows in (1, 5, 13, 16, 64, 130):
                x = (torch.randn(rows, k, generator=g) * 2).to(dtype)
                for b in (None, bias):
                    want = lib.silu_and_mul(linear(x, panels, b, 2 * d))
                    got = lib.gate_up_silu(x, panels, b, 2 * d)
                    assert got.shape == (rows, d) and got.dtype == dtype
                    assert torch.equal(got.view(bits), want.view(bits)), (d, rows)
    finally:
        torch.set_num_threads(before)
    w = torch.randn(2 * 40, 64).to(dtype)  # d 40: a panel would mix gate and up columns
    with pytest.raises(RuntimeError, match="multiple of 2 x the panel width"):
        lib.gate_up_silu(torch.randn(2, 64).to(dtype), native.pack_linear(w), None, 80)


def test_bf16_panels_are_not_packed_with_amx():
    """With AMX oneDNN's tiles serve bf16 batches, so the weights stay [N, K]."""
    assert native.bf16_panels_serve(["avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]) is False
    assert native.bf16_panels_serve(["avx512f", "avx512_bf16"]) is True
    lib = native.ops()
    if lib is None or not lib.small_linear_supported():  # no AVX-512 BF16: no panels op
        assert native.bf16_panels_here() is False


def test_linear_f32_keeps_leading_dims_and_leaves_other_cases_to_torch(monkeypatch):
    lib = _linear_f32_lib(monkeypatch)
    w = torch.randn(8, 64)
    x = torch.randn(2, 3, 64)
    got = native.small_linear(x, w)
    assert got is not None and got.shape == (2, 3, 8)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-5)
    assert native.small_linear(torch.randn(0, 64), w) is None  # no rows: torch
    chunk = torch.randn(native.LINEAR_F32_UNIT_ROWS + 1, 64)  # a prefill chunk: packed GEMM
    torch.testing.assert_close(
        native.small_linear(chunk, w), torch.nn.functional.linear(chunk, w), atol=1e-4, rtol=1e-5
    )
    assert native.small_linear(x[..., :60], w[:, :60]) is None  # K not a multiple of 8
    assert native.small_linear(x, w.T.contiguous().T) is None  # weight not row-major
    assert native.small_linear(x, w.to(torch.bfloat16)) is None  # mixed dtypes
    with native.torch_linears():  # the engine bench's ceiling: transformers' path
        assert native.small_linear(x, w) is None
    assert native.small_linear(x, w) is not None
    with pytest.raises(RuntimeError, match="at least one row"):
        lib.linear_f32(torch.randn(0, 64), w, None)
