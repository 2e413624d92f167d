"""Per-step sampling inputs and the per-request state they are built from.

`SamplerState` lives in the model runner for the whole life of the worker. It holds
what the sampler needs to remember about each running request between steps:

- its `SamplingParams`, EOS id and number of output tokens so far (min_tokens);
- a `torch.Generator` on the sampling device when the request has a `seed`, so that
  its random stream depends on nothing but its own steps;
- for requests with a repetition, frequency or presence penalty only: one row of a
  pooled `[slots, vocab]` table of output-token counts and one row of a `[slots, vocab]`
  prompt-token mask. New output tokens are queued in Python and added to the table
  with one scatter at the next `build()`, so penalties never rescan a history.

Each step the runner calls `build(req_ids)` with the ids of the requests that sample,
in logits row order, and gets a `SamplingMetadata`: flags plus small tensors for the
features that some row of *this* batch uses (the others are None). When no request
in the state samples randomly, penalises, waits on min_tokens or asks for logprobs,
`build()` is O(1): the sampler then does a single argmax.

Per step, the model runner does::

    for new request:       state.add_request(req_id, params, prompt_ids, eos_id)
    for finished/aborted:  state.remove(req_id)
    meta = state.build(req_ids)                 # rows in the order of `logits`
    out = sampler(logits, meta)                 # logits: [num_reqs, vocab] float32
    state.append_sampled(req_ids, out.sampled_token_ids.tolist())

A preempted request keeps its state (do not `remove` it): its generator then goes on
where it stopped, so a seeded request gives the same tokens with or without
preemption. A request re-added after its state was dropped passes its output tokens
to `add_request` so that penalties and min_tokens count them (its generator restarts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spur.actors.step import SamplingParams

_MIN_PENALTY_SLOTS = 8


@dataclass(frozen=True)
class RowValues:
    """A per-row parameter for the rows of the batch that use a feature."""

    rows: torch.Tensor | None
    """[S] int64 batch rows, ascending; None means every row of the batch, in order."""
    values: torch.Tensor
    """[S] the parameter of each of those rows (dtype depends on the feature)."""
    max_value: float
    """max(values) as a Python number, so that the sampler needs no device sync for it."""


@dataclass(frozen=True)
class PenaltyMetadata:
    """Penalties of the rows that have at least one (the others are untouched)."""

    rows: torch.Tensor | None
    """[P] int64 batch rows, ascending; None means every row, in order."""
    repetition: torch.Tensor | None
    """[P] float32 repetition penalty (1.0 = none); None when no row has one."""
    frequency: torch.Tensor | None
    """[P] float32 frequency penalty; None when no row has one."""
    presence: torch.Tensor | None
    """[P] float32 presence penalty; None when no row has one."""
    output_counts: torch.Tensor
    """[P, vocab] int32: how often each token occurs in the row's output so far."""
    prompt_mask: torch.Tensor | None
    """[P, vocab] bool: token occurs in the prompt; None when no repetition penalty."""


@dataclass(frozen=True)
class MinTokensMask:
    """(row, token) pairs whose logits are set to -inf this step."""

    rows: torch.Tensor
    """[M] int64."""
    token_ids: torch.Tensor
    """[M] int64."""


@dataclass(frozen=True)
class LogprobsRequest:
    """The rows that want logprobs, and how many top alternatives each wants."""

    rows: torch.Tensor | None
    """[L] int64 batch rows, ascending; None means every row, in order."""
    row_list: list[int]
    """The same rows as Python ints (output assembly happens in Python anyway)."""
    num: list[int]
    """Top-N per listed row (0 = only the sampled token's logprob); N <= vocab."""
    max_num: int
    """max(num)."""


@dataclass(frozen=True)
class SamplingMetadata:
    """Everything the sampler needs for one step; built by `SamplerState.build`.

    All tensors are on the sampling device and are owned by this object: later calls to
    `SamplerState` do not change them, so it stays valid after the state moves on.
    A field that is None means no row of the batch uses that feature.
    """

    num_reqs: int
    """Rows of the logits this step."""
    all_greedy: bool
    """Every row takes the argmax (of the penalised logits)."""
    greedy: torch.Tensor | None = None
    """[num_reqs] bool, True on greedy rows; None when all rows are greedy or all random."""
    temperature: torch.Tensor | None = None
    """[num_reqs] float32 (1.0 on greedy rows); None when no random row has T != 1."""
    top_k: RowValues | None = None
    """Random rows with 0 < top_k < vocab; values int64."""
    top_p: RowValues | None = None
    """Random rows with top_p < 1; values float32."""
    min_p: RowValues | None = None
    """Random rows with min_p > 0; values float32."""
    min_tokens: MinTokensMask | None = None
    """Stop ids (and EOS) masked on rows that have fewer than min_tokens outputs."""
    penalties: PenaltyMetadata | None = None
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)
    """(row, generator) for random rows with a seed."""
    any_unseeded_random: bool = False
    """Some random row has no seed: draw its noise from `shared_generator`."""
    shared_generator: torch.Generator | None = None
    """Generator for unseeded rows; None means torch's default generator."""
    logprobs: LogprobsRequest | None = None

    @property
    def needs_processing(self) -> bool:
        """False when the step is a plain argmax of the raw logits."""
        return not self.all_greedy or self.penalties is not None or self.min_tokens is not None


@dataclass
class _Request:
    params: SamplingParams
    greedy: bool
    has_penalty: bool
    min_tokens_ids: tuple[int, ...]
    """Token ids masked while num_output < min_tokens (empty when min_tokens is 0)."""
    generator: torch.Generator | None
    slot: int | None
    """Row of the penalty tables; None without penalties."""
    num_output: int
    pending: list[int] = field(default_factory=list)
    """Output tokens appended but not yet added to the count table."""

    @property
    def min_tokens_active(self) -> bool:
        return bool(self.min_tokens_ids) and self.num_output < self.params.min_tokens


class SamplerState:
    """Per-request sampling state kept by the model runner across steps.

    Not thread-safe. `build` flushes queued output tokens into the penalty tables;
    every other method only touches Python data, except `add_request` for requests
    with penalties (it writes their table rows).
    """

    def __init__(
        self, vocab_size: int, device: torch.device | str = "cpu", seed: int | None = None
    ) -> None:
        """`seed` seeds the generator of unseeded random rows (None: torch's default)."""
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._shared: torch.Generator | None = None
        if seed is not None:
            self._shared = torch.Generator(device=self.device)
            self._shared.manual_seed(seed)
        self._reqs: dict[str, _Request] = {}
        # Counters over all requests in the state, so that `build` can take its O(1)
        # all-greedy path without looking at any request.
        self._num_random = 0
        self._num_penalized = 0
        self._num_min_tokens_active = 0
        self._num_logprobs = 0
        # Penalty tables, one row ("slot") per request with a penalty; grown by doubling.
        self._counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self._prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._free_slots: list[int] = []
        self._dirty: set[str] = set()  # requests with pending tokens

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._reqs

    def num_output_tokens(self, req_id: str) -> int:
        """Output tokens counted so far for `req_id` (KeyError if unknown)."""
        return self._reqs[req_id].num_output

    # ---- request lifecycle -------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        eos_token_id: int | None,
        output_token_ids: Sequence[int] = (),
        resumed: int = 0,
    ) -> None:
        """Start tracking a request.

        `output_token_ids` are tokens it already generated (a request resumed after its
        state was dropped); they count for penalties and min_tokens. `resumed`: the
        prompt's last ids are output another replica generated (a failover
        continuation, whose params already count them for min_tokens and max_tokens):
        they count for presence / frequency penalties, and a seeded generator is
        advanced past the draws they took (one [vocab] draw per token, as `race` makes
        them, and as `Sampler.verify` leaves them with speculative decoding). Stop ids
        at or above vocab_size can never be sampled and are ignored.
        Raises ValueError if `req_id` is already tracked or a prompt/output token id is
        outside the vocab.
        """
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} is already in the sampler state")
        greedy = params.greedy
        has_penalty = (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
        )
        min_tokens_ids: tuple[int, ...] = ()
        if params.min_tokens > 0:
            # vLLM semantics: min_tokens suppresses EOS even with ignore_eos (ignore_eos
            # only stops EOS from ending the request; it never masks it by itself).
            ids = {*params.stop_token_ids, *params.masked_eos_token_ids}
            if eos_token_id is not None:
                ids.add(eos_token_id)
            min_tokens_ids = tuple(sorted(t for t in ids if 0 <= t < self.vocab_size))
        generator = None
        if not greedy and params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
            for _ in range(resumed):  # the other replica's draws, one per token
                torch.rand(self.vocab_size, generator=generator, device=self.device)
        slot = None
        if has_penalty:
            history = list(output_token_ids)
            if resumed:
                history += list(prompt_token_ids[len(prompt_token_ids) - resumed :])
            slot = self._init_penalty_slot(prompt_token_ids, history)
        req = _Request(
            params=params,
            greedy=greedy,
            has_penalty=has_penalty,
            min_tokens_ids=min_tokens_ids,
            generator=generator,
            slot=slot,
            num_output=len(output_token_ids),
        )
        self._reqs[req_id] = req
        self._count(req, +1)

    def append_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Record tokens the request generated (KeyError if unknown). Python-only."""
        req = self._reqs[req_id]
        was_active = req.min_tokens_active
        req.num_output += len(token_ids)
        if was_active and not req.min_tokens_active:
            self._num_min_tokens_active -= 1
        if req.has_penalty and token_ids:
            req.pending.extend(token_ids)
            self._dirty.add(req_id)

    def append_sampled(self, req_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """`append_tokens` of one token per request, in `build` row order."""
        if len(req_ids) != len(token_ids):
            raise ValueError(f"{len(req_ids)} request ids but {len(token_ids)} token ids")
        for req_id, token_id in zip(req_ids, token_ids, strict=True):
            self.append_tokens(req_id, (token_id,))

    def remove(self, req_id: str) -> bool:
        """Forget a finished or aborted request; False if it was not tracked."""
        req = self._reqs.pop(req_id, None)
        if req is None:
            return False
        self._count(req, -1)
        self._dirty.discard(req_id)
        if req.slot is not None:
            self._free_slots.append(req.slot)
        return True

    # ---- per step ----------------------------------------------------------------------

    def build(self, req_ids: Sequence[str]) -> SamplingMetadata:
        """Metadata for one step whose logits rows are `req_ids`, in that order.

        O(1) when no tracked request samples randomly, has a penalty, is under its
        min_tokens or wants logprobs (the ids are then not even looked up); otherwise
        O(len(req_ids)) Python work plus a few small host-to-device copies. Raises
        KeyError for an unknown id on the non-trivial path.
        """
        num_reqs = len(req_ids)
        if (
            self._num_random == 0
            and self._num_penalized == 0
            and self._num_min_tokens_active == 0
            and self._num_logprobs == 0
        ):
            return SamplingMetadata(num_reqs=num_reqs, all_greedy=True)

        reqs = [self._reqs[r] for r in req_ids]
        greedy = [r.greedy for r in reqs]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        temperature = top_k = top_p = min_p = None
        seeded: list[tuple[int, torch.Generator]] = []
        any_unseeded = False
        if not all_greedy:
            temps = [1.0 if g else r.params.temperature for g, r in zip(greedy, reqs, strict=True)]
            if any(t != 1.0 for t in temps):
                temperature = self._tensor(temps, torch.float32)
            vocab = self.vocab_size
            top_k = self._row_values(
                reqs, greedy, lambda p: 0 < p.top_k < vocab, lambda p: p.top_k, torch.int64
            )
            top_p = self._row_values(
                reqs, greedy, lambda p: p.top_p < 1.0, lambda p: p.top_p, torch.float32
            )
            min_p = self._row_values(
                reqs, greedy, lambda p: p.min_p > 0.0, lambda p: p.min_p, torch.float32
            )
            for row, (g, r) in enumerate(zip(greedy, reqs, strict=True)):
                if g:
                    continue
                if r.generator is not None:
                    seeded.append((row, r.generator))
                else:
                    any_unseeded = True

        return SamplingMetadata(
            num_reqs=num_reqs,
            all_greedy=all_greedy,
            greedy=None if all_greedy or all_random else self._tensor(greedy, torch.bool),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            min_tokens=self._min_tokens_mask(reqs),
            penalties=self._penalties(reqs),
            seeded=seeded,
            any_unseeded_random=any_unseeded,
            shared_generator=self._shared,
            logprobs=self._logprobs(reqs),
        )

    # ---- integrity ---------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the internal invariants (counters, slots, counts); slow, for tests."""
        reqs = self._reqs.values()
        assert self._num_random == sum(not r.greedy for r in reqs)
        assert self._num_penalized == sum(r.has_penalty for r in reqs)
        assert self._num_min_tokens_active == sum(r.min_tokens_active for r in reqs)
        assert self._num_logprobs == sum(r.params.logprobs is not None for r in reqs)
        used = [r.slot for r in reqs if r.slot is not None]
        assert len(used) == self._num_penalized
        capacity = self._counts.shape[0]
        assert sorted(used + self._free_slots) == list(range(capacity)), "slot leak or double use"
        assert self._dirty == {rid for rid, r in self._reqs.items() if r.pending}
        for r in reqs:
            if r.slot is not None:
                counted = int(self._counts[r.slot].sum())
                assert counted == r.num_output - len(r.pending), "count table out of sync"

    # ---- helpers -----------------------------------------------------------------------

    def _count(self, req: _Request, sign: int) -> None:
        self._num_random += sign * (not req.greedy)
        self._num_penalized += sign * req.has_penalty
        self._num_min_tokens_active += sign * req.min_tokens_active
        self._num_logprobs += sign * (req.params.logprobs is not None)

    def _tensor(self, values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _ids_tensor(self, ids: Sequence[int], what: str) -> torch.Tensor:
        t = torch.as_tensor(list(ids), dtype=torch.int64)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            raise ValueError(f"{what} token id outside [0, vocab_size={self.vocab_size})")
        return t.to(self.device)

    def _init_penalty_slot(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> int:
        prompt = self._ids_tensor(prompt_ids, "prompt")
        output = self._ids_tensor(output_ids, "output")
        if not self._free_slots:
            old = self._counts.shape[0]
            new = max(_MIN_PENALTY_SLOTS, 2 * old)
            counts = self._counts.new_zeros(new, self.vocab_size)
            counts[:old] = self._counts
            mask = self._prompt_mask.new_zeros(new, self.vocab_size)
            mask[:old] = self._prompt_mask
            self._counts, self._prompt_mask = counts, mask
            # Reversed so that pop() hands out the lowest slot first.
            self._free_slots.extend(reversed(range(old, new)))
        slot = self._free_slots.pop()
        self._counts[slot].zero_()
        self._counts[slot].index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
        self._prompt_mask[slot].zero_()
        self._prompt_mask[slot, prompt] = True
        return slot

    def _flush_pending(self) -> None:
        """Add all queued output tokens to the count table with one scatter."""
        if not self._dirty:
            return
        slots: list[int] = []
        tokens: list[int] = []
        for req_id in self._dirty:
            req = self._reqs[req_id]
            assert req.slot is not None
            slots.extend([req.slot] * len(req.pending))
            tokens.extend(req.pending)
            req.pending.clear()
        self._dirty.clear()
        index = self._tensor([slots, tokens], torch.int64)  # [2, n]
        ones = torch.ones(index.shape[1], dtype=torch.int32, device=self.device)
        self._counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def _row_values(
        self,
        reqs: list[_Request],
        greedy: list[bool],
        uses: Callable[[SamplingParams], bool],
        value: Callable[[SamplingParams], float],
        dtype: torch.dtype,
    ) -> RowValues | None:
        """RowValues over the random rows whose params satisfy `uses`."""
        rows = [
            i for i, (g, r) in enumerate(zip(greedy, reqs, strict=True)) if not g and uses(r.params)
        ]
        if not rows:
            return None
        python_values = [value(reqs[i].params) for i in rows]
        return RowValues(
            rows=self._rows_or_none(rows, len(reqs)),
            values=self._tensor(python_values, dtype),
            max_value=max(python_values),
        )

    def _rows_or_none(self, rows: list[int], num_reqs: int) -> torch.Tensor | None:
        # Rows are ascending and unique, so covering every row means "all, in order",
        # which lets the sampler work on the logits without a gather/scatter copy.
        return None if len(rows) == num_reqs else self._tensor(rows, torch.int64)

    def _min_tokens_mask(self, reqs: list[_Request]) -> MinTokensMask | None:
        if self._num_min_tokens_active == 0:
            return None
        rows: list[int] = []
        ids: list[int] = []
        for row, r in enumerate(reqs):
            if r.min_tokens_active:
                rows.extend([row] * len(r.min_tokens_ids))
                ids.extend(r.min_tokens_ids)
        if not rows:
            return None
        index = self._tensor([rows, ids], torch.int64)
        return MinTokensMask(rows=index[0], token_ids=index[1])

    def _penalties(self, reqs: list[_Request]) -> PenaltyMetadata | None:
        if self._num_penalized == 0:
            return None
        rows = [i for i, r in enumerate(reqs) if r.has_penalty]
        if not rows:
            return None
        self._flush_pending()
        params = [reqs[i].params for i in rows]
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        slots = self._tensor([reqs[i].slot for i in rows], torch.int64)
        any_rep = any(v != 1.0 for v in rep)
        return PenaltyMetadata(
            rows=self._rows_or_none(rows, len(reqs)),
            repetition=self._tensor(rep, torch.float32) if any_rep else None,
            frequency=self._tensor(freq, torch.float32) if any(freq) else None,
            presence=self._tensor(pres, torch.float32) if any(pres) else None,
            # Advanced indexing copies, so the metadata does not alias the tables.
            output_counts=self._counts[slots],
            prompt_mask=self._prompt_mask[slots] if any_rep else None,
        )

    def _logprobs(self, reqs: list[_Request]) -> LogprobsRequest | None:
        if self._num_logprobs == 0:
            return None
        rows: list[int] = []
        num: list[int] = []
        for row, r in enumerate(reqs):
            if r.params.logprobs is not None:
                rows.append(row)
                num.append(min(r.params.logprobs, self.vocab_size))
        if not rows:
            return None
        return LogprobsRequest(
            rows=self._rows_or_none(rows, len(reqs)), row_list=rows, num=num, max_num=max(num)
        )
