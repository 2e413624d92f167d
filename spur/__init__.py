"""spur: a Ray-distributed LLM serving cluster on paged KV-cache memory.

The Python API, where users look for it (as with vLLM):

    from spur import LLM, SamplingParams

    llm = LLM("SmolLM2-135M-Instruct")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))

The names load lazily (a module `__getattr__`): `import spur.configs` or the
engine's pure core loads neither torch nor Ray; `spur.LLM` does, on first use.
The packages themselves live in the repository's top-level folders, installed
as `spur.cluster`, `spur.actors`, `spur.kernels` and `spur.configs`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "spur.actors.llm",
    "SamplingParams": "spur.actors.step",
    "RequestOutput": "spur.actors.engine.core.outputs",
    "CompletionOutput": "spur.actors.engine.core.outputs",
}

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

# No TYPE_CHECKING imports of these: a type checker of the engine core would then
# follow them into the model code (torch) through this package.


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'spur' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
