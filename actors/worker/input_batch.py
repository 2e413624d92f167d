"""The worker's view of the requests it holds, and the step's flat input arrays.

The scheduler sends a request in full once (`NewRequestData`) and then diffs
(`CachedRequestData`); `RequestStates.update` applies them so the worker always
knows each request's tokens, block table and computed count. `prepare` turns
one step's schedule into flat numpy arrays (views of persistent buffers, no
per-step allocation for the big ones):

    request r:   computed c_r, scheduled n_r
    input_ids    [ tokens[c_0 : c_0+n_0] | tokens[c_1 : c_1+n_1] | ... ]      [num_tokens]
    positions    [ c_0 .. c_0+n_0-1      | c_1 .. c_1+n_1-1      | ... ]      [num_tokens]
    slot_mapping [ table_r[p // bs] * bs + p % bs  for each position p ]      [num_tokens]
    query_start  [ 0, n_0, n_0+n_1, ... ]                                      [num_reqs + 1]
    seq_lens     [ c_r + n_r ]                                                 [num_reqs]
    block_table  [ table_r padded with 0 ]                                     [num_reqs, width]
    logits_index [ query_start[r+1] - 1 for requests that sample ]            [num_sampling]
                 (a verify step: the last 1 + num_drafts rows of the request)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spur.actors.step import SamplingParams, SchedulerOutput


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs known to the worker
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]  # attention group's table (group 0)
    num_computed_tokens: int
    eos_token_id: int | None
    group_block_ids: list[list[int]] | None = None
    """Every group's table (hybrid models; [0] is `block_ids` itself), else None."""
    num_resumed: int = 0
    """The prompt's last ids that are another replica's output (a failover continuation)."""


@dataclass
class StepInputs:
    """One step's flat inputs (numpy views, valid until the next `prepare`)."""

    req_ids: list[str]
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    block_table: np.ndarray  # [num_reqs, width] int32
    logits_indices: np.ndarray  # [num_sampling + drafts] int64
    sampling_req_ids: list[str]
    drafts: dict[str, list[int]]
    """Draft tokens verified this step, per sampling request that has any; such a
    request owns 1 + len(drafts) consecutive logits rows (one per draft, then the last)."""
    num_tokens: int
    max_query_len: int
    max_seq_len: int


class RequestStates:
    """Requests held by one worker, kept in step with the scheduler."""

    def __init__(self, block_size: int, max_num_batched_tokens: int) -> None:
        self.block_size = block_size
        self.states: dict[str, RequestState] = {}
        cap = max(max_num_batched_tokens, 1)
        self._input_ids = np.zeros(cap, dtype=np.int64)
        self._positions = np.zeros(cap, dtype=np.int64)
        self._slots = np.zeros(cap, dtype=np.int64)

    def update(self, out: SchedulerOutput) -> list[str]:
        """Apply the schedule's diffs: drop finished and preempted requests, add
        new ones, extend cached ones. Returns the ids added."""
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.states.pop(rid, None)
        added = []
        for new in out.scheduled_new_reqs:
            tables = [list(t) for t in new.block_ids]
            self.states[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=tables[0],
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
                group_block_ids=tables if len(tables) > 1 else None,
                num_resumed=new.num_resumed,
            )
            added.append(new.req_id)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.states[rid]
            new_tokens = cached.new_token_ids[i]
            if new_tokens:
                state.token_ids.extend(new_tokens)
            if cached.block_table_lengths and (cut := cached.block_table_lengths[i]) is not None:
                # Blocks of rejected drafts went back to the pool: cut before appending.
                tables = state.group_block_ids or [state.block_ids]
                for table, length in zip(tables, cut, strict=True):
                    del table[length:]
            blocks = cached.new_block_ids[i]
            if blocks is not None:
                if state.group_block_ids is None:
                    state.block_ids.extend(blocks[0])
                else:
                    for table, ids in zip(state.group_block_ids, blocks, strict=True):
                        table.extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens[i]
        return added

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled requests (in the schedule's order)."""
        bs = self.block_size
        req_ids = list(out.num_scheduled_tokens)
        num_reqs = len(req_ids)
        total = out.total_num_scheduled_tokens
        if total > len(self._input_ids):  # a schedule bigger than the configured budget
            self._input_ids = np.zeros(total, dtype=np.int64)
            self._positions = np.zeros(total, dtype=np.int64)
            self._slots = np.zeros(total, dtype=np.int64)
        input_ids = self._input_ids[:total]
        positions = self._positions[:total]
        slots = self._slots[:total]
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        seq_lens = np.zeros(num_reqs, dtype=np.int32)
        width = 1
        tables = []
        logits_indices = []
        sampling_ids = []
        drafts: dict[str, list[int]] = {}
        spec = out.scheduled_spec_decode_tokens
        start = 0
        for r, rid in enumerate(req_ids):
            state = self.states[rid]
            n = out.num_scheduled_tokens[rid]
            c = state.num_computed_tokens
            tokens = state.token_ids
            end = c + n
            table = state.block_ids
            if n == 1 and c < len(tokens):  # a decode: scalars, no arrays (~4 us a request)
                input_ids[start] = tokens[c]
                positions[start] = c
                slots[start] = table[c // bs] * bs + c % bs
            else:
                if end <= len(tokens):
                    input_ids[start : start + n] = tokens[c:end]
                else:  # draft tokens ride after the known ones
                    known = tokens[c:]
                    input_ids[start : start + len(known)] = known
                    input_ids[start + len(known) : start + n] = spec[rid][: n - len(known)]
                pos = positions[start : start + n]
                pos[:] = np.arange(c, end)
                table_np = np.asarray(table, dtype=np.int64)
                slots[start : start + n] = table_np[pos // bs] * bs + pos % bs
            tables.append(table)
            width = max(width, len(table))
            start += n
            qsl[r + 1] = start
            seq_lens[r] = end
            if end >= len(tokens):  # the request's last known token runs: sample
                # A verify step samples at its last known token and at every draft.
                num_drafts = end - len(tokens)
                logits_indices.extend(range(start - 1 - num_drafts, start))
                sampling_ids.append(rid)
                if num_drafts:
                    drafts[rid] = spec[rid][:num_drafts]
        block_table = np.zeros((num_reqs, width), dtype=np.int32)
        for r, table in enumerate(tables):
            block_table[r, : len(table)] = table
        return StepInputs(
            req_ids=req_ids,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            logits_indices=np.asarray(logits_indices, dtype=np.int64),
            sampling_req_ids=sampling_ids,
            drafts=drafts,
            num_tokens=total,
            max_query_len=int(max(out.num_scheduled_tokens.values(), default=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
        )
