"""Which model class serves which Hugging Face architecture.

Keyed by `config.architectures[0]`. Model modules are imported on first use.
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


def get_model_class(config: Any) -> type[nn.Module]:
    """The model class for `config.architectures[0]`.

    Raises ValueError naming the architecture and the supported ones.
    """
    arch = architecture_of(config)
    entry = _MODELS.get(arch)
    if entry is None:
        raise ValueError(
            f"architecture {arch!r} is not supported; supported: {supported_architectures()}"
        )
    module_name, class_name = entry
    module = importlib.import_module(f"spur.actors.worker.models.{module_name}")
    return getattr(module, class_name)
