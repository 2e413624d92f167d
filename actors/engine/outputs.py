"""The data that crosses the step boundary: scheduler -> worker -> scheduler -> client.

    schedule()          -> SchedulerOutput      what to compute this step
    execute_model(out)  -> ModelRunnerOutput    what was sampled
    update_from_output  -> EngineCoreOutputs    what each client gets

A worker keeps per-request state between steps, so SchedulerOutput sends a
request in full once (when it is first scheduled, or resumed after preemption)
and afterwards only what changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spur.actors.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen (or dropped at preemption): all of it."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens already generated (non-empty only when resuming after preemption);
    # the worker recomputes their KV from `num_computed_tokens`.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # Per KV-cache group, the request's whole block table (0 = null block).
    block_ids: list[list[int]]
    # Tokens whose KV is already in the cache (prefix hit); compute from here.
    num_computed_tokens: int
    eos_token_id: int | None = None


@dataclass
class CachedRequestData:
    """Requests the worker already holds, as parallel lists (one entry each)."""

    req_ids: list[str] = field(default_factory=list)
    # Tokens appended since the request was last scheduled (sampled outputs).
    new_token_ids: list[list[int]] = field(default_factory=list)
    # Per request, per group: block ids appended to the table this step
    # (None when nothing was appended in any group).
    new_block_ids: list[list[list[int]] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Per request, per group: the length to cut the block table to BEFORE appending
    # `new_block_ids` (blocks of rejected draft tokens went back to the pool); None
    # when nothing was cut. Empty when no request was cut (the common case).
    block_table_lengths: list[list[int] | None] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's work. Token counts are per request; their sum is the batch."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (prefill chunk, 1 for decode, ...).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> draft tokens to verify this step (speculative decoding).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests that ended since the last step: the worker drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted since the last step: the worker drops their state;
    # they come back later as new requests.
    preempted_req_ids: set[str] = field(default_factory=set)
    # (src, dst) block copies to apply to every layer's cache BEFORE the
    # forward (copy-on-write of a forked request's partly filled block).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class Logprobs:
    """Log-probabilities of one sampled token: its own and the top-N."""

    sampled: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass
class ModelRunnerOutput:
    """What the worker computed. Every scheduled request has an entry; a
    request in the middle of its prefill gets an empty list (no token)."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[Logprobs]] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request gained this step, for the front end to stream."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    new_logprobs: list[Logprobs] | None = None
    num_cached_tokens: int = 0
    parent_id: str | None = None
    index: int = 0
    # Speculative decoding, over the request's life so far: drafts verified and kept.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """A snapshot after one step (counters marked 'step' cover that step only)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_scheduled_tokens: int = 0  # step
    prefix_queries: int = 0  # step, tokens
    prefix_hits: int = 0  # step, tokens
    num_preemptions: int = 0  # step
    total_preemptions: int = 0
    total_evictions: int = 0
    kv_leak_violations: int = 0  # total requests flagged by the leak detector
    spec_num_drafts: int = 0  # step, verify steps (requests that had drafts)
    spec_num_draft_tokens: int = 0  # step
    spec_num_accepted_tokens: int = 0  # step


# -- what a front end returns (offline LLM API, HTTP ingress) ----------------------------
@dataclass
class CompletionOutput:
    """One of the n completions of a request, accumulated so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string hit
    logprobs: list[Logprobs] | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts verified so far
    num_accepted_tokens: int = 0  # ... and kept

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request as its client sees it: the prompt and its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
