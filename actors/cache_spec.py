"""The KV cache's shape, which the engine and the workers compute alike.

From a model's geometry (how many layers of each kind, one layer's spec) both
sides derive the same cache groups with `build_groups`: the engine core to
account for blocks (`engine/core/groups.py`, `engine/core/capacity.py`), the
worker to lay out the memory those block ids index (`worker/cache_layout.py`).
Keeping the specs here lets both import them without importing each other.

Pure data: this module imports only the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CPU_KV_BYTES = 2 << 30
"""The KV pool of a CPU engine whose cache sets neither num_kv_blocks nor kv_cache_bytes
(`cache.kv_cache_bytes` null; the worker sizes it, `spur capacity` assumes it)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- specs: the geometry of one group's layers ---------------------------------------
@dataclass(frozen=True)
class FullAttentionSpec:
    """Attention over the whole sequence; K and V per token per layer."""

    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    kind = "full"

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block of one layer: K and V for block_size tokens."""
        return 2 * block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    def max_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Blocks a request of `num_tokens` slots holds: ceil(num_tokens / bs)."""
        return cdiv(num_tokens, block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Attention over the last `sliding_window` tokens only."""

    sliding_window: int = 4096

    kind = "sliding"

    def max_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """A chunk of n new tokens needs the W - 1 tokens before it too:
        min(ceil(L / bs), ceil((W - 1 + n) / bs) + 1), with n = max_chunk."""
        window = cdiv(self.sliding_window - 1 + max_chunk, block_size) + 1
        return min(cdiv(num_tokens, block_size), window)


@dataclass(frozen=True)
class StateSpec:
    """Mamba / linear-attention layers: a fixed-size state per request and layer
    (conv state + recurrent state), not growing with the sequence."""

    state_bytes: int
    """Bytes of one layer's state (all its tensors), before padding."""

    kind = "state"

    def page_bytes(self, block_size: int) -> int:
        return self.state_bytes

    def max_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The state being read and the one being written: min(ceil(L / bs), 2)."""
        return min(cdiv(num_tokens, block_size), 2)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | StateSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """A set of layers that share block ids (one table per request)."""

    spec: KVCacheSpec
    num_layers: int


# -- a model's layers, by kind ------------------------------------------------------------
DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "float8_e4m3fn": 1,
}


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(set(DTYPE_BYTES))}") from None


@dataclass(frozen=True)
class LayerKind:
    """All layers of one kind in a model: how many, and one layer's spec."""

    name: str  # "full_attention" | "sliding_attention" | "state"
    count: int
    spec: KVCacheSpec


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    kinds: tuple[LayerKind, ...]

    @property
    def num_layers(self) -> int:
        return sum(k.count for k in self.kinds)


def build_groups(geometry: ModelGeometry) -> tuple[tuple[KVCacheGroup, ...], int]:
    """Split each layer kind into groups of `group_size` layers (the smallest
    kind count), attention kinds first. Returns the groups and group_size."""
    group_size = min(k.count for k in geometry.kinds)
    groups = []
    # Attention groups first: group 0 is the one routers match prefixes on.
    rank = {"full": 0, "sliding": 1, "state": 2}
    for kind in sorted(geometry.kinds, key=lambda k: rank[k.spec.kind]):
        left = kind.count
        while left > 0:
            n = min(group_size, left)
            groups.append(KVCacheGroup(kind.spec, n))
            left -= n
    return tuple(groups), group_size
