"""The scheduler: which requests get how many tokens this step, and where their
KV goes.

One rule, no phases: every request has `num_computed_tokens` and `num_tokens`
(+ draft tokens); each step gives requests tokens, within a token budget and a
sequence cap, so that the first catches up with the second. Running requests go
first (in admission order), then waiting ones. Chunked prefill is the budget
running out mid-prompt; a prefix hit starts `num_computed_tokens` above zero;
preemption (by recompute) resets it to zero.

Draft tokens (speculative decoding) are optional work: every running request gets
its real tokens first; then drafts, in admission order, from the budget and the free
blocks left (`_schedule_drafts`). A request whose drafts do not fit runs without them,
and no request is ever preempted for another's drafts.

When `allocate_slots` fails, a victim is preempted: under FCFS the most recently
admitted running request, under "priority" the one with the largest (priority,
arrival). Its blocks go back at once and it re-enters the front of the waiting
queue. No waiting request is admitted in a step that preempted.

Parallel sampling (n > 1): the request prefills all but its last prompt token,
then forks n - 1 children that share its full blocks by reference and get a copy
of its partly filled last block; each then computes the last prompt token and
samples on its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from spur.actors.engine.core.kv_cache_manager import KVCacheConfig, KVCacheManager
from spur.actors.engine.core.outputs import EngineCoreOutput, SchedulerStats
from spur.actors.engine.core.request import Request, RequestStatus
from spur.actors.engine.core.request_queue import make_queue
from spur.actors.engine.core.spec_decode import NgramProposer, SpecStats, SpeculativeConfig
from spur.actors.step import (
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)

SPECULATION_ON_STATE_MODELS = (
    "speculative decoding is not supported for models with recurrent-state layers (hybrid "
    "models such as Qwen3-Next / Qwen3.5): their states cannot be rolled back past "
    "rejected drafts yet; unset engine.speculative"
)
"""The error for speculation on a model with state groups (the scheduler's, and the
builder's as soon as the model is loaded, before its pool is allocated)."""


class RequestRejected(ValueError):
    """A request the engine can never serve; the message names the fix."""


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Raise RequestRejected for ids that are not ints in [0, vocab_size): the
    embedding would fail the whole step, and with it every request in the batch (a
    float or a bool passes the range check and fails later)."""
    bad = [
        t
        for t in token_ids
        if type(t) is not int or not 0 <= t < vocab_size  # bool is an int subclass
    ]
    if bad:
        raise RequestRejected(
            f"token ids {bad[:5]} are not integers in the vocabulary (0 to {vocab_size - 1}): "
            "send ids the model's tokenizer produces"
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine's steps. The settings have no defaults here: their one
    source is `spur.configs.schema.SchedulerConfig` (names, defaults, bounds, docs),
    mapped by `spur.actors.builder.EngineArgs.scheduler_config`; tests and
    simulations state every value."""

    max_num_batched_tokens: int
    """Token budget of one step (all requests together)."""
    max_num_seqs: int
    """Most requests running at once."""
    max_model_len: int
    """Most tokens (prompt + output) in one request (resolved when the model loads)."""
    long_prefill_token_threshold: int
    """Most tokens one request gets in a step when prefilling (0 = no cap)."""
    policy: str
    """'fcfs' or 'priority' (lower `priority` value runs first)."""
    check_kv_bounds: bool
    """Run the leak detector on every scheduled request every step."""
    speculative: SpeculativeConfig | None = None
    """n-gram speculative decoding (None: off). See `spec_decode.py`."""
    num_lookahead_tokens: int = 0
    """Extra slots allocated per step for draft tokens (speculative decoding)."""

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 disables it)")
        if self.num_lookahead_tokens < 0:
            raise ValueError("num_lookahead_tokens must be >= 0")
        make_queue(self.policy)  # validates the name


class Scheduler:
    """Owns the requests, their queues and the KV cache manager. Not thread-safe:
    the engine loop calls it from one thread (or one asyncio task)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_config: KVCacheConfig,
        *,
        enable_kv_events: bool = False,
    ) -> None:
        self.config = config
        self.kv = KVCacheManager(
            kv_config, max_chunk=config.max_num_batched_tokens, enable_kv_events=enable_kv_events
        )
        self.block_size = kv_config.block_size
        self._align_chunks = kv_config.has_state_groups
        # States are cached only at block boundaries: stop a prefill at its last one.
        self._cut_tail = self._align_chunks and kv_config.enable_prefix_caching
        self._check_fits_one_request(kv_config)
        if self._align_chunks:
            self._check_chunks_reach_a_block(kv_config.block_size)
        self.proposer: NgramProposer | None = None
        if config.speculative is not None:
            if kv_config.has_state_groups:
                raise ValueError(SPECULATION_ON_STATE_MODELS)
            self.proposer = NgramProposer(config.speculative)
        self.spec_stats = SpecStats()
        """Verify steps since the engine started (all requests)."""
        self._step_spec = SpecStats()

        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self._pending_forks: dict[str, int] = {}  # parent id -> n, until forked
        self._children: dict[str, list[str]] = {}
        self._known: dict[str, int] = {}  # req ids the worker holds -> tokens it was sent
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        # Preempted requests whose sampler state the worker keeps (seeded generators,
        # penalty counts) until it is told they finished, even while they wait.
        self._held_while_preempted: set[str] = set()
        self._cuts: dict[str, list[int]] = {}  # table lengths the worker must cut to

        self.total_preemptions = 0
        self._step_preemptions = 0
        self._step_tokens = 0

    def _check_chunks_reach_a_block(self, bs: int) -> None:
        """With state groups a prefill chunk ends on a block boundary (states are saved
        there), so a chunk limit below one block would schedule nothing, forever."""
        limits = {
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "long_prefill_token_threshold": self.config.long_prefill_token_threshold or bs,
        }
        for name, value in limits.items():
            if value < bs:
                raise ValueError(
                    f"{name}={value} is below block_size={bs}: a model with recurrent-state "
                    "layers computes its prefill in whole blocks, so no chunk could run; "
                    f"raise {name} to at least {bs} (or lower block_size)"
                )
        budget, seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        if budget < bs + seqs - 1:
            # Each decode takes a token of the step's budget first: past budget - bs + 1
            # of them, what is left is less than a block and no prefill chunk runs.
            logger.warning(
                "max_num_batched_tokens=%d with block_size=%d: while more than %d requests "
                "decode, a prompt's prefill (whole blocks, for the recurrent-state layers) "
                "waits until some finish; raise max_num_batched_tokens to at least %d "
                "(block_size + max_num_seqs - 1) so it never does",
                budget,
                bs,
                budget - bs,
                bs + seqs - 1,
            )

    def _check_fits_one_request(self, kv_config: KVCacheConfig) -> None:
        bs, chunk = kv_config.block_size, self.config.max_num_batched_tokens
        need = sum(
            g.spec.max_blocks(self.config.max_model_len, bs, chunk) for g in kv_config.groups
        )
        if need > kv_config.num_blocks - 1:
            raise ValueError(
                f"the KV pool has {kv_config.num_blocks - 1:,} usable blocks but one request of "
                f"max_model_len={self.config.max_model_len:,} tokens needs {need:,}: "
                "lower max_model_len or give the cache more memory"
            )

    # -- requests in and out ------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        **kwargs: Any,
    ) -> Request:
        """A Request wired to this engine's block hasher (kwargs as for Request)."""
        return Request(
            request_id, prompt_token_ids, sampling_params, block_hasher=self.kv.hasher, **kwargs
        )

    def validate_prompt(self, num_prompt_tokens: int) -> None:
        """Raise RequestRejected if a prompt of this length can never run.
        Reads only immutable config: safe from any thread."""
        max_len = self.config.max_model_len
        if num_prompt_tokens < 1:
            raise RequestRejected("the prompt is empty: send at least one token")
        if num_prompt_tokens >= max_len:
            raise RequestRejected(
                f"prompt has {num_prompt_tokens:,} tokens, max_model_len is {max_len:,} (prompt "
                "plus at least one generated token): shorten the prompt or raise max_model_len"
            )

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises RequestRejected if it can never run."""
        self.validate_prompt(request.num_prompt_tokens)
        if request.request_id in self.requests or request.request_id in self._children:
            # (the second: an n > 1 request ended while completions of it still run)
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if "#" in request.request_id:
            # A parent "a" of n > 1 names its completions "a#1", ...: an id of that form
            # would be taken over by a fork made later.
            raise RequestRejected(
                f"request id {request.request_id!r} contains '#', which names a request's "
                "completions (Request.fork_id): choose an id without it"
            )
        if request.block_hashes == [] and request.num_tokens >= self.block_size:
            # Built without this engine's hasher: hash now so prefix caching works.
            request._hasher = self.kv.hasher
            request._extend_hashes()
        self.requests[request.request_id] = request
        if request.sampling_params.n > 1:
            self._pending_forks[request.request_id] = request.sampling_params.n
            self._children[request.request_id] = []
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str] | str) -> list[EngineCoreOutput]:
        """Finish requests as aborted (and their forks); blocks are freed at
        once. Unknown or already finished ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED, with_forks=True)

    def finish_requests(
        self, request_ids: list[str] | str, status: RequestStatus, *, with_forks: bool = False
    ) -> list[EngineCoreOutput]:
        """End requests from outside the step (abort, a stop string matched by
        the detokenizer). Returns one final output per request ended.
        `with_forks`: a parent's id also ends its forks (an abort of the whole
        request); without it only the completion named ends (a stop string in
        completion 0 leaves its siblings running)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        assert status.finished
        outs = []
        for rid in request_ids:
            group = [rid, *self._children.get(rid, [])] if with_forks else [rid]
            for cid in group:
                req = self.requests.get(cid)
                if req is not None:
                    self._finish(req, status)
                    outs.append(self._output(req, []))
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- the step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide this step's work and reserve its slots. Mutates requests'
        `num_computed_tokens` (optimistically, as if the step will run)."""
        cfg = self.config
        kv = self.kv
        budget = cfg.max_num_batched_tokens
        lookahead = cfg.num_lookahead_tokens
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[list[int]]] = {}
        spec_tokens: dict[str, list[int]] = {}
        want_drafts: dict[str, int] = {}  # running request -> drafts it would verify
        preempted = False
        self._step_preemptions = 0

        if self._pending_forks:
            preempted |= self._fork_ready_parents()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget)
            if num_new <= 0:
                i += 1
                continue
            real = req.num_tokens - req.num_computed_tokens
            if num_new > real > 0:
                # Drafts are optional work: every running request's real tokens first
                # (this pass), the drafts from what is left (below), never preempting.
                want_drafts[req.request_id] = num_new - real
                num_new = real
            blocks = kv.allocate_slots(req, num_new, lookahead)
            while blocks is None:
                victim = self._pick_victim()
                preempted = True
                if victim is req:
                    self._preempt(req)
                    break
                if victim.request_id in scheduled:  # priority policy: undo its slot
                    budget += scheduled.pop(victim.request_id)
                    new_blocks.pop(victim.request_id, None)
                    spec_tokens.pop(victim.request_id, None)
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim)
                blocks = kv.allocate_slots(req, num_new, lookahead)
            if blocks is None:
                continue  # req itself was preempted; running[i] is the next one
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = blocks
            budget -= num_new
            i += 1
        budget = self._schedule_drafts(want_drafts, scheduled, new_blocks, spec_tokens, budget)

        if not preempted:
            while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
                req = self.waiting.peek()
                hits, num_hit = kv.get_computed_blocks(req, record=False)
                num_new = self._num_new_tokens(req, budget, base=num_hit)
                if num_new <= 0 and not self._fork_waits_for_admission(req, num_hit):
                    break
                blocks = kv.allocate_slots(req, num_new, lookahead, hits, num_hit)
                if blocks is None:
                    break
                kv.record_prefix_lookup(req, num_hit)  # once per admission
                self.waiting.pop()
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                self.running.append(req)
                if num_new > 0:
                    scheduled[req.request_id] = num_new
                    new_blocks[req.request_id] = blocks
                    budget -= num_new

        out = self._build_output(scheduled, new_blocks, spec_tokens)
        if cfg.check_kv_bounds:
            for rid in scheduled:
                kv.check_bounds(self.requests[rid])
        return out

    def _schedule_drafts(
        self,
        want: dict[str, int],
        scheduled: dict[str, int],
        new_blocks: dict[str, list[list[int]]],
        spec_tokens: dict[str, list[int]],
        budget: int,
    ) -> int:
        """Give the running requests scheduled with their real tokens the drafts they
        want (`want`: request id -> drafts), in admission order, from the budget and
        the free blocks left once every running request has its real tokens: a request
        whose drafts do not fit runs without them, and no one is preempted for a draft.
        Extends `scheduled`, `new_blocks` and `spec_tokens`; returns the budget left."""
        lookahead = self.config.num_lookahead_tokens
        for rid, n_drafts in want.items():
            if budget <= 0:
                break
            real = scheduled.get(rid)
            if real is None:  # preempted by a later request of higher priority
                continue
            req = self.requests[rid]
            n = min(n_drafts, budget)
            more = self.kv.allocate_slots(req, real + n, lookahead)
            if more is None:
                continue
            new_blocks[rid] = [
                old + extra for old, extra in zip(new_blocks[rid], more, strict=True)
            ]
            scheduled[rid] = real + n
            spec_tokens[rid] = req.spec_token_ids[:n]
            budget -= n
        return budget

    def _num_new_tokens(self, req: Request, budget: int, base: int | None = None) -> int:
        """How many tokens `req` gets this step: what it lacks (up to its draft
        tokens, or up to its last prompt token while a fork is pending), capped
        by the prefill threshold, the budget and max_model_len, and cut at a
        block boundary when state groups must save a state there."""
        computed = req.num_computed_tokens if base is None else base
        target = req.num_tokens_with_spec
        if req.request_id in self._pending_forks:
            target = min(target, req.num_prompt_tokens - 1)
        num_new = target - computed
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_new > threshold:
            num_new = threshold
        num_new = min(num_new, budget, self.config.max_model_len - computed)
        end = computed + num_new
        if self._align_chunks:
            bs = self.block_size
            if end < target:
                num_new = end // bs * bs - computed
            elif self._cut_tail and computed < (target - 1) // bs * bs < end:
                # The last chunk of a prefill stops first at the last block boundary
                # before its last token, so the state there is kept: the longest hit
                # a repeat of the prompt can use (its last token is always computed),
                # also when the prompt ends on a boundary. The tail follows.
                num_new = (target - 1) // bs * bs - computed
        return num_new

    def _fork_waits_for_admission(self, req: Request, num_hit: int) -> bool:
        # A parent whose prompt (minus its last token) is all cached is admitted
        # with no tokens; it forks at the start of the next step.
        return req.request_id in self._pending_forks and num_hit >= req.num_prompt_tokens - 1

    def _pick_victim(self, candidates: list[Request] | None = None) -> Request:
        """The running request to preempt (from `candidates`, default all)."""
        pool = self.running if candidates is None else candidates
        if self.config.policy == "priority":
            # Ties (a request's forks share its priority and arrival) go to the one
            # admitted last, as under fcfs; else a fork would preempt itself in turn.
            return max(reversed(pool), key=lambda r: (r.priority, r.arrival_time))
        return pool[-1]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        self._cuts.pop(req.request_id, None)
        req.num_preemptions += 1
        self.total_preemptions += 1
        self._step_preemptions += 1
        if self._known.pop(req.request_id, None) is not None:
            self._preempted_ids.add(req.request_id)
            self._held_while_preempted.add(req.request_id)
        self.waiting.prepend(req)

    def _fork_ready_parents(self) -> bool:
        """Fork every running parent whose prompt minus one token is computed: each
        copy shares the parent's blocks and runs at once when it has a seat
        (max_num_seqs) and room, preempting by the policy's order (never the parent's
        own completions) to make room. A copy for which the policy would preempt the
        parent itself, or that has no seat, waits instead: it recomputes its prompt
        when admitted (the parent's full blocks are prefix hits). So every parent
        forks in one step and never holds its last prompt token waiting for room.
        Returns True if a preemption was needed to make room for the copies."""
        preempted = False
        for parent in list(self.running):
            rid = parent.request_id
            n = self._pending_forks.get(rid)
            if n is None or parent.num_computed_tokens < parent.num_prompt_tokens - 1:
                continue
            for index in range(len(self._children[rid]) + 1, n):
                child = parent.fork(Request.fork_id(rid, index), index)
                self.requests[child.request_id] = child
                self._children[rid].append(child.request_id)
                runs = len(self.running) < self.config.max_num_seqs
                while runs and not self.kv.fork(parent, child):
                    victim = self._pick_victim([r for r in self.running if r.parent_id != rid])
                    runs = victim is not parent
                    if runs:
                        preempted = True
                        self._preempt(victim)
                if runs:
                    child.status = RequestStatus.RUNNING
                    child.num_cached_tokens = parent.num_cached_tokens
                    self.running.append(child)
                else:
                    child.status = RequestStatus.WAITING
                    # Not admitted yet (-1): admission records its prefix hit.
                    child.num_computed_tokens, child.num_cached_tokens = 0, -1
                    self.waiting.prepend(child)
            del self._pending_forks[rid]
        return preempted

    def _build_output(
        self,
        scheduled: dict[str, int],
        new_blocks: dict[str, list[list[int]]],
        spec_tokens: dict[str, list[int]],
    ) -> SchedulerOutput:
        requests = self.requests
        new_data = []
        cached = CachedRequestData()
        known = self._known
        kv = self.kv
        cuts = self._cuts
        has_cuts = bool(cuts)  # then one entry per cached request, in order
        for rid, n in scheduled.items():
            req = requests[rid]
            if rid not in known:
                new_data.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_token_ids=req.prompt_token_ids,
                        output_token_ids=req.output_token_ids,
                        sampling_params=req.sampling_params,
                        block_ids=kv.block_ids(rid),
                        num_computed_tokens=req.num_computed_tokens,
                        eos_token_id=req.eos_token_id,
                        num_resumed=req.num_resumed,
                    )
                )
            else:
                blocks = new_blocks[rid]
                sent = known[rid]
                cached.req_ids.append(rid)
                cached.new_token_ids.append(
                    req.all_token_ids[sent:] if sent < req.num_tokens else []
                )
                cached.new_block_ids.append(blocks if any(blocks) else None)
                cached.num_computed_tokens.append(req.num_computed_tokens)
                if has_cuts:
                    cached.block_table_lengths.append(cuts.pop(rid, None))
            known[rid] = req.num_tokens
            req.num_computed_tokens += n
        total = sum(scheduled.values())
        self._step_tokens = total
        out = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self._finished_ids,
            preempted_req_ids=self._preempted_ids,
            blocks_to_copy=kv.take_block_copies(),
        )
        self._finished_ids = set()
        self._preempted_ids = set()
        return out

    def resend_finished(self, request_ids: set[str] | frozenset[str]) -> None:
        """Send `request_ids` as finished again with the next step (its output's
        `finished_req_ids`): the step that carried them did not reach the workers."""
        self._finished_ids |= set(request_ids)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply sampled tokens: append them, stop requests that are done, offer
        newly computed blocks to the prefix cache. Returns per-request outputs
        (only for requests that gained a token or finished). Raises RuntimeError
        naming the request when one that ran its last position has no sampled token
        (the executor answered with another step's output)."""
        outputs = []
        sampled_all = runner_output.sampled_token_ids
        logprobs_all = runner_output.logprobs
        spec_all = scheduler_output.scheduled_spec_decode_tokens
        cache_blocks = self.kv.cache_blocks
        requests = self.requests
        running = RequestStatus.RUNNING
        for rid in scheduler_output.num_scheduled_tokens:
            req = requests.get(rid)
            if req is None or req.status is not running:
                continue  # aborted or preempted while the step ran
            sampled = sampled_all.get(rid, ())
            if spec_all:
                spec = spec_all.get(rid)
                if spec:
                    # Roll back: drafts after the first rejected one were not really
                    # computed. Their KV slots lie past num_computed_tokens, so the next
                    # step rewrites them before anything reads them, and they are never
                    # offered to the prefix cache (cache_blocks stops at computed).
                    accepted = max(len(sampled) - 1, 0)
                    if accepted < len(spec):
                        req.num_computed_tokens -= len(spec) - accepted
                        # Keep the slot of the token sampled now; free what lies past it.
                        cut = self.kv.rollback(req, req.num_computed_tokens + 1)
                        if cut is not None:
                            self._cuts[rid] = cut
                    req.num_draft_tokens += len(spec)
                    req.num_accepted_tokens += accepted
                    self.spec_stats.observe(len(spec), accepted)
                    self._step_spec.observe(len(spec), accepted)
            if req.spec_token_ids:
                req.spec_token_ids = []
            if not sampled or req.num_computed_tokens < len(req.all_token_ids):
                if not sampled and req.num_computed_tokens >= len(req.all_token_ids):
                    # Its last position ran, so the runner sampled it (drafts included):
                    # a step without its token is another step's answer. Left as is, the
                    # request would wait forever with nothing to schedule.
                    raise RuntimeError(
                        f"request {rid} ran its last position ({req.num_computed_tokens} "
                        f"of {len(req.all_token_ids)} tokens computed) but the runner "
                        "output has no token for it: the executor returned a step that "
                        "is not this one (a stale answer); create a new LLM"
                    )
                cache_blocks(req)  # prefill chunk: no token yet
                continue
            new_tokens: list[int] = []
            status = None
            for token in sampled:
                req.append_output_token_ids((token,))
                new_tokens.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            cache_blocks(req)
            logprobs = logprobs_all.get(rid) if logprobs_all else None
            if logprobs is not None:
                logprobs = logprobs[: len(new_tokens)]
            if status is not None:
                self._finish(req, status)
            elif self.proposer is not None:
                self._propose(req)
            outputs.append(self._output(req, new_tokens, logprobs))
        return outputs

    def _propose(self, req: Request) -> None:
        """Set the request's drafts for its next step (n-gram lookup); none when
        it could produce at most one more token anyway, or while at least
        `disable_by_batch_size` requests run."""
        assert self.proposer is not None
        limit = self.proposer.config.disable_by_batch_size
        if limit is not None and len(self.running) >= limit:
            req.spec_token_ids = []
            return
        num_output = req.num_output_tokens
        max_new = min(
            req.sampling_params.max_tokens - num_output,
            self.config.max_model_len - req.num_tokens,
        )
        req.spec_token_ids = self.proposer.propose(
            req.request_id, req.all_token_ids, req.sampling_params, num_output, max_new
        )

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        num_tokens = len(req.all_token_ids)
        num_output = num_tokens - req.num_prompt_tokens
        # Stop tokens count only once min_tokens outputs exist (this one included).
        if num_output >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        rid = req.request_id
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        del self.requests[rid]
        self._pending_forks.pop(rid, None)
        group = req.parent_id or rid
        children = self._children.get(group)
        live = group in self.requests or any(c in self.requests for c in children or ())
        if children is not None and not live:
            del self._children[group]  # the whole request has ended
        req.spec_token_ids = []
        self._cuts.pop(rid, None)
        if self.proposer is not None:
            self.proposer.drop(rid)
        sent = self._known.pop(rid, None) is not None
        if sent or rid in self._held_while_preempted:  # the worker must forget it
            self._held_while_preempted.discard(rid)
            self._finished_ids.add(rid)

    @staticmethod
    def _output(
        req: Request, tokens: list[int], logprobs: list[Logprobs] | None = None
    ) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=req.request_id,
            new_token_ids=tokens,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            new_logprobs=logprobs,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            parent_id=req.parent_id,
            index=req.index,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
        )

    # -- stats and checks ---------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        """Snapshot; the step counters (prefix queries/hits) restart after it."""
        prefix = self.kv.prefix_stats
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            num_free_blocks=self.kv.num_free_blocks,
            num_scheduled_tokens=self._step_tokens,
            prefix_queries=prefix.queries,
            prefix_hits=prefix.hits,
            num_preemptions=self._step_preemptions,
            total_preemptions=self.total_preemptions,
            total_evictions=self.kv.pool.stats.num_evictions,
            kv_leak_violations=self.kv.leaks.num_violations,
            spec_num_drafts=self._step_spec.num_drafts,
            spec_num_draft_tokens=self._step_spec.num_draft_tokens,
            spec_num_accepted_tokens=self._step_spec.num_accepted_tokens,
        )
        prefix.queries = prefix.hits = 0
        if self._step_spec.num_drafts:
            self._step_spec = SpecStats()
        return stats

    def check_integrity(self) -> None:
        """KV invariants plus: every request is in exactly one queue that
        matches its status, only running requests hold blocks or are known to the
        worker, a running request's full-attention blocks cover its computed tokens,
        every cached block a running request holds is the one of its own hash there,
        the blocks it still writes (from its computed tokens on) are its own and not
        cached (copy-on-write), and every block its next token reads is held (the
        sliding window's live blocks; a state group's current state)."""
        self.kv.check_integrity()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        if len(set(running_ids)) != len(running_ids) or set(running_ids) & set(waiting_ids):
            raise AssertionError("a request is queued twice")
        if set(running_ids) | set(waiting_ids) != set(self.requests):
            raise AssertionError("requests and queues disagree")
        for req in self.running:
            assert req.status == RequestStatus.RUNNING, req
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), req
            assert not any(self.kv.num_held(req.request_id)), f"waiting {req} holds blocks"
        for parent_id, children in self._children.items():
            assert parent_id in self.requests or any(c in self.requests for c in children), (
                f"fork bookkeeping of {parent_id} outlived all its completions"
            )
        held = {rid for m in self.kv.managers for rid in m.tables}
        assert held <= set(running_ids), (
            f"blocks held by non-running requests: {held - set(running_ids)}"
        )
        # What the worker is told about: only running requests.
        for name, ids in (("_known", self._known), ("_cuts", self._cuts)):
            assert set(ids) <= set(running_ids), f"{name} names {set(ids) - set(running_ids)}"
        assert set(self._pending_forks) <= set(self.requests), "a fork of a request that ended"
        # A running request's full-attention tables cover every token it has computed
        # (a rollback or retirement that freed a live block would show here), and a
        # cached block it reads at position i is the one of its own i-th hash (a wrong
        # prefix hit would show here).
        bs, null = self.block_size, self.kv.pool.null_block
        for g, m in enumerate(self.kv.managers):
            kind = m.spec.kind
            for req in self.running:
                rid, computed = req.request_id, req.num_computed_tokens
                table = m.tables.get(rid, [])
                hashes = req.block_hashes
                for i, b in enumerate(table):
                    if b is not null and b.block_hash is not None:
                        assert i < len(hashes) and b.block_hash == hashes[i], (
                            f"{rid} reads block {b.block_id} at {i}: not its hash"
                        )
                # Copy-on-write: the request writes from its computed tokens on, so a
                # block there must be its alone and not findable in the prefix cache.
                for i in range(computed // bs, len(table)):
                    b = table[i]
                    assert b is null or (b.ref_cnt == 1 and b.block_hash is None), (
                        f"{rid} writes block {b.block_id} at {i} (from token {computed}) "
                        f"that is shared ({b.ref_cnt} holders) or cached: copy-on-write missed"
                    )
                if kind != "full":
                    # Sliding window: the blocks since the window's start; state: the
                    # block of the state after the computed tokens.
                    end = -(-computed // bs)
                    start = max(0, end - 1) if kind == "state" else m._retire_until(computed)
                    lost = [i for i in range(start, end) if i >= len(table) or table[i] is null]
                    assert not lost, (
                        f"{rid}: group {g} ({kind}) holds no block at {lost}, which its "
                        f"next token reads ({computed} tokens computed)"
                    )
                if kind == "full":
                    assert len(table) * bs >= req.num_computed_tokens, (
                        f"{req.request_id}: {len(table)} blocks, {req.num_computed_tokens} tokens"
                    )
                    assert null not in table, f"{req.request_id}: a null full-attention block"
