"""Vocabulary-parallel token embedding and LM head.

The vocabulary is cut into `T` equal contiguous ranges (the last one padded
with zero rows when `vocab_size % T != 0`):

```
vocab ids     0 ........ V/T ........ 2V/T ... V   (V rounded up to a multiple of T)
rank          |   r = 0   |   r = 1   | ...   |
```

Embedding: each rank looks up the ids in its range (others read as zero
vectors) and the partial embeddings are all-reduced. LM head: each rank
computes logits for its range and the ranges are all-gathered, so every rank
ends with the full `[n, vocab_size]` logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spur.actors.worker.layers.linear import PackedWeight, check_shape, set_weight_attrs
from spur.actors.worker.layers.parallel_state import SINGLE, TPGroup
from spur.kernels import native


class VocabParallelEmbedding(PackedWeight, nn.Module):
    """Token embedding whose rows are split by vocabulary range across TP ranks.

    forward: `input_ids [n] (int64, any id in [0, vocab_size)) -> [n, embedding_dim]`,
    identical on every rank. Tied to an LM head whose weight is packed
    (`pack_linears`), it reads its rows from the head's panels.
    """

    packs_itself = False  # lookups only: packed with a tied LM head, never alone

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp: TPGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_rank = -(-num_embeddings // tp.size)
        self.vocab_start = tp.rank * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(self.weight, weight_loader=self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy this rank's vocabulary rows of the full `[vocab, dim]` tensor; zero the padding."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused, got shard id {shard_id!r}")
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[n:].zero_()

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids [n]` of this rank's weight -> [n, dim]."""
        if self.weight_panels is not None:
            return native.linear_panel_rows(self.weight_panels, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return self._rows(input_ids)  # [n, dim]
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [n]
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        emb = self._rows(local_ids)  # [n, dim]
        emb = emb.masked_fill(~in_range.unsqueeze(-1), 0)
        return self.tp.all_reduce(emb)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings_per_rank} (of {self.num_embeddings}), "
            f"dim={self.embedding_dim}, tp={self.tp.size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocabulary logits, split by vocabulary range.

    With tied embeddings call `tie_to(embedding)`: both modules then share one
    parameter (same vocabulary split, so the shards coincide), and one packed copy.
    """

    packs_itself = True

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share `embedding.weight` (mutates self; loading fills both at once)."""
        if (embedding.num_embeddings, embedding.embedding_dim) != (
            self.num_embeddings,
            self.embedding_dim,
        ):
            raise ValueError("tied LM head and embedding must have the same shape")
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_states [n, dim] -> logits [n, vocab_size]` float32, full vocab on every
        rank: the weight's dtype's products, widened (bf16 panels write them as float32
        directly)."""
        if self.weight_panels is not None and not self.tp.is_parallel:
            return native.linear_panels_float(
                hidden_states, self.weight_panels, None, self.packed_out_features
            )
        logits = self._linear(hidden_states, None)  # [n, vocab / T]
        if self.tp.is_parallel:
            logits = self.tp.all_gather(logits, dim=-1)  # [n, vocab rounded up]
            logits = logits[:, : self.num_embeddings]
        return logits.float()

    def greedy_ids(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """`hidden_states [n, dim]` -> `[n]` int64: `forward(hidden_states).argmax(-1)`
        exactly (first maximal logit; NaN the largest), computed by the native
        `panels_argmax` without writing the logits. None where it cannot (no packed
        panels: CUDA, tensor parallel; a build without the op): then call `forward`."""
        if self.weight_panels is None or self.tp.is_parallel:
            return None
        return native.panels_argmax(hidden_states, self.weight_panels, self.packed_out_features)
