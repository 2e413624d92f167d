"""The HTTP front: OpenAI-compatible API, authentication, validation, chat
template, tokenization (once, here, off the event loop), lane choice, and
streaming of engine deltas as SSE.

A request's way: API key (cluster/auth.py middleware: 401/403 before any route
runs, when keys are configured) -> body read within server.requests.max_body_bytes
(413) -> parse + validate (400 naming the field) -> lane from `model` (404 listing
the served models) -> token ids and block hashes (in the tokenizer thread pool;
the tenant's salt scopes the hashes) -> per-key limits (429 with Retry-After) ->
one engine stream per prompt, opened concurrently, each pumped into a bounded
buffer (a slow client makes the engine stream wait) -> the first items decide
the status (an engine-side rejection is a 400, a full queue a 429, no engine of
the lane or its spare a 503) -> chunks or one JSON body. A client that goes away
cancels the engine-side generators, which abort the requests and free their
blocks. No client input makes this answer 5xx or stop serving: a 500 means a bug
(its body names only the exception type; the log has the traceback).
"""

import asyncio
import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from spur.actors.engine.core.outputs import CompletionOutput, RequestOutput
from spur.actors.engine.shell.chat_template import ChatTemplateError, chat_token_ids
from spur.actors.engine.shell.detokenizer import token_bytes
from spur.actors.engine.shell.output_processor import Delta
from spur.actors.generation_config import SamplingDefaults
from spur.actors.step import Logprobs, SamplingParams
from spur.cluster import api_requests as rq
from spur.cluster import api_responses as rs
from spur.cluster import metrics as M
from spur.cluster.auth import AuthGuard, AuthMiddleware, Principal, install_guard, request_salt
from spur.cluster.cors import CORSGate, install_origins
from spur.cluster.errors import (
    ERROR_CODE_HEADER,
    ProtocolError,
    bad_request,
    body_too_large,
    classify,
    error_body,
    model_not_found,
    queue_full,
    rate_limited,
    service_unavailable,
)
from spur.cluster.failover import EngineStream, LaneOpener
from spur.cluster.fanout import FanOut
from spur.cluster.lanes import Lane, LaneMonitor, LaneSelector
from spur.cluster.readiness import health_report, quiet_probe_logs, shutting_down
from spur.cluster.routing.index_actor import get_index, index_kwargs_of
from spur.cluster.tokenizer_cache import local_tokenizer_dir

logger = logging.getLogger(__name__)

VERSION = "0.1.0"
MAX_WARNED_FIELDS = 256
"""Unknown request fields remembered (to log each once); a fixed cap, since clients
choose the names."""
app = FastAPI(title="spur", version=VERSION)
app.add_middleware(AuthMiddleware)
_SERVED: list[str] = []  # this process's served model names (set by the Ingress)


def _openapi() -> dict[str, Any]:
    """FastAPI's document plus the request models (the routes read raw bodies, so
    FastAPI cannot see them), with `model` narrowed to the served names. Built
    per set of served names, not cached on the app: Serve serves a copy of the
    app, taken before the Ingress knows its lanes."""
    import importlib

    from fastapi.openapi.utils import get_openapi

    here = importlib.import_module(__name__)  # this process's module state
    served = tuple(here._SERVED)
    doc = here._OPENAPI.get(served)
    if doc is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        doc.setdefault("components", {}).setdefault("schemas", {}).update(
            rq.request_schemas(served)
        )
        here._OPENAPI.clear()
        here._OPENAPI[served] = doc
    return doc


_OPENAPI: dict[tuple[str, ...], dict[str, Any]] = {}
app.openapi = _openapi  # type: ignore[method-assign]
app.add_middleware(M.CountingMiddleware)  # HTTP counters for /metrics (cluster/metrics.py)
app.add_middleware(CORSGate)  # outermost: preflights are answered before the key check


# -- module helpers ---------------------------------------------------------------------
_TOKENIZER_LOCK = asyncio.Lock()
"""One tokenizer load at a time: lanes warm up concurrently, and a first import of
transformers from two threads at once can fail half-initialised."""


_TOKENIZER_MODULES = (
    "transformers",
    "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_tokenizers",
    "transformers.configuration_utils",
    "transformers.utils.type_validators",
    "jinja2",
)
"""What a first `AutoTokenizer.from_pretrained` imports (about 3 s on a 2-core host;
the load itself takes 0.2 s after them). Names that a transformers release moves
are skipped: the load imports what it needs either way."""

_tokenizer_code: threading.Thread | None = None


def _import_tokenizer_code() -> None:
    for name in _TOKENIZER_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a moved module: the load imports it later
            logger.debug("tokenizer warm-up: %s not imported (%r)", name, exc)


def start_tokenizer_import() -> None:
    """Import transformers' tokenizer code in a thread of its own, once per process,
    while the engines start: the ingress then loads a lane's tokenizer, and `/health`
    turns 200, within a fraction of a second of an engine's first answer, not about 5 s
    after it (`_engine_tokenizer` waits for this thread: two threads importing
    transformers at once can leave it half-initialised)."""
    global _tokenizer_code
    if _tokenizer_code is None:
        _tokenizer_code = threading.Thread(
            target=_import_tokenizer_code, name="spur-import-tokenizer", daemon=True
        )
        _tokenizer_code.start()


async def tokenizer_import_done() -> None:
    """Wait for `start_tokenizer_import`'s thread, if one runs. A module function, so
    that it reads this module's state: Serve's copy of the `Ingress` class keeps a copy
    of the module's globals, in which `_tokenizer_code` would stay as it was."""
    thread = _tokenizer_code
    if thread is not None and thread.is_alive():
        await asyncio.to_thread(thread.join)


def _learn_limits(lane: Lane, stats: dict[str, Any], *, from_spare: bool) -> None:
    """Set what requests are built with from an engine's `stats`: max_model_len and
    the sampling defaults (the model's generation_config)."""
    lane.max_model_len = int(stats["max_model_len"])
    lane.sampling_defaults = SamplingDefaults.from_dict(stats.get("sampling_defaults"))
    lane.limits_from_spare = from_spare


def _load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _params_dict(params: SamplingParams) -> dict[str, Any]:
    """What the engine rebuilds SamplingParams from: every field but `extra` (the
    ingress's own: priority, cache_salt, ...), so none can be left behind (a list of
    names used to drop include_stop_str_in_output)."""
    return {
        f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "extra"
    }


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


async def _await(ref: Any) -> Any:
    """`await ref` as a coroutine (so that it can run as a task of its own)."""
    return await ref


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends. The body's own
    `finally` is not enough: when the client has gone before the body starts (it
    waited for its first token, then hung up), Starlette cancels the response without
    ever iterating the body, and a generator that never started runs no `finally`.
    `on_close` must be idempotent (the body's `finally` may have run it already)."""

    def __init__(self, content: Any, *, on_close: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _collect(fan: FanOut, n: int, prompts: list[list[int]]) -> list[RequestOutput]:
    """Accumulate every prompt's stream into a RequestOutput (non-streaming answers).
    A `restart` item (the prompt runs again from its start on another replica: n > 1
    after a replica failed, see `EngineStream`) drops what the prompt had collected."""

    def empty() -> list[CompletionOutput]:
        return [CompletionOutput(index=i, text="", token_ids=[]) for i in range(n)]

    outs = [RequestOutput("", None, ids, empty()) for ids in prompts]
    async for i, item in fan.items():
        out = outs[i]
        if item["type"] == "restart":
            out.outputs = empty()
        elif item["type"] == "delta":
            d = _delta(item)
            c = out.outputs[d.index]
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            if d.logprobs:
                c.logprobs = (c.logprobs or []) + d.logprobs
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        elif item["type"] == "final":
            out.num_cached_tokens = item.get("num_cached_tokens", 0)
    return outs


@contextlib.contextmanager
def _own_internal_request_id() -> Iterator[None]:
    """Give the handle call(s) made inside a fresh Serve internal request id.

    Serve 2.60 copies the HTTP request's internal id into every handle call made
    while serving it, and its request router indexes pending requests by that id:
    of two calls of one HTTP request pending at once (a completion's prompts,
    opened concurrently), the second is never assigned a replica and waits
    forever. One id per engine call keeps them apart (the public request_id,
    used in logs and tracing, stays the HTTP request's)."""
    from ray.serve._private.utils import generate_request_id
    from ray.serve.context import _get_serve_request_context, _serve_request_context

    current = _get_serve_request_context()
    token = _serve_request_context.set(
        dataclasses.replace(current, _internal_request_id=generate_request_id())
    )
    try:
        yield
    finally:
        _serve_request_context.reset(token)


def _too_few_for_choices(principal: Principal, left: int, each: int, choices: int) -> ProtocolError:
    """The 400 for a request whose `choices` cannot each get `each` tokens (its
    min_tokens, at least 1) of the `left` that the key's per-minute budget leaves after
    its prompt."""
    return bad_request(
        f"the prompt leaves {left:,} of the {principal.tokens_per_minute or 0:,} tokens key "
        f"{principal.name!r} may use per minute, fewer than {each:,} (min_tokens, at least "
        f"1) for each of its {choices:,} choices: shorten the prompt, ask for fewer choices "
        "or a lower min_tokens, or ask for a higher tokens_per_minute",
        param="prompt",
        code="tokens_per_minute_exceeded",
    )


def _as_protocol_error(exc: BaseException) -> ProtocolError:
    return classify(exc)


def _error_response(exc: ProtocolError) -> Response:
    headers = dict(exc.headers or {})
    if exc.code:  # read (and removed) by the metrics middleware
        headers[ERROR_CODE_HEADER.decode()] = exc.code
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers or None)


# Starlette's own refusals: status -> (OpenAI code, message of "{method} {path}")
_HTTP_ERRORS = {
    404: ("not_found", "Invalid URL ({}): no such route"),
    405: ("method_not_allowed", "Method not allowed ({})"),
}


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Starlette's own refusals (an unknown path, a wrong method) in OpenAI's error
    body, with a code, as every other answer of the API: not {"detail": ...}. Their
    headers (Allow on a 405) go along."""
    code, message = "http_error", str(exc.detail)
    if exc.status_code in _HTTP_ERRORS:
        code, template = _HTTP_ERRORS[exc.status_code]
        message = template.format(f"{request.method} {request.url.path}")
    return _error_response(
        ProtocolError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
    )


@serve.ingress(app)
class Ingress:
    def __init__(self, engines: dict[str, Any], config: dict[str, Any]) -> None:
        start_tokenizer_import()  # while the engines start (readiness waits on the load)
        quiet_probe_logs()
        self.config = config
        sections = {lane["name"]: lane for lane in config["lanes"]}
        spare = config.get("spare")
        if spare is not None:
            sections[spare["name"]] = spare
        self.lanes = {
            name: Lane(name, handle, sections[name]["engine"]["cache"])
            for name, handle in engines.items()
        }
        self.primaries = [lane["name"] for lane in config["lanes"]]
        self.model_to_lane: dict[str, str] = {}
        for lane in config["lanes"]:
            for served in lane["served_model_names"]:
                self.model_to_lane[served] = lane["name"]
        self.served = list(self.model_to_lane)
        self._token_bytes: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> it, its bytes
        _SERVED[:] = self.served
        self._warned_fields: set[str] = set()
        router = config["router"]
        self.router = router
        # Serve's private handle option: False streams over the replicas' gRPC servers.
        self.by_reference = config["server"]["data_plane"] == "object_ref"
        self.selector = LaneSelector(
            self.primaries,
            spare_of={lane: spare["name"] for lane in spare["serves_lanes"]} if spare else {},
            saturation={
                lane["name"]: lane["saturation_queue_threshold"] for lane in config["lanes"]
            },
            healthy_after_s=router["failover_healthy_after_s"],
        )
        self.index = get_index(index_kwargs_of(router))
        self._monitor: asyncio.Task[None] | None = None
        self.metrics_on = bool(config["server"].get("metrics", True))
        M.HTTP.enabled = self.metrics_on
        self.ingress_id = M.ingress_id()
        # Lane health, failover and drain state (spur.cluster.lanes, readiness).
        self.monitor = LaneMonitor(
            self.lanes,
            self.primaries,
            self.selector,
            self.index,
            self.ingress_id,
            metrics_on=self.metrics_on,
        )
        # Requests held per lane while no engine of it answers yet, bounded by the
        # lane's max_queued_requests.
        self.holding: Counter[str] = Counter()
        self.hold_limit = {name: int(sections[name]["max_queued_requests"]) for name in sections}
        self._warmer: asyncio.Task[None] | None = None
        with contextlib.suppress(RuntimeError):  # no running loop yet: on first call
            self._ensure_monitor()
        # Keys are read here, in the ingress's own process (never shipped through
        # Ray's control plane); a bad keys file fails the replica's start.
        self.guard = AuthGuard.from_config(config["server"].get("auth", {}))
        install_guard(self.guard)
        if self.guard.enabled:
            logger.info("API keys on: %s", self.guard.store.summary())
        self.limits: Any = None
        limits_cfg = config["server"].get("requests", {})
        self.max_body_bytes = int(limits_cfg.get("max_body_bytes", 4 * 1024**2))
        self.max_prompts = int(limits_cfg.get("max_prompts", 64))
        self.stream_buffer = int(limits_cfg.get("stream_buffer", 64))
        self.cors_origins = tuple(limits_cfg.get("cors_allowed_origins", ()))
        install_origins(self.cors_origins)
        self.pool = ThreadPoolExecutor(
            max_workers=int(limits_cfg.get("tokenizer_threads", 2)),
            thread_name_prefix="spur-tokenize",
        )

    @property
    def draining(self) -> str | None:
        """Why the deployment drains (None: it does not); the lane monitor learns it."""
        return self.monitor.draining

    # -- helpers ----------------------------------------------------------------------
    async def _lane(self, model: str | None) -> tuple[str, Lane]:
        self._ensure_monitor()
        if self.draining is not None:
            raise shutting_down(self.draining)
        name = rq.resolve_model(model, self.served)
        lane = self.lanes[self.model_to_lane[name]]
        if lane.tokenizer is None:
            # Cold start: hold the request until an engine of the lane (or its spare)
            # answers, or the client gives up (its disconnect cancels this wait).
            if self.holding[lane.name] >= self.hold_limit[lane.name]:
                raise queue_full(2.0, lane=lane.name, max_queued=self.hold_limit[lane.name])
            self.holding[lane.name] += 1
            try:
                async with lane.lock:
                    if lane.tokenizer is None:
                        await self._init_lane(lane)
            finally:
                self.holding[lane.name] -= 1
        if lane.limits_from_spare:
            self._relearn_soon(lane)
        return name, lane

    def _relearn_soon(self, lane: Lane, retry_s: float = 2.0) -> None:
        """The lane's tokenizer, max_model_len and sampling defaults came from its
        spare (the primaries were down at its first request): read them from a
        primary in the background, one try at a time and at most one every
        `retry_s`, until one answers. Requests meanwhile keep the spare's. Once a
        primary answers, its tokenizer becomes the lane's (the cached token bytes of
        the spare's are dropped) and the spare's vocabulary is checked against it
        as `_init_lane` does: another one disables the fallback. A failed read
        (the tokenizer files, say) leaves the spare's in place for the next try."""
        now = time.monotonic()
        if lane.relearn is not None or now < lane.relearn_after:
            return
        lane.relearn_after = now + retry_s

        async def relearn() -> None:
            try:
                stats = await self._stats(lane.name, 5.0, quiet=True)
                if stats is None:
                    return
                tok_dir = stats.get("tokenizer_dir") or stats["model_dir"]
                tokenizer = await self._engine_tokenizer(lane.name, tok_dir)
                spare_tokenizer, lane.tokenizer = lane.tokenizer, tokenizer
                self._token_bytes.pop(id(spare_tokenizer), None)
                spare = self.selector.spare_of.get(lane.name)
                if spare and lane.spare_source is not None:
                    spare_dir, spare_model = lane.spare_source
                    if spare_dir != tok_dir:
                        self._check_spare_vocab(
                            lane, spare, spare_tokenizer, spare_model, stats["model_dir"]
                        )
                _learn_limits(lane, stats, from_spare=False)
                lane.spare_source = None
                logger.info(
                    "lane %r: tokenizer, limits and sampling defaults read from its engines",
                    lane.name,
                )
            except Exception as exc:  # retried by the next request after retry_s
                logger.warning("lane %r: reading its engines' model failed: %r", lane.name, exc)
            finally:
                lane.relearn = None

        lane.relearn = asyncio.ensure_future(relearn())

    def _check_spare_vocab(
        self, lane: Lane, spare: str, spare_tokenizer: Any, spare_model: str, lane_model: str
    ) -> None:
        """Disable `lane`'s fallback to `spare` when the spare's tokenizer has another
        vocabulary than the lane's (`lane.tokenizer`): token ids travel between them."""
        if spare_tokenizer.get_vocab() != lane.tokenizer.get_vocab():
            self.selector.disable_spare(
                lane.name,
                f"spare {spare!r} ({spare_model}) has another vocabulary than "
                f"the lane's model ({lane_model}): fallback disabled; give the "
                "spare a model with the same tokenizer",
            )

    async def _stats(
        self, name: str, timeout_s: float = 10.0, *, quiet: bool = False
    ) -> dict[str, Any] | None:
        try:
            return dict(await asyncio.wait_for(self.lanes[name].handle.stats.remote(), timeout_s))
        except Exception as exc:  # no replica up (yet), or it died while answering
            if not quiet:
                logger.warning("no stats from %s: %s", name, exc)
            return None

    async def _init_lane(self, lane: Lane) -> None:
        """Learn a lane's model (tokenizer, max_model_len, sampling defaults) from its
        engines, or from its spare when the primaries are down (waiting until one
        answers, or the server drains; `_relearn_soon` then reads the primaries' model
        once they answer, and checks the spare's vocabulary then); check that the spare
        tokenizes the same way (token ids travel between them), else disable its
        fallback."""
        spare = self.selector.spare_of.get(lane.name)
        while True:
            stats, spare_stats = await asyncio.gather(
                self._stats(lane.name, 5.0, quiet=True),
                self._stats(spare, 5.0, quiet=True) if spare else asyncio.sleep(0, None),
            )
            if stats is not None or spare_stats is not None:
                break
            if self.draining is not None:
                raise shutting_down(self.draining)
            await asyncio.sleep(0.2)
        own = stats or spare_stats
        assert own is not None
        _learn_limits(lane, own, from_spare=stats is None)
        if spare and spare_stats and not self.monitor.lanes[spare].max_model_len:
            # Known before the first failover: the opener fits requests to it.
            self.monitor.lanes[spare].max_model_len = int(spare_stats["max_model_len"])
        if (
            stats
            and spare_stats
            and stats.get("sampling_defaults") != spare_stats.get("sampling_defaults")
        ):
            logger.warning(
                "spare %r has other sampling defaults than lane %r: requests keep the lane's "
                "wherever they run",
                spare,
                lane.name,
            )
        # The engine's tokenizer (engine.model.tokenizer, else its model folder).
        tok_dir = own.get("tokenizer_dir") or own["model_dir"]
        source = lane.name if stats is not None else spare
        assert source is not None
        lane.tokenizer = await self._engine_tokenizer(source, tok_dir)
        spare_tok = (spare_stats or {}).get("tokenizer_dir") or (spare_stats or {}).get("model_dir")
        # Learned from the spare: `_relearn_soon` checks its vocabulary once a primary answers.
        lane.spare_source = (tok_dir, own["model_dir"]) if stats is None else None
        if spare and stats and spare_stats and spare_tok != tok_dir:
            other = await self._engine_tokenizer(spare, spare_tok)
            self._check_spare_vocab(
                lane, spare, other, spare_stats["model_dir"], stats["model_dir"]
            )

    async def _engine_tokenizer(self, name: str, tok_dir: str) -> Any:
        """The tokenizer of deployment `name`'s engines, whose folder is `tok_dir` on
        their node: read from there when this node has it (one node, shared storage),
        else from a copy of the files the engine sends (`tokenizer_cache`)."""
        if not await asyncio.to_thread(os.path.isdir, tok_dir):
            files = await asyncio.wait_for(self.lanes[name].handle.tokenizer_files.remote(), 60)
            local = await asyncio.to_thread(local_tokenizer_dir, files)
            logger.info("%s: tokenizer folder %s is not on this node; using a copy", name, tok_dir)
            tok_dir = str(local)
        async with _TOKENIZER_LOCK:  # transformers' loading is not thread-safe
            await tokenizer_import_done()
            return await asyncio.to_thread(_load_tokenizer, tok_dir)

    def _note_unknown(self, fields: list[str]) -> None:
        new = [f[:64] for f in fields[:16] if f[:64] not in self._warned_fields]
        if new and len(self._warned_fields) < MAX_WARNED_FIELDS:
            self._warned_fields.update(new[: MAX_WARNED_FIELDS - len(self._warned_fields)])
            logger.info("ignoring unknown request fields %s", new)

    async def _off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `fn` in the tokenizer pool: tokenizing, templating and hashing a long
        prompt must not stall the event loop that streams every response."""
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(fn, *args, **kwargs)
        )

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 beyond server.requests.max_body_bytes
        (checked while reading: a client cannot make the ingress hold more)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise body_too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _encode(
        self, lane: Lane, prompt: str | list[int], add_special_tokens: bool = True
    ) -> list[int]:
        if isinstance(prompt, str):
            return list(lane.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        return list(prompt)

    async def _chat_ids(self, lane: Lane, req: rq.ChatCompletionRequest) -> list[int]:
        try:
            return list(
                await self._off_loop(
                    chat_token_ids,
                    lane.tokenizer,
                    req.chat_messages(),
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    add_special_tokens=req.add_special_tokens,
                    template_kwargs=req.chat_template_kwargs,
                )
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages", code="chat_template_error") from None

    async def _admit(
        self,
        principal: Principal | None,
        prompt_tokens: int,
        max_completion_tokens: int = 0,
        asked: bool = False,
        min_completion_tokens: int = 1,
        *,
        choices: int = 1,
        owner: str | None = None,
    ) -> tuple[Any, int | None, int | None]:
        """Take a lease of the key's limits for this request (429 when over one; 400 when
        it can never fit the key's budget), its prompt and its completion's maximum
        charged (`LimitBook.admit`; `asked`: the request named its max tokens;
        `min_completion_tokens`: what its `choices` need together). `owner`: this
        ingress's id, which the lane monitor renews, so the lease expires soon after
        this replica dies. Returns (limits actor, lease id, the completion tokens the
        request may generate or None for no bound); (None, None, None) when the key
        has no limits."""
        if principal is None or not principal.limited:
            return None, None, None
        if self.limits is None:
            from spur.cluster.limits import get_limits

            self.limits = self.monitor.limits = get_limits()  # the monitor renews leases
        limits = self.limits
        call = asyncio.ensure_future(
            _await(
                limits.admit.remote(
                    principal.key_id,
                    principal.max_concurrent_requests,
                    principal.tokens_per_minute,
                    prompt_tokens,
                    max_completion_tokens,
                    asked,
                    min_completion_tokens,
                    owner,
                )
            )
        )
        try:
            answer = await asyncio.shield(call)
        except asyncio.CancelledError:
            # The client went away while the actor decided. The call runs on, and a
            # lease it grants would never be released: release it when it comes, its
            # charge refunded (nothing ran).
            key_id = principal.key_id

            def release_late(done: asyncio.Future[Any]) -> None:
                if not done.cancelled() and done.exception() is None:
                    lease = done.result().get("lease")
                    if lease is not None:
                        limits.release.remote(key_id, lease, 0, True)  # nothing ran

            call.add_done_callback(release_late)
            raise
        except Exception as exc:  # the actor restarts: fail open rather than lock out
            logger.warning("limits actor unavailable (%s): request admitted", exc)
            return None, None, None
        if "lease" in answer:
            return limits, int(answer["lease"]), answer.get("completion_tokens")
        reason = answer.get("reason")
        if reason == "too_large":
            budget = principal.tokens_per_minute or 0
            if prompt_tokens >= budget:
                raise bad_request(
                    f"the prompt has {prompt_tokens:,} tokens, and key {principal.name!r} may "
                    f"use {budget:,} per minute (prompt and completion): shorten it or ask "
                    "for a higher tokens_per_minute",
                    param="prompt",
                    code="tokens_per_minute_exceeded",
                )
            if not asked:  # a default max_tokens is cut to fit: its choices' minimum is not
                each = max(1, min_completion_tokens // choices)
                raise _too_few_for_choices(principal, budget - prompt_tokens, each, choices)
            raise bad_request(
                f"max_tokens: the prompt's {prompt_tokens:,} tokens and up to "
                f"{max_completion_tokens:,} generated (max tokens for every choice and "
                f"prompt) exceed the {budget:,} tokens key {principal.name!r} may use per "
                "minute: lower max_tokens, or ask for a higher tokens_per_minute",
                param="max_tokens",
                code="tokens_per_minute_exceeded",
            )
        if reason == "concurrency":
            raise rate_limited(
                f"key {principal.name!r} has {principal.max_concurrent_requests} requests in "
                "flight, its max_concurrent_requests",
                float(answer.get("retry_after_s", 1.0)),
                "concurrency_limit_exceeded",
            )
        raise rate_limited(
            f"key {principal.name!r} used its {principal.tokens_per_minute:,} tokens per minute",
            float(answer.get("retry_after_s", 1.0)),
            "tokens_per_minute_exceeded",
        )

    def _token_str(self, lane: Lane) -> rs.TokenStrings:
        """How logprobs spell the lane's tokens (`rs.token_strings` of their raw bytes;
        the table behind them is built once per tokenizer)."""
        tok = lane.tokenizer
        known = self._token_bytes.get(id(tok))
        if known is None or known[0] is not tok:
            known = self._token_bytes[id(tok)] = (tok, token_bytes(tok))
        return rs.token_strings(known[1])

    def _ensure_monitor(self) -> None:
        loop = asyncio.get_running_loop()
        if self._monitor is None or self._monitor.done():
            self._monitor = loop.create_task(self.monitor.run())
        if self._warmer is None:  # learn every lane's model now: readiness, no cold request
            self._warmer = loop.create_task(self._warm_lanes())

    async def _warm_lanes(self) -> None:
        async def warm(lane: Lane) -> None:
            while lane.tokenizer is None and self.draining is None:
                try:
                    async with lane.lock:
                        if lane.tokenizer is None:
                            await self._init_lane(lane)
                except Exception as exc:  # retried: readiness depends on it
                    logger.warning("lane %s not initialised yet: %r", lane.name, exc)
                    await asyncio.sleep(1.0)

        await asyncio.gather(*(warm(self.lanes[name]) for name in self.primaries))

    def _opener(self, lane: Lane, *, chat: bool) -> LaneOpener:
        """`open(payload, attempt)` for EngineStream (see `failover.LaneOpener`)."""
        return LaneOpener(self.monitor, lane, chat=chat, off_loop=self._off_loop, send=self._send)

    def _send(self, target: Lane, payload: dict[str, Any]) -> Any:
        """Start one streamed `generate` call on `target`'s deployment."""
        with _own_internal_request_id():
            return target.handle.options(
                stream=True, _by_reference=self.by_reference
            ).generate.remote(payload)

    def _on_event(self, lane: str) -> Any:
        def on_event(name: str, replica_id: str | None) -> None:  # failover.EngineStream
            self.index.count.remote(lane, name)
            if name == "replica_failed" and replica_id:
                self.index.report_failure.remote(replica_id)

        return on_event

    # -- OpenAI API ---------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=rq.openapi_request_body("/v1/completions"))
    async def completions(self, request: Request) -> Response:
        return await self._guard(self._completions(request))

    @app.post("/v1/chat/completions", openapi_extra=rq.openapi_request_body("/v1/chat/completions"))
    async def chat_completions(self, request: Request) -> Response:
        return await self._guard(self._chat(request))

    def _session(self, request: Request, model: str) -> str | None:
        header = self.router.get("affinity_header")
        value = request.headers.get(header) if header else None
        return f"{model}:{value}" if value else None

    async def _completions(self, request: Request) -> Response:
        req = rq.parse_request(rq.CompletionRequest, await self._body(request))
        self._note_unknown(req.unknown_fields)
        texts = req.prompts()
        if len(texts) > self.max_prompts:
            raise bad_request(
                f"prompt: {len(texts)} prompts in one request, at most {self.max_prompts} "
                "(server.requests.max_prompts): split the request",
                param="prompt",
            )
        model, lane = await self._lane(req.model)
        prompts = [
            req.truncate(
                await self._off_loop(self._encode, lane, p, req.add_special_tokens)
                if isinstance(p, str)
                else list(p),
                lane.max_model_len,
            )
            for p in texts
        ]
        longest = max(len(p) for p in prompts)
        req.check_room(longest, lane.max_model_len)
        # max_tokens: null (explicit) means the room the longest prompt leaves, as in vLLM.
        params = req.to_sampling_params(
            default_max_tokens=max(1, lane.max_model_len - longest),
            defaults=lane.sampling_defaults,
        )
        each = None
        if req.max_tokens is None:  # null: each prompt's own room (vLLM, per engine prompt)
            each = [
                lane.sampling_defaults.max_tokens(None, max(1, lane.max_model_len - len(p)))
                for p in prompts
            ]
        session = self._session(request, model)
        return await self._serve(
            req,
            model,
            lane,
            prompts,
            params,
            chat=False,
            session=session,
            request=request,
            max_tokens_each=each,
        )

    async def _chat(self, request: Request) -> Response:
        req = rq.parse_request(rq.ChatCompletionRequest, await self._body(request))
        self._note_unknown(req.unknown_fields)
        model, lane = await self._lane(req.model)
        ids = req.truncate(await self._chat_ids(lane, req), lane.max_model_len)
        req.check_room(len(ids), lane.max_model_len)
        params = req.to_sampling_params(
            default_max_tokens=max(1, lane.max_model_len - len(ids)),
            defaults=lane.sampling_defaults,
        )
        session = self._session(request, model)
        return await self._serve(
            req, model, lane, [ids], params, chat=True, session=session, request=request
        )

    async def _serve(
        self,
        req: Any,
        model: str,
        lane: Lane,
        prompts: list[list[int]],
        params: Any,
        *,
        chat: bool,
        session: str | None = None,
        request: Request | None = None,
        max_tokens_each: list[int] | None = None,
    ) -> Response:
        """Run `prompts` with `params` (`max_tokens_each`: prompt i's own max_tokens)
        and answer the request, streamed or not."""
        self._ensure_monitor()
        rid = rs.make_id("chatcmpl" if chat else "cmpl")
        created = rs.now()
        sp = _params_dict(params)
        principal: Principal | None = getattr(request.state, "principal", None) if request else None
        salt = params.extra.get("cache_salt")
        salt = request_salt(principal, self.guard.enabled, salt)  # tenants never share
        prompt_tokens = sum(len(p) for p in prompts)
        each = max_tokens_each or [params.max_tokens] * len(prompts)
        most = sum(each) * params.n
        choices = params.n * len(prompts)
        limits, lease, allowed = await self._admit(
            principal,
            prompt_tokens,
            most,
            req.asks_max_tokens,
            max(1, params.min_tokens) * choices,
            choices=choices,
            owner=self.ingress_id,
        )
        if allowed is not None and allowed < most:
            # The key's token budget bounds a default max_tokens: every choice gets an
            # equal share of what it leaves (the reservation just charged).
            share = allowed // choices
            if share < max(1, params.min_tokens):
                assert limits is not None and principal is not None
                limits.release.remote(principal.key_id, lease, 0, True)
                raise _too_few_for_choices(principal, allowed, max(1, params.min_tokens), choices)
            max_tokens_each = [min(m, share) for m in each]
        payloads = [
            {
                "request_id": f"{rid}-{i}",
                "prompt_token_ids": ids,
                "sampling_params": sp
                if max_tokens_each is None
                else {**sp, "max_tokens": max_tokens_each[i]},
                "priority": int(params.extra.get("priority", 0) or 0),
                "cache_salt": salt,
                "session": session,
                "lane": lane.name,  # a spare's metrics count the request on this lane
                # A spare with a shorter max_model_len refuses a max_tokens the client
                # named rather than cut it short (a default one is lowered to fit).
                "max_tokens_asked": bool(req.asks_max_tokens),
            }
            for i, ids in enumerate(prompts)
        ]
        opener = self._opener(lane, chat=chat)  # one per request: it counts one fallback
        streams = [
            EngineStream(
                opener,
                payload,
                max_attempts=int(self.router["max_attempts"]),
                on_event=self._on_event(lane.name),
                restartable=not req.stream,  # nothing reaches the client before the end
            )
            for payload in payloads
        ]
        fan = FanOut(streams, buffer=self.stream_buffer)
        released = False

        def release(completion_tokens: int, refund: bool = False) -> None:
            nonlocal released
            if limits is not None and principal is not None and not released:
                released = True
                limits.release.remote(principal.key_id, lease, completion_tokens, refund)

        try:
            await fan.ready()
            token_str = self._token_str(lane) if params.logprobs is not None else None
            if req.stream:
                stream = rs.ChunkStream.for_request(
                    req,
                    request_id=rid,
                    model=model,
                    created=created,
                    prompt_tokens=prompt_tokens,
                    token_str=token_str,
                    prompt_lens=[len(p) for p in prompts],
                )
                return _ClosingStreamingResponse(
                    self._sse(stream, fan, release),
                    on_close=lambda: (fan.close(), release(stream.completion_tokens)),
                    media_type="text/event-stream",
                )
            outputs = await _collect(fan, params.n, prompts)
        except BaseException as exc:  # a failed prompt, or the client went away: abort all
            fan.close()
            generated = sum(len(s.generated) + s.discarded for s in streams)
            # What was computed is billed; a request refused before its first token (a
            # full queue, a bad prompt, no replica) is refunded, prompt included, so a
            # client that retries after a 429 is not charged for work that never ran.
            release(generated, refund=not generated and not isinstance(exc, asyncio.CancelledError))
            raise
        # What the answer holds, and what runs a restart dropped computed (EngineStream).
        release(
            sum(len(c.token_ids) for o in outputs for c in o.outputs)
            + sum(s.discarded for s in streams)
        )
        for out in outputs:
            for comp in out.outputs:
                if comp.finish_reason == "abort":
                    raise service_unavailable("the request was aborted by the engine")
        if chat:
            body = rs.chat_response(
                rid,
                model,
                created,
                outputs[0],
                prompt_tokens=prompt_tokens,
                token_str=token_str,
                num_top_logprobs=req.num_top_logprobs,
            )
        else:
            body = rs.completion_response(
                rid,
                model,
                created,
                outputs,
                prompt_tokens=prompt_tokens,
                token_str=token_str,
                num_top_logprobs=req.num_top_logprobs,
            )
        return JSONResponse(body)

    async def _sse(self, stream: rs.ChunkStream, fan: FanOut, release: Any) -> AsyncIterator[bytes]:
        cached = 0
        try:
            for chunk in stream.start():
                yield rs.sse(chunk)
            try:
                async for i, item in fan.items():
                    if item["type"] == "delta":
                        delta = _delta(item)
                        for chunk in stream.update(delta, delta.logprobs, prompt_index=i):
                            yield rs.sse(chunk)
                    elif item["type"] == "final":
                        cached += item.get("num_cached_tokens", 0)
            except Exception as exc:  # the response has started: report it in-stream
                err = _as_protocol_error(exc)
                log = logger.exception if err.status >= 500 else logger.warning
                log("stream %s failed after it started: %s", stream.request_id, err.message)
                yield rs.sse(error_body(err))
                yield rs.sse_done()
                return
            for chunk in stream.finish(cached):
                yield rs.sse(chunk)
            yield rs.sse_done()
        finally:
            # A client that went away lands here too: cancel the engine-side
            # generators, which abort the requests and free their blocks.
            fan.close()
            release(stream.completion_tokens)

    async def _guard(self, work: Any) -> Response:
        try:
            return await work
        except Exception as exc:  # never a bare 500 without a body
            err = _as_protocol_error(exc)
            if err.status >= 500 and not isinstance(exc, ProtocolError):
                logger.exception("request failed: answering %d", err.status)
            return _error_response(err)

    # -- other endpoints ----------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self) -> Response:
        """The served model names, each with its lane's max_model_len (vLLM's extra
        field; null until the lane's first replica has told it)."""
        return JSONResponse(rs.models_response([self._card(name) for name in self.served]))

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str) -> Response:
        """One served model's card (OpenAI's retrieve), or 404 model_not_found."""
        if model not in self.served:
            return _error_response(model_not_found(model, self.served))
        return JSONResponse(self._card(model).model_dump())

    def _card(self, name: str) -> rs.ModelCard:
        lane = self.lanes[self.model_to_lane[name]]
        return rs.ModelCard(id=name, root=name, max_model_len=lane.max_model_len or None)

    @app.get("/health")
    async def health(self) -> Response:
        """Readiness (see spur.cluster.readiness): 503 naming what is missing."""
        self._ensure_monitor()
        status, body = health_report(
            {name: self.lanes[name].tokenizer is not None for name in self.primaries},
            {name: lane.healthy for name, lane in self.lanes.items()},
            self.selector.spare_of,
            self.draining,
        )
        return JSONResponse(body, status_code=status)

    @app.get("/health/live")
    async def health_live(self) -> Response:
        """Liveness: 200 while this process runs."""
        return JSONResponse({"status": "alive"})

    @app.get("/version")
    async def version(self) -> Response:
        return JSONResponse({"version": VERSION})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text: every engine, ingress and lane of the deployment
        (cluster/metrics.py), whichever ingress replica answers."""
        if not self.metrics_on:
            return _error_response(
                ProtocolError(404, "metrics are off (server.metrics: false)", code="not_found")
            )
        self._ensure_monitor()
        try:
            view = await self.index.metrics_view.remote(
                list(self.lanes), self.ingress_id, M.HTTP.snapshot(), self.monitor.lane_states()
            )
        except Exception as exc:
            return _error_response(service_unavailable(f"the KV index is unavailable ({exc})", 1.0))
        body = await asyncio.to_thread(M.render, view, self.config)
        return Response(body, media_type=M.CONTENT_TYPE)

    @app.get("/admin/config")
    async def admin_config(self) -> Response:
        return JSONResponse(self.config)

    @app.get("/admin/lanes")
    async def admin_lanes(self) -> Response:
        """Per lane: where its traffic goes now and why, and per replica: healthy,
        queue, KV usage, blocks held, restarts (from the KV index). Each ingress
        replica decides its lanes' targets itself (from the same health view, with
        hysteresis): `ingress_id` names the replica whose decision this is."""
        self._ensure_monitor()
        names = list(self.lanes)
        try:
            reports = await self.index.lanes.remote(names)
        except Exception as exc:
            return _error_response(service_unavailable(f"the KV index is unavailable ({exc})", 1.0))
        out = {}
        for name in names:
            entry = dict(reports.get(name, {}))
            if name in self.selector.state:
                entry.update(self.selector.report(name))
            entry["kind"] = "primary" if name in self.primaries else "spare"
            entry["ingress_id"] = self.ingress_id
            out[name] = entry
        return JSONResponse(out)

    @app.post(
        "/admin/reset_prefix_cache",
        openapi_extra=rq.openapi_request_body("/admin/reset_prefix_cache", required=False),
    )
    async def admin_reset_prefix_cache(self, request: Request) -> Response:
        """Make engines forget their cached prefixes: body {"lane": name} for one lane,
        {"replica_id": id} for one replica, {} for all. Answers the replica ids; each
        resets within one heartbeat (router.stats_period_s)."""

        async def work() -> Response:
            body = await self._body(request)
            req = rq.parse_request(rq.ResetPrefixCacheRequest, body if body.strip() else {})
            lane, replica = req.lane, req.replica_id
            if lane is not None and lane not in self.lanes:
                raise ProtocolError(
                    404, f"unknown lane {lane!r}; lanes: {sorted(self.lanes)}", param="lane"
                )
            ids = await self.index.queue_command.remote("reset_prefix_cache", lane, replica)
            return JSONResponse({"replica_ids": ids})

        return await self._guard(work())

    @app.get("/admin/routing")
    async def admin_routing(self) -> Response:
        """Routing metrics: decisions by reason, matched blocks, index size and event
        lag, failovers, retries and spare fallbacks."""
        try:
            return JSONResponse(await self.index.metrics.remote())
        except Exception as exc:
            return _error_response(service_unavailable(f"the KV index is unavailable ({exc})", 1.0))

    @app.get("/admin/engines")
    async def admin_engines(self) -> Response:
        out = {}
        for name in self.lanes:
            stats = await self._stats(name)
            out[name] = stats if stats is not None else {"error": "no replica answered"}
        return JSONResponse(out)

    @app.post("/tokenize", openapi_extra=rq.openapi_request_body("/tokenize"))
    async def tokenize(self, request: Request) -> Response:
        async def work() -> Response:
            req = rq.parse_request(rq.TokenizeRequest, await self._body(request))
            _, lane = await self._lane(req.model)
            tok = lane.tokenizer
            if req.is_chat:
                try:
                    ids = await self._off_loop(
                        chat_token_ids,
                        tok,
                        req.chat_messages(),
                        add_generation_prompt=req.add_generation_prompt,
                        continue_final_message=req.continue_final_message,
                        add_special_tokens=req.special_tokens,
                        template_kwargs=req.chat_template_kwargs,
                    )
                except ChatTemplateError as exc:
                    raise bad_request(
                        str(exc), param="messages", code="chat_template_error"
                    ) from None
            else:
                special = req.special_tokens
                ids = await self._off_loop(
                    lambda: list(tok(req.prompt, add_special_tokens=special)["input_ids"])
                )
            strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return JSONResponse(rs.tokenize_response(ids, lane.max_model_len, strs))

        return await self._guard(work())

    @app.post("/detokenize", openapi_extra=rq.openapi_request_body("/detokenize"))
    async def detokenize(self, request: Request) -> Response:
        async def work() -> Response:
            req = rq.parse_request(rq.DetokenizeRequest, await self._body(request))
            _, lane = await self._lane(req.model)
            vocab = len(lane.tokenizer)
            bad = [t for t in req.tokens if t >= vocab]
            if bad:
                raise ProtocolError(
                    400,
                    f"token ids {bad[:5]} are outside the vocabulary of {vocab}",
                    param="tokens",
                )
            text = await self._off_loop(lane.tokenizer.decode, req.tokens)
            return JSONResponse(rs.detokenize_response(text))

        return await self._guard(work())
