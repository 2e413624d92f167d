"""One engine request that survives the replica serving it.

`EngineStream` wraps an `open(payload, attempt)` (`LaneOpener`, below: it picks the
lane's primaries or its spare, sends the request and returns the engine stream
with its first item) and gives every request exactly one ending: a complete answer, or an
error item that says what happened.

- Before the first token: a replica that dies (or whose engine died) is retried,
  on another replica or the spare; then a 503 that names the attempts and the last
  failure.
- One budget for the request's whole life: `max_attempts` replicas may fail it (an
  open that fails, or a stream that breaks), then it ends. A replica drained on purpose
  (scale-down, shutdown) is not a failure. Without the bound, a request that crashes
  every engine it runs on (a kernel fault, an OOM at some length) was continued on
  replica after replica, once per token.
- After tokens were streamed (one completion, n == 1): the request continues on
  another replica with prompt + generated tokens as its prompt and the remaining
  token budget, so the client sees one unbroken stream. With n > 1 (several
  completions interleaved) it cannot be continued: a `restartable` stream (the client
  has seen nothing yet: a non-streamed response) runs again from its start on another
  replica, announced by a `{"type": "restart"}` item (the consumer drops what it
  collected); a streamed one ends with an explicit error item.

The continuation says how many of its prompt ids are output (`resumed`) and how many
characters of their text the client received (`resumed_chars`): the new replica's
text picks up there (what the old one held back still arrives, a stop string across
the break matches), the resumed ids count for presence / frequency penalties, and a
seeded request's generator is advanced past their draws. So greedy and seeded
requests continue as the unbroken request would have, up to the floating-point
differences of recomputing the prompt (speculative decoding included: it takes one
draw per emitted token too); an unseeded request continues with a valid, not the same,
sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from spur.cluster.errors import ProtocolError, engine_error, queue_full, service_unavailable
from spur.cluster.lanes import Lane, LaneMonitor
from spur.cluster.readiness import SHUTTING_DOWN_CODE, CountedStream, shutting_down

logger = logging.getLogger(__name__)

Opener = Callable[[dict[str, Any], int], Awaitable[tuple[Any, dict[str, Any]]]]
OnEvent = Callable[[str, str | None], None]


# Ray's errors for a replica (or its node) that went away; matched by class name
# over the MRO so that this module needs no Ray import to classify them.
REPLICA_GONE = frozenset(
    {
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "NodeDiedError",
        "WorkerCrashedError",
        "OwnerDiedError",
        "DeploymentUnavailableError",
    }
)


DRAIN_CODE = "draining"
"""`code` of the error item a replica removed on purpose (scale-down, shutdown) ends or
refuses a request with (`actors.engine.shell.actor.DRAIN_CODE`): never a failure."""

SPARE_CONTEXT_CODE = "spare_context_length_exceeded"
"""`code` of the 503 for a prompt the lane accepts but its spare, which serves the lane
for now, cannot (a shorter max_model_len): retry once the lane is back, not now."""

MAX_DRAINED_OPENS = 8
"""Drain refusals one open of a request may meet before it gives up with a 503: they
do not count against `max_attempts`, so this bounds them instead."""

_NOT_RETRIED = frozenset({"queue_full", SHUTTING_DOWN_CODE, SPARE_CONTEXT_CODE})


def is_retriable(exc: BaseException) -> bool:
    """A failure of the replica rather than of the request: its actor died or is
    unreachable, or its engine died or drains (503)."""
    if isinstance(exc, ProtocolError):
        return exc.status == 503 and exc.code not in _NOT_RETRIED
    return any(c.__name__ in REPLICA_GONE for c in type(exc).__mro__)


class EngineStream:
    """Async iterator over one request's engine items (see the module docstring)."""

    def __init__(
        self,
        opener: Opener,
        payload: dict[str, Any],
        *,
        max_attempts: int,
        on_event: OnEvent = lambda name, replica: None,
        backoff_s: float = 0.1,
        restartable: bool = False,
    ) -> None:
        self.opener = opener
        self.restartable = restartable
        """Nothing reaches the client before the end (a non-streamed response): with
        n > 1, a broken stream may run again from its start."""
        self.payload = payload
        self.max_attempts = max_attempts
        self.on_event = on_event
        self.backoff_s = backoff_s
        self.gen: Any = None
        self.replica_id: str | None = None
        self.generated: list[int] = []
        self.streamed_chars = 0
        """Characters of text the client has received (a continuation resumes there)."""
        self.finished = False
        self.ended = False
        self.done_indices: set[int] = set()
        self.continuations = 0
        self.restarts = 0
        self.discarded = 0
        """Tokens generated by runs a restart dropped: computed, so billed too."""
        self.attempts = 0
        """Opens tried, failed or not."""
        self.failures = 0
        """Replicas that failed this request (opens that failed, streams that broke)."""
        self._pending: dict[str, Any] | None = None

    @property
    def n(self) -> int:
        return int(self.payload.get("sampling_params", {}).get("n", 1) or 1)

    async def start(self) -> dict[str, Any]:
        """Open the request (with retries); returns its first item. Errors that are
        the request's own (400s) are raised as they are."""
        self.gen, first = await self._open(self.payload)
        self._note(first)
        return first

    async def _open(
        self, payload: dict[str, Any], first_attempt: int = 0
    ) -> tuple[Any, dict[str, Any]]:
        """Open `payload` on the lane, retrying while the request's failure budget
        lasts (the caller checks that some is left); returns (stream, first item).

        The opener sees attempt numbers from `first_attempt` on: 0 for a request's
        first open, 1 for a continuation, which is a re-open after a failure (the
        opener then refreshes the lane view, fails over, and checks the drain, as it
        does for every retry). Each retriable failure costs one of `max_attempts` and
        counts a `replica_failed` event; a drain refusal (code `draining`) costs
        none, up to MAX_DRAINED_OPENS of them. Raises the request's own errors
        (`is_retriable` False: a 400, a 429, shutting_down) as they are, else a 503
        that names the attempts and the last failure."""
        last: BaseException | None = None
        attempt = 0  # this call's opens so far: the backoff and the retry event
        drained = 0
        while self.failures < self.max_attempts and drained <= MAX_DRAINED_OPENS:
            self.attempts += 1
            if attempt:
                if not self.generated:  # spur:retries: re-opens before a first token
                    self.on_event("retry", None)
                await asyncio.sleep(self.backoff_s * attempt)
            try:
                return await self.opener(payload, attempt + first_attempt)
            except Exception as exc:
                if not is_retriable(exc):
                    raise
                last = exc
                attempt += 1
                if isinstance(exc, ProtocolError) and exc.code == DRAIN_CODE:
                    drained += 1  # removed on purpose: not a failure
                else:
                    self.failures += 1
                    # The opener reported the replica (it knows its id) to the index.
                    self.on_event("replica_failed", None)
                logger.warning(
                    "request %s attempt %d failed: %s", payload["request_id"], attempt, exc
                )
        detail = last.message if isinstance(last, ProtocolError) else f"{type(last).__name__}"
        raise service_unavailable(
            f"no replica could serve the request after {self.attempts} attempts "
            f"(last failure: {detail}); retry later",
            1.0,
        )

    def _note(self, item: dict[str, Any]) -> None:
        if item.get("replica_id"):
            self.replica_id = item["replica_id"]
        if item.get("type") == "delta":
            self.generated.extend(item.get("token_ids", ()))
            self.streamed_chars += len(item.get("text") or "")
            if item.get("finish_reason") is not None:
                self.done_indices.add(item.get("index", 0))
                self.finished = len(self.done_indices) >= self.n
        elif item.get("type") in ("final", "error"):
            self.finished = True

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.ended:  # our own error item was the last one
            raise StopAsyncIteration
        if self._pending is not None:  # the first item of a restart
            item, self._pending = self._pending, None
            self._note(item)
            return item
        try:
            item = await self.gen.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            if not is_retriable(exc):
                raise
            return await self._recover(f"{type(exc).__name__}: {exc}")
        if item.get("type") == "error" and item.get("status") == 503 and not self.finished:
            # "draining": the replica was removed on purpose (scale-down, shutdown):
            # continue elsewhere without counting a failure.
            planned = item.get("code") == "draining"
            return await self._recover(item.get("message", "engine failed"), planned=planned)
        if item.get("type") == "final" and self.continuations:
            # A continuation's prompt includes the tokens generated before the
            # break: its cache hits are not hits on the client's prompt.
            prompt_len = len(self.payload["prompt_token_ids"])
            item = {**item, "num_cached_tokens": min(item.get("num_cached_tokens", 0), prompt_len)}
        self._note(item)
        return item

    async def _recover(self, why: str, *, planned: bool = False) -> dict[str, Any]:
        self.on_event("drained" if planned else "replica_failed", self.replica_id)
        with contextlib.suppress(Exception):
            self.gen.cancel()
        if self.finished:  # every token arrived; only the summary was lost
            raise StopAsyncIteration
        if self.n != 1 and not self.restartable:
            return self._error(
                f"the replica serving this stream failed ({why}); with n > 1 it "
                "cannot be continued elsewhere: retry the request"
            )
        done = len(self.generated)
        if not planned:
            self.failures += 1
            if self.failures >= self.max_attempts:
                return self._error(
                    f"the replica serving this stream failed after {done} tokens ({why}); "
                    f"{self.failures} replicas have failed this request, its max_attempts: "
                    "retry the request"
                )
        if self.n != 1:
            return await self._restart(why, done)
        params = dict(self.payload.get("sampling_params", {}))
        params["max_tokens"] = max(1, int(params.get("max_tokens", 16)) - done)
        params["min_tokens"] = max(0, int(params.get("min_tokens", 0) or 0) - done)
        self.continuations += 1
        payload = {
            **self.payload,
            "request_id": f"{self.payload['request_id']}-c{self.continuations}",
            "prompt_token_ids": list(self.payload["prompt_token_ids"]) + self.generated,
            "sampling_params": params,
            "resumed": done,
            "resumed_chars": self.streamed_chars,
        }
        payload.pop("block_hashes", None)  # the opener hashes the new prompt
        failure = f"the replica serving this stream failed after {done} tokens ({why})"
        first, opened = await self._reopen(payload, failure, "continue it")
        if not opened:
            return first
        self.on_event("failover", self.replica_id)  # spur:stream_continuations
        self._note(first)
        return first

    async def _restart(self, why: str, done: int) -> dict[str, Any]:
        """Run the request again from its start (n > 1, nothing sent to the client yet):
        returns the `restart` item; the new stream's first item follows it. What the
        broken stream generated is dropped here and by the consumer."""
        self.restarts += 1
        self.on_event("retry", None)  # spur:retries: a re-open, nothing delivered
        payload = {**self.payload, "request_id": f"{self.payload['request_id']}-r{self.restarts}"}
        self.discarded += len(self.generated)
        self.generated, self.streamed_chars, self.done_indices = [], 0, set()
        failure = f"the replica serving this request failed after {done} tokens ({why})"
        first, opened = await self._reopen(payload, failure, "run it again")
        if not opened:
            return first
        self._pending = first
        return {"type": "restart", "replica_id": self.replica_id}

    async def _reopen(
        self, payload: dict[str, Any], failure: str, to: str
    ) -> tuple[dict[str, Any], bool]:
        """Open `payload` after a break, as a retry: the lane view is refreshed, a dead
        lane fails over to its spare, and a draining server ends the stream
        (shutting_down) at once. Returns (its first item, True), or (the error item
        that ends this stream, False) when no replica could `to` ("continue it")."""
        try:
            self.gen, first = await self._open(payload, first_attempt=1)
        except ProtocolError as exc:
            message = f"{failure} and no other replica could {to}: {exc.message}"
            code = exc.code if exc.code == SHUTTING_DOWN_CODE else None
            return self._error(message, code=code), False
        return first, True

    def _error(self, message: str, code: str | None = None) -> dict[str, Any]:
        """The 503 error item that ends this stream; `code` only for shutting_down
        (`errors.engine_error` passes it on to the client)."""
        self.finished = self.ended = True
        item = {"type": "error", "status": 503, "message": message, "param": None}
        if code is not None:
            item["code"] = code
        return item

    def cancel(self) -> None:
        if self.gen is not None:
            with contextlib.suppress(Exception):
                self.gen.cancel()


# -- opening a lane's engine stream --------------------------------------------------------
NO_REPLICA_TIMEOUT_S = 15.0
"""How long a request waits for its first item while its target has no healthy
replica, before a retriable 503 (Serve would hold it until one comes back)."""


def is_back_pressure(exc: BaseException) -> bool:
    """Serve's `BackPressureError` (every replica's queue is full), matched by class
    name as `REPLICA_GONE` is, so that this module needs no Ray import."""
    return any(c.__name__ == "BackPressureError" for c in type(exc).__mro__)


class LaneOpener:
    """`open(payload, attempt)` for `EngineStream`, for one lane: its primaries or
    its spare (as the lane monitor's selector says now), the prompt's block hashes
    for that target, and the first item, so that a rejection becomes an HTTP error
    before any byte is sent.

    `off_loop(fn, *args, **kwargs)` runs `fn` off the event loop (the ingress's
    tokenizer pool: hashing a long prompt); `send(target, payload)` starts the
    streamed `generate` call on the target lane's deployment and returns its
    response generator. Raises `ProtocolError`: 503 (retriable, see
    `is_retriable`; code `draining` for a replica removed on purpose) when the target
    fails or moves away before the first item, 429 `queue_full` on back pressure, a
    503 `spare_context_length_exceeded` (not retried) for a prompt the lane accepts
    but its spare, serving it now, cannot, or the engine's own error (400, ...). A
    stream it raises for is cancelled first (a spare's stream stops counting in the
    lane's spare demand at once).

    One opener per `EngineStream`: it counts the request's first open on the spare
    as its one `fallback` event (spur:spare_fallbacks counts requests, not opens).
    """

    def __init__(
        self,
        monitor: LaneMonitor,
        lane: Lane,
        *,
        chat: bool,
        off_loop: Callable[..., Awaitable[Any]],
        send: Callable[[Lane, dict[str, Any]], Any],
    ) -> None:
        self.monitor = monitor
        self.lane = lane
        self.chat = chat
        self.off_loop = off_loop
        self.send = send
        self.fell_back = False  # this request was counted in spur:spare_fallbacks

    async def __call__(self, payload: dict[str, Any], attempt: int) -> tuple[Any, dict[str, Any]]:
        monitor, lane, selector = self.monitor, self.lane, self.monitor.selector
        if attempt:  # see the failure this request just reported (LaneMonitor.refresh)
            await monitor.refresh()
        if attempt and monitor.draining is not None:  # nowhere to move it to
            raise shutting_down(monitor.draining)
        name = selector.target(lane.name)
        if name == lane.name and attempt and lane.healthy == 0:
            # The primaries are gone and the monitor has not switched yet.
            if selector.fail_over_now(lane.name):
                monitor.switched(lane.name, "down")
            name = selector.target(lane.name)
        target = monitor.lanes[name]
        if name != lane.name:
            payload = self._fit_spare(name, target.max_model_len, payload)
            if not self.fell_back:
                self.fell_back = True
                monitor.index.count.remote(lane.name, "fallback")
        if target.caching and payload.get("block_hashes") is None:
            payload = {
                **payload,
                "block_hashes": await self.off_loop(
                    target.hasher.chain,
                    payload["prompt_token_ids"],
                    cache_salt=payload.get("cache_salt"),
                ),
            }
        if attempt:  # a retry may reach a replica that still holds the old id
            payload = {**payload, "request_id": f"{payload['request_id']}-a{attempt}"}
        gen = self.send(target, payload)
        if name != lane.name:  # the lane's demand, for its autoscaling policy
            gen = CountedStream(gen, monitor.on_spare, lane.name)
        first_task = asyncio.ensure_future(gen.__anext__())
        try:
            await self._first_item(name, first_task)
        except BaseException:
            first_task.cancel()
            gen.cancel()
            with contextlib.suppress(BaseException):
                await first_task  # retrieve it: no "exception never retrieved"
            raise
        try:
            first = first_task.result()
        except StopAsyncIteration:
            _cancel(gen)
            raise service_unavailable("the engine closed the stream without answering") from None
        except Exception as exc:
            _cancel(gen)
            if is_back_pressure(exc):
                raise queue_full(1.0) from None
            raise
        if first["type"] == "error":
            _cancel(gen)  # before raising: the exception may outlive the request
            if name != lane.name:
                self._check_spare_context(name, payload, first)
            self._raise_engine_error(first)
        return gen, first

    def _fit_spare(self, spare: str, limit: int, payload: dict[str, Any]) -> dict[str, Any]:
        """`payload` for the spare `spare`, whose max_model_len is `limit` (0: not
        known yet). The lane checked prompt + max_tokens against its own, longer one:
        a prompt over the spare's is refused (`_spare_too_short`); so is one whose
        max_tokens the client named (`max_tokens_asked`, continuations keep it), or
        whose min_tokens, the spare cannot generate in full, rather than cut short with
        a silent "length"; a default max_tokens (the room the lane would leave) is
        lowered to the room the spare leaves."""
        n = len(payload["prompt_token_ids"])
        resumed = int(payload.get("resumed", 0) or 0)
        if limit <= 0:
            return payload
        if limit <= n < self.lane.max_model_len:
            raise self._spare_too_short(spare, n, limit, resumed=resumed)
        params = payload.get("sampling_params", {})
        want = int(params.get("max_tokens") or 0)
        if n + want <= limit:
            return payload
        room = max(1, limit - n)
        if payload.get("max_tokens_asked") or int(params.get("min_tokens") or 0) > room:
            raise self._spare_too_short(spare, n, limit, max_tokens=want, resumed=resumed)
        return {**payload, "sampling_params": {**params, "max_tokens": room}}

    async def _first_item(self, name: str, first: asyncio.Future[Any]) -> None:
        """Wait for a request's first item, in slices: give up (a retriable 503) when
        the lane moved to its spare because its primaries went down, when it moved
        back to its primaries while the request waits on a spare with no healthy
        replica, or when the target has had no healthy replica for
        NO_REPLICA_TIMEOUT_S (Serve would otherwise hold the request until a replica
        comes back, maybe never)."""
        lane, selector = self.lane, self.monitor.selector
        loop = asyncio.get_running_loop()
        since: float | None = None
        while True:
            done, _ = await asyncio.wait({first}, timeout=0.5)
            if done:
                return
            state = selector.state.get(lane.name)
            moved = name == lane.name and selector.target(lane.name) != name
            if moved and state is not None and state.reason != "saturated":
                raise service_unavailable(
                    f"lane {lane.name!r} moved to its spare while the request waited"
                )
            back = name != lane.name and selector.target(lane.name) != name
            if back and self.monitor.lanes[name].healthy == 0:
                raise service_unavailable(
                    f"lane {lane.name!r} moved back to its primaries while the request "
                    f"waited on its spare {name!r}, which has no healthy replica"
                )
            if self.monitor.lanes[name].healthy == 0:
                since = loop.time() if since is None else since
                if loop.time() - since > NO_REPLICA_TIMEOUT_S:
                    raise service_unavailable(
                        f"{name!r} has had no healthy replica for {NO_REPLICA_TIMEOUT_S:.0f} s; "
                        "retry later",
                        5.0,
                    )
            else:
                since = None

    def _raise_engine_error(self, first: dict[str, Any]) -> None:
        """The engine's error item (its first) as the ProtocolError the client gets; a
        drain's keeps its code `draining` (EngineStream does not count it as a
        failure; it never reaches the client as it is, being retried)."""
        draining = first.get("code") == DRAIN_CODE  # planned removal: no failure
        if first.get("status") == 503 and first.get("replica_id") and not draining:
            self.monitor.index.report_failure.remote(first["replica_id"])
        exc = engine_error(first, chat=self.chat)
        if draining and first.get("status") == 503:
            exc.code = DRAIN_CODE
        raise exc

    def _check_spare_context(
        self, spare: str, payload: dict[str, Any], first: dict[str, Any]
    ) -> None:
        """Raise the 503 of `_spare_too_short` when the spare's error item is its
        max_model_len refusal (scheduler.validate_prompt's 400) of a prompt the lane
        itself accepts; remember the spare's limit (its `Lane.max_model_len`), so that
        later prompts over it are refused without a round trip. Returns for any
        other error."""
        if first.get("status") != 400 or first.get("param") != "prompt":
            return
        found = _MAX_LEN.search(str(first.get("message", "")))
        n = len(payload["prompt_token_ids"])
        if found is None or not n < self.lane.max_model_len:
            return
        limit = int(found.group(1).replace(",", ""))
        self.monitor.lanes[spare].max_model_len = limit
        raise self._spare_too_short(spare, n, limit)

    def _spare_too_short(
        self, spare: str, n: int, limit: int, *, max_tokens: int | None = None, resumed: int = 0
    ) -> ProtocolError:
        """The 503 for a prompt of `n` tokens (and, when given, the `max_tokens` the
        client named) that the lane accepts but its spare `spare` (max_model_len
        `limit`), which serves the lane for now, cannot: a temporary condition of the
        failover, not the client's fault."""
        # The lane returns to its primaries once they have been usable this long.
        retry_s = max(5.0, self.monitor.selector.healthy_after_s)
        prompt = f"the prompt's {n:,} tokens"
        if resumed:  # a continuation: its prompt holds what was generated before
            prompt = f"the prompt's {n - resumed:,} tokens and the {resumed:,} generated so far"
        if max_tokens is None:
            what = f"{prompt} fit"
            fix = f"send a prompt under {limit:,} tokens"
        else:
            what = f"{prompt} and {max_tokens:,} more to generate fit"
            fix = f"ask for at most {max(1, limit - n):,} tokens"
        exc = service_unavailable(
            f"lane {self.lane.name!r} is served by its spare {spare!r} for now, whose "
            f"max_model_len is {limit:,}: {what} the lane's own "
            f"{self.lane.max_model_len:,} but not the spare's; retry once the lane is back "
            f"on its primaries (Retry-After), or {fix}",
            retry_s,
        )
        exc.code = SPARE_CONTEXT_CODE
        return exc


_MAX_LEN = re.compile(r"max_model_len is ([\d,]+)")
"""The engine's limit in its max_model_len refusal (scheduler.validate_prompt's text)."""


def _cancel(gen: Any) -> None:
    """Cancel an engine stream the opener gives up on (a `CountedStream` also stops
    counting), ignoring a stream that already ended."""
    with contextlib.suppress(Exception):
        gen.cancel()
