"""Gated activations for the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spur.kernels import native

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    """`x [..., 2 * d] -> act(x[..., :d]) * x[..., d:]  # [..., d]` (SwiGLU for "silu").

    On CPU, SiLU on a 2-D float32 / bfloat16 input is one native op (kernels/native.py)
    instead of a chunk, a SiLU and a multiply, unless SPUR_NATIVE_KERNELS=0.
    """

    def __init__(self, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
            )
        self.hidden_act = hidden_act
        self._act = _ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden_act in ("silu", "swish") and x.dim() == 2 and x.stride(-1) == 1:
            lib = native.usable(x)
            if lib is not None:
                return lib.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return self._act(gate) * up

    def extra_repr(self) -> str:
        return self.hidden_act
