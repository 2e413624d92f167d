"""Which model class serves which Hugging Face architecture.

Keyed by `config.architectures[0]`; `config.model_type` must be one that
transformers builds that architecture for (transformers picks its class by
model_type, so a mismatch would serve another model than transformers does).
Model modules are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture name -> (module under spur.actors.worker.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen3", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_next", "Qwen3_5ForConditionalGeneration"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
}

# architecture name -> the config.json model_type values transformers 5 maps to it
# (AutoModelForCausalLM / AutoModelForImageTextToText). A GGUF converted by
# `loader.convert_gguf` gets its model_type from transformers' GGUF reader (SmolLM2:
# "llama"). "qwen3_5" with Qwen3_5ForCausalLM is transformers' "VLM compatibility"
# entry: the causal LM built from a multimodal config's text_config.
_MODEL_TYPES: dict[str, frozenset[str]] = {
    "LlamaForCausalLM": frozenset({"llama"}),
    "Qwen2ForCausalLM": frozenset({"qwen2"}),
    "Qwen3ForCausalLM": frozenset({"qwen3"}),
    "Qwen3_5ForCausalLM": frozenset({"qwen3_5_text", "qwen3_5"}),
    "Qwen3_5ForConditionalGeneration": frozenset({"qwen3_5"}),
    "Qwen3NextForCausalLM": frozenset({"qwen3_next"}),
}


def supported_architectures() -> list[str]:
    """Architecture names that `get_model_class` accepts, sorted."""
    return sorted(_MODELS)


def architecture_of(config: Any) -> str:
    """`config.architectures[0]`; ValueError when the config names none."""
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError(
            "config.json has no 'architectures' entry: add e.g. "
            f'"architectures": ["LlamaForCausalLM"] (supported: {supported_architectures()})'
        )
    return archs[0]


def check_model_type(config: Any, arch: str) -> None:
    """Raise ValueError when `config.model_type` is set and is not one transformers
    builds `arch` for (e.g. model_type "mistral" with LlamaForCausalLM: transformers
    builds Mistral, with its sliding window). A config without model_type passes
    (transformers' AutoConfig gives it one, checked again on the parsed config)."""
    model_type = getattr(config, "model_type", None)
    expected = _MODEL_TYPES.get(arch)
    if model_type is None or expected is None or model_type in expected:
        return
    raise ValueError(
        f"architectures names {arch!r} but model_type is {model_type!r}; transformers "
        f"builds its model from model_type, and spur serves {arch} only for model_type "
        f"{' or '.join(repr(t) for t in sorted(expected))}: fix architectures or model_type "
        "in config.json so that they name the same model"
    )


def get_model_class(config: Any) -> type[nn.Module]:
    """The model class for `config.architectures[0]`.

    Raises ValueError naming the architecture and the supported ones, or naming
    the architecture and `config.model_type` when they disagree (`check_model_type`).
    """
    arch = architecture_of(config)
    entry = _MODELS.get(arch)
    if entry is None:
        raise ValueError(
            f"architecture {arch!r} is not supported; supported: {supported_architectures()}"
        )
    check_model_type(config, arch)
    module_name, class_name = entry
    module = importlib.import_module(f"spur.actors.worker.models.{module_name}")
    return getattr(module, class_name)
