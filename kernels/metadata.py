"""Per-step attention metadata shared by every attention backend.

One `AttentionMetadata` describes one forward step of a flattened batch: the
query tokens of all scheduled requests laid end to end, in scheduler order.

```
flattened query tokens   | r0: 5 new tokens  | r1: 1 | r2: 3     | pad |
query_start_loc          0                   5       6           9
seq_lens                 [12, 40, 3]        (context incl. this step's tokens)
positions of r0's tokens 7 8 9 10 11        (= seq_len - query_len + i)
```

A request's query tokens are the LAST `query_len` positions of its context;
token `i` of request `r` sits at `seq_lens[r] - query_len_r + i` and attends
causally to positions `[0, pos]` (or `[pos - sliding_window + 1, pos]`). The
context's K/V live in the paged cache, reached through `block_tables`:
position `p` of request `r` is slot `block_tables[r, p // block_size] *
block_size + p % block_size`.

The model runner builds one instance per step and passes it explicitly to each
attention layer; nothing is kept in a global.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where each request's queries and cached context are, for one step.

    Tensors without the `_cpu` suffix live on the model's device. The `_cpu`
    copies carry the same values and exist so that host-side code (the torch
    reference, launch grids) never forces a device sync.
    """

    num_reqs: int
    # Query tokens of real requests; rows past this in `query` are padding.
    num_actual_tokens: int
    max_query_len: int
    # Longest context (cached + new) of any request in the batch.
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, unused entries 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding (not stored)
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32 on CPU
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32 on CPU
    # Per-step values a backend derives once and reuses in every layer (keyed by the
    # backend; the metadata of one step never changes, so they never go stale).
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """Query tokens per request, on CPU.  # [num_reqs] int32"""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def is_decode_only(self) -> bool:
        """True when every request has exactly one query token this step."""
        return self.max_query_len <= 1

    def check(self, block_size: int) -> None:
        """Validate internal consistency (host-side only, no device sync).

        Raises ValueError naming the inconsistent field. Meant for tests and
        debug runs; the hot path does not call it.
        """
        qsl = self.query_start_loc_cpu
        seq = self.seq_lens_cpu
        if qsl.shape != (self.num_reqs + 1,) or seq.shape != (self.num_reqs,):
            raise ValueError(
                f"query_start_loc_cpu {tuple(qsl.shape)} / seq_lens_cpu {tuple(seq.shape)} "
                f"do not match num_reqs={self.num_reqs}: expected ({self.num_reqs + 1},) "
                f"and ({self.num_reqs},)"
            )
        qlens = qsl[1:] - qsl[:-1]
        if self.num_reqs and int(qlens.min()) < 0:
            raise ValueError("query_start_loc_cpu must be non-decreasing")
        if int(qsl[-1]) != self.num_actual_tokens:
            raise ValueError(
                f"query_start_loc_cpu[-1]={int(qsl[-1])} != num_actual_tokens="
                f"{self.num_actual_tokens}"
            )
        if self.num_reqs and bool((qlens > seq).any()):
            raise ValueError("a request has more query tokens than context (seq_lens)")
        if self.num_reqs and int(qlens.max()) > self.max_query_len:
            raise ValueError(f"max_query_len={self.max_query_len} is below a query length")
        if self.num_reqs and int(seq.max()) > self.max_seq_len:
            raise ValueError(f"max_seq_len={self.max_seq_len} is below a seq_len")
        max_blocks = self.block_tables.shape[1]
        if self.num_reqs and -(-int(seq.max()) // block_size) > max_blocks:
            raise ValueError(
                f"block_tables has {max_blocks} columns, too few for seq_len "
                f"{int(seq.max())} with block_size {block_size}"
            )


def build_attention_metadata(
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    *,
    num_padded_tokens: int | None = None,
    max_blocks_per_req: int | None = None,
) -> AttentionMetadata:
    """Build metadata from plain Python lists (tests and the model runner).

    Args:
        num_computed: per request, tokens whose K/V are already in the cache.
        num_new: per request, tokens computed this step (its query length).
        block_tables: per request, the block ids holding its context in order;
            must cover `num_computed + num_new` positions.
        block_size: tokens per KV block.
        device: where the device-side tensors go.
        num_padded_tokens: total rows of the query tensor (>= sum(num_new));
            the extra rows get slot -1. Defaults to sum(num_new).
        max_blocks_per_req: width of the block table; defaults to the longest
            list in `block_tables` (at least 1).

    Returns a fresh AttentionMetadata; inputs are not mutated. Raises
    ValueError when lengths disagree or a block table is too short.
    """
    num_reqs = len(num_new)
    if len(num_computed) != num_reqs or len(block_tables) != num_reqs:
        raise ValueError(
            f"num_computed ({len(num_computed)}), num_new ({num_reqs}) and block_tables "
            f"({len(block_tables)}) must have one entry per request"
        )
    seq_lens = [c + n for c, n in zip(num_computed, num_new, strict=True)]
    for r, (s, table) in enumerate(zip(seq_lens, block_tables, strict=True)):
        if len(table) * block_size < s:
            raise ValueError(
                f"request {r}: {len(table)} blocks of {block_size} cannot hold {s} tokens; "
                "allocate more blocks before building metadata"
            )
    num_tokens = sum(num_new)
    padded = num_tokens if num_padded_tokens is None else num_padded_tokens
    if padded < num_tokens:
        raise ValueError(f"num_padded_tokens={padded} is below the {num_tokens} query tokens")
    width = max_blocks_per_req or max([len(t) for t in block_tables] + [1])

    table = torch.zeros((num_reqs, width), dtype=torch.int32)
    for r, blocks in enumerate(block_tables):
        table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    # slot of each new token: its position mapped through the request's table.
    slots = torch.full((padded,), -1, dtype=torch.int64)
    start = 0
    for c, n, blocks in zip(num_computed, num_new, block_tables, strict=True):
        if n:
            pos = torch.arange(c, c + n)
            ids = torch.tensor(blocks, dtype=torch.int64)[pos // block_size]
            slots[start : start + n] = ids * block_size + pos % block_size
        start += n

    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(list(num_new), dtype=torch.int32), 0)
    seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(num_new, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc=qsl.to(device),
        seq_lens=seq_cpu.to(device),
        block_tables=table.to(device),
        slot_mapping=slots.to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_cpu,
    )


def random_block_tables(
    seq_lens: list[int], block_size: int, spare_blocks: int, generator: torch.Generator
) -> tuple[list[list[int]], int]:
    """Test and benchmark data: block tables for requests of `seq_lens` tokens over a
    pool of just enough blocks plus `spare_blocks`, scattered by one random
    permutation drawn from `generator` (so neighbours in a table are rarely neighbours
    in the pool). Returns (tables, num_blocks)."""
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    return tables, num_blocks
