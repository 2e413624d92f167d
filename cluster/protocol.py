"""OpenAI-compatible API shapes: request models, the mapping to `SamplingParams`,
and builders of response bodies and SSE chunks. No HTTP, no Ray, no tensors.

One request's way through this module (the ingress does the I/O around it):

    body bytes --parse_request--> CompletionRequest | ChatCompletionRequest
                                     .prompts() / .chat_messages()   -> tokenizer
                                     .to_sampling_params(default)    -> engine
    engine RequestOutput --completion_response / chat_response--> dict -> JSON
    engine Deltas --ChunkStream.update--> chunk dicts --sse()--> b"data: {...}\\n\\n"
                  ... ChunkStream.finish() (usage chunk) ... sse_done()

Field names, nesting and `object` values follow OpenAI's API exactly (the tests
validate every builder's output with the official `openai` package's types).
A few vLLM fields are added where vLLM adds them: request extras (`top_k`,
`min_p`, ...), `stop_reason` in choices, `max_model_len` in model cards.

Every failure is a `ProtocolError` (see cluster/errors.py) whose message names
the field and the fix; nothing here answers 500 for any input.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from spur.actors.step import SamplingParams, SamplingParamsError
from spur.cluster.errors import (
    FieldError,
    ProtocolError,
    from_sampling_params_error,
    from_validation_error,
    malformed_json,
    model_not_found,
)

if TYPE_CHECKING:
    from spur.actors.engine.core.outputs import RequestOutput
    from spur.actors.engine.shell.output_processor import Delta
    from spur.actors.step import Logprobs

# JSON types without coercion: "1" is not an int, true is not 1, 1.5 is not an int
# (an int is a valid float, as in JSON Schema).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = StrictBool
Str = StrictStr

TokenStr = Callable[[int], str]
"""Token id -> its text (e.g. `lambda t: tokenizer.decode([t])`), for logprobs."""

MIN_LOGPROB = -9999.0
"""What a -inf (or NaN) log-probability is sent as: JSON has no infinities (vLLM
does the same)."""

MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's bound on `logprobs` of /v1/completions."""
MAX_CHAT_TOP_LOGPROBS = 20
"""OpenAI's bound on `top_logprobs` of /v1/chat/completions."""
MAX_STOP_STRINGS = 4
"""OpenAI's bound on the number of stop strings."""


# -- ids and framing ---------------------------------------------------------------------
def make_id(prefix: str) -> str:
    """A fresh response id: make_id("cmpl") -> "cmpl-<32 hex>" ("chatcmpl" for chat)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The `created` field: Unix seconds."""
    return int(time.time())


def json_bytes(data: Any) -> bytes:
    """Compact UTF-8 JSON. Raises ValueError on a non-finite float (a bug: the
    builders clamp log-probabilities), never emits invalid JSON."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8", errors="replace")


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: b"data: {...}\\n\\n". A dict is sent as compact JSON;
    a string as it is (every line of it prefixed with "data: ", as SSE requires)."""
    text = data if isinstance(data, str) else json_bytes(data).decode("utf-8")
    lines = text.split("\n")
    return ("".join(f"data: {line}\n" for line in lines) + "\n").encode("utf-8")


def sse_done() -> bytes:
    """The event that ends every OpenAI stream."""
    return b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object, always with `prompt_tokens_details.cached_tokens`
    (prompt tokens served from the prefix cache; 0 included, so that clients can
    rely on the field)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# -- request models ----------------------------------------------------------------------
class _Nested(BaseModel):
    """Objects inside a request: unknown keys are ignored (clients add fields)."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Nested):
    include_usage: Bool | None = False
    """Send a last chunk with empty `choices` and the request's `usage`."""


class TextPart(_Nested):
    """One part of a message's content; only text parts are supported."""

    type: Str
    text: Str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text":
            raise FieldError(
                ("type",),
                f"content parts of type {self.type!r} are not supported (text only): "
                "send the content as a string or as {'type': 'text', 'text': ...} parts",
            )
        if self.text is None:
            raise FieldError(("text",), "a text part needs its 'text'")
        return self


class ChatMessage(_Nested):
    """One message of a conversation. `developer` is OpenAI's newer name for `system`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextPart] | None = None
    """A string, or text parts (joined with newlines). Only an assistant message
    may omit it."""
    name: Str | None = None
    tool_call_id: Str | None = None
    tool_calls: list[Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str | list):
            raise FieldError((), "must be a string or a list of text parts")
        return value

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise FieldError(("content",), f"a {self.role} message needs its content")
        if self.tool_calls:
            raise FieldError(
                ("tool_calls",), "tool calls are not supported: remove them from the history"
            )
        return self

    def text(self) -> str:
        """The content as one string (text parts joined with "\\n", as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class ResponseFormat(_Nested):
    type: Literal["text", "json_object", "json_schema"]

    @model_validator(mode="after")
    def _text_only(self) -> ResponseFormat:
        if self.type != "text":
            raise FieldError(
                ("type",),
                f"{self.type!r} is not supported (no structured output): remove "
                "response_format or use {'type': 'text'}",
            )
        return self


def _unsupported(fix: str, what: str = "this field") -> FieldError:
    return FieldError((), f"{what} is not supported: {fix}")


class _TopLevel(BaseModel):
    """A request body. Unknown top-level fields are accepted and ignored (OpenAI
    clients send fields this server does not know); `unknown_fields` names them
    so that the ingress can log them. Known fields are type-checked strictly (a
    string is not a number)."""

    model_config = ConfigDict(extra="allow")

    @property
    def unknown_fields(self) -> list[str]:
        """Top-level fields this server does not know (ignored), sorted."""
        return sorted(self.model_extra or {})


class _Request(_TopLevel):
    """Fields common to completions and chat completions. Value ranges are
    checked by `SamplingParams`, in `to_sampling_params`."""

    model: Str | None = None
    """Served model name; null picks the default (see `resolve_model`)."""
    n: Int | None = 1
    temperature: Float | None = None
    top_p: Float | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    stop: Str | list[Str] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    user: Str | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int | None = None
    ignore_eos: Bool | None = None
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: Bool | None = None
    priority: Int | None = None
    """Scheduling priority (lower runs first, as in vLLM); carried in `extra`."""
    cache_salt: Str | None = None
    """Separates this request's prefix-cache entries from others'; carried in `extra`."""

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        """stop: a string, or a list of at most 4 strings (or null)."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise FieldError((), "must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise FieldError((), f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise _unsupported("remove it")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise FieldError(
                ("stream_options",), "only allowed with stream=true: remove it or set stream"
            )
        return self

    # -- derived values ----------------------------------------------------------------
    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return self.n if self.n is not None else 1

    def _max_tokens(self, default_max_tokens: int) -> tuple[int, str]:
        """(value, OpenAI field name it came from)."""
        raise NotImplementedError

    def _logprobs(self) -> int | None:
        raise NotImplementedError

    @property
    def num_top_logprobs(self) -> int | None:
        """How many top alternatives to return per token; None = no logprobs."""
        return self._logprobs()

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Every sampling field mapped onto a new SamplingParams (pure).

        `default_max_tokens` applies when the request sets no max tokens (the
        ingress passes max_model_len minus the prompt's length, or a config
        default). Raises ProtocolError (400) naming the request's field when a
        value is out of range.
        """
        max_tokens, max_name = self._max_tokens(default_max_tokens)
        kwargs: dict[str, Any] = {"n": self.num_choices, "max_tokens": max_tokens}
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_tokens",
            "ignore_eos",
            "skip_special_tokens",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.stop is not None:
            kwargs["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids is not None:
            kwargs["stop_token_ids"] = tuple(self.stop_token_ids)
        kwargs["logprobs"] = self._logprobs()
        extra = {k: getattr(self, k) for k in ("user", "priority", "cache_salt")}
        kwargs["extra"] = {k: v for k, v in extra.items() if v is not None}
        try:
            return SamplingParams(**kwargs)
        except SamplingParamsError as exc:
            raise from_sampling_params_error(exc, self._param_names(max_name)) from exc

    def _param_names(self, max_name: str) -> dict[str, str]:
        return {"max_tokens": max_name}


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: Str | list[Str] | list[Int] | list[list[Int]]
    """Text, texts, token ids, or lists of token ids (one request per prompt)."""
    max_tokens: Int | None = 16
    """OpenAI's default is 16; null means `default_max_tokens`."""
    logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: Bool | None = False
    best_of: Int | None = None
    suffix: Str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        shape = (
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )
        if isinstance(value, str):
            if not value:
                raise FieldError((), "must not be empty")
            return value
        if not isinstance(value, list):
            raise FieldError((), shape)
        if not value:
            raise FieldError((), "must not be empty")
        if all(isinstance(p, str) for p in value):
            for i, p in enumerate(value):
                if not p:
                    raise FieldError((i,), "must not be empty")
        elif all(_is_token_id(t) for t in value):
            _check_token_ids(value, ())
        elif all(isinstance(p, list) for p in value):
            for i, ids in enumerate(value):
                if not ids:
                    raise FieldError((i,), "must not be empty")
                _check_token_ids(ids, (i,))
        else:
            raise FieldError((), shape)
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported("remove echo or set it to false", "echo=true (returning the prompt)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("remove it", "suffix (insertion)")
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.num_choices:
            raise FieldError(
                ("best_of",),
                f"best_of={self.best_of} is not supported: only best_of equal to n "
                f"({self.num_choices}) or null",
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one engine request each: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        ids = [x for x in p if isinstance(x, int)]
        if len(ids) == len(p):
            return [ids]  # one prompt of token ids
        out: list[str | list[int]] = []
        for x in p:
            if isinstance(x, str | list):
                out.append(x if isinstance(x, str) else list(x))
        return out

    def _max_tokens(self, default_max_tokens: int) -> tuple[int, str]:
        value = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return value, "max_tokens"

    def _logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: Int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens, which wins."""
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: Bool | None = None
    """Accepted and ignored (there are no tools)."""
    # vLLM extras for the chat template
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise _unsupported("remove tools / functions", "tool calling")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none", "auto"):
            raise _unsupported("remove it or use 'none'", "tool calling")
        return value

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if not self.messages:
            raise FieldError(("messages",), "must hold at least one message")
        if self.top_logprobs and not self.logprobs:
            raise FieldError(("top_logprobs",), "needs logprobs=true: set it or remove this")
        _check_chat_options(self.messages, self.add_generation_prompt, self.continue_final_message)
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        """[{"role", "content": str}] for the tokenizer's chat template
        (`developer` becomes `system`, which templates know)."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]

    def _max_tokens(self, default_max_tokens: int) -> tuple[int, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        if self.max_tokens is not None:
            return self.max_tokens, "max_tokens"
        return default_max_tokens, "max_completion_tokens"

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _param_names(self, max_name: str) -> dict[str, str]:
        return {"max_tokens": max_name, "logprobs": "top_logprobs"}


def _check_chat_options(
    messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool
) -> None:
    """The chat template's options, checked before templating (400 naming them)."""
    if not messages:
        raise FieldError(("messages",), "must hold at least one message")
    if add_generation_prompt and continue_final_message:
        raise FieldError(
            ("continue_final_message",),
            "cannot be combined with add_generation_prompt=true: set one of them to false",
        )
    if continue_final_message and messages[-1].role != "assistant":
        raise FieldError(
            ("continue_final_message",), "needs the last message to be the assistant's"
        )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(ids: list[Any], path: tuple[int | str, ...]) -> None:
    for i, t in enumerate(ids):
        if not _is_token_id(t) or t < 0:
            raise FieldError((*path, i), f"token ids must be integers >= 0, got {t!r}")


class TokenizeRequest(_TopLevel):
    """POST /tokenize: either {"prompt"} or {"messages"} (chat template applied)."""

    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool | None = None
    """Default: true for a prompt, false for messages (the template adds them)."""
    return_token_strs: Bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError(("prompt",), "send exactly one of prompt or messages")
        if self.messages is not None:
            _check_chat_options(
                self.messages, self.add_generation_prompt, self.continue_final_message
            )
        elif self.continue_final_message:
            raise FieldError(("continue_final_message",), "only applies to messages")
        return self

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def special_tokens(self) -> bool:
        """Whether to add the tokenizer's special tokens (BOS, ...)."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return not self.is_chat

    def chat_messages(self) -> list[dict[str, str]]:
        """As `ChatCompletionRequest.chat_messages`; [] for a prompt."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages or []
        ]


class DetokenizeRequest(_TopLevel):
    """POST /detokenize: {"tokens": [ids]} -> {"prompt": text}."""

    model: Str | None = None
    tokens: list[Int]

    @field_validator("tokens")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        _check_token_ids(value, ())
        return value


class ResetPrefixCacheRequest(_TopLevel):
    """POST /admin/reset_prefix_cache: {"lane": name} for one lane, {"replica_id": id}
    for one replica, {} for all."""

    lane: Str | None = None
    replica_id: Str | None = None


def tokenize_response(
    tokens: Sequence[int], max_model_len: int, token_strs: Sequence[str] | None = None
) -> dict[str, Any]:
    """{count, max_model_len, tokens[, token_strs]} (vLLM's /tokenize answer)."""
    out: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": list(tokens),
    }
    if token_strs is not None:
        out["token_strs"] = list(token_strs)
    return out


def detokenize_response(prompt: str) -> dict[str, Any]:
    """{"prompt": text} (vLLM's /detokenize answer)."""
    return {"prompt": prompt}


M = TypeVar("M", bound=BaseModel)


def parse_request(model_cls: type[M], body: bytes | str | dict[str, Any]) -> M:
    """Parse and validate a request body. Raises ProtocolError (400) for bad
    JSON (including NaN / Infinity, which JSON does not have), a body that is
    not an object, or a field of the wrong type or value, naming the field."""
    if isinstance(body, bytes | str):
        try:
            data = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
            raise malformed_json(str(exc) or type(exc).__name__) from None
    else:
        data = body
    if not isinstance(data, dict):
        raise ProtocolError(
            400, f"the request body must be a JSON object, got {type(data).__name__}"
        )
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def resolve_model(requested: str | None, served: Sequence[str]) -> str:
    """The served model a request names: `requested` if served, the first served
    one when the request names none. Raises ProtocolError 404 otherwise."""
    if requested is None and served:
        return served[0]
    if requested is not None and requested in served:
        return requested
    raise model_not_found(str(requested), list(served))


# -- models ------------------------------------------------------------------------------
class ModelCard(BaseModel):
    """One entry of GET /v1/models (OpenAI's Model plus vLLM's max_model_len)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "spur"
    root: str | None = None
    max_model_len: int | None = None


def models_response(
    names: Sequence[str | ModelCard], max_model_len: int | None = None
) -> dict[str, Any]:
    """{"object": "list", "data": [model cards]} for GET /v1/models."""
    cards = [
        n if isinstance(n, ModelCard) else ModelCard(id=n, root=n, max_model_len=max_model_len)
        for n in names
    ]
    return {"object": "list", "data": [c.model_dump() for c in cards]}


# -- logprobs ----------------------------------------------------------------------------
def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[Logprobs],
    token_str: TokenStr,
    *,
    text_offset: int = 0,
    num_top: int | None = None,
) -> dict[str, Any]:
    """The legacy completions format: {tokens, token_logprobs, top_logprobs:
    [{token: logprob}], text_offset}. Each top dict holds the `num_top` most
    likely tokens plus the sampled one (as OpenAI does). `text_offset` is where
    the first token's text starts in the completion (for a stream: the length of
    the text already sent). Raises ValueError if the two sequences differ in length."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = text_offset
    for tid, lp in zip(token_ids, logprobs, strict=True):
        text = token_str(tid)
        tokens.append(text)
        token_logprobs.append(_finite(lp.sampled))
        top = {token_str(t): _finite(v) for t, v in lp.top[:num_top]}
        top.setdefault(text, _finite(lp.sampled))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[Logprobs],
    token_str: TokenStr,
    *,
    num_top: int | None = None,
) -> dict[str, Any]:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}]}], "refusal": null}; `bytes` is the UTF-8 of the token's text."""

    def entry(tid: int, logprob: float) -> dict[str, Any]:
        text = token_str(tid)
        return {
            "token": text,
            "logprob": _finite(logprob),
            "bytes": list(text.encode("utf-8", errors="replace")),
        }

    content = []
    for tid, lp in zip(token_ids, logprobs, strict=True):
        item = entry(tid, lp.sampled)
        item["top_logprobs"] = [entry(t, v) for t, v in lp.top[:num_top]]
        content.append(item)
    return {"content": content, "refusal": None}


# -- non-streaming responses -------------------------------------------------------------
def completion_response(
    request_id: str,
    model: str,
    created: int,
    outputs: RequestOutput | Sequence[RequestOutput],
    *,
    prompt_tokens: int | None = None,
    token_str: TokenStr | None = None,
    num_top_logprobs: int | None = None,
) -> dict[str, Any]:
    """The body of a /v1/completions answer (object "text_completion").

    `outputs`: one finished RequestOutput per prompt, in prompt order; choice
    `index` is prompt_index * n + completion index, as OpenAI numbers them.
    `prompt_tokens` defaults to the sum of the prompts' lengths. Logprobs are
    included for completions that carry them when `token_str` is given.
    An unfinished completion has finish_reason null, which OpenAI's schema
    does not allow: the ingress sends only finished outputs (an aborted
    request, finish_reason "abort", should become an error instead).
    """
    outs = [outputs] if not isinstance(outputs, Sequence) else list(outputs)
    choices = []
    for i, out in enumerate(outs):
        n = len(out.outputs)
        for comp in out.outputs:
            lp = None
            if token_str is not None and comp.logprobs is not None:
                lp = completion_logprobs(
                    comp.token_ids, comp.logprobs, token_str, num_top=num_top_logprobs
                )
            choices.append(
                {
                    "index": i * n + comp.index,
                    "text": comp.text,
                    "logprobs": lp,
                    "finish_reason": comp.finish_reason,
                    "stop_reason": comp.stop_reason,
                }
            )
    choices.sort(key=lambda c: c["index"])
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage_of(outs, prompt_tokens),
    }


def chat_response(
    request_id: str,
    model: str,
    created: int,
    output: RequestOutput,
    *,
    prompt_tokens: int | None = None,
    token_str: TokenStr | None = None,
    num_top_logprobs: int | None = None,
) -> dict[str, Any]:
    """The body of a /v1/chat/completions answer (object "chat.completion"),
    one choice per completion of `output`; same contract as `completion_response`."""
    choices = []
    for comp in sorted(output.outputs, key=lambda c: c.index):
        lp = None
        if token_str is not None and comp.logprobs is not None:
            lp = chat_logprobs(comp.token_ids, comp.logprobs, token_str, num_top=num_top_logprobs)
        choices.append(
            {
                "index": comp.index,
                "message": {"role": "assistant", "content": comp.text},
                "logprobs": lp,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage_of([output], prompt_tokens),
    }


def _usage_of(outs: Sequence[RequestOutput], prompt_tokens: int | None) -> dict[str, Any]:
    if prompt_tokens is None:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)
    return usage(prompt_tokens, completion_tokens, cached)


# -- streaming ---------------------------------------------------------------------------
def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    *,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One streamed completions event: one choice's new text (object
    "text_completion", like the non-streamed body). With `include_usage` the
    chunk carries "usage": null, as OpenAI sends on all but the last chunk."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    *,
    role: str | None = None,
    content: str | None = None,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chat event (object "chat.completion.chunk"). The delta holds
    `role` (first chunk of a choice) and `content` when given; the last chunk of
    a choice carries its finish_reason."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(
    request_id: str, model: str, created: int, usage_: dict[str, Any], *, chat: bool
) -> dict[str, Any]:
    """The last event of a stream with include_usage: empty choices, the usage."""
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }


class ChunkStream:
    """Turns one request's engine Deltas into OpenAI stream chunks, in order.

    Usage (the ingress; each returned dict goes out as `sse(chunk)`):

        stream = ChunkStream.for_request(req, request_id=..., model=..., created=...,
                                         prompt_tokens=..., token_str=...)
        send(stream.start())                 # chat: the role chunk of every choice
        for delta in deltas:                 # from OutputProcessor.process
            send(stream.update(delta, logprobs=new_logprobs, prompt_index=0))
        send(stream.finish())                # the usage chunk, if asked for
        send_raw(sse_done())

    Chat: each choice's first chunk is {"role": "assistant", "content": ""}
    (sent by `start`, or before its first content otherwise); its last chunk
    carries finish_reason. Completions: one chunk per delta with text, logprobs
    or a finish. Deltas of a finished choice are ignored. Not thread-safe.
    """

    def __init__(
        self,
        *,
        chat: bool,
        request_id: str,
        model: str,
        created: int,
        n: int = 1,
        num_prompts: int = 1,
        prompt_tokens: int = 0,
        include_usage: bool = False,
        token_str: TokenStr | None = None,
        num_top_logprobs: int | None = None,
    ) -> None:
        self.chat = chat
        self.request_id = request_id
        self.model = model
        self.created = created
        self.n = n
        self.num_choices = n * num_prompts
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.token_str = token_str
        self.num_top_logprobs = num_top_logprobs
        self.completion_tokens = 0
        self._started = [False] * self.num_choices
        self._finished = [False] * self.num_choices
        self._text_len = [0] * self.num_choices

    @classmethod
    def for_request(
        cls,
        request: CompletionRequest | ChatCompletionRequest,
        *,
        request_id: str,
        model: str,
        created: int,
        prompt_tokens: int,
        token_str: TokenStr | None = None,
    ) -> ChunkStream:
        """A stream set up from the request's n, prompts, stream_options and logprobs."""
        chat = isinstance(request, ChatCompletionRequest)
        return cls(
            chat=chat,
            request_id=request_id,
            model=model,
            created=created,
            n=request.num_choices,
            num_prompts=len(request.prompts()) if isinstance(request, CompletionRequest) else 1,
            prompt_tokens=prompt_tokens,
            include_usage=request.include_usage,
            token_str=token_str,
            num_top_logprobs=request.num_top_logprobs,
        )

    @property
    def finished(self) -> bool:
        """True once every choice has sent its finish_reason."""
        return all(self._finished)

    def start(self) -> list[dict[str, Any]]:
        """Chat: the role chunk of every choice not started yet; completions: []."""
        if not self.chat:
            return []
        return [c for i in range(self.num_choices) for c in self._role_chunk(i)]

    def _role_chunk(self, index: int) -> list[dict[str, Any]]:
        if self._started[index]:
            return []
        self._started[index] = True
        return [
            chat_chunk(
                self.request_id,
                self.model,
                self.created,
                index,
                role="assistant",
                content="",
                include_usage=self.include_usage,
            )
        ]

    def update(
        self,
        delta: Delta,
        logprobs: Sequence[Logprobs] | None = None,
        prompt_index: int = 0,
    ) -> list[dict[str, Any]]:
        """The chunks for one Delta (possibly none: a step that produced no
        visible text, no logprobs and no finish). `logprobs`: the Logprobs of
        `delta.token_ids` (same length), sent when the request asked for them."""
        index = prompt_index * self.n + delta.index
        if self._finished[index]:
            return []
        self.completion_tokens += len(delta.token_ids)
        lp = None
        if logprobs and self.token_str is not None and self.num_top_logprobs is not None:
            ids = delta.token_ids
            if self.chat:
                lp = chat_logprobs(ids, logprobs, self.token_str, num_top=self.num_top_logprobs)
            else:
                lp = completion_logprobs(
                    ids,
                    logprobs,
                    self.token_str,
                    text_offset=self._text_len[index],
                    num_top=self.num_top_logprobs,
                )
        if not delta.text and lp is None and delta.finish_reason is None:
            return []
        self._text_len[index] += len(delta.text)
        self._finished[index] = delta.finish_reason is not None
        if not self.chat:
            return [
                completion_chunk(
                    self.request_id,
                    self.model,
                    self.created,
                    index,
                    delta.text,
                    logprobs=lp,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                    include_usage=self.include_usage,
                )
            ]
        return [
            *self._role_chunk(index),
            chat_chunk(
                self.request_id,
                self.model,
                self.created,
                index,
                content=delta.text if delta.text or lp is not None else None,
                logprobs=lp,
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
                include_usage=self.include_usage,
            ),
        ]

    def finish(self, cached_tokens: int = 0) -> list[dict[str, Any]]:
        """The usage chunk (empty choices) when the request asked for usage, else []."""
        if not self.include_usage:
            return []
        u = usage(self.prompt_tokens, self.completion_tokens, cached_tokens)
        return [usage_chunk(self.request_id, self.model, self.created, u, chat=self.chat)]


# -- OpenAPI -----------------------------------------------------------------------------
REQUEST_MODELS: dict[str, type[BaseModel]] = {}
"""Route path -> the request model its body must match (published in /openapi.json)."""


def _register_request_models() -> None:
    REQUEST_MODELS.update(
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
            "/admin/reset_prefix_cache": ResetPrefixCacheRequest,
        }
    )


_register_request_models()


def request_schemas(served_models: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """JSON Schemas of every request model and the models they nest, keyed by
    model name, with references as `#/components/schemas/NAME` (an OpenAPI
    document's components). `model` is narrowed to the served names (or null),
    so that a generated client or a fuzzer forms requests that reach an engine.
    Pure."""
    out: dict[str, dict[str, Any]] = {}
    for cls in REQUEST_MODELS.values():
        schema = cls.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            out.setdefault(name, sub)
        if served_models and "model" in schema.get("properties", {}):
            schema["properties"]["model"] = {
                "anyOf": [{"type": "string", "enum": list(served_models)}, {"type": "null"}],
                "default": None,
                "description": "A served model name (GET /v1/models); null: the first one.",
            }
        out[cls.__name__] = schema
    return out


def openapi_request_body(path: str, required: bool = True) -> dict[str, Any]:
    """The `requestBody` of a route's OpenAPI operation (for `openapi_extra`)."""
    name = REQUEST_MODELS[path].__name__
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }
