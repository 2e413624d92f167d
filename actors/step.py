"""The step contract: what crosses between the engine core and the workers.

    schedule()          -> SchedulerOutput      what to compute this step
    execute_model(out)  -> ModelRunnerOutput    what was sampled
    update_from_output  -> per-request outputs  (engine side: `engine/core/outputs.py`)

The engine (`actors/engine/`) builds `SchedulerOutput`s and reads
`ModelRunnerOutput`s; the workers (`actors/worker/`) do the opposite, behind the
`Executor` interface. Both import this module and neither imports the other.
`SamplingParams` travels inside `NewRequestData`: the core reads the fields that
decide when a request ends, the worker's sampler the rest.

A worker keeps per-request state between steps, so SchedulerOutput sends a
request in full once (when it is first scheduled, or resumed after preemption)
and afterwards only what changed.

Pure data and an abstract class: this module imports only the standard library.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# -- sampling parameters -----------------------------------------------------------------
_GREEDY_EPS = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range. The message names the parameter,
    the value and the allowed range, so that an HTTP layer can pass it on."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


MIN_TEMPERATURE = 0.01
"""The smallest temperature other than 0 (vLLM's `_MAX_TEMP`): smaller ones are raised
to it, so that only 0 is greedy."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; immutable once built.

    Raises `SamplingParamsError` (a ValueError) naming the first bad parameter, for a
    value out of range and for one of the wrong type (`temperature="0.5"`,
    `stop_token_ids=[True]`).
    """

    n: int = 1
    """Independent completions of the prompt (forks sharing its KV blocks)."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it. Range [0, 100]. A value in
    (0, 0.01) is raised to 0.01, as vLLM does: only 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose mass >= top_p. (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top one. [0, 1]."""
    seed: int | None = None
    """Per-request seed (-1 means none, as in vLLM): the same seed gives the same tokens
    whatever the batch, with
    or without speculative decoding (up to floating-point differences in the logits of
    differently shaped batches, as for greedy)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated. [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of generated tokens. [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of prompt and output tokens. > 0
    (1 disables), as in vLLM."""
    max_tokens: int = 16
    """Most tokens to generate (>= 1). A request also stops at max_model_len. None (vLLM's
    "up to max_model_len") is refused: give max_model_len for that."""
    min_tokens: int = 0
    """Stop tokens and EOS are suppressed until this many tokens exist (<= max_tokens)."""
    stop: tuple[str, ...] = ()
    """Stop strings (one string, a list, or None for none), matched on the detokenized
    text (not part of the output), in text that the tokens after the first `min_tokens`
    complete."""
    include_stop_str_in_output: bool = False
    """Keep the stop string, or the text of the stop token (EOS, stop_token_ids), that
    ended a completion in its text (vLLM's extra). The token ids always hold it."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the request (in addition to EOS unless ignore_eos); None: none."""
    ignore_eos: bool = False
    """Keep generating through the model's EOS token."""
    masked_eos_token_ids: tuple[int, ...] = ()
    """The model's other EOS ids (its generation config's) under ignore_eos and
    min_tokens: they end nothing, but min_tokens masks them as it masks EOS (vLLM's
    `_all_stop_token_ids`). Set where requests enter the engine
    (`generation_config.with_eos`); without ignore_eos they are in stop_token_ids."""
    logprobs: int | None = None
    """Return the log-probability of each sampled token and of the top-N ones. [0, 20]."""
    prompt_logprobs: int | None = None
    """Not supported yet; must stay None."""
    skip_special_tokens: bool = True
    """Detokenization option, passed through."""
    extra: dict[str, object] = field(default_factory=dict, compare=False)
    """Free-form fields a front end wants carried along (never read by the core)."""

    def __post_init__(self) -> None:
        # Normalise lists to tuples so that the object stays hashable and frozen; None is
        # no stop strings / ids, as vLLM's default.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            stop = _as_tuple("stop", self.stop, "a string or a list of strings")
            object.__setattr__(self, "stop", stop)
        for name in ("stop_token_ids", "masked_eos_token_ids"):
            ids = _as_tuple(name, getattr(self, name), "a list of non-negative integers")
            object.__setattr__(self, name, ids)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM: no seed
            object.__setattr__(self, "seed", None)
        t = self.temperature
        if isinstance(t, (int, float)) and 0.0 < t < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        self._validate()

    def _validate(self) -> None:
        for name in ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs"):
            if isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be an integer, not a boolean")

        def bad(param: str, value: object, allowed: str) -> SamplingParamsError:
            return SamplingParamsError(param, f"{param}={value!r} is invalid: allowed {allowed}")

        # A string, None or a boolean where a number is meant would fail the range checks
        # below with a TypeError naming no parameter.
        for name in _FLOAT_PARAMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise bad(name, value, "a number")
            if not isinstance(value, (int, float)):  # numpy's float32, Fraction: plain
                object.__setattr__(self, name, float(value))
        if self.max_tokens is None:
            # vLLM's None: up to the room max_model_len leaves. Not here: max_tokens is an
            # int through the engine core; a request stops at max_model_len anyway.
            raise SamplingParamsError(
                "max_tokens",
                "max_tokens=None is invalid: allowed an integer >= 1 (leave it out for 16; "
                "to generate until the context is full, as vLLM's None, give max_tokens="
                "max_model_len: a request stops there, finish_reason 'length')",
            )
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            raise bad("n", self.n, "an integer in [1, 128]")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", self.temperature, "[0, 100] (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "(0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 or -1 disables)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "[0, 1]")
        if self.seed is not None and not (
            isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63
        ):
            raise bad("seed", self.seed, "a 64-bit signed integer, in [-2**63, 2**63)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "[-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "[-2, 2]")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(
                "min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
        for name in ("stop_token_ids", "masked_eos_token_ids"):
            ids = getattr(self, name)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise bad(name, ids, "non-negative integers")
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20
        ):
            raise bad("logprobs", self.logprobs, "an integer in [0, 20] or null")
        if self.prompt_logprobs is not None:
            raise bad(
                "prompt_logprobs", self.prompt_logprobs, "null (prompt logprobs are not supported)"
            )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def with_changes(self, **changes: object) -> SamplingParams:
        """A validated copy with some fields replaced (for example n=1 for forks)."""
        return replace(self, **changes)  # type: ignore[arg-type]


_FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
"""The parameters that take a number (an int or a float, not a boolean)."""


def _as_tuple(param: str, value: object, allowed: str) -> tuple[Any, ...]:
    """`value` (a list, tuple or other iterable; None: empty) as a tuple. Raises
    SamplingParamsError naming `param` for a value that is not a collection."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise SamplingParamsError(param, f"{param}={value!r} is invalid: allowed {allowed}")
    return tuple(value)


# -- scheduler output / model-runner output ----------------------------------------------
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
    # A failover continuation: the prompt's last ids that are another replica's output.
    num_resumed: int = 0


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


# -- the executor interface ----------------------------------------------------------------
class Executor(abc.ABC):
    """Runs one step's model work for an engine."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens; sample for requests that completed
        their scheduled context. Must handle an empty schedule (state updates
        only: finished / preempted ids)."""

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call `method` on every worker; returns one result per worker."""
        fn = getattr(self, method) if isinstance(method, str) else method
        return [fn(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        """Release workers and devices (idempotent)."""
        return None
