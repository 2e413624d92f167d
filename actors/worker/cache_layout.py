"""One paged pool for attention pages and recurrent states (hybrid models).

The engine core groups layers (`actors/cache_spec.build_groups`): every
layer kind is split into groups of `group_size` layers, and all groups draw
block ids from one pool. A block is `group_size` pages, one per layer of the
group that owns it; a page is the largest page of any kind (smaller ones are
padded up), so a block can serve any group:

```
buffer j (j < group_size):  [num_blocks, page_bytes]  bytes, block-major
  block b owned by an attention group -> layer (group, j)'s K|V of block b
      view  [2, num_blocks, block_size, kv_heads, head_dim]   (strided: K and V of
            one block are adjacent, blocks page_bytes apart)
  block b owned by a state group      -> layer (group, j)'s state, contiguous:
      conv [K-1, conv_dim] | recurrent [Hv, dk, dv]    (state_dtype)   | padding
```

Layer i of kind k is the (i-th layer of kind k); it goes to group
`first_group[k] + idx // group_size`, buffer `idx % group_size`, where the
groups are in `build_groups` order (attention kinds first): the worker and the
engine compute the same groups from the same geometry.

`HybridMetadata` carries one metadata object per group (attention: an
`AttentionMetadata` on that group's block tables; state: a `GDNMetadata`) and
gives each layer its group's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from spur.actors.cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    LayerKind,
    ModelGeometry,
    StateSpec,
    build_groups,
)
from spur.kernels import AttentionMetadata
from spur.kernels.gdn_reference import GDNMetadata


def is_hybrid(model: torch.nn.Module) -> bool:
    """True for models that describe per-layer caches of several kinds."""
    return hasattr(model, "layer_cache_kinds")


@dataclass
class HybridMetadata:
    """Per-group metadata of one step; `for_layer(i)` is what layer i reads."""

    groups: list[AttentionMetadata | GDNMetadata]
    layer_group: list[int]

    def for_layer(self, i: int) -> AttentionMetadata | GDNMetadata:
        return self.groups[self.layer_group[i]]


@dataclass
class CacheLayout:
    """Where each layer's cache lives in the pool (this rank's sizes)."""

    geometry: ModelGeometry
    groups: tuple[KVCacheGroup, ...]
    group_size: int
    page_bytes: int
    layer_kinds: list[str]
    layer_group: list[int]
    layer_slot: list[int]
    block_size: int
    kv_dtype: torch.dtype
    state_dtype: torch.dtype
    kv_shape: tuple[int, int, int]  # (block_size, kv_heads, head_dim)
    state_shapes: tuple[tuple[int, ...], tuple[int, ...]]  # conv, recurrent
    buffers: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def for_model(
        cls,
        model: Any,
        block_size: int,
        kv_dtype: torch.dtype,
        state_dtype: torch.dtype,
    ) -> CacheLayout:
        kinds: list[str] = list(model.layer_cache_kinds)
        kv_elem = torch.empty((), dtype=kv_dtype).element_size()
        st_elem = torch.empty((), dtype=state_dtype).element_size()
        attn = FullAttentionSpec(model.num_kv_heads_per_rank, model.head_dim, kv_elem)
        conv, ssm = model.gdn_shape.state_shapes()
        state = StateSpec((math.prod(conv) + math.prod(ssm)) * st_elem)
        counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
        spec_of = {"full_attention": attn, "linear_attention": state}
        geometry = ModelGeometry(
            type(model).__name__,
            tuple(LayerKind(k, n, spec_of[k]) for k, n in counts.items()),
        )
        groups, group_size = build_groups(geometry)
        page = max(g.spec.page_bytes(block_size) for g in groups)
        if page % max(kv_elem, st_elem):
            raise ValueError(
                f"page of {page} B is not a multiple of the state / KV element size: "
                "use an even block_size"
            )
        # Groups are in build_groups order; map each layer kind to its first group.
        first: dict[str, int] = {}
        for gid, g in enumerate(groups):
            name = "linear_attention" if g.spec.kind == "state" else "full_attention"
            first.setdefault(name, gid)
        seen: dict[str, int] = {}
        layer_group, layer_slot = [], []
        for k in kinds:
            idx = seen.get(k, 0)
            seen[k] = idx + 1
            layer_group.append(first[k] + idx // group_size)
            layer_slot.append(idx % group_size)
        return cls(
            geometry=geometry,
            groups=groups,
            group_size=group_size,
            page_bytes=page,
            layer_kinds=kinds,
            layer_group=layer_group,
            layer_slot=layer_slot,
            block_size=block_size,
            kv_dtype=kv_dtype,
            state_dtype=state_dtype,
            kv_shape=(block_size, model.num_kv_heads_per_rank, model.head_dim),
            state_shapes=(conv, ssm),
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all its pages (this rank)."""
        return self.page_bytes * self.group_size

    def padding_report(self) -> list[dict[str, Any]]:
        """Per group: its own page, the padded page, and the padding share."""
        return [
            {
                "group": i,
                "kind": g.spec.kind,
                "layers": g.num_layers,
                "page_bytes": g.spec.page_bytes(self.block_size),
                "padded_page_bytes": self.page_bytes,
                "padding_percent": round(
                    100.0 * (1 - g.spec.page_bytes(self.block_size) / self.page_bytes), 2
                ),
            }
            for i, g in enumerate(self.groups)
        ]

    def allocate(self, num_blocks: int, device: torch.device) -> list[Any]:
        """Allocate the pool; returns each layer's cache view (see the module docstring)."""
        self.buffers = [
            torch.zeros(num_blocks, self.page_bytes, dtype=torch.uint8, device=device)
            for _ in range(self.group_size)
        ]
        bs, heads, dim = self.kv_shape
        conv, ssm = self.state_shapes
        n_conv, n_ssm = math.prod(conv), math.prod(ssm)
        caches: list[Any] = []
        for kind, slot in zip(self.layer_kinds, self.layer_slot, strict=True):
            buf = self.buffers[slot]
            if kind == "full_attention":
                flat = buf.view(self.kv_dtype)[:, : 2 * bs * heads * dim]
                caches.append(flat.view(num_blocks, 2, bs, heads, dim).transpose(0, 1))
            else:
                flat = buf.view(self.state_dtype)
                caches.append(
                    (
                        flat[:, :n_conv].view(num_blocks, *conv),
                        flat[:, n_conv : n_conv + n_ssm].view(num_blocks, *ssm),
                    )
                )
        return caches

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (every page) src[i] -> dst[i]."""
        if not src:
            return
        device = self.buffers[0].device
        s = torch.tensor(src, device=device)
        d = torch.tensor(dst, device=device)
        for buf in self.buffers:
            buf[d] = buf[s]

    # -- per-step metadata ------------------------------------------------------------
    def state_metadata(
        self,
        tables: list[list[int]],
        computed: list[int],
        scheduled: list[int],
        query_start_loc_cpu: torch.Tensor,
        device: torch.device,
    ) -> GDNMetadata:
        """One state group's metadata for a step.

        A step computing tokens [c, c + n) of a request reads the state after c
        tokens from position ceil(c / bs) - 1 of the group's table (src) and
        leaves the state after c + n tokens at position ceil((c + n) / bs) - 1
        (dst). They differ when the request crosses a block: the old block keeps
        its state (cacheable once full), the kernels write the new one. dst
        blocks are the request's own (fresh or partly filled, never cached), so
        no request writes a block another one reads.
        """
        bs = self.block_size
        src, dst, init = [], [], []
        for table, c, n in zip(tables, computed, scheduled, strict=True):
            d = table[-(-(c + n) // bs) - 1]
            dst.append(d)
            src.append(table[-(-c // bs) - 1] if c > 0 else d)
            init.append(c > 0)
        src_cpu = torch.tensor(src, dtype=torch.int64)
        dst_cpu = torch.tensor(dst, dtype=torch.int64)
        init_cpu = torch.tensor(init, dtype=torch.bool)
        return GDNMetadata(
            num_seqs=len(dst),
            num_actual_tokens=int(query_start_loc_cpu[-1]),
            max_query_len=max(scheduled, default=0),
            query_start_loc=query_start_loc_cpu.to(device),
            src_slots=src_cpu.to(device),
            dst_slots=dst_cpu.to(device),
            has_initial_state=init_cpu.to(device),
            query_start_loc_cpu=query_start_loc_cpu,
            src_slots_cpu=src_cpu,
            dst_slots_cpu=dst_cpu,
            has_initial_state_cpu=init_cpu,
        )


def attention_metadata_for(
    base: AttentionMetadata,
    tables: list[list[int]],
    positions: np.ndarray,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """`base` (group 0's metadata of this step) on another attention group's tables."""
    width = max([len(t) for t in tables] + [1])
    table = np.zeros((len(tables), width), dtype=np.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = t
    qsl = base.query_start_loc_cpu.numpy()
    req_of_token = np.repeat(np.arange(len(tables)), np.diff(qsl))
    slots = table[req_of_token, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    return AttentionMetadata(
        num_reqs=base.num_reqs,
        num_actual_tokens=base.num_actual_tokens,
        max_query_len=base.max_query_len,
        max_seq_len=base.max_seq_len,
        query_start_loc=base.query_start_loc,
        seq_lens=base.seq_lens,
        block_tables=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc_cpu=base.query_start_loc_cpu,
        seq_lens_cpu=base.seq_lens_cpu,
    )
