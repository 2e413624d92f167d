"""Rotary position embedding (RoPE), "rotate half" (GPT-NeoX) layout.

The first `rotary_dim` features of each head are split into two halves
`x1 = x[:rd/2]`, `x2 = x[rd/2:rd]` and rotated by the angle `pos * inv_freq[i]`:

```
out[:rd/2]   = x1 * cos - x2 * sin
out[rd/2:rd] = x2 * cos + x1 * sin
out[rd:]     = x[rd:]                 (partial rotary only)
```

cos/sin are precomputed in float32 for positions `[0, max_position)` and cast
to the activation dtype when applied (as the Hugging Face reference does).
Supported `rope_type`s: default, linear, llama3.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings of a Hugging Face config as one dict with `rope_type` and `rope_theta`.

    Reads transformers 5's `config.rope_parameters` or the older
    `config.rope_theta` + `config.rope_scaling`.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _inv_freq(rotary_dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """Inverse frequencies `[rotary_dim // 2]` float32 for the configured rope_type."""
    base = float(params["rope_theta"])
    # Explicit CPU: the model may be built under a `meta` default device.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params.get("original_max_position_embeddings", max_position))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept,
        # the band in between interpolated smoothly.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding:
    """Applies RoPE to query and key heads at explicit token positions.

    A plain object, not an `nn.Module`: it has no parameters, and one instance
    is shared by every attention layer of a model. The cos/sin table is built
    on the CPU at construction and copied once per device on first use.

    Args:
        head_dim: features per head.
        rotary_dim: leading features of each head that rotate (<= head_dim).
        max_position: positions `[0, max_position)` are supported.
        params: `rope_parameters(config)`: rope_type, rope_theta and the
            type's own keys (factor, low_freq_factor, ...).
    """

    def __init__(
        self, head_dim: int, rotary_dim: int, max_position: int, params: dict[str, Any]
    ) -> None:
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.params = dict(params)
        inv_freq = _inv_freq(rotary_dim, self.params, max_position)  # [rd/2]
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_position, rd/2]
        # Concatenated so one gather fetches both.
        self._cos_sin_cpu = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, rd]
        self._per_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """`[max_position, rotary_dim]` float32 (cos | sin) on `device` (cached)."""
        cache = self._per_device.get(device)
        if cache is None:
            cache = self._cos_sin_cpu.to(device)
            self._per_device[device] = cache
        return cache

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [n, heads, head_dim]; cos, sin [n, 1, rd/2] in x.dtype
        half = self.rotary_dim // 2
        x1 = x[..., :half]
        x2 = x[..., half : self.rotary_dim]
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rotary_dim < self.head_dim:
            parts.append(x[..., self.rotary_dim :])
        return torch.cat(parts, dim=-1)

    def __call__(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query [n, Hq, head_dim]` and `key [n, Hk, head_dim]` at `positions [n]`.

        Returns new tensors of the same shapes and dtypes; inputs are not mutated.
        """
        cos_sin = self.cos_sin_cache(positions.device)[positions]  # [n, rd]
        cos, sin = cos_sin.to(query.dtype).unsqueeze(1).chunk(2, dim=-1)  # [n, 1, rd/2]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def __repr__(self) -> str:
        return (
            f"RotaryEmbedding(head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, rope_type={self.params['rope_type']!r}, "
            f"theta={self.params['rope_theta']})"
        )
