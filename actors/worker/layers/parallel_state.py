"""Tensor-parallel group handle passed explicitly to every parallel layer.

A model is built with one `TPGroup`; layers read `rank` and `size` to decide
which slice of a weight they own and call `all_reduce` / `all_gather` on it.
Nothing is kept in a global: two models in one process (tests) can use
different groups.

With `size == 1` (or no process group) every collective is the identity, so a
single-device model pays nothing for the abstraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank: index of this process in the group, `0 <= rank < size`.
        size: number of processes that split each layer.
        group: the torch.distributed process group whose members are exactly
            the TP ranks; `None` means the default (world) group. Ignored when
            `size == 1`.
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"tensor-parallel rank {self.rank} / size {self.size} is invalid: "
                "need size >= 1 and 0 <= rank < size"
            )
        if self.size > 1 and not dist.is_initialized():
            raise ValueError(
                f"tensor parallel size {self.size} needs torch.distributed to be initialised "
                "(call torch.distributed.init_process_group first) or use tp_size=1"
            )
        if self.size > 1:
            group_size = dist.get_world_size(self.group)
            if group_size != self.size:
                raise ValueError(
                    f"the process group has {group_size} members but tp_size is {self.size}: "
                    "pass a group made of exactly the tensor-parallel ranks"
                )

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def split(self, total: int, what: str) -> int:
        """Per-rank share of `total` (which must divide evenly); `what` names it in errors."""
        if total % self.size:
            raise ValueError(
                f"{what}={total} is not divisible by tensor parallel size {self.size}: "
                "choose a tp_size that divides it"
            )
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns `x` (identity when size == 1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order (a new tensor).

        All ranks must pass tensors of the same shape.
        """
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TPGroup()
"""The trivial group: one rank, no communication."""
