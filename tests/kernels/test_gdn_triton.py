"""GDN Triton kernels: against the torch reference in the interpreter, and compiled for Hopper.

As in test_triton_kernels.py, Triton reads TRITON_INTERPRET when a kernel is
decorated, so nothing here runs Triton in the pytest process: a module fixture
runs this very file as a script twice, in parallel,

    python tests/kernels/test_gdn_triton.py interpret OUT.json   # TRITON_INTERPRET=1
    python tests/kernels/test_gdn_triton.py compile OUT.json     # sm_90, no GPU needed

and each test reports one record of those runs. Interpreter cases are tiny
(head dims 16 to 40, chunks of 16): the interpreter runs every program in
Python. fp32 and fp16 only: the interpreter gets tl.dot wrong on bf16.

Nothing at import time may import triton (the script checks that it can set
the mode first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__)
TIMEOUT_S = 300
CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


# --------------------------------------------------------------------------- cases

# (tokens this step, has_initial_state): a 2-chunk prefill, continuations, decodes,
# an empty sequence; two sequences copy-on-write into fresh slots.
STEP = [(7, False), (1, True), (20, True), (0, True), (1, False), (3, True), (2, False)]
SRC = [0, 5, 2, 6, 8, 4, 1]
DST = [0, 3, 2, 6, 7, 4, 9]
SLOTS = 10


def _metadata(step=STEP, src=SRC, dst=DST):
    from spur.kernels.gdn_reference import build_gdn_metadata

    return build_gdn_metadata([n for n, _ in step], src, [h for _, h in step], dst)


def _gdn_case(hk, hv, dk, dv, *, pad=3, seed=0, dtype=torch.float32, fused=False):
    """q, k, v, g, beta for STEP (+ padding rows); fused: q/k/v are views of one projection."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(t for t, _ in STEP) + pad
    if fused:
        mixed = torch.randn((n, 2 * hk * dk + hv * dv + 5), generator=gen)
        q = mixed[:, : hk * dk].view(n, hk, dk)
        k = mixed[:, hk * dk : 2 * hk * dk].view(n, hk, dk)
        v = mixed[:, 2 * hk * dk : 2 * hk * dk + hv * dv].view(n, hv, dv)
        q, k, v = (t.to(dtype) for t in (q, k, v)) if dtype != torch.float32 else (q, k, v)
    else:
        q, k = (torch.randn((n, hk, dk), generator=gen).to(dtype) for _ in range(2))
        v = torch.randn((n, hv, dv), generator=gen).to(dtype)
    g = -torch.rand((n, hv), generator=gen) * 2
    beta = torch.rand((n, hv), generator=gen)
    return q, k, v, g, beta


def _compare_gdn(case, state, *, atol, chunk_size=16, methods=("auto", "recurrent", "chunk"), **kw):
    """Run reference and Triton on copies of `state`; outputs and pools must agree.

    A bf16 pool is compared to one bf16 step (0.8%): the interpreter converts
    fp32 -> bf16 by truncation where torch rounds to nearest.
    """
    from spur.kernels.gdn_reference import gated_delta_rule_varlen_ref
    from spur.kernels.gdn_triton import gated_delta_rule_varlen_triton

    meta = kw.pop("meta", None) or _metadata()
    want_pool = state.clone()
    want = gated_delta_rule_varlen_ref(*case, want_pool, meta, chunk_size=chunk_size, **kw)
    pool_atol = max(atol, 8e-3) if state.dtype == torch.bfloat16 else atol
    for method in methods:
        pool = state.clone()
        got = gated_delta_rule_varlen_triton(
            *case, pool, meta, chunk_size=chunk_size, method=method, **kw
        )
        assert got.dtype == case[0].dtype and not got.isnan().any(), method
        assert not got[meta.num_actual_tokens :].any(), f"{method}: padding rows must be zero"
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol, msg=method)
        torch.testing.assert_close(
            pool.float(), want_pool.float(), atol=pool_atol, rtol=pool_atol, msg=method
        )
        untouched = [s for s in range(state.shape[0]) if s not in meta.dst_slots_cpu.tolist()]
        assert torch.equal(pool[untouched], state[untouched]), f"{method} wrote a foreign slot"
    return want


@check
def gdn_fp32_gqa_two_chunks():
    # 2 v heads per k head; the 20-token sequence spans two chunks of 16.
    case = _gdn_case(hk=1, hv=2, dk=16, dv=16)
    state = torch.randn((SLOTS, 2, 16, 16), generator=torch.Generator().manual_seed(1))
    _compare_gdn(case, state, atol=2e-5)


@check
def gdn_fp32_odd_dims_strided_views_no_l2norm_scale():
    # k_head_dim 12 / v_head_dim 40 pad the tiles (40 > 32: two value blocks in the
    # recurrent kernel); q, k, v are views of one fused projection.
    q, k, v, g, beta = _gdn_case(hk=2, hv=2, dk=12, dv=40, fused=True, seed=2)
    from spur.kernels.gdn_reference import l2norm

    state = torch.randn((SLOTS, 2, 12, 40), generator=torch.Generator().manual_seed(3)) * 0.1
    _compare_gdn((q, k, v, g, beta), state, atol=2e-5)
    case = (l2norm(q), l2norm(k), v, g, beta)
    _compare_gdn(case, state, atol=2e-5, use_qk_l2norm=False, scale=0.5, methods=("auto",))


@check
def gdn_fp16_inputs_bf16_state_in_shared_page():
    # fp16 activations, a bf16 state pool as a view into pages that also hold other
    # data (slot stride > state size); chunk 32 with a 20-token prefill.
    case = _gdn_case(hk=1, hv=1, dk=16, dv=16, dtype=torch.float16, seed=4)
    pages = torch.zeros((SLOTS, 16 * 16 + 7), dtype=torch.bfloat16)
    state = pages[:, 3 : 3 + 256].view(SLOTS, 1, 16, 16)
    state.copy_(torch.randn((SLOTS, 1, 16, 16), generator=torch.Generator().manual_seed(5)))
    _compare_gdn(case, state, atol=3e-3, chunk_size=32)
    from spur.kernels.gdn_triton import gated_delta_rule_varlen_triton

    gated_delta_rule_varlen_triton(*case, state, _metadata())
    assert not pages[:, :3].any() and not pages[:, -4:].any(), "writes left their views"


@check
def gdn_long_prefill_only_and_decode_only_steps():
    # A 40-token prefill continuing from a state (3 chunks of 16), then a step of decodes.
    from spur.kernels.gdn_reference import build_gdn_metadata

    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn((40, 1, 16), generator=gen), torch.randn((40, 1, 16), generator=gen)
    v, g = torch.randn((40, 2, 16), generator=gen), -torch.rand((40, 2), generator=gen)
    beta = torch.rand((40, 2), generator=gen)
    state = torch.randn((4, 2, 16, 16), generator=gen)
    meta = build_gdn_metadata([40], [2], [True], [3])
    _compare_gdn((q, k, v, g, beta), state, atol=3e-5, meta=meta)
    # Two decodes continue from one shared state (slot 0) into their own blocks.
    meta = build_gdn_metadata([1, 1, 1], [0, 0, 2], [True, True, False], [1, 3, 2])
    _compare_gdn((q[:3], k[:3], v[:3], g[:3], beta[:3]), state, atol=2e-5, meta=meta)


@check
def gdn_default_chunk_64():
    # The default chunk size (what serving runs): a 70-token prefill = 64 + a 6-row tail.
    from spur.kernels.gdn_reference import build_gdn_metadata

    gen = torch.Generator().manual_seed(11)
    q, k = torch.randn((70, 1, 16), generator=gen), torch.randn((70, 1, 16), generator=gen)
    v, g = torch.randn((70, 1, 16), generator=gen), -torch.rand((70, 1), generator=gen)
    beta = torch.rand((70, 1), generator=gen)
    state = torch.randn((2, 1, 16, 16), generator=gen)
    meta = build_gdn_metadata([70], [0], [True], [1])
    _compare_gdn((q, k, v, g, beta), state, atol=3e-5, chunk_size=64, meta=meta, methods=("auto",))


def _conv_case(conv_dim, kernel, *, pad=2, seed=0, dtype=torch.float32, strided=False):
    gen = torch.Generator().manual_seed(seed)
    n = sum(t for t, _ in STEP) + pad
    x = torch.randn((n, conv_dim + (9 if strided else 0)), generator=gen).to(dtype)
    x = x[:, 4 : 4 + conv_dim] if strided else x
    weight = torch.randn((conv_dim, kernel), generator=gen).to(dtype)
    bias = torch.randn((conv_dim,), generator=gen).to(dtype)
    state = torch.randn((SLOTS, kernel - 1, conv_dim), generator=gen)
    return x, weight, bias, state


def _compare_conv(x, weight, bias, state, *, atol, activation="silu"):
    from spur.kernels.gdn_conv_triton import causal_conv1d_varlen_triton
    from spur.kernels.gdn_reference import causal_conv1d_varlen_ref

    meta = _metadata()
    want_pool = state.clone()
    want = causal_conv1d_varlen_ref(x, weight, bias, want_pool, meta, activation)
    pool = state.clone()
    got = causal_conv1d_varlen_triton(x, weight, bias, pool, meta, activation)
    assert got.dtype == x.dtype and not got[meta.num_actual_tokens :].any()
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
    # The state holds inputs: copied, never computed, so bit-exact.
    assert torch.equal(pool, want_pool), "conv state differs from the reference"


@check
def conv_fp32_kernels_bias_activation():
    for kernel in (4, 2, 3):
        x, weight, bias, state = _conv_case(20, kernel, seed=kernel)
        _compare_conv(x, weight, bias, state, atol=1e-5)
        _compare_conv(x, weight, None, state, atol=1e-5, activation=None)


@check
def conv_fp16_strided_x_fp32_and_bf16_pools_wide_channels():
    # 150 channels: two channel blocks of 128; x a column slice of a wider tensor. The
    # inputs are exact in bf16 too, so storing them in a bf16 pool is exact.
    x, weight, _, state = _conv_case(150, 4, dtype=torch.float16, strided=True, seed=7)
    x.copy_(x.bfloat16())
    _compare_conv(x, weight, None, state, atol=2e-3)
    _compare_conv(x, weight, None, state.to(torch.bfloat16), atol=2e-3)


@check
def dispatch_through_package():
    from spur.kernels import causal_conv1d_varlen, gated_delta_rule_varlen, select_backend
    from spur.kernels.gdn_reference import causal_conv1d_varlen_ref, gated_delta_rule_varlen_ref

    assert select_backend("triton", "cpu") == "triton"
    meta = _metadata()
    case = _gdn_case(hk=1, hv=1, dk=16, dv=16, seed=8)
    state = torch.randn((SLOTS, 1, 16, 16), generator=torch.Generator().manual_seed(9))
    pools = [state.clone(), state.clone()]
    got = gated_delta_rule_varlen(*case, pools[0], meta, chunk_size=16, backend="triton")
    want = gated_delta_rule_varlen_ref(*case, pools[1], meta, chunk_size=16)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    x, weight, bias, cstate = _conv_case(16, 4, seed=10)
    pools = [cstate.clone(), cstate.clone()]
    got = causal_conv1d_varlen(x, weight, bias, pools[0], meta, backend="triton")
    want = causal_conv1d_varlen_ref(x, weight, bias, pools[1], meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The token -> sequence map is derived once per step, then reused by every layer.
    (key,) = meta.memo
    again = causal_conv1d_varlen(x, weight, bias, cstate.clone(), meta, backend="triton")
    assert torch.equal(again, got) and list(meta.memo) == [key]


@check
def launcher_errors_name_the_problem():
    from spur.kernels.gdn_conv_triton import causal_conv1d_varlen_triton
    from spur.kernels.gdn_triton import gated_delta_rule_varlen_triton

    meta = _metadata()
    q, k, v, g, beta = _gdn_case(hk=1, hv=1, dk=16, dv=16)
    state = torch.zeros((SLOTS, 1, 16, 16))
    x, weight, bias, cstate = _conv_case(16, 4)
    bad = [
        (lambda: gated_delta_rule_varlen_triton(q, k, v, g, beta, state, meta, chunk_size=8), "16"),
        (lambda: gated_delta_rule_varlen_triton(q, k, v, g, beta, state.double(), meta), "dtype"),
        (lambda: gated_delta_rule_varlen_triton(q, k, v, g, beta, state, meta, method="x"), "auto"),
        (
            lambda: causal_conv1d_varlen_triton(x.t().contiguous().t(), weight, bias, cstate, meta),
            "contiguous",
        ),
        (lambda: causal_conv1d_varlen_triton(x, weight, bias, cstate, meta, "gelu"), "silu"),
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
    """Compile every GDN kernel variant for sm_90, with the warps the launchers use."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    limit = 227 * 1024
    results = {}
    for module in ("gdn_triton", "gdn_conv_triton"):
        mod = importlib.import_module(f"spur.kernels.{module}")
        for label, kernel, signature, constexprs, warps in mod.compile_specs():
            start = time.perf_counter()
            try:
                src = triton.compiler.ASTSource(kernel, signature, constexprs)
                compiled = triton.compile(src, target=target, options={"num_warps": warps})
                assert compiled.asm.get("cubin"), "no cubin produced"
                shared = compiled.metadata.shared
                assert shared <= limit, f"needs {shared} bytes of shared memory, sm_90 has {limit}"
                results[label] = {"ok": True, "detail": f"shared={shared}"}
            except Exception:
                results[label] = {"ok": False, "detail": traceback.format_exc()}
            results[label]["module"] = module
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
        sys.stderr.write("usage: test_gdn_triton.py interpret|compile OUT.json [CHECK ...]\n")
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


# --------------------------------------------------------------------------- pytest side


def _start(mode: str, out: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # main() sets it for the interpret mode only
    env["OMP_NUM_THREADS"] = "1"
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
    tmp = tmp_path_factory.mktemp("gdn_triton")
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


@pytest.mark.parametrize("name", list(CHECKS))
def test_interpreted_gdn_kernel_matches_reference(results, name):
    runs = results["interpret"]
    assert "__crash__" not in runs, f"interpreter run crashed:\n{runs['__crash__']}"
    assert name in runs, f"{name} missing from the interpreter results"
    assert runs[name]["ok"], runs[name]["detail"]


@pytest.mark.parametrize("module", ["gdn_triton", "gdn_conv_triton"])
def test_gdn_kernels_compile_for_hopper(results, module):
    runs = results["compile"]
    assert "__crash__" not in runs, f"compile run crashed:\n{runs['__crash__']}"
    mine = {label: r for label, r in runs.items() if r["module"] == module}
    assert mine, f"no compile specs from spur.kernels.{module}"
    failed = {label: r["detail"] for label, r in mine.items() if not r["ok"]}
    assert not failed, "\n".join(f"--- {label}\n{detail}" for label, detail in failed.items())


def test_triton_gdn_on_cpu_names_the_fix(monkeypatch):
    from spur.kernels import gated_delta_rule_varlen

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, g, beta = _gdn_case(hk=1, hv=1, dk=16, dv=16)
    state = torch.zeros((SLOTS, 1, 16, 16))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        gated_delta_rule_varlen(q, k, v, g, beta, state, _metadata(), backend="triton")


# --------------------------------------------------------------------------- real GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_gdn_matches_reference(dtype):
    """Qwen3.5 head sizes on CUDA: chunk 64 over long prefills, decodes, and the conv."""
    from spur.kernels.gdn_conv_triton import causal_conv1d_varlen_triton
    from spur.kernels.gdn_reference import (
        build_gdn_metadata,
        causal_conv1d_varlen_ref,
        gated_delta_rule_varlen_ref,
    )
    from spur.kernels.gdn_triton import gated_delta_rule_varlen_triton

    gen = torch.Generator().manual_seed(0)
    lens = [300, 1, 1, 129, 64, 1, 0, 17]
    meta = build_gdn_metadata(lens, list(range(8)), [i % 2 == 0 for i in range(8)],
                              [8 + i for i in range(8)], device="cuda")  # fmt: skip
    n, hk, hv, d = sum(lens), 4, 8, 128
    # Inputs rounded to `dtype` first: the reference then sees what the kernel sees.
    q, k = (torch.randn((n, hk, d), generator=gen).to(dtype) for _ in range(2))
    v = torch.randn((n, hv, d), generator=gen).to(dtype)
    g, beta = -torch.rand((n, hv), generator=gen) * 0.5, torch.rand((n, hv), generator=gen)
    state = torch.randn((16, hv, d, d), generator=gen) * 0.1
    want_pool = state.clone()
    want = gated_delta_rule_varlen_ref(q, k, v, g, beta, want_pool, meta.to("cpu"))
    for method in ("auto", "chunk"):
        pool = state.cuda()
        cuda = [t.cuda() for t in (q, k, v, g, beta)]
        got = gated_delta_rule_varlen_triton(*cuda, pool, meta, method=method)
        atol = 2e-3 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got.float().cpu(), want.float(), atol=atol, rtol=atol)
        torch.testing.assert_close(pool.cpu(), want_pool, atol=atol, rtol=atol)

    x = torch.randn((n, 2 * hk * d + hv * d), generator=gen).to(dtype)
    w = torch.randn((x.shape[1], 4), generator=gen).to(dtype)
    cstate = torch.randn((16, 3, x.shape[1]), generator=gen)
    want_c = cstate.clone()
    want = causal_conv1d_varlen_ref(x, w, None, want_c, meta.to("cpu"))
    pool = cstate.cuda()
    got = causal_conv1d_varlen_triton(x.cuda(), w.cuda(), None, pool, meta)
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=atol, rtol=atol)
    assert torch.equal(pool.cpu(), want_c), "conv state holds inputs: copies are exact"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
