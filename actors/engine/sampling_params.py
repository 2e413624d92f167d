"""Sampling parameters of one request: pure data, validated on construction.

The engine core reads only the fields that decide when a request ends
(`max_tokens`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `n`); the worker's
sampler reads the rest. Stop *strings* are matched on detokenized text, outside
the core, which then finishes the request through `Scheduler.finish_requests`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

_GREEDY_EPS = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range. The message names the parameter,
    the value and the allowed range, so that an HTTP layer can pass it on."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; immutable once built.

    Raises `SamplingParamsError` (a ValueError) naming the first bad parameter.
    """

    n: int = 1
    """Independent completions of the prompt (forks sharing its KV blocks)."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it. Range [0, 100]."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose mass >= top_p. (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top one. [0, 1]."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated. [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of generated tokens. [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of prompt and output tokens. (0, 2]."""
    max_tokens: int = 16
    """Most tokens to generate (>= 1)."""
    min_tokens: int = 0
    """Stop tokens and EOS are suppressed until this many tokens exist (<= max_tokens)."""
    stop: tuple[str, ...] = ()
    """Stop strings, matched on the detokenized text (not part of the output)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the request (in addition to EOS unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating through the model's EOS token."""
    logprobs: int | None = None
    """Return the log-probability of each sampled token and of the top-N ones. [0, 20]."""
    prompt_logprobs: int | None = None
    """Not supported yet; must stay None."""
    skip_special_tokens: bool = True
    """Detokenization option, passed through."""
    extra: dict[str, object] = field(default_factory=dict, compare=False)
    """Free-form fields a front end wants carried along (never read by the core)."""

    def __post_init__(self) -> None:
        # Normalise lists to tuples so that the object stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        for name in ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs"):
            if isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"{name} must be an integer, not a boolean")

        def bad(param: str, value: object, allowed: str) -> SamplingParamsError:
            return SamplingParamsError(param, f"{param}={value!r} is invalid: allowed {allowed}")

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
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise bad("seed", self.seed, "an integer in [0, 2**63)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "[-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "[-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", self.repetition_penalty, "(0, 2]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(
                "min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "non-negative integers")
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
