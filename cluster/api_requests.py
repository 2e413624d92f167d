"""OpenAI-compatible API shapes, incoming: request models, parsing, the mapping
to `SamplingParams`, and their JSON Schemas for /openapi.json. No HTTP, no Ray,
no tensors.

One request's way through this module (the ingress does the I/O around it):

    body bytes --parse_request--> CompletionRequest | ChatCompletionRequest
                                     .prompts() / .chat_messages()   -> tokenizer
                                     .to_sampling_params(default)    -> engine

Field names follow OpenAI's API exactly; a few vLLM request extras (`top_k`,
`min_p`, ...) are added where vLLM adds them. The outgoing side (response
bodies, SSE chunks) is `cluster/api_responses.py`.

Every failure is a `ProtocolError` (see cluster/errors.py) whose message names
the field and the fix; nothing here answers 500 for any input.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
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

from spur.actors.engine.shell.chat_template import ROLE_ALIASES, join_text_parts
from spur.actors.generation_config import SamplingDefaults
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
    pass

# JSON types without coercion: "1" is not an int, true is not 1, 1.5 is not an int
# (an int is a valid float, as in JSON Schema).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = StrictBool


def _utf8(text: str) -> str:
    """JSON's escapes can spell a lone UTF-16 surrogate ("\\ud800"), which is no
    character: refused here (400 naming the field), not by the tokenizer (a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds a lone surrogate ({text[exc.start]!r} at {exc.start}), which is not text: "
            "send valid Unicode (a surrogate pair or the character itself)"
        ) from None
    return text


Str = Annotated[StrictStr, AfterValidator(_utf8)]

MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's bound on `logprobs` of /v1/completions."""
MAX_CHAT_TOP_LOGPROBS = 20
"""OpenAI's bound on `top_logprobs` of /v1/chat/completions."""
MAX_STOP_STRINGS = 4
"""OpenAI's bound on the number of stop strings."""
MAX_STOP_CHARS = 1024
"""spur's bound on one stop string's length. The engine holds back the last
len(stop) - 1 characters of every choice and checks them at every token, so a stop
string of 100,000 characters made each of its tokens cost milliseconds of the step
that every request of the replica shares."""


# -- request models ----------------------------------------------------------------------
class _Nested(BaseModel):
    """Objects inside a request: unknown keys are ignored (clients add fields)."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Nested):
    include_usage: Bool | None = False
    """Send a last chunk with empty `choices` and the request's `usage`."""
    continuous_usage_stats: Bool | None = False
    """vLLM's extra: with include_usage, every chunk carries its choice's usage so far."""


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

    def template_dict(self) -> dict[str, str]:
        """The message as the chat template gets it: role (`developer` becomes
        `system`, which templates know), content as text, and `name` / `tool_call_id`
        when given (templates may render them, as vLLM passes them on)."""
        out = {"role": ROLE_ALIASES.get(self.role, self.role), "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

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
        return join_text_parts([part.text or "" for part in self.content])


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


REFUSED_EXTRAS: dict[str, str] = {
    **dict.fromkeys(
        ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
        "structured output",
    ),
    "allowed_token_ids": "a restricted vocabulary",
    "bad_words": "banned words",
    "logits_processors": "logits processors",
    "use_beam_search": "beam search",
    "echo": "echoing the prompt",
    "audio": "audio output",
    "web_search_options": "web search",
}
"""Fields of vLLM's or OpenAI's API that change what a request generates, which this
server does not do: refused when set (a value other than null, false or empty), never
ignored, so that a client never takes free text for a constrained answer. (Other
unknown fields are ignored, as OpenAI clients send many.)"""


def _check_refused_extras(extra: dict[str, Any]) -> None:
    for name, what in REFUSED_EXTRAS.items():
        if extra.get(name) not in (None, False, [], {}, ""):
            raise FieldError((name,), f"{what} is not supported: remove it")
    modalities = extra.get("modalities")
    if modalities not in (None, [], ["text"]):
        raise FieldError(("modalities",), 'only text output is supported: use ["text"]')


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
    include_stop_str_in_output: Bool | None = None
    priority: Int | None = None
    """Scheduling priority (lower runs first, as in vLLM); carried in `extra`."""
    cache_salt: Str | None = None
    """Separates this request's prefix-cache entries from others'; carried in `extra`."""
    prompt_logprobs: Int | None = None
    """vLLM's extra; not supported (refused rather than ignored)."""
    truncate_prompt_tokens: Int | None = Field(None, ge=-1)
    """vLLM's extra: keep only the prompt's last k tokens (after tokenizing, and for chat
    after templating); -1 keeps max_model_len's worth. See `truncate`."""

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _some_prompt_left(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("0 would leave no prompt: give k >= 1, or -1 for max_model_len")
        return value

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """`ids` cut to their last `truncate_prompt_tokens` tokens (-1: max_model_len),
        as vLLM keeps them; unchanged when it is unset or they are fewer."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep == -1:
            keep = max_model_len
        return ids[len(ids) - keep :] if len(ids) > keep else ids

    @field_validator("prompt_logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise _unsupported("remove it", "prompt_logprobs")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        """stop: a string, or a list of at most 4 strings (or null), each of at most
        `MAX_STOP_CHARS` characters."""
        if value is None:
            return value
        if isinstance(value, str):
            stops = [value]
        elif isinstance(value, list) and all(isinstance(s, str) for s in value):
            stops = value
        else:
            raise FieldError((), "must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise FieldError((), f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for s in stops:
            if len(s) > MAX_STOP_CHARS:
                raise FieldError(
                    (),
                    f"a stop string has {len(s):,} characters, more than {MAX_STOP_CHARS:,}: "
                    "shorten it",
                )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise _unsupported("remove it")
        return value

    @model_validator(mode="after")
    def _no_refused_extras(self) -> _Request:
        _check_refused_extras(self.model_extra or {})
        return self

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
    def continuous_usage(self) -> bool:
        """Whether every chunk carries its choice's usage so far (vLLM's
        `continuous_usage_stats`, which needs include_usage)."""
        opts = self.stream_options
        return self.include_usage and bool(opts and opts.continuous_usage_stats)

    @property
    def asks_max_tokens(self) -> bool:
        """Whether the request names its max tokens (OpenAI's default of 16 for
        completions included) rather than leaving them to the server."""
        return self._max_tokens()[0] is not None

    @property
    def num_choices(self) -> int:
        return self.n if self.n is not None else 1

    def _max_tokens(self) -> tuple[int | None, str]:
        """(the request's own max tokens or None, the OpenAI field name it is under)."""
        raise NotImplementedError

    def _logprobs(self) -> int | None:
        raise NotImplementedError

    @property
    def num_top_logprobs(self) -> int | None:
        """How many top alternatives to return per token; None = no logprobs."""
        return self._logprobs()

    def to_sampling_params(
        self, default_max_tokens: int, defaults: SamplingDefaults | None = None
    ) -> SamplingParams:
        """Every sampling field mapped onto a new SamplingParams (pure).

        `default_max_tokens` applies when the request sets no max tokens (the
        ingress passes max_model_len minus the prompt's length, or a config
        default). `defaults`: the lane's sampling defaults (the model's
        generation_config, `actors/generation_config.py`): they fill the fields the
        request leaves out, their max_tokens replaces `default_max_tokens`, and an
        override's cap bounds max_tokens. Raises ProtocolError (400) naming the
        request's field when a value is out of range.
        """
        defaults = defaults or SamplingDefaults()
        requested, max_name = self._max_tokens()
        max_tokens = defaults.max_tokens(requested, default_max_tokens)
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
            "include_stop_str_in_output",
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
        kwargs = defaults.fill(kwargs)
        try:
            return SamplingParams(**kwargs)
        except SamplingParamsError as exc:
            raise from_sampling_params_error(exc, self._param_names(max_name)) from exc

    def _param_names(self, max_name: str) -> dict[str, str]:
        return {"max_tokens": max_name}

    _prompt_param = "prompt"
    """The field an error about the prompt's length names."""

    def check_room(self, prompt_tokens: int, max_model_len: int) -> None:
        """Raise ProtocolError (400) when the request's own max tokens do not fit after a
        prompt of `prompt_tokens` (the longest, for several prompts), as vLLM does; a
        default max tokens is fitted to the room instead. A prompt with no room at all is
        refused here too, with the engine's words: it never travels to an engine (a
        prompt of millions of tokens would not fit Serve's 4 MiB gRPC messages)."""
        requested, name = self._max_tokens()
        if prompt_tokens >= max_model_len:
            raise ProtocolError(
                400,
                f"prompt has {prompt_tokens:,} tokens, max_model_len is {max_model_len:,} "
                "(prompt plus at least one generated token): shorten the prompt",
                param=self._prompt_param,
                code="context_length_exceeded",
            )
        if requested is not None and prompt_tokens + requested > max_model_len:
            raise ProtocolError(
                400,
                f"{name}: {requested:,} is too large: this model's maximum context length "
                f"is {max_model_len:,} tokens and the request has {prompt_tokens:,} input "
                f"tokens ({requested:,} > {max_model_len:,} - {prompt_tokens:,}): lower "
                f"{name} or shorten the prompt",
                param=name,
                code="context_length_exceeded",
            )


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: Str | list[Str] | list[Int] | list[list[Int]]
    """Text, texts, token ids, or lists of token ids (one request per prompt)."""
    max_tokens: Int | None = 16
    """OpenAI's default is 16; null means `default_max_tokens` (the ingress passes the
    room the longest prompt leaves, as vLLM does)."""
    add_special_tokens: Bool = True
    """Add the tokenizer's special tokens (BOS, ...) to a text prompt (vLLM's extra);
    false for a prompt already formatted with them."""
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

    def _max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    _prompt_param = "messages"

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
    add_special_tokens: Bool = False
    """Add the tokenizer's special tokens (BOS, ...) to the templated prompt, which
    usually writes them itself (vLLM's default: false)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the model's chat template (Qwen3: {"enable_thinking": false})."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_template_kwargs(value)

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
        if self.top_logprobs is not None and not self.logprobs:  # 0 too, as vLLM
            raise FieldError(("top_logprobs",), "needs logprobs=true: set it or remove this")
        _check_chat_options(self.messages, self.add_generation_prompt, self.continue_final_message)
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages for the tokenizer's chat template (`ChatMessage.template_dict`)."""
        return [m.template_dict() for m in self.messages]

    def _max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        if self.max_tokens is not None:
            return self.max_tokens, "max_tokens"
        return None, "max_completion_tokens"

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _param_names(self, max_name: str) -> dict[str, str]:
        return {"max_tokens": max_name, "logprobs": "top_logprobs"}


TEMPLATE_RESERVED = frozenset(
    {"messages", "conversation", "add_generation_prompt", "continue_final_message",
     "tokenize", "chat_template", "tools", "documents", "return_dict"}
)  # fmt: skip
"""Arguments of apply_chat_template that chat_template_kwargs may not set."""


def _check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    reserved = sorted(set(value or ()) & TEMPLATE_RESERVED)
    if reserved:
        raise FieldError(
            (reserved[0],),
            "is set by the request itself, not through chat_template_kwargs: remove it there",
        )
    return value


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


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_TOKEN_ID = 2**31 - 1
"""No vocabulary comes near it; larger ids are refused here, before the prompt's block
hashes (32-bit words) are made, so that they get a 400 like any id past the model's
vocabulary, which the engine refuses."""


def _check_token_ids(ids: list[Any], path: tuple[int | str, ...]) -> None:
    for i, t in enumerate(ids):
        if not _is_token_id(t) or not 0 <= t <= MAX_TOKEN_ID:
            raise FieldError(
                (*path, i), f"token ids must be integers in [0, {MAX_TOKEN_ID}], got {t!r}"
            )


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
    chat_template_kwargs: dict[str, Any] | None = None
    """As in chat completions."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_template_kwargs(value)

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
        return [m.template_dict() for m in self.messages or []]


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


REQUEST_EXAMPLES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Say hello.", "max_tokens": 8},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
    },
    "/tokenize": {"prompt": "Say hello."},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/admin/reset_prefix_cache": {},
}
"""Route path -> a request every deployment accepts (no `model`: the first served one),
published as the schema's `examples`: in /docs, and the first case a fuzzer sends."""


def request_schemas(served_models: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """JSON Schemas of every request model and the models they nest, keyed by
    model name, with references as `#/components/schemas/NAME` (an OpenAPI
    document's components), each with its REQUEST_EXAMPLES request. `model` is
    narrowed to the served names (or null), so that a generated client or a fuzzer
    forms requests that reach an engine. Pure."""
    out: dict[str, dict[str, Any]] = {}
    for path, cls in REQUEST_MODELS.items():
        schema = cls.model_json_schema(ref_template="#/components/schemas/{model}")
        schema["examples"] = [REQUEST_EXAMPLES[path]]
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
