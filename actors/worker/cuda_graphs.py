"""CUDA graphs for decode steps: which batch sizes to capture, which one a step uses, padding.

Pure logic (ints and numpy, no torch): the torch side is `graph_runner.DecodeGraphs`.

A decode step (every scheduled request has exactly one new token) of `n`
requests replays the graph captured for the smallest size >= n. Its inputs are
written into persistent buffers, padded to that size with dummy one-token
requests that store nothing and read only the null block (block 0, which the
block pool never hands out, so it holds zeros and is never written):

```
                      real requests (n)         padding (size - n)
input_ids     [size]  t_0 ... t_{n-1}         | 0 ... 0
positions     [size]  p_0 ... p_{n-1}         | 0 ... 0
slot_mapping  [size]  s_0 ... s_{n-1}         | -1 ... -1        (-1: not stored)
query_start   [size+1] 0 1 ... n              | n+1 ... size      (one token each)
seq_lens      [size]  p_r + 1                 | 1 ... 1           (attend to position 0)
block_table   [size, width] tables, 0-padded  | rows of 0         (the null block)
```

Every row is then an ordinary one-token request, so every attention backend
computes the padded batch without special cases, and row r of the output is
request r's (padding rows are computed and dropped). Only the first `width`
columns of the block table are written each step (the step's widest table);
kernels read no column past a request's `ceil(seq_len / block_size)`.

Prefill chunks, verify steps of speculative decoding (several tokens per
request) and batches above the largest size run eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from spur.actors.worker.input_batch import StepInputs


def capture_sizes(max_num_seqs: int, requested: Sequence[int] | None = None) -> tuple[int, ...]:
    """The decode batch sizes to capture, ascending.

    Default (`requested` None): 1, 2, 4, then every multiple of 8 up to
    `max_num_seqs`, and `max_num_seqs` itself (vLLM's choice: padding wastes at
    most 7 rows above 8, and each graph costs memory and start-up time).
    `requested`: these sizes, de-duplicated; those above `max_num_seqs` are
    dropped (a step never holds more requests). Raises ValueError for a size
    below 1 or for `max_num_seqs` below 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if requested is None:
        sizes = {1, 2, 4, *range(8, max_num_seqs + 1, 8), max_num_seqs}
    else:
        bad = [s for s in requested if s < 1]
        if bad:
            raise ValueError(f"cuda_graph_batch_sizes must be >= 1, got {bad}")
        sizes = set(requested)
    return tuple(sorted(s for s in sizes if s <= max_num_seqs))


@dataclass(frozen=True)
class GraphPlan:
    """Captured sizes and the block-table width of the persistent buffers.

    `sizes`: ascending decode batch sizes with a graph. `max_blocks_per_req`:
    columns of the persistent block table, `ceil(max_model_len / block_size)`.
    """

    sizes: tuple[int, ...]
    max_blocks_per_req: int

    def __post_init__(self) -> None:
        if list(self.sizes) != sorted(set(self.sizes)) or (self.sizes and self.sizes[0] < 1):
            raise ValueError(f"sizes must be ascending, distinct and >= 1, got {self.sizes}")
        if self.max_blocks_per_req < 1:
            raise ValueError(f"max_blocks_per_req must be >= 1, got {self.max_blocks_per_req}")

    @classmethod
    def build(
        cls,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        requested: Sequence[int] | None = None,
    ) -> GraphPlan:
        """The plan of an engine: `capture_sizes(max_num_seqs, requested)`, and a block
        table wide enough for `max_model_len` tokens."""
        if max_model_len < 1 or block_size < 1:
            raise ValueError(
                f"max_model_len ({max_model_len}) and block_size ({block_size}) must be >= 1"
            )
        width = -(-max_model_len // block_size)
        return cls(capture_sizes(max_num_seqs, requested), width)

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size >= num_reqs, or None when none is (or num_reqs < 1)."""
        if num_reqs < 1:
            return None
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def size_for(self, inputs: StepInputs) -> int | None:
        """The graph size a step replays, or None when it runs eagerly: only decode
        steps (one token per request, no drafts) whose requests and block tables fit."""
        num_reqs = len(inputs.req_ids)
        if inputs.num_tokens != num_reqs or inputs.max_query_len != 1 or inputs.drafts:
            return None
        if inputs.block_table.shape[1] > self.max_blocks_per_req:
            return None
        return self.padded_size(num_reqs)


@dataclass
class HostBuffers:
    """Persistent host-side inputs of the largest graph (numpy views; on CUDA, views
    of pinned tensors that are copied to the device buffers each step)."""

    input_ids: np.ndarray  # [max_size] int64
    positions: np.ndarray  # [max_size] int64
    slot_mapping: np.ndarray  # [max_size] int64
    query_start_loc: np.ndarray  # [max_size + 1] int32
    seq_lens: np.ndarray  # [max_size] int32
    block_table: np.ndarray  # [max_size, max_blocks_per_req] int32

    @classmethod
    def zeros(cls, plan: GraphPlan) -> HostBuffers:
        """Plain numpy buffers for `plan` (tests; the runner wraps pinned tensors)."""
        m = plan.max_size
        return cls(
            input_ids=np.zeros(m, np.int64),
            positions=np.zeros(m, np.int64),
            slot_mapping=np.zeros(m, np.int64),
            query_start_loc=np.zeros(m + 1, np.int32),
            seq_lens=np.zeros(m, np.int32),
            block_table=np.zeros((m, plan.max_blocks_per_req), np.int32),
        )


def fill_padded(buffers: HostBuffers, inputs: StepInputs, size: int) -> int:
    """Write a decode step's inputs into `buffers[:size]`, padded as in the module
    docstring (mutates `buffers`). Returns the number of block-table columns
    written (the step's width): columns past it are stale and must not be read.

    Preconditions (from `GraphPlan.size_for`): one token per request,
    `len(req_ids) <= size <= len(buffers.seq_lens)`, table width within the buffer.
    """
    n = len(inputs.req_ids)
    width = inputs.block_table.shape[1]
    if not n <= size <= len(buffers.seq_lens) or inputs.num_tokens != n:
        raise ValueError(
            f"a decode step of {n} requests ({inputs.num_tokens} tokens) does not fit graph "
            f"size {size} (buffers of {len(buffers.seq_lens)})"
        )
    buffers.input_ids[:n] = inputs.input_ids[:n]
    buffers.positions[:n] = inputs.positions[:n]
    buffers.slot_mapping[:n] = inputs.slot_mapping[:n]
    buffers.seq_lens[:n] = inputs.seq_lens[:n]
    buffers.block_table[:n, :width] = inputs.block_table
    fill_padding(buffers, n, size, width)
    return width


def fill_padding(buffers: HostBuffers, start: int, size: int, width: int) -> None:
    """Make rows `[start, size)` padding requests (see the module docstring), write
    `query_start_loc[: size + 1]`, and zero columns `[0, width)` of the padding rows
    of the block table (mutates `buffers`). With start 0: a batch of padding only,
    the dummy input graphs are captured with."""
    buffers.input_ids[start:size] = 0
    buffers.positions[start:size] = 0
    buffers.slot_mapping[start:size] = -1
    buffers.query_start_loc[: size + 1] = np.arange(size + 1, dtype=np.int32)
    buffers.seq_lens[start:size] = 1
    buffers.block_table[start:size, :width] = 0
