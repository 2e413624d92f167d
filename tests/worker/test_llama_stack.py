"""The Llama decoder's layers as one native loop (models/llama_stack.py): the same hidden
states and KV caches, bit for bit, as running the layers one by one, on tiny random
checkpoints through mixed steps (prefill chunks, decodes, padding rows) and shuffled
block tables; and the steps it must leave to the layers, declined before anything is
written."""

from __future__ import annotations

import pytest
import torch

from spur.actors.worker.layers.linear import pack_linears
from spur.actors.worker.loader import load_model
from spur.actors.worker.models import llama_stack
from spur.kernels import build_attention_metadata, native, reference

BLOCK = 4
SEQS = [list(range(3, 17)), list(range(40, 46)), list(range(60, 79))]  # 14, 6, 19 tokens
STEPS = [  # (request, tokens) per step: prefill chunks, then decodes mixed with chunks
    [(0, 6), (1, 5), (2, 9)],
    [(1, 1), (0, 7), (2, 1)],
    [(2, 5), (0, 1)],
    [(0, 0), (2, 4)],
]


@pytest.fixture
def served(monkeypatch):
    """How many steps the stack ran (its `_run`, wrapped, still runs)."""
    calls = []
    run = llama_stack._run

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(llama_stack, "_run", counted)
    return calls


def _model(tiny_model_dir, name: str, dtype: torch.dtype, packed: bool):
    model = load_model(tiny_model_dir(name), dtype=dtype, device="cpu").model
    if packed:
        assert pack_linears(model)[0] > 0
    return model


def _steps(paged_steps, model, cache_dtype: torch.dtype):
    """Every step's final hidden states (padding rows included) and the KV caches after."""
    steps = list(paged_steps(model, SEQS, STEPS, pad=2, dtype=cache_dtype))
    return [hidden for _, hidden, _, _ in steps], steps[-1][3]


@pytest.fixture
def same_as_layer_by_layer(paged_stepper, served):
    """`check(model, dtype, cache_dtype)`: the steps through the stack (which must serve
    each of them) give the hidden states and KV caches of the layers one by one."""

    def check(model, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
        stacked, stacked_kv = _steps(paged_stepper, model, cache_dtype)
        assert len(served) == len(STEPS)  # the stack ran every step
        with llama_stack.layer_by_layer():
            layered, layered_kv = _steps(paged_stepper, model, cache_dtype)
        assert len(served) == len(STEPS)  # and none of these
        for s, (a, b) in enumerate(zip(stacked, layered, strict=True)):
            assert a.dtype == dtype and torch.equal(a, b), f"step {s}"
        for i, (a, b) in enumerate(zip(stacked_kv, layered_kv, strict=True)):
            assert torch.equal(a, b), f"layer {i}'s KV cache"
        assert any(kv.abs().sum() > 0 for kv in stacked_kv)

    return check


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2"])
@pytest.mark.parametrize("packed", [False, True])
def test_float32_steps_match_layer_by_layer(
    name, packed, tiny_model_dir, same_as_layer_by_layer, request
):
    """Untied / tied heads, biases everywhere (llama_tied) or on qkv only (qwen2); the
    linears on [N, K] weights or on their packed panels. Packed, without biases after
    o_proj / down_proj, the whole stack is one native call (`decoder_stack`)."""
    if packed:
        request.getfixturevalue("panels_here")
    model = _model(tiny_model_dir, name, torch.float32, packed)
    in_one_call = llama_stack._stack_weights(model.model.layers) is not None
    assert in_one_call == (packed and name != "llama_tied")
    same_as_layer_by_layer(model, torch.float32, torch.float32)


def test_float32_compute_over_a_bf16_cache(tiny_model_dir, same_as_layer_by_layer):
    """The compute dtype float32 over a bfloat16 cache (`model.compute_dtype` on CPUs
    without bf16 units): RoPE rounds K/V into the cache, attention widens them back."""
    model = _model(tiny_model_dir, "llama", torch.float32, False)
    same_as_layer_by_layer(model, torch.float32, torch.bfloat16)


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
@pytest.mark.parametrize("packed", [False, True])
def test_bfloat16_steps_match_layer_by_layer(
    name, packed, tiny_model_dir, same_as_layer_by_layer, request
):
    if packed:
        request.getfixturevalue("bf16_panels")
    model = _model(tiny_model_dir, name, torch.bfloat16, packed)
    in_one_call = llama_stack._stack_weights(model.model.layers) is not None
    assert in_one_call == (packed and name == "llama")
    same_as_layer_by_layer(model, torch.bfloat16, torch.bfloat16)


def test_torch_linears_unpack_for_every_call(tiny_model_dir, same_as_layer_by_layer, panels_here):
    """Under `native.torch_linears` (the engine bench's ceiling) packed layers compute
    with `F.linear` on their unpacked weights, in the stack as layer by layer."""
    model = _model(tiny_model_dir, "llama", torch.float32, True)
    with native.torch_linears():
        same_as_layer_by_layer(model, torch.float32, torch.float32)


def test_weights_packed_again_reach_the_next_step(
    tiny_model_dir, paged_stepper, served, panels_here
):
    """`forward` reads the layers' weights once per model (`_modules`, cached). A layer
    packed again (new weights loaded, then `pack_weight`) is read by the next step,
    as the layers one by one read it."""
    model = _model(tiny_model_dir, "llama", torch.float32, True)
    before, _ = _steps(paged_stepper, model, torch.float32)
    o_proj = model.model.layers[0].self_attn.o_proj
    w = native.unpack_linear(o_proj.weight_panels, o_proj.packed_out_features)
    o_proj.weight = torch.nn.Parameter(w * 1.5, requires_grad=False)
    o_proj.weight_panels = None
    assert o_proj.pack_weight() > 0
    stacked, _ = _steps(paged_stepper, model, torch.float32)
    assert len(served) == 2 * len(STEPS)  # the stack ran every step of both runs
    with llama_stack.layer_by_layer():
        layered, _ = _steps(paged_stepper, model, torch.float32)
    assert not torch.equal(stacked[0], before[0])  # the new weights matter
    for s, (a, b) in enumerate(zip(stacked, layered, strict=True)):
        assert torch.equal(a, b), f"step {s}"


def _one_step(model, computed: list[int], nums: list[int], cache_dtype=torch.float32):
    shape = model.kv_cache_shape(64, BLOCK)
    kv_caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(model.num_attention_layers)]
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(nums))]
    md = build_attention_metadata(computed, nums, tables, BLOCK)
    pos = [p for c, n in zip(computed, nums, strict=True) for p in range(c, c + n)]
    positions = torch.tensor(pos)
    hidden = model.model.embed_tokens(torch.tensor([7] * len(pos)))
    return hidden, positions, kv_caches, md


@pytest.mark.parametrize("name", ["qwen3", "qwen2_sliding"])
def test_declines_other_architectures(name, tiny_model_dir):
    """q/k norms (Qwen3) and sliding windows run layer by layer."""
    model = load_model(tiny_model_dir(name), dtype=torch.float32, device="cpu").model
    hidden, positions, kv_caches, md = _one_step(model, [0, 5], [4, 1])
    assert not llama_stack.serves_structure(model.model)
    assert llama_stack.forward(model.model, hidden, positions, kv_caches, md) is None


def test_declines_steps_with_sdpa_prefills_and_writes_nothing(tiny_model_dir, monkeypatch):
    """A prefill chunk past NATIVE_PREFILL_MAX_CONTEXT goes to SDPA: the whole step runs
    layer by layer, and the declined stack stored no K/V; a fp8 cache, dummy runs and
    `layer_by_layer` are declined too."""
    model = load_model(tiny_model_dir("llama"), dtype=torch.float32, device="cpu").model
    hidden, positions, kv_caches, md = _one_step(model, [0, 5], [9, 1])
    with torch.inference_mode():
        assert llama_stack.forward(model.model, hidden, positions, kv_caches, md) is not None
    monkeypatch.setattr(reference, "NATIVE_PREFILL_MAX_CONTEXT", 8)
    hidden, positions, kv_caches, md = _one_step(model, [0, 5], [9, 1])
    with torch.inference_mode():
        assert llama_stack.forward(model.model, hidden, positions, kv_caches, md) is None
    assert all(kv.abs().sum() == 0 for kv in kv_caches)
    assert llama_stack.forward(model.model, hidden, positions, [], None) is None
    fp8 = [kv.to(torch.float8_e4m3fn) for kv in kv_caches]
    assert llama_stack.forward(model.model, hidden, positions, fp8, md) is None
    with llama_stack.layer_by_layer():
        assert llama_stack.forward(model.model, hidden, positions, kv_caches, md) is None


def test_bad_metadata_is_refused_before_any_write(tiny_model_dir):
    model = load_model(tiny_model_dir("llama"), dtype=torch.float32, device="cpu").model
    hidden, positions, kv_caches, md = _one_step(model, [0, 5], [4, 1])
    md.seq_lens = md.seq_lens.long()
    with pytest.raises(ValueError, match=r"metadata\.seq_lens must be int32"):
        llama_stack.forward(model.model, hidden, positions, kv_caches, md)
    assert all(kv.abs().sum() == 0 for kv in kv_caches)
