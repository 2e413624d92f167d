"""OpenAI-compatible API shapes, outgoing: response bodies and SSE chunks.

No HTTP, no Ray, no tensors. The ingress does the I/O around it:

    engine RequestOutput --completion_response / chat_response--> dict -> JSON
    engine Deltas --ChunkStream.update--> chunk dicts --sse()--> b"data: {...}\\n\\n"
                  ... ChunkStream.finish() (usage chunk) ... sse_done()

Field names, nesting and `object` values follow OpenAI's API exactly (the tests
validate every builder's output with the official `openai` package's types).
A few vLLM fields are added where vLLM adds them: `stop_reason` in choices,
`max_model_len` in model cards. The incoming side (request models, parsing,
the mapping to `SamplingParams`) is `cluster/api_requests.py`.
"""

from __future__ import annotations

import codecs
import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from spur.cluster.api_requests import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from spur.actors.engine.core.outputs import RequestOutput
    from spur.actors.engine.shell.output_processor import Delta
    from spur.actors.step import Logprobs

TokenStr = Callable[[int], str]
"""Token id -> its text (e.g. `lambda t: tokenizer.decode([t])`), for logprobs."""


class TokenStrings:
    """A `TokenStr` that also knows each token's raw bytes (`detokenizer.token_bytes`),
    which chat logprobs send as `bytes`; a plain `TokenStr` gives the UTF-8 of the
    text, U+FFFD where a token holds part of a character."""

    def __init__(self, text: TokenStr, raw: Callable[[int], bytes]) -> None:
        self.text, self.raw = text, raw

    def __call__(self, tid: int) -> str:
        return self.text(tid)


def token_strings(raw: Callable[[int], bytes]) -> TokenStrings:
    """Logprobs' spelling of tokens from their raw bytes (`detokenizer.token_bytes`):
    the text of those bytes, U+FFFD where a token holds part of a character. Not the
    tokenizer's `decode([tid])`: a SentencePiece decoder strips a lone token's leading
    space ("\u2581world" reads "world"), so the tokens would not join into the text."""
    return TokenStrings(lambda tid: raw(tid).decode("utf-8", errors="replace"), raw)


MIN_LOGPROB = -9999.0
"""What a -inf (or NaN) log-probability is sent as: JSON has no infinities (vLLM
does the same)."""


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


# -- tokenize / detokenize -----------------------------------------------------------------
def tokenize_response(
    tokens: Sequence[int], max_model_len: int, token_strs: Sequence[str] | None = None
) -> dict[str, Any]:
    """{count, max_model_len, tokens, token_strs} (vLLM's /tokenize answer; token_strs
    is null unless asked for, as vLLM's model dumps it)."""
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": list(tokens),
        "token_strs": None if token_strs is None else list(token_strs),
    }


def detokenize_response(prompt: str) -> dict[str, Any]:
    """{"prompt": text} (vLLM's /detokenize answer)."""
    return {"prompt": prompt}


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


class TextOffsets:
    """Where each token's text starts in a completion's text (OpenAI's `text_offset`),
    counted on the tokens' own bytes (`TokenStrings.raw`, else their text's UTF-8): a
    token holding the first bytes of a character starts where that character does, and
    the count moves past the character once its last byte arrives. One per choice, kept
    across a stream's chunks, so text held back for a possible stop string (sent later,
    or never) does not move the offsets of the tokens after it."""

    def __init__(self) -> None:
        self._chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, data: bytes) -> int:
        """The offset of the token whose bytes are `data`; counts it."""
        at = self._chars
        self._chars += len(self._decoder.decode(data))
        return at


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[Logprobs],
    token_str: TokenStr,
    *,
    offsets: TextOffsets | None = None,
    num_top: int | None = None,
) -> dict[str, Any]:
    """The legacy completions format: {tokens, token_logprobs, top_logprobs:
    [{token: logprob}], text_offset}. Each top dict holds the `num_top` most
    likely tokens plus the sampled one with its own logprob (as OpenAI does; where
    two ids spell the same string, the sampled one's value wins). `offsets`: the
    choice's `TextOffsets` (a stream passes the same one for every chunk); a fresh
    one starts at 0. Raises ValueError if the two sequences differ in length."""
    raw = token_str.raw if isinstance(token_str, TokenStrings) else None
    counter = TextOffsets() if offsets is None else offsets
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    text_offsets: list[int] = []
    for tid, lp in zip(token_ids, logprobs, strict=True):
        text = token_str(tid)
        tokens.append(text)
        token_logprobs.append(_finite(lp.sampled))
        top: dict[str, float] = {}
        for t, v in lp.top[:num_top]:
            top.setdefault(token_str(t), _finite(v))
        top[text] = _finite(lp.sampled)
        tops.append(top)
        text_offsets.append(counter.take(raw(tid) if raw else text.encode("utf-8")))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": text_offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[Logprobs],
    token_str: TokenStr,
    *,
    num_top: int | None = None,
) -> dict[str, Any]:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}]}], "refusal": null}; `bytes` is the token's own bytes when
    `token_str` is a `TokenStrings` (joined over a text's tokens, its UTF-8), else the
    UTF-8 of its text."""
    raw = token_str.raw if isinstance(token_str, TokenStrings) else None

    def entry(tid: int, logprob: float) -> dict[str, Any]:
        text = token_str(tid)
        return {
            "token": text,
            "logprob": _finite(logprob),
            "bytes": list(raw(tid) if raw else text.encode("utf-8", errors="replace")),
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
        continuous_usage: bool = False,
        prompt_lens: Sequence[int] | None = None,
    ) -> None:
        """`continuous_usage` (vLLM's continuous_usage_stats): every chunk of a choice
        carries that choice's usage so far, its prompt's tokens (`prompt_lens`, one per
        prompt; default: `prompt_tokens` spread as one prompt) and its tokens."""
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
        self.continuous_usage = continuous_usage and include_usage
        self._prompt_lens = list(prompt_lens) if prompt_lens is not None else [prompt_tokens]
        self._tokens = [0] * self.num_choices
        self._started = [False] * self.num_choices
        self._finished = [False] * self.num_choices
        self._offsets = [TextOffsets() for _ in range(self.num_choices)]

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
        prompt_lens: Sequence[int] | None = None,
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
            continuous_usage=request.continuous_usage,
            prompt_lens=prompt_lens,
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
        chunk = chat_chunk(
            self.request_id,
            self.model,
            self.created,
            index,
            role="assistant",
            content="",
            include_usage=self.include_usage,
        )
        return [self._with_usage(chunk, index)]

    def _with_usage(self, chunk: dict[str, Any], index: int) -> dict[str, Any]:
        """`chunk` with its choice's usage so far, under continuous usage."""
        if self.continuous_usage:
            prompt = self._prompt_lens[min(index // self.n, len(self._prompt_lens) - 1)]
            done = self._tokens[index]
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": done,
                "total_tokens": prompt + done,
            }
        return chunk

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
        self._tokens[index] += len(delta.token_ids)
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
                    offsets=self._offsets[index],
                    num_top=self.num_top_logprobs,
                )
        if not delta.text and lp is None and delta.finish_reason is None:
            return []
        self._finished[index] = delta.finish_reason is not None
        if not self.chat:
            chunk = completion_chunk(
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
            return [self._with_usage(chunk, index)]
        chunk = chat_chunk(
            self.request_id,
            self.model,
            self.created,
            index,
            content=delta.text if delta.text or lp is not None else None,
            logprobs=lp,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            include_usage=self.include_usage,
        )
        return [*self._role_chunk(index), self._with_usage(chunk, index)]

    def finish(self, cached_tokens: int = 0) -> list[dict[str, Any]]:
        """The usage chunk (empty choices) when the request asked for usage, else []."""
        if not self.include_usage:
            return []
        u = usage(self.prompt_tokens, self.completion_tokens, cached_tokens)
        return [usage_chunk(self.request_id, self.model, self.created, u, chat=self.chat)]
