"""n-gram (prompt-lookup) speculative decoding: the drafting and the bookkeeping.

Pure Python, no torch or Ray: the scheduler owns one `NgramProposer`; the
worker's sampler verifies the drafts (`spur.actors.worker.sampler.verify`).

One request's way through a verify step (k = 3 drafts, greedy):

    tokens   ... a b c | x          <- x sampled last step, its KV not computed yet
    drafts                 d1 d2 d3  <- the tokens that followed the last match of "b c x"
    step     computes x d1 d2 d3 (4 query rows), logits at all 4 rows
    target   t0 t1 t2 t3            <- what the model picks after x, d1, d2, d3
    accept   d1 == t0, d2 == t1, d3 != t2  ->  output d1 d2 t2   (2 accepted + 1)

The output is always the accepted prefix plus one token the model chose itself
(the correction at the first mismatch, or a bonus token after all k), so a
verify step yields 1 to k + 1 tokens. The scheduler then rolls back the
rejected drafts: the computed count drops by their number (their KV slots are
rewritten by the next step before anything reads them), and the blocks wholly
past the new last token go back to the pool (`KVCacheManager.rollback`; the
worker cuts its tables to match, `CachedRequestData.block_table_lengths`), so a
request never holds more blocks than its tokens need, as the leak detector checks.

Drafting (`propose`) matches the last n tokens, n from `max_n` down to `min_n`,
against the request's own earlier tokens (prompt and output) and drafts the k
tokens that followed the most recent earlier occurrence (continued with the
repeat's period when that occurrence ends less than k tokens before the end). An index of every
n-gram's latest end is kept per request and extended as tokens arrive, so one
proposal costs O(max_n) dict lookups however long the request is.

Requests draft only when verification is exact for their sampling parameters:
no penalties (each draft position would need its own output history), no
logprobs, min_tokens already reached. Others decode one token per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spur.actors.step import SamplingParams


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram speculation of one engine (see `configs/schema.py` for the docs)."""

    num_speculative_tokens: int
    """Most draft tokens verified per request and step (k)."""
    prompt_lookup_min: int = 2
    """Shortest suffix (n-gram) that may match."""
    prompt_lookup_max: int = 4
    """Longest suffix tried first."""
    method: str = "ngram"
    disable_by_batch_size: int | None = 8
    """Draft only while fewer than this many requests run; None: always."""

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method {self.method!r} is unknown: use 'ngram'")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1 "
                "(leave speculation unset to turn it off)"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size={self.disable_by_batch_size} must be >= 1 "
                "(None: draft at any batch size)"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} and prompt_lookup_max="
                f"{self.prompt_lookup_max}: need 1 <= min <= max"
            )


def can_draft(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when drafts of a request with these params can be verified exactly:
    no penalty, no logprobs, min_tokens already reached."""
    return (
        params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and params.logprobs is None
        and num_output_tokens >= params.min_tokens
    )


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a token list last ended.

    `last_end[n][gram] = j` means `tokens[j - n : j] == gram` and no later
    indexed j has it. Only ends j < len(tokens) are indexed, so the request's
    current suffix never matches itself.
    """

    __slots__ = ("_indexed", "last_end", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)
        }
        self._indexed = 0  # ends j < _indexed are in the index

    def extend(self, tokens: list[int]) -> None:
        """Index every end j in [indexed, len(tokens) - 1]. `tokens` only grows."""
        stop = len(tokens) - 1
        for j in range(max(self._indexed, self.min_n), stop + 1):
            for n, table in self.last_end.items():
                if j >= n:
                    table[tuple(tokens[j - n : j])] = j
        self._indexed = max(self._indexed, stop + 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest
        matching suffix; [] when no suffix of length >= min_n recurs.

        An occurrence ending at j, fewer than k tokens before the end, means the
        tokens from j on repeat with period `len(tokens) - j` (the suffix is the
        same n-gram again): the draft goes on with that period. A request looping
        on one token drafts k of it, not 1; vLLM's earliest match gives k there too."""
        self.extend(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            j = self.last_end[n].get(tuple(tokens[length - n :]))
            if j is not None:
                period = length - j
                return [tokens[j + i % period] for i in range(k)]
        return []


@dataclass
class SpecStats:
    """Counters over verify steps (vLLM's spec-decode metrics): `num_drafts`
    verify steps, `num_draft_tokens` drafts sent, `num_accepted_tokens` kept,
    and accepted counts by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class NgramProposer:
    """Drafts for the scheduler's requests; keeps one `NgramIndex` per request.
    Not thread-safe (the scheduler's thread only)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._indexes: dict[str, NgramIndex] = {}

    def propose(
        self,
        req_id: str,
        tokens: list[int],
        params: SamplingParams,
        num_output_tokens: int,
        max_new: int,
    ) -> list[int]:
        """Drafts for the request whose tokens are `tokens` (prompt + output),
        at most `max_new - 1` of them (`max_new`: tokens it may still produce;
        a verify step yields drafts + 1). [] when it must not draft."""
        k = min(self.config.num_speculative_tokens, max_new - 1)
        if k <= 0 or not can_draft(params, num_output_tokens):
            return []
        index = self._indexes.get(req_id)
        if index is None:
            cfg = self.config
            index = self._indexes[req_id] = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        return index.propose(tokens, k)

    def drop(self, req_id: str) -> None:
        """Forget a finished request's index (no-op for unknown ids)."""
        self._indexes.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._indexes)


def accepted_prefix(drafts: list[int], targets: list[int]) -> int:
    """Greedy acceptance: how many leading drafts equal the model's choice at
    the position before them (`targets[i]` follows draft i - 1)."""
    n = 0
    for d, t in zip(drafts, targets, strict=False):
        if d != t:
            break
        n += 1
    return n
