"""GDN torch reference ops against transformers 5.24's Qwen3-Next functions; the varlen pool path.

transformers' functions are batched ([batch, seq, heads, dim]) with conv states
[batch, conv_dim, K]; ours are per sequence with states [K-1, conv_dim]. The
varlen ops are checked against the per-sequence ops run one sequence at a time.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from spur.kernels.gdn_reference import (
    build_gdn_metadata,
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    causal_conv1d_varlen_ref,
    chunk_gated_delta_rule_ref,
    gated_delta_rule_step_ref,
    gated_delta_rule_varlen_ref,
    recurrent_gated_delta_rule_ref,
)

ATOL = 2e-5


def gdn_inputs(seq_len, hk=2, hv=4, dk=8, dv=6, seed=0, dtype=torch.float32):
    """Random q, k, v, g (log-decay <= 0, as the model computes it), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((seq_len, hk, dk), generator=gen)
    k = torch.randn((seq_len, hk, dk), generator=gen)
    v = torch.randn((seq_len, hv, dv), generator=gen)
    a_log = torch.rand(hv, generator=gen).log()
    g = -a_log.exp() * F.softplus(torch.randn((seq_len, hv), generator=gen))
    beta = torch.randn((seq_len, hv), generator=gen).sigmoid()
    return [t.to(dtype) for t in (q, k, v)] + [g, beta]


def hf_gdn(fn, q, k, v, g, beta, state, **kw):
    out, final = fn(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=None if state is None else state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True, **kw,
    )  # fmt: skip
    return out[0], final[0]


@pytest.mark.parametrize("seq_len", [1, 5, 16, 37])
@pytest.mark.parametrize("with_state", [False, True])
def test_gdn_chunk_and_recurrent_match_transformers(seq_len, with_state):
    q, k, v, g, beta = gdn_inputs(seq_len, seed=seq_len)
    gen = torch.Generator().manual_seed(9)
    state = torch.randn((4, 8, 6), generator=gen) if with_state else None
    chunk = hf.torch_chunk_gated_delta_rule
    want_out, want_state = hf_gdn(chunk, q, k, v, g, beta, state, chunk_size=16)
    ours = ((chunk_gated_delta_rule_ref, {"chunk_size": 16}), (recurrent_gated_delta_rule_ref, {}))
    for fn, kw in ours:
        out, final = fn(q, k, v, g, beta, state, **kw)
        torch.testing.assert_close(out, want_out, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(final, want_state, atol=ATOL, rtol=ATOL)
    rec_out, rec_state = hf_gdn(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    out, final = recurrent_gated_delta_rule_ref(q, k, v, g, beta, state)
    torch.testing.assert_close(out, rec_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(final, rec_state, atol=1e-6, rtol=1e-6)


def test_gdn_continuing_from_state_equals_one_pass():
    # Prefill in pieces (the engine's chunked prefill) == prefill at once; default chunk 64.
    q, k, v, g, beta = gdn_inputs(100, hk=1, hv=2, dk=16, dv=16, seed=3)
    whole, whole_state = chunk_gated_delta_rule_ref(q, k, v, g, beta)
    state, parts = None, []
    for s in (slice(0, 70), slice(70, 71), slice(71, 100)):
        out, state = chunk_gated_delta_rule_ref(q[s], k[s], v[s], g[s], beta[s], state)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(state, whole_state, atol=ATOL, rtol=ATOL)


def test_gdn_scale_and_no_l2norm_options():
    q, k, v, g, beta = gdn_inputs(9, seed=4)
    k = k * 0.2  # unnormalised keys: keep the delta rule contractive
    want, want_state = hf_gdn(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, None)
    # transformers always scales by dk ** -0.5; pre-normalising its inputs is the no-l2norm case.
    out, final = chunk_gated_delta_rule_ref(
        hf.l2norm(q), hf.l2norm(k), v, g, beta, use_qk_l2norm=False, chunk_size=4
    )
    torch.testing.assert_close(out, want, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(final, want_state, atol=ATOL, rtol=ATOL)
    doubled, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale=2 * 8**-0.5)
    torch.testing.assert_close(doubled, 2 * want, atol=ATOL, rtol=ATOL)


def test_gdn_step_does_not_mutate_and_keeps_dtype():
    q, k, v, g, beta = gdn_inputs(3, dtype=torch.bfloat16, seed=5)
    state = torch.randn((3, 4, 8, 6))
    before = state.clone()
    out, new = gated_delta_rule_step_ref(q, k, v, g, beta, state)
    assert out.dtype == torch.bfloat16 and new.dtype == torch.float32
    assert torch.equal(state, before)
    assert not torch.allclose(new, state)


# --------------------------------------------------------------------------- conv


def conv_inputs(seq_len, conv_dim=10, kernel=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((seq_len, conv_dim), generator=gen)
    weight = torch.randn((conv_dim, kernel), generator=gen)
    bias = torch.randn((conv_dim,), generator=gen)
    return x, weight, bias


@pytest.mark.parametrize("bias_on", [False, True])
def test_conv_prefill_matches_transformers(bias_on):
    x, weight, bias = conv_inputs(11, seed=1)
    bias = bias if bias_on else None
    want = hf.causal_conv1d_fn(x.t()[None], weight, bias, activation="silu")[0].t()
    out, final = causal_conv1d_ref(x, weight, bias)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(final, x[-3:])
    # Shorter than the kernel: the final state keeps part of the (zero) initial state.
    out, final = causal_conv1d_ref(x[:2], weight, bias, activation=None)
    assert torch.equal(final, torch.cat([torch.zeros(1, 10), x[:2]]))


def test_conv_update_matches_transformers_and_continues_prefill():
    x, weight, bias = conv_inputs(9, seed=2)
    whole, _ = causal_conv1d_ref(x, weight, bias)
    _, state = causal_conv1d_ref(x[:6], weight, bias)
    # transformers keeps K inputs ([B, C, K], the oldest unused by the update); we keep K-1.
    hf_state = torch.cat([torch.zeros(1, 10), state]).t()[None].clone()
    mine = state[None].clone()
    for t in range(6, 9):
        want = hf.causal_conv1d_update(x[t, :, None][None], hf_state, weight, bias, "silu")[0, :, 0]
        got = causal_conv1d_update_ref(x[t][None], mine, weight, bias)[0]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got, whole[t], atol=1e-6, rtol=1e-6)
        assert torch.equal(mine[0], hf_state[0, :, 1:].t())


# --------------------------------------------------------------------------- varlen


# (tokens this step, has_initial_state): prefill chunks, continuations, decodes, an empty one.
STEP = [(7, False), (1, True), (20, True), (0, True), (1, False), (3, True), (2, False)]
SRC = [0, 5, 2, 6, 8, 4, 1]
DST = [0, 3, 2, 6, 7, 4, 9]  # seq 1 and 4 copy-on-write into fresh slots


def varlen_case(pad=2, seed=0, hk=1, hv=2, dk=8, dv=8, conv_dim=12, kernel=4, slots=10):
    lens = [n for n, _ in STEP]
    meta = build_gdn_metadata(lens, SRC, [h for _, h in STEP], DST)
    total = sum(lens) + pad
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = gdn_inputs(total, hk, hv, dk, dv, seed=seed)
    ssm = torch.randn((slots, hv, dk, dv), generator=gen)
    x, weight, bias = conv_inputs(total, conv_dim, kernel, seed=seed)
    conv = torch.randn((slots, kernel - 1, conv_dim), generator=gen)
    return meta, (q, k, v, g, beta, ssm), (x, weight, bias, conv)


def per_sequence(meta, step_fn, pool, *inputs):
    """Expected outputs and pool after a step, computed one sequence at a time."""
    qsl = meta.query_start_loc_cpu.tolist()
    pool = pool.clone()
    outs = []
    for i, (n, has_init) in enumerate(STEP):
        s = slice(qsl[i], qsl[i + 1])
        if n == 0:
            continue
        init = pool[SRC[i]] if has_init else None
        out, final = step_fn(*(t[s] for t in inputs), init)
        outs.append((s, out))
        pool[DST[i]] = final
    return outs, pool


def test_gdn_varlen_matches_per_sequence_and_writes_slots():
    meta, (q, k, v, g, beta, ssm), _ = varlen_case()
    pool = ssm.clone()
    out = gated_delta_rule_varlen_ref(q, k, v, g, beta, pool, meta, chunk_size=8)
    want, want_pool = per_sequence(meta, recurrent_gated_delta_rule_ref, ssm, q, k, v, g, beta)
    for s, o in want:
        torch.testing.assert_close(out[s], o, atol=ATOL, rtol=ATOL)
    assert not out[meta.num_actual_tokens :].any(), "padding rows must be zero"
    torch.testing.assert_close(pool, want_pool, atol=ATOL, rtol=ATOL)
    # Untouched: slots nobody writes (5 and 8 are read-only sources, 6 is the empty sequence's).
    for slot in (1, 5, 6, 8):
        assert torch.equal(pool[slot], ssm[slot])


def test_conv_varlen_matches_per_sequence_and_writes_slots():
    meta, _, (x, weight, bias, conv) = varlen_case(seed=1)
    pool = conv.clone()
    out = causal_conv1d_varlen_ref(x, weight, bias, pool, meta)
    fn = lambda xs, init: causal_conv1d_ref(xs, weight, bias, init)  # noqa: E731
    want, want_pool = per_sequence(meta, fn, conv, x)
    for s, o in want:
        torch.testing.assert_close(out[s], o, atol=1e-6, rtol=1e-6)
    assert not out[meta.num_actual_tokens :].any()
    torch.testing.assert_close(pool, want_pool, atol=1e-6, rtol=1e-6)


def test_varlen_states_in_a_shared_page_and_low_precision_pool():
    # Both states of a layer as views into one page buffer (slot stride > state size), bf16.
    meta, (q, k, v, g, beta, ssm), (x, weight, bias, conv) = varlen_case(seed=2)
    conv_numel, ssm_numel = conv[0].numel(), ssm[0].numel()
    pages = torch.zeros((10, conv_numel + ssm_numel + 5), dtype=torch.bfloat16)
    conv_view = pages[:, :conv_numel].view(10, *conv.shape[1:])
    ssm_view = pages[:, conv_numel : conv_numel + ssm_numel].view(10, *ssm.shape[1:])
    conv_view.copy_(conv)
    ssm_view.copy_(ssm)
    ssm_bf16, conv_bf16 = ssm_view.clone(), conv_view.clone()
    out = gated_delta_rule_varlen_ref(q, k, v, g, beta, ssm_view, meta)
    want = gated_delta_rule_varlen_ref(q, k, v, g, beta, ssm_bf16, meta)
    assert torch.equal(out, want) and torch.equal(ssm_view, ssm_bf16)
    cout = causal_conv1d_varlen_ref(x, weight, bias, conv_view, meta)
    cwant = causal_conv1d_varlen_ref(x, weight, bias, conv_bf16, meta)
    assert torch.equal(cout, cwant) and torch.equal(conv_view, conv_bf16)
    assert not pages[:, -5:].any(), "writes stayed inside their views"


def test_metadata_rejects_racing_slots():
    with pytest.raises(ValueError, match="distinct"):
        build_gdn_metadata([1, 1], [0, 1], [True, True], [2, 2])
    with pytest.raises(ValueError, match="sequence 0 writes slot 1 that sequence 1 reads"):
        build_gdn_metadata([1, 1], [0, 1], [True, True], [1, 2])
    with pytest.raises(ValueError, match="one entry per sequence"):
        build_gdn_metadata([1, 1], [0], [True, True])
    # A sequence without initial state reads nothing: its src slot may be someone's dst.
    meta = build_gdn_metadata([3, 1], [0, 1], [True, False], [1, 2])
    assert meta.query_start_loc_cpu.tolist() == [0, 3, 4] and meta.max_query_len == 3
    # Two requests continuing from one cached state (a shared prefix) read the same slot.
    build_gdn_metadata([2, 2], [5, 5], [True, True], [1, 2])


def test_varlen_shape_errors_name_the_fix():
    meta, (q, k, v, g, beta, ssm), (x, weight, bias, conv) = varlen_case()
    with pytest.raises(ValueError, match="ssm_state must be"):
        gated_delta_rule_varlen_ref(q, k, v, g, beta, ssm.transpose(2, 3), meta)
    with pytest.raises(ValueError, match="squeeze"):
        causal_conv1d_varlen_ref(x, weight[:, None], bias, conv, meta)
    with pytest.raises(ValueError, match="kernel_size - 1"):
        causal_conv1d_varlen_ref(x, weight, bias, conv.transpose(1, 2), meta)


def test_package_dispatch_runs_the_reference_on_cpu():
    from spur.kernels import causal_conv1d_varlen, gated_delta_rule_varlen

    meta, (q, k, v, g, beta, ssm), (x, weight, bias, conv) = varlen_case(seed=3)
    pools = [ssm.clone(), ssm.clone()]
    out = gated_delta_rule_varlen(q, k, v, g, beta, pools[0], meta)
    want = gated_delta_rule_varlen_ref(q, k, v, g, beta, pools[1], meta)
    assert torch.equal(out, want) and torch.equal(*pools)
    pools = [conv.clone(), conv.clone()]
    out = causal_conv1d_varlen(x, weight, bias, pools[0], meta, backend="torch")
    want = causal_conv1d_varlen_ref(x, weight, bias, pools[1], meta)
    assert torch.equal(out, want) and torch.equal(*pools)


def test_gdn_layer_from_our_ops_equals_transformers_layer():
    """transformers' Qwen3NextGatedDeltaNet over 12 tokens at once == the same layer
    run through our varlen ops in steps (a 5-token prefill, 3 decodes that copy-on-write
    into a new block, a 4-token chunk), states kept only in the pools between steps."""
    from transformers import Qwen3NextConfig

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(
        hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=16,
    )  # fmt: skip
    layer = hf.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    hidden = torch.randn(1, 12, 32)
    with torch.no_grad():
        want = layer(hidden)[0]  # [12, 32], no cache: one chunked pass
        qkvz, ba = layer.in_proj_qkvz(hidden), layer.in_proj_ba(hidden)
        q, k, v, z, b, a = (t[0] for t in layer.fix_query_key_value_ordering(qkvz, ba))
        mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)  # [12, conv_dim]
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
        conv_pool = torch.full((4, 3, mixed.shape[1]), float("nan"))  # unread slots stay NaN
        ssm_pool = torch.full((4, 4, 16, 16), float("nan"))
        outs, pos = [], 0
        # (tokens, src slot, dst slot, has_initial_state)
        for n, src, dst, init in [(5, 1, 1, False), (1, 1, 2, True), (1, 2, 2, True),
                                  (1, 2, 2, True), (4, 2, 3, True)]:  # fmt: skip
            meta = build_gdn_metadata([n], [src], [init], [dst])
            rows = slice(pos, pos + n)
            x = causal_conv1d_varlen_ref(
                mixed[rows], layer.conv1d.weight[:, 0], None, conv_pool, meta, "silu"
            )
            qc, kc, vc = x.split([32, 32, 64], dim=-1)
            core = gated_delta_rule_varlen_ref(
                qc.reshape(n, 2, 16), kc.reshape(n, 2, 16), vc.reshape(n, 4, 16),
                g[rows], b[rows].sigmoid(), ssm_pool, meta,
            )  # fmt: skip
            normed = layer.norm(core.reshape(-1, 16), z[rows].reshape(-1, 16))
            outs.append(layer.out_proj(normed.reshape(n, 64)))
            pos += n
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-5, rtol=1e-5)
    assert conv_pool[0].isnan().all() and ssm_pool[0].isnan().all()
