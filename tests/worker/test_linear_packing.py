"""Float32 linear weights packed once at load (layers.linear.pack_linears): the layers
compute what they did on the [N, K] weights, the packed copy replaces the weight (no
second copy kept), benches can have the [N, K] weights back for a while, and the
worker packs what it loads on a CPU where spur's float32 linear serves."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spur.actors.worker.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    pack_linears,
    unpacked_linears,
)
from spur.kernels import native


def _layers(dtype: torch.dtype = torch.float32) -> nn.ModuleDict:
    gen = torch.Generator().manual_seed(3)
    layers = nn.ModuleDict(
        {
            "col": ColumnParallelLinear(64, 40, bias=True, params_dtype=dtype),
            "qkv": QKVParallelLinear(64, 16, 4, 2, bias=False, params_dtype=dtype),
            "row": RowParallelLinear(40, 64, bias=True, params_dtype=dtype),
        }
    )
    for p in layers.parameters():
        p.data = torch.randn(p.shape, generator=gen).to(dtype)
    return layers


def _outputs(layers: nn.ModuleDict, x64: torch.Tensor, x40: torch.Tensor) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [layers["col"](x64), layers["qkv"](x64), layers["row"](x40)]


@pytest.mark.parametrize("rows", [1, 16, 70])
def test_packed_layers_compute_what_they_did(panels_here, rows):
    layers = _layers()
    weights = {name: m.weight.detach().clone() for name, m in layers.items()}
    x64, x40 = torch.randn(rows, 64), torch.randn(rows, 40)
    expected = [
        F.linear(x64, weights["col"], layers["col"].bias),
        F.linear(x64, weights["qkv"]),
        F.linear(x40, weights["row"]) + layers["row"].bias,
    ]
    packed, nbytes = pack_linears(layers)
    assert packed == 3
    pw = native.ops().linear_f32_panel_width()
    padded = {name: -(-w.shape[0] // pw) * pw for name, w in weights.items()}  # zeros past N
    assert nbytes == 4 * sum(padded[name] * w.shape[1] for name, w in weights.items())
    for name, m in layers.items():
        assert m.weight.shape == (0, weights[name].shape[1])  # the panels replace it
        assert m.weight_panels is not None
    for got, want in zip(_outputs(layers, x64, x40), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert pack_linears(layers) == (0, 0)  # packing twice packs nothing


def test_unpacked_linears_restores_the_weights_for_a_while(panels_here):
    layers = _layers()
    weights = {name: m.weight.detach().clone() for name, m in layers.items()}
    pack_linears(layers)
    panels = {name: m.weight_panels for name, m in layers.items()}
    x64, x40 = torch.randn(5, 64), torch.randn(5, 40)
    with unpacked_linears(layers), native.torch_linears():
        for name, m in layers.items():
            assert torch.equal(m.weight, weights[name]) and m.weight_panels is None
        got = _outputs(layers, x64, x40)
        torch.testing.assert_close(got[0], F.linear(x64, weights["col"], layers["col"].bias))
    for name, m in layers.items():
        assert m.weight_panels is panels[name] and m.weight.shape[0] == 0


def test_other_dtypes_and_cpus_keep_their_weights(panels_here, monkeypatch):
    monkeypatch.setitem(native._state, "bf16_panels_here", False)  # AMX, or no AVX-512 BF16
    layers = _layers(torch.bfloat16)
    assert pack_linears(layers) == (0, 0)
    assert all(m.weight_panels is None and m.weight.shape[0] > 0 for m in layers.values())
    assert pack_linears(_layers(torch.float16)) == (0, 0)
    monkeypatch.setitem(native._state, "linear_f32_here", False)  # MKL serves float32
    assert pack_linears(_layers()) == (0, 0)


@pytest.mark.parametrize("rows", [1, 16, 70])
def test_packed_bf16_layers_compute_what_they_did(bf16_panels, rows):
    """bf16 weights packed in pairs: the layers' outputs within one bf16 step of float64
    math on the same weights, rounded where the layers round."""
    layers = _layers(torch.bfloat16)
    weights = {name: m.weight.detach().clone() for name, m in layers.items()}
    biases = {name: getattr(m, "bias", None) for name, m in layers.items()}
    x64 = torch.randn(rows, 64).to(torch.bfloat16)
    x40 = torch.randn(rows, 40).to(torch.bfloat16)
    packed, nbytes = pack_linears(layers)
    assert packed == 3
    assert nbytes == 2 * sum(-(-w.shape[0] // 32) * 32 * w.shape[1] for w in weights.values())
    for name, m in layers.items():
        assert m.weight.shape == (0, weights[name].shape[1]) and m.weight_panels is not None
    for (name, x), got in zip(
        [("col", x64), ("qkv", x64), ("row", x40)], _outputs(layers, x64, x40), strict=True
    ):
        b, product = biases[name], x.double() @ weights[name].double().T
        if name == "row":  # the bias is added after the (all-)reduce: a rounding each
            exact = product.to(torch.bfloat16).double() + b.double()
            step = (product.abs().clamp_min(0.05) + exact.abs()) * 2**-7
        else:
            exact = product + (b.double() if b is not None else 0.0)
            step = exact.abs().clamp_min(0.05) * 2**-7  # one bf16 step
        assert got.dtype == torch.bfloat16 and ((got.double() - exact).abs() <= step).all()
    with unpacked_linears(layers):
        for name, m in layers.items():
            assert torch.equal(m.weight, weights[name])


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_worker_packs_float32_linears_at_load(panels_here, tiny_model_dir, name):
    """Every linear layer and the LM head packed; a tied embedding shares the head's
    panels and looks its rows up there; greedy tokens and logprobs as with the [N, K]
    weights (unpacked_linears, same process)."""
    from spur.actors.llm import LLM
    from spur.actors.step import SamplingParams
    from spur.actors.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    llm = LLM(str(tiny_model_dir(name)), dtype="float32", block_size=4)
    runner = llm.executor.worker.runner
    model = runner.model
    linears = [
        m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    assert linears and all(m.weight_panels is not None for m in linears)
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    embed = next(
        m
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    )
    assert head.weight_panels is not None and head.weight.shape[0] == 0
    if name == "llama_tied":  # one packed copy, still tied
        assert embed.weight_panels is head.weight_panels and embed.weight is head.weight
    else:  # an embedding alone only looks rows up: it keeps its [V, K] weight
        assert embed.weight_panels is None and embed.weight.shape[0] > 0
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 3, 11]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    packed = llm.generate(prompts, params)
    with unpacked_linears(model):
        assert embed.weight.shape[0] > 0 and head.weight.shape[0] > 0
        plain = llm.generate(prompts, params)
    for a, b in zip(packed, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.sampled == pytest.approx(y.sampled, abs=1e-4)
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)
    # the engine bench's ceiling times torch's F.linear on [N, K] weights, then packs back
    assert runner.time_matmuls([(4, 4, 1)], repeats=1, torch_path=True) > 0
    assert all(m.weight_panels is not None for m in [*linears, head])


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_worker_packs_bf16_linears_at_load(bf16_panels, tiny_model_dir, name):
    """bf16 too: every linear and the LM head packed in pairs, a tied embedding reading
    the head's panels; the same greedy tokens as the [N, K] weights (torch's bf16
    matmul), logprobs within bf16 rounding (the sums' order differs)."""
    from spur.actors.llm import LLM
    from spur.actors.step import SamplingParams
    from spur.actors.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    llm = LLM(str(tiny_model_dir(name)), dtype="bfloat16", block_size=4)
    model = llm.executor.worker.runner.model
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    embed = next(
        m
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    )
    linears = [
        m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    assert all(m.weight_panels is not None for m in [*linears, head])
    assert head.weight_panels.dtype == torch.bfloat16 and head.weight_panels.dim() == 4
    assert (embed.weight_panels is head.weight_panels) == (name == "llama_tied")
    # the head writes float32 logits directly: the bf16 products, widened
    h = torch.randn(5, head.embedding_dim).to(torch.bfloat16)
    logits = head(h)
    assert logits.dtype == torch.float32 and torch.equal(logits, head._linear(h, None).float())
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 3, 11]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    packed = llm.generate(prompts, params)
    with unpacked_linears(model), native.torch_linears():
        plain = llm.generate(prompts, params)
    for a, b in zip(packed, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.sampled == pytest.approx(y.sampled, abs=0.05)


def _greedy_in_the_head(llm, model, monkeypatch, torch_path):
    """Greedy requests without logprobs pick their token in the LM head (no logits);
    a request with logprobs, or a sampled one, still gets logits; the tokens are the
    [N, K] weights' (unpacked_linears: logits, then the sampler's argmax)."""
    from spur.actors.step import SamplingParams

    calls: list[int] = []
    fused = native.panels_argmax

    def counting(x, panels, n):
        ids = fused(x, panels, n)
        if ids is not None:  # picked in the head
            calls.append(x.shape[0])
        return ids

    monkeypatch.setattr(native, "panels_argmax", counting)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 3, 11], [5] * 13]
    greedy = SamplingParams(max_tokens=7, temperature=0.0)
    packed = llm.generate(prompts, greedy)
    lib = native.ops()
    if lib is not None and lib.panels_argmax_supported():
        assert calls and max(calls) == 3  # every step's sampling rows, in one call
    else:
        assert not calls  # a build without it: the sampler's path
    calls.clear()
    llm.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0.0, logprobs=1))
    llm.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0.8, seed=1))
    assert not calls
    with unpacked_linears(model), native.torch_linears() if torch_path else nullcontext():
        plain = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in packed] == [o.outputs[0].token_ids for o in plain]


def test_greedy_float32_steps_pick_in_the_lm_head(panels_here, tiny_model_dir, monkeypatch):
    from spur.actors.llm import LLM

    llm = LLM(str(tiny_model_dir("llama_tied")), dtype="float32", block_size=4)
    _greedy_in_the_head(llm, llm.executor.worker.runner.model, monkeypatch, torch_path=False)


def test_greedy_bf16_steps_pick_in_the_lm_head(bf16_panels, tiny_model_dir, monkeypatch):
    from spur.actors.llm import LLM

    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", block_size=4)
    _greedy_in_the_head(llm, llm.executor.worker.runner.model, monkeypatch, torch_path=True)
