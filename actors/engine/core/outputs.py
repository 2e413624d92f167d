"""What the engine core hands up after a step: per-request outputs and stats.

    update_from_output  -> EngineCoreOutput     what each request gained this step
    (front end)         -> RequestOutput        what each client gets

The types that cross down to the workers (SchedulerOutput, ModelRunnerOutput,
SamplingParams) are in `spur.actors.step`.
"""

from __future__ import annotations

from dataclasses import dataclass

from spur.actors.step import Logprobs


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
    cumulative_logprob: float | None = None
    """The sum of the sampled tokens' logprobs (vLLM's field); None unless the request
    asked for logprobs."""
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
