"""One request as the engine core sees it: token ids, counters and a status.

Counters (the scheduler's one rule is to make the first catch up with the last):

    |<------------- num_tokens (prompt + output) ------------->|<- spec ->|
    |<--- num_computed_tokens --->|                             |
    |<- num_cached_tokens ->|  (prefix-cache hit at admission)  |

A step schedules `num_tokens_with_spec - num_computed_tokens` tokens (or fewer,
under the token budget); prefill, chunked prefill, decode, resumption after
preemption and speculative verification are all that same rule.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from spur.actors.engine.core.hashing import BlockHash, BlockHasher, MultiModalSpan
from spur.actors.step import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every finished state sorts after PREEMPTED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "stop", "length", "abort" or None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Mutable state of one sequence. Owned by the scheduler; not thread-safe.

    `block_hashes` always covers every full block of `all_token_ids` (it is
    extended on every append), so prefix lookup and caching never rehash.
    """

    __slots__ = (
        "_hasher",
        "adapter_id",
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "eos_token_id",
        "index",
        "mm_spans",
        "num_accepted_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_draft_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_resumed",
        "parent_id",
        "priority",
        "request_id",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        mm_spans: Sequence[MultiModalSpan] = (),
        block_hasher: BlockHasher | None = None,
        parent_id: str | None = None,
        index: int = 0,
        num_resumed: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; send at least 1 token")
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.adapter_id = adapter_id
        self.mm_spans = tuple(mm_spans)
        self.parent_id = parent_id
        """For a fork of a request with n > 1: the id of the original request."""
        self.index = index
        self.num_resumed = num_resumed
        """A failover continuation: the prompt's last `num_resumed` ids are output another
        replica generated. The worker counts them for presence / frequency penalties and
        advances a seeded request's generator past their draws, so the continuation
        samples as the unbroken request would have."""
        """Which of the n completions this is (0 for the original)."""

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prompt tokens served by the prefix cache at first admission (-1: not yet)."""
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        """Speculative decoding: draft tokens verified so far, and how many were kept."""
        self.num_accepted_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        """The stop token id or stop string that ended the request, if any."""

        self._hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        if block_hasher is not None:
            self._extend_hashes()

    # -- derived counts -----------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    # -- mutation -----------------------------------------------------------------------
    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        """Append sampled tokens and hash any block they complete."""
        self.all_token_ids.extend(token_ids)
        if self._hasher is not None and (
            len(self.all_token_ids) // self._hasher.block_size > len(self.block_hashes)
        ):
            self._extend_hashes()

    def _extend_hashes(self) -> None:
        assert self._hasher is not None
        self._hasher.extend(
            self.block_hashes,
            self.all_token_ids,
            adapter_id=self.adapter_id,
            cache_salt=self.cache_salt,
            mm_spans=self.mm_spans,
        )

    @staticmethod
    def fork_id(request_id: str, index: int) -> str:
        """The engine id of completion `index` (>= 1) of an n > 1 request."""
        return f"{request_id}#{index}"

    def fork(self, child_id: str, index: int) -> Request:
        """A copy that shares this request's tokens so far (for n > 1).

        The copy has its own token list and counters; the KV manager makes the
        blocks shared. Its sampling params have n=1 (it is never forked again)
        and, when seeded, seed + index.
        """
        child = Request.__new__(Request)
        for name in Request.__slots__:
            setattr(child, name, getattr(self, name))
        child.request_id = child_id
        child.index = index
        child.parent_id = self.parent_id or self.request_id
        seed = self.sampling_params.seed
        # Each completion gets its own seed, else seeded forks would be identical.
        child.sampling_params = self.sampling_params.with_changes(
            n=1, seed=None if seed is None else (seed + index) % 2**63
        )
        child.all_token_ids = list(self.all_token_ids)
        child.spec_token_ids = []
        child.num_draft_tokens = child.num_accepted_tokens = 0
        child.block_hashes = list(self.block_hashes)
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
