"""The HTTP front: OpenAI-compatible API, validation, chat template, tokenization
(once, here), lane choice, and streaming of engine deltas as SSE.

A request's way: parse + validate (400 naming the field) -> lane from `model`
(404 listing the served models) -> token ids -> engine deployment's streaming
`generate` -> the first item decides the status (an engine-side rejection is a
400, not a broken 200 stream) -> chunks or one JSON body. A client that goes
away cancels the engine-side generator, which aborts the request and frees its
blocks. Nothing a client sends makes this answer 500 or stop serving.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError

from spur.actors.engine.output_processor import Delta
from spur.actors.engine.outputs import CompletionOutput, Logprobs, RequestOutput
from spur.cluster import protocol as P
from spur.cluster.errors import (
    ProtocolError,
    error_body,
    internal_error,
    queue_full,
    service_unavailable,
)

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
app = FastAPI(title="spur", version=VERSION)


# -- module helpers ---------------------------------------------------------------------
def _load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _params_dict(params: Any) -> dict[str, Any]:
    fields = (
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "stop",
        "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens",
    )  # fmt: skip
    return {f: getattr(params, f) for f in fields}


def _delta(item: dict[str, Any]) -> Delta:
    logprobs = None
    if item.get("logprobs") is not None:
        logprobs = [
            Logprobs(lp["sampled"], [tuple(t) for t in lp["top"]], lp.get("rank"))
            for lp in item["logprobs"]
        ]
    return Delta(
        request_id="",
        index=item["index"],
        text=item["text"],
        token_ids=item["token_ids"],
        finish_reason=item["finish_reason"],
        stop_reason=item.get("stop_reason"),
        logprobs=logprobs,
    )


async def _collect(gen: Any, first: dict[str, Any], n: int, prompt_ids: list[int]) -> RequestOutput:
    """Accumulate a stream into a RequestOutput (non-streaming answers)."""
    comps = [CompletionOutput(index=i, text="", token_ids=[]) for i in range(n)]
    out = RequestOutput("", None, prompt_ids, comps)

    def apply(item: dict[str, Any]) -> None:
        if item["type"] == "delta":
            d = _delta(item)
            c = comps[d.index]
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            if d.logprobs:
                c.logprobs = (c.logprobs or []) + d.logprobs
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        elif item["type"] == "final":
            out.num_cached_tokens = item.get("num_cached_tokens", 0)
        elif item["type"] == "error":
            raise ProtocolError(item["status"], item["message"], param=item.get("param"))

    apply(first)
    async for item in gen:
        apply(item)
    return out


def _as_protocol_error(exc: BaseException) -> ProtocolError:
    if isinstance(exc, ProtocolError):
        return exc
    if isinstance(exc, BackPressureError):
        return queue_full(1.0)
    name = type(exc).__name__
    if "Actor" in name or "Replica" in name or "Unavailable" in name:
        return service_unavailable(f"the engine is unavailable ({name}); retry shortly", 1.0)
    return internal_error(exc)


def _error_response(exc: ProtocolError) -> Response:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers or None)


class _Lane:
    """What the ingress knows of one lane's engines (filled on first use)."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self.handle = handle
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.lock = asyncio.Lock()


@serve.ingress(app)
class Ingress:
    def __init__(self, engines: dict[str, Any], config: dict[str, Any]) -> None:
        self.config = config
        self.lanes = {name: _Lane(name, handle) for name, handle in engines.items()}
        self.model_to_lane: dict[str, str] = {}
        for lane in config["lanes"]:
            for served in lane["served_model_names"]:
                self.model_to_lane[served] = lane["name"]
        self.served = list(self.model_to_lane)
        self._warned_fields: set[str] = set()

    # -- helpers ----------------------------------------------------------------------
    async def _lane(self, model: str | None) -> tuple[str, _Lane]:
        name = P.resolve_model(model, self.served)
        lane = self.lanes[self.model_to_lane[name]]
        if lane.tokenizer is None:
            async with lane.lock:
                if lane.tokenizer is None:
                    stats = await lane.handle.stats.remote()
                    lane.max_model_len = int(stats["max_model_len"])
                    lane.tokenizer = await asyncio.to_thread(_load_tokenizer, stats["model_dir"])
        return name, lane

    def _note_unknown(self, fields: list[str]) -> None:
        new = [f for f in fields if f not in self._warned_fields]
        if new:
            self._warned_fields.update(new)
            logger.info("ignoring unknown request fields %s", new)

    def _encode(self, lane: _Lane, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(lane.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return list(prompt)

    def _chat_ids(self, lane: _Lane, messages: list[dict[str, str]]) -> list[int]:
        text = lane.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(lane.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _token_str(self, lane: _Lane) -> Any:
        tok = lane.tokenizer
        return lambda tid: tok.decode([tid], skip_special_tokens=False)

    async def _open(
        self, lane: _Lane, payload: dict[str, Any], *, chat: bool = False
    ) -> tuple[Any, dict[str, Any]]:
        """Start an engine stream and read its first item (so that a
        rejection becomes an HTTP error before any byte is sent)."""
        gen = lane.handle.options(stream=True).generate.remote(payload)
        try:
            first = await gen.__anext__()
        except BackPressureError:
            raise queue_full(1.0) from None
        except StopAsyncIteration:
            raise service_unavailable("the engine closed the stream without answering") from None
        if first["type"] == "error":
            param = first.get("param")
            code = None
            if param == "prompt" and "max_model_len" in first["message"]:
                code = "context_length_exceeded"
            if param == "prompt" and chat:
                param = "messages"
            raise ProtocolError(first["status"], first["message"], param=param, code=code)
        return gen, first

    # -- OpenAI API ---------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._guard(self._completions(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._guard(self._chat(request))

    async def _completions(self, request: Request) -> Response:
        req = P.parse_request(P.CompletionRequest, await request.body())
        self._note_unknown(req.unknown_fields)
        model, lane = await self._lane(req.model)
        prompts = [self._encode(lane, p) for p in req.prompts()]
        params = req.to_sampling_params(default_max_tokens=16)
        return await self._serve(req, model, lane, prompts, params, chat=False)

    async def _chat(self, request: Request) -> Response:
        req = P.parse_request(P.ChatCompletionRequest, await request.body())
        self._note_unknown(req.unknown_fields)
        model, lane = await self._lane(req.model)
        ids = self._chat_ids(lane, req.chat_messages())
        params = req.to_sampling_params(default_max_tokens=max(1, lane.max_model_len - len(ids)))
        return await self._serve(req, model, lane, [ids], params, chat=True)

    async def _serve(
        self,
        req: Any,
        model: str,
        lane: _Lane,
        prompts: list[list[int]],
        params: Any,
        *,
        chat: bool,
    ) -> Response:
        rid = P.make_id("chatcmpl" if chat else "cmpl")
        created = P.now()
        sp = _params_dict(params)
        opened = []
        try:
            for i, ids in enumerate(prompts):
                payload = {
                    "request_id": f"{rid}-{i}",
                    "prompt_token_ids": ids,
                    "sampling_params": sp,
                    "priority": int(params.extra.get("priority", 0) or 0),
                    "cache_salt": params.extra.get("cache_salt"),
                }
                opened.append(await self._open(lane, payload, chat=chat))
        except BaseException:
            for gen, _ in opened:
                gen.cancel()
            raise
        prompt_tokens = sum(len(p) for p in prompts)
        token_str = self._token_str(lane) if params.logprobs is not None else None
        if req.stream:
            stream = P.ChunkStream.for_request(
                req,
                request_id=rid,
                model=model,
                created=created,
                prompt_tokens=prompt_tokens,
                token_str=token_str,
            )
            return StreamingResponse(self._sse(stream, opened), media_type="text/event-stream")
        outputs = await asyncio.gather(
            *(
                _collect(gen, first, params.n, ids)
                for (gen, first), ids in zip(opened, prompts, strict=True)
            )
        )
        for out in outputs:
            for comp in out.outputs:
                if comp.finish_reason == "abort":
                    raise service_unavailable("the request was aborted by the engine")
        cached = sum(o.num_cached_tokens for o in outputs)
        if chat:
            body = P.chat_response(
                rid,
                model,
                created,
                outputs[0],
                prompt_tokens=prompt_tokens,
                token_str=token_str,
                num_top_logprobs=req.num_top_logprobs,
            )
        else:
            body = P.completion_response(
                rid,
                model,
                created,
                outputs,
                prompt_tokens=prompt_tokens,
                token_str=token_str,
                num_top_logprobs=req.num_top_logprobs,
            )
        if cached:
            body["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        return JSONResponse(body)

    async def _sse(
        self, stream: P.ChunkStream, opened: list[tuple[Any, dict[str, Any]]]
    ) -> AsyncIterator[bytes]:
        merged: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, gen: Any, first: dict[str, Any]) -> None:
            try:
                await merged.put((i, first))
                async for item in gen:
                    await merged.put((i, item))
            except BaseException as exc:
                await merged.put((i, exc))
            finally:
                await merged.put((i, None))

        tasks = [asyncio.create_task(pump(i, g, f)) for i, (g, f) in enumerate(opened)]
        open_streams = len(tasks)
        cached = 0
        try:
            for chunk in stream.start():
                yield P.sse(chunk)
            while open_streams:
                i, item = await merged.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, BaseException):
                    yield P.sse(error_body(_as_protocol_error(item)))
                    yield P.sse_done()
                    return
                if item["type"] == "delta":
                    delta = _delta(item)
                    for chunk in stream.update(delta, delta.logprobs, prompt_index=i):
                        yield P.sse(chunk)
                elif item["type"] == "final":
                    cached += item.get("num_cached_tokens", 0)
                elif item["type"] == "error":
                    err = ProtocolError(item["status"], item["message"], param=item.get("param"))
                    yield P.sse(error_body(err))
                    yield P.sse_done()
                    return
            for chunk in stream.finish(cached or None):
                yield P.sse(chunk)
            yield P.sse_done()
        finally:
            # A client that went away lands here too: cancel the engine-side
            # generators, which abort the requests and free their blocks.
            for (gen, _), task in zip(opened, tasks, strict=True):
                task.cancel()
                with contextlib.suppress(Exception):
                    gen.cancel()

    async def _guard(self, work: Any) -> Response:
        try:
            return await work
        except ProtocolError as exc:
            return _error_response(exc)
        except BackPressureError:
            return _error_response(queue_full(1.0))
        except Exception as exc:  # never a bare 500 without a body
            logger.exception("request failed")
            return _error_response(_as_protocol_error(exc))

    # -- other endpoints ----------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self) -> Response:
        return JSONResponse(P.models_response(self.served))

    @app.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version(self) -> Response:
        return JSONResponse({"version": VERSION})

    @app.get("/admin/config")
    async def admin_config(self) -> Response:
        return JSONResponse(self.config)

    @app.get("/admin/engines")
    async def admin_engines(self) -> Response:
        out = {}
        for name, lane in self.lanes.items():
            try:
                out[name] = await lane.handle.stats.remote()
            except Exception as exc:
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return JSONResponse(out)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        async def work() -> Response:
            req = P.parse_request(P.TokenizeRequest, await request.body())
            _, lane = await self._lane(req.model)
            if req.is_chat:
                text = lane.tokenizer.apply_chat_template(
                    req.chat_messages(),
                    add_generation_prompt=req.add_generation_prompt,
                    tokenize=False,
                )
                ids = lane.tokenizer(text, add_special_tokens=req.special_tokens)["input_ids"]
            else:
                ids = lane.tokenizer(req.prompt, add_special_tokens=req.special_tokens)["input_ids"]
            strs = lane.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return JSONResponse(P.tokenize_response(ids, lane.max_model_len, strs))

        return await self._guard(work())

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        async def work() -> Response:
            req = P.parse_request(P.DetokenizeRequest, await request.body())
            _, lane = await self._lane(req.model)
            vocab = len(lane.tokenizer)
            bad = [t for t in req.tokens if t >= vocab]
            if bad:
                raise ProtocolError(
                    400,
                    f"token ids {bad[:5]} are outside the vocabulary of {vocab}",
                    param="tokens",
                )
            return JSONResponse(P.detokenize_response(lane.tokenizer.decode(req.tokens)))

        return await self._guard(work())
