"""RMSNorm with float32 accumulation and an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from spur.actors.worker.layers.linear import default_weight_loader, set_weight_attrs
from spur.kernels import native


class RMSNorm(nn.Module):
    """`y = w * x / sqrt(mean(x^2) + eps)`, statistics in float32.

    The normalised value is cast back to the input dtype before the weight
    multiply (as the Llama reference does), so bf16 results match it bit for bit.
    Weights are replicated on every TP rank. On CPU, 2-D float32 / bfloat16 inputs
    take the native op (kernels/native.py: one pass per row, the residual add fused;
    the same rounding, float32 sums in another order) unless SPUR_NATIVE_KERNELS=0.
    """

    # Subclasses that change the formula set this False (they keep the torch path).
    native_formula = True

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, params_dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=params_dtype), requires_grad=False
        )
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise the last dim of `x [..., hidden]`.

        Without `residual`: returns `norm(x)`. With it: returns
        `(norm(x + residual), x + residual)`, the second being the new residual
        stream. Inputs are not mutated.
        """
        lib = self._native_ops(x, residual)
        if lib is not None:
            if residual is None:
                return lib.rms_norm(x, self.weight, self.eps)
            out, new_residual = lib.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return out, new_residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _native_ops(self, x: torch.Tensor, residual: torch.Tensor | None):
        if not self.native_formula or x.dim() != 2 or x.stride(-1) != 1:
            return None
        if x.dtype != self.weight.dtype:
            return None
        if residual is not None and (
            residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1
        ):
            return None
        return native.usable(x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5 / Qwen3-Next norm: `y = (x / rms(x)) * (1 + w)`, all in float32.

    The checkpoint stores `w` centred on zero. Unlike `RMSNorm` the weight is
    applied in float32 before the cast back (`(x * (1 + w)).to(dtype)`), as
    transformers' `Qwen3_5RMSNorm` does, so bf16 results match it.
    """

    native_formula = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """Gated DeltaNet output norm: `y = (w * (x / rms(x)).to(dtype)) * silu(gate)`.

    Statistics and the gate in float32, the result cast to x's dtype (as
    transformers' `Qwen3_5RMSNormGated`). `x`, `gate`: `[..., hidden]`; the
    weight is one head's width and is replicated on every TP rank.
    """

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dtype)
        return (y * torch.nn.functional.silu(gate.float())).to(dtype)
