"""Gated activations for the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    """`x [..., 2 * d] -> act(x[..., :d]) * x[..., d:]  # [..., d]` (SwiGLU for "silu")."""

    def __init__(self, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
            )
        self.hidden_act = hidden_act
        self._act = _ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self._act(gate) * up

    def extra_repr(self) -> str:
        return self.hidden_act
