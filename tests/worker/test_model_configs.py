"""Configs that spur would compute differently from transformers are refused (or read
as transformers reads them), never served silently wrong.

Each case is a config.json transformers accepts: a hybrid with a non-silu
`hidden_act`, an architecture / model_type mismatch (Mistral saved as Llama), a
quantized checkpoint, sliding `layer_types` on Llama (which transformers' Llama
ignores), and a multimodal Qwen3.5 checkpoint whose head is tied by its top-level
`tie_word_embeddings`. Tiny models: hidden 64, 2 layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from spur.actors.worker.loader import ModelLoadError, load_config, load_model
from spur.actors.worker.models import registry
from spur.actors.worker.random_models import PRESETS, _draw, hf_config
from tests.worker.conftest import TINY  # the tiny geometry every model test uses

# Hybrid presets cut to 2 layers: one GDN layer, one full-attention layer.
HYBRID_2 = dict(num_hidden_layers=2, full_attention_interval=2)


def _save_config(config: Any, out: Path, **edits: Any) -> Path:
    """Write `config` as out/config.json, with `edits` applied to the JSON; returns `out`.

    A config built without `architectures` gets transformers' causal LM class of its
    model_type, as `save_pretrained` of a model would write."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    raw.setdefault("architectures", None)
    raw["architectures"] = raw["architectures"] or [
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[raw["model_type"]]
    ]
    raw.update(edits)
    (out / "config.json").write_text(json.dumps(raw))
    return out


# ---- 1. hybrids compute silu in the GDN convolution and the experts ----


@pytest.mark.parametrize(
    ("preset", "act"), [("qwen3_5-test", "gelu"), ("qwen3_next-test", "gelu_pytorch_tanh")]
)
def test_hybrid_with_another_hidden_act_is_refused(tmp_path, preset, act):
    config = hf_config(preset, hidden_act=act, **HYBRID_2)
    path = _save_config(config, tmp_path)
    with pytest.raises(ModelLoadError, match=rf"hidden_act is '{act}'.*'silu'"):
        load_config(path)
    cls = registry.get_model_class(config)
    with torch.device("meta"), pytest.raises(ValueError, match="hidden_act"):
        cls(config)


@pytest.mark.parametrize("preset", ["qwen3_5-test", "qwen3_next-test"])
def test_hybrid_with_silu_loads(tmp_path, preset):
    assert load_config(_save_config(hf_config(preset, **HYBRID_2), tmp_path)).hidden_act == "silu"


# ---- 2. architectures and model_type must name the same model ----


def test_mistral_saved_as_llama_is_refused(tmp_path):
    """transformers builds Mistral (model_type) with its sliding window; spur would
    build Llama (architectures) without it."""
    from transformers import MistralConfig

    path = _save_config(
        MistralConfig(**TINY, sliding_window=4), tmp_path, architectures=["LlamaForCausalLM"]
    )
    with pytest.raises(ModelLoadError, match=r"'LlamaForCausalLM'.*'mistral'.*'llama'"):
        load_config(path)


@pytest.mark.parametrize(
    ("arch", "model_type"),
    [
        ("LlamaForCausalLM", "llama"),
        ("Qwen2ForCausalLM", "qwen2"),
        ("Qwen3ForCausalLM", "qwen3"),
        ("Qwen3_5ForCausalLM", "qwen3_5_text"),
        ("Qwen3_5ForCausalLM", "qwen3_5"),
        ("Qwen3_5ForConditionalGeneration", "qwen3_5"),
        ("Qwen3NextForCausalLM", "qwen3_next"),
    ],
)
def test_registry_accepts_the_model_types_transformers_maps(arch, model_type):
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    mapped = {**MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, **MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    if arch.endswith("ForConditionalGeneration"):
        mapped = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    assert mapped[model_type] == arch  # transformers builds `arch` for this model_type
    config = type("Config", (), {"architectures": [arch], "model_type": model_type})()
    assert registry.get_model_class(config).__name__ == arch
    config.model_type = "mistral"
    with pytest.raises(ValueError, match="model_type"):
        registry.get_model_class(config)


# ---- 3. Llama has no sliding-window layers in transformers ----


def test_llama_with_sliding_layer_types_is_refused(tmp_path):
    from transformers import LlamaConfig

    path = _save_config(
        LlamaConfig(**TINY),
        tmp_path,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
    )
    with pytest.raises(ModelLoadError, match=r"layers \[0\] sliding_attention.*LlamaForCausalLM"):
        load_config(path)


def test_qwen2_sliding_layer_types_and_full_llama_layer_types_load(tmp_path):
    from transformers import LlamaConfig, Qwen2Config

    qwen2 = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert "sliding_attention" in load_config(_save_config(qwen2, tmp_path / "q")).layer_types
    full = ["full_attention", "full_attention"]
    llama = _save_config(LlamaConfig(**TINY), tmp_path / "l", layer_types=full)
    assert load_config(llama).model_type == "llama"


# ---- 4. multimodal Qwen3.5: the top-level tie_word_embeddings ties the head ----


@pytest.fixture(scope="module")
def tied_multimodal_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3_5ForConditionalGeneration folder, tie_word_embeddings true at the top
    level only (text_config's stays false): save_pretrained stores no lm_head.weight."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {k: v for k, v in PRESETS["qwen3_5-test"].items() if k != "arch"}
    text.update(HYBRID_2)
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=64,
        patch_size=2,
        temporal_patch_size=1,
        spatial_merge_size=1,
    )
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(_draw(name, p, gen))
    out = tmp_path_factory.mktemp("q35_mm_tied")
    hf.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    assert raw["tie_word_embeddings"] and not raw["text_config"].get("tie_word_embeddings")
    return out


def test_multimodal_top_level_tie_ties_the_head(tied_multimodal_dir):
    loaded = load_model(tied_multimodal_dir, dtype="float32")
    model = loaded.model
    assert model.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_hf_reference_loads_the_multimodal_class(tied_multimodal_dir):
    from spur.actors.worker import hf_reference

    ref = hf_reference.load_model(tied_multimodal_dir)
    try:
        assert type(ref).__name__ == "Qwen3_5ForConditionalGeneration"
        embed = ref.model.language_model.embed_tokens.weight
        assert torch.equal(ref.lm_head.weight, embed)
        assert hf_reference.kv_bytes_per_token(ref) == 2 * 1 * 2 * 16 * 4  # 1 attention layer
    finally:
        hf_reference.clear_cache()


def test_multimodal_top_level_tie_greedy_matches_transformers(tied_multimodal_dir):
    """spur's greedy tokens are transformers' full-forward argmax, token for token."""
    from spur.actors.llm import LLM
    from spur.actors.step import SamplingParams
    from spur.actors.worker import hf_reference

    prompts = [[3, 17, 99, 250, 4, 8], [200, 1, 1, 7, 42, 42, 42, 9, 13]]
    llm = LLM(str(tied_multimodal_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    ref = hf_reference.load_model(tied_multimodal_dir)
    try:
        for prompt, out in zip(prompts, outs, strict=True):
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([prompt + out])).logits[0]
            assert out == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    finally:
        hf_reference.clear_cache()


# ---- 5. quantized checkpoints are refused ----


def test_quantized_checkpoint_is_refused(tmp_path):
    from transformers import LlamaConfig

    quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    path = _save_config(LlamaConfig(**TINY), tmp_path, quantization_config=quant)
    with pytest.raises(ModelLoadError, match=r"quant_method 'fp8'.*unquantized.*GGUF"):
        load_config(path)
