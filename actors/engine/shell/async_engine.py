"""An EngineCore driven by its own thread, for asyncio callers (the Serve replica).

    asyncio tasks ──add/abort──> inbox (thread-safe) ──> engine thread
                                                          step(): schedule -> execute -> update
    asyncio queues <──call_soon_threadsafe── deltas ─────┘

Only the engine thread touches the core (it is not thread-safe); callers talk to
it through the inbox and read per-request asyncio queues. The model forward runs
on the engine thread, so the event loop stays free to accept requests and
stream tokens while a step runs. A generator that is closed early (the client
went away) aborts its request: its blocks return to the pool within a step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from spur.actors.engine.core.block_pool import AllBlocksCleared, BlockStored, KVEvent
from spur.actors.engine.core.engine_core import EngineCore
from spur.actors.engine.core.outputs import RequestOutput
from spur.actors.engine.core.request import RequestStatus
from spur.actors.engine.core.scheduler import check_token_ids
from spur.actors.engine.shell.metrics import EngineMetrics
from spur.actors.engine.shell.output_processor import Delta, OutputProcessor
from spur.actors.generation_config import with_eos
from spur.actors.step import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed; the replica must be restarted."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    priority: int
    cache_salt: str | None
    resumed: int = 0
    arrival: float | None = None  # metrics clock, when the request reached the engine
    resumed_chars: int | None = None
    lane: str | None = None  # the lane its metrics count on (None: the engine's own)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _ResetPrefixCache:
    done: asyncio.Future[None]


@dataclass
class _Snapshot:
    done: asyncio.Future[tuple[int, list[bytes], list[bytes] | None]]


@dataclass
class _CheckIntegrity:
    done: asyncio.Future[dict[str, int]]


_Command = _Add | _Abort | _ResetPrefixCache | _Snapshot | _CheckIntegrity


def event_batch(
    seq: int, events: list[KVEvent], group_id: int = 0, state_group: int | None = None
) -> dict[str, Any]:
    """The net effect of `events` on group `group_id`'s cached hashes, as one batch
    for the KV index: {"seq", "cleared", "stored", "removed", "time"}. Applying
    it = clear (if cleared), add stored, remove removed; a hash stored and then
    evicted within the batch ends up in removed only, and the reverse in stored.
    With `state_group` (a model with recurrent-state layers), that group's changes
    too, as "state_stored" / "state_removed": a prefix hit needs its state."""
    groups = (group_id,) if state_group is None else (group_id, state_group)
    last: dict[int, dict[bytes, bool]] = {g: {} for g in groups}
    cleared = False
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            for table in last.values():
                table.clear()
            cleared = True
        elif ev.group_id in last:
            present = isinstance(ev, BlockStored)
            table = last[ev.group_id]
            for h in ev.block_hashes:
                table[h] = present
    batch: dict[str, Any] = {"seq": seq, "cleared": cleared, "time": time.time()}
    for prefix, g in (("", group_id), ("state_", state_group)):
        if g is not None:
            batch[f"{prefix}stored"] = [h for h, present in last[g].items() if present]
            batch[f"{prefix}removed"] = [h for h, present in last[g].items() if not present]
    return batch


class AsyncEngine:
    """Thread-owning wrapper of an EngineCore. Create it inside a running event
    loop; `shutdown()` stops the thread (requests in flight are aborted).
    `on_thread_start` runs first on the engine thread (per-thread settings such
    as the number of OpenMP threads of the forward). `stream_interval`: tokens per
    streamed delta after a completion's first (RuntimeConfig.stream_interval)."""

    def __init__(
        self,
        core: EngineCore,
        tokenizer: Any | None,
        *,
        eos_token_id: int | None,
        more_eos_token_ids: tuple[int, ...] = (),
        vocab_size: int | None = None,
        idle_wait_s: float = 0.05,
        stream_interval: int = 1,
        step_timeout_s: float | None = None,
        on_thread_start: Callable[[], None] | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.core = core
        self.metrics = metrics  # fed on the engine thread (None: metrics off)
        self.scheduler = core.scheduler
        self.processor = OutputProcessor(tokenizer)
        self.eos_token_id = eos_token_id
        self.more_eos_token_ids = more_eos_token_ids
        """The model's other EOS ids (`generation_config.with_eos`)."""
        self.vocab_size = vocab_size
        self.idle_wait_s = idle_wait_s
        self.stream_interval = stream_interval
        self.step_timeout_s = step_timeout_s
        """A step running longer makes the engine not `alive` (None: no bound)."""
        self._step_started: float | None = None  # monotonic, while a step runs
        self._inbox: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._unapplied: list[_Command | None] = []
        self._streams: dict[str, asyncio.Queue[Delta | RequestOutput | Exception]] = {}
        # Ids whose stream ended before the request did: the engine thread may still
        # deliver a step's output for them until it applies their abort, so they are
        # not reused until it has (event loop thread only).
        self._closing: set[str] = set()
        # Open streams whose last item (the final output, or an error) is queued: the
        # request is over though its consumer has not read it yet (event loop thread).
        self._ended: set[str] = set()
        # Requests `generate` handed to the engine thread, and those it has taken in
        # (each counter written by one thread): the difference is queued behind a step.
        self._adds_sent = 0
        self._adds_done = 0
        self._arrived: list[str] = []  # ids that reached `generate`, for the router's index
        self._loop = asyncio.get_running_loop()
        self._stop = threading.Event()
        self.error: str | None = None
        self.num_steps = 0
        self.last_stats: dict[str, Any] = {}
        # KV event batches for the router's index, when the pool records events
        # (engine thread appends, the replica's publisher pops; a full deque
        # drops the oldest batch, which the index sees as a gap and resyncs).
        self.publish_kv_events = core.scheduler.kv.pool.enable_kv_events
        groups = core.scheduler.kv.config.groups
        self.state_group = next((i for i, g in enumerate(groups) if g.spec.kind == "state"), None)
        """The cache group of recurrent states (hybrid models), published beside group
        0's attention blocks: the router's hit needs both; None for other models."""
        self.kv_batches: collections.deque[dict[str, Any]] = collections.deque(maxlen=10_000)
        self._next_seq = 0
        self._on_thread_start = on_thread_start
        self._thread = threading.Thread(target=self._run, name="spur-engine", daemon=True)
        self._thread.start()

    # -- caller side (event loop) -------------------------------------------------------
    def validate(self, prompt_token_ids: list[int]) -> None:
        """Raise RequestRejected (naming the fix) for a prompt the engine can
        never serve: too long, or a token id outside the vocabulary (which
        would fail the whole step). Safe from any thread: it reads only
        immutable config."""
        self.scheduler.validate_prompt(len(prompt_token_ids))
        if self.vocab_size is not None:
            check_token_ids(prompt_token_ids, self.vocab_size)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        resumed: int = 0,
        resumed_chars: int | None = None,
        lane: str | None = None,
    ) -> AsyncIterator[Delta | RequestOutput]:
        """Stream a request's deltas, then its final RequestOutput. Raises
        RequestRejected before anything runs, EngineDeadError if the engine
        fails mid-way (after the tokens generated until then). Closing the generator
        early aborts the request. Each completion's first delta goes out at once; later
        ones hold at least `stream_interval` tokens, but the last (its finish reason).
        `resumed`: the last `resumed` prompt ids are output that another replica
        generated and streamed (a failover continuation, n == 1), of whose text the
        client received `resumed_chars` characters: the text continues from there (see
        `OutputProcessor.add_request`). `lane`: the lane the request came for, when
        another than the engine's own (a spare's): its statistics count there
        (`EngineMetrics.on_add`)."""
        if len(self._arrived) < 100_000:  # bounded when no publisher takes them
            self._arrived.append(request_id)
        if self.error is not None or self.stuck:
            # Stuck: it would queue behind a step that may never end (the replica is
            # about to be restarted): refused now, with the reason.
            raise EngineDeadError(self.dead_message)
        self.validate(prompt_token_ids)
        if not 0 <= resumed < len(prompt_token_ids) or (resumed and params.n != 1):
            raise ValueError(
                f"resumed={resumed}: a continuation resumes fewer ids than its prompt holds, "
                "with n == 1"
            )
        if request_id in self._streams or request_id in self._closing:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[Delta | RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = stream
        arrival = self.metrics.clock() if self.metrics is not None else None
        self._adds_sent += 1
        self._inbox.put(
            _Add(
                request_id,
                prompt_token_ids,
                params,
                prompt,
                priority,
                cache_salt,
                resumed,
                arrival,
                resumed_chars,
                lane,
            )
        )
        if self.error is not None:  # the thread ended meanwhile; it may not have seen this
            self._streams.pop(request_id, None)
            raise EngineDeadError(self.dead_message)
        done = False
        pending: Delta | RequestOutput | Exception | None = None
        held: dict[int, Delta] = {}  # completion index -> tokens not sent yet (interval)
        sent: set[int] = set()  # completion indexes whose first tokens went out
        try:
            while True:
                item = pending if pending is not None else await stream.get()
                pending = None
                if isinstance(item, Exception | RequestOutput):
                    for delta in held.values():  # what was generated reaches the caller
                        yield delta
                    held.clear()
                    done = True
                    if isinstance(item, Exception):
                        raise item
                    yield item
                    return
                # Coalesce under back-pressure: when the consumer fell behind
                # (a busy ingress or proxy), the deltas already queued for this
                # completion go out as one. No latency is added otherwise.
                while not stream.empty() and item.finish_reason is None:
                    nxt = stream.get_nowait()
                    if isinstance(nxt, Delta) and nxt.index == item.index:
                        item = _merge(item, nxt)
                    else:
                        pending = nxt
                        break
                if self.stream_interval > 1:
                    before = held.pop(item.index, None)  # only ever after a first
                    first = item.index not in sent
                    sent.add(item.index)
                    if before is not None:
                        item = _merge(before, item)
                    # The first tokens go at once (TTFT); then every `stream_interval`
                    # tokens, and whatever is held when the completion finishes.
                    short = len(item.token_ids) < self.stream_interval
                    if short and not first and item.finish_reason is None:
                        held[item.index] = item
                        continue
                yield item
        finally:
            self._streams.pop(request_id, None)
            self._ended.discard(request_id)
            if not done:
                self._closing.add(request_id)
                self._inbox.put(_Abort(request_id))

    @property
    def request_ids(self) -> list[str]:
        """Requests whose stream is open (event loop thread)."""
        return list(self._streams)

    def fail(self, request_id: str, exc: Exception) -> bool:
        """End an open request's stream with `exc` (its `generate` raises it) and abort
        the request: its blocks return to the pool within one step. Call from the event
        loop thread. Returns False when the request has no open stream, or its stream
        already holds its last item (it ended; its consumer has not read it yet)."""
        stream = self._streams.get(request_id)
        if stream is None or request_id in self._ended:
            return False
        self._ended.add(request_id)
        stream.put_nowait(exc)
        self._closing.add(request_id)
        self._inbox.put(_Abort(request_id))
        return True

    async def check_integrity(self) -> dict[str, int]:
        """Run the scheduler's and the KV pool's `check_integrity()` on the engine thread
        (between steps). Returns {"num_requests", "num_free_blocks", "num_blocks"};
        raises AssertionError (from the check) when the bookkeeping is broken, and
        EngineDeadError when the engine thread is gone."""
        return await self._ask(_CheckIntegrity)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached block hash, on the engine thread (between steps)."""
        await self._ask(_ResetPrefixCache)

    async def snapshot(self) -> tuple[int, list[bytes], list[bytes] | None]:
        """(seq, every cached hash of group 0, those of the state group or None) as of
        event batch `seq`, taken on the engine thread: the index replaces its view with
        it and applies later batches."""
        return await self._ask(_Snapshot)

    async def _ask(self, command: Callable[[asyncio.Future[Any]], _Command]) -> Any:
        """Queue `command` for the engine thread and await its answer; EngineDeadError
        when the thread is gone (it fails what it finds queued when it ends, and a
        command queued after that is failed here: see `_end`)."""
        if self.error is not None:
            raise EngineDeadError(self.dead_message)
        done: asyncio.Future[Any] = self._loop.create_future()
        self._inbox.put(command(done))
        if self.error is not None and not done.done():  # the thread may have ended first
            done.set_exception(EngineDeadError(self.dead_message))
        return await done

    def take_kv_batches(self) -> list[dict[str, Any]]:
        """The KV event batches not taken yet, oldest first."""
        out = []
        while self.kv_batches:
            out.append(self.kv_batches.popleft())
        return out

    def return_kv_batches(self, batches: list[dict[str, Any]]) -> None:
        """Put back taken batches that did not reach the index, before any taken since
        (resending is safe: the index skips sequence numbers it has applied)."""
        self.kv_batches.extendleft(reversed(batches))

    @property
    def dead_message(self) -> str:
        """What clients are told once the engine failed (no traceback: that
        stays in the replica's log)."""
        if self.error is None and self.stuck:
            return (
                f"the engine has been in one step for {self.step_running_s():.0f} s, more "
                f"than engine.runtime.step_timeout_s ({self.step_timeout_s:g} s): it is "
                "stuck and being restarted, retry shortly"
            )
        last = (self.error or "").strip().splitlines()[-1:] or ["unknown error"]
        return f"the engine failed ({last[0]}); it is being restarted, retry shortly"

    def step_running_s(self) -> float:
        """Seconds the engine thread has been in its current step (0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def stuck(self) -> bool:
        """The current step has run longer than `step_timeout_s`."""
        return self.step_timeout_s is not None and self.step_running_s() > self.step_timeout_s

    @property
    def alive(self) -> bool:
        """The engine thread runs, has not failed, and is not stuck in a step."""
        return self.error is None and self._thread.is_alive() and not self.stuck

    async def shutdown(self) -> None:
        """Stop the engine thread: requests in flight are aborted and their streams end
        with EngineDeadError, as do later calls."""
        self._stop.set()
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join, 30)

    # -- engine thread ------------------------------------------------------------------
    def _deliver(self, request_id: str, item: Delta | RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)
            if not isinstance(item, Delta):
                self._ended.add(request_id)

    def _deliver_many(self, items: list[Delta | RequestOutput]) -> None:
        for item in items:
            self._deliver(item.request_id, item)

    def _send(self, request_id: str, item: Delta | RequestOutput | Exception) -> None:
        self._loop.call_soon_threadsafe(self._deliver, request_id, item)

    def _apply(self, cmd: _Command) -> None:
        sched = self.scheduler
        if isinstance(cmd, _ResetPrefixCache):
            sched.kv.reset_prefix_cache()
            self._flush_kv_events()
            self._settle(cmd.done, None)
            return
        if isinstance(cmd, _Snapshot):
            self._flush_kv_events()
            cached = sched.kv.pool.cached
            hashes = list(cached[0]) if cached else []
            states = None if self.state_group is None else list(cached[self.state_group])
            self._settle(cmd.done, (self._next_seq - 1, hashes, states))
            return
        if isinstance(cmd, _CheckIntegrity):
            try:
                sched.check_integrity()
                report = {
                    "num_requests": len(sched.requests),
                    "num_free_blocks": sched.kv.num_free_blocks,
                    "num_blocks": sched.kv.pool.num_blocks,
                }
            except Exception as exc:  # reported to the caller, the engine goes on
                self._settle(cmd.done, error=exc)
            else:
                self._settle(cmd.done, report)
            return
        if isinstance(cmd, _Abort):
            if cmd.request_id in sched.requests or cmd.request_id in self.processor.requests:
                sched.abort_requests(cmd.request_id)
                self.processor.abort(cmd.request_id)
                if self.metrics is not None:
                    self.metrics.on_abort(cmd.request_id)
                    self.metrics.refresh_gauges(sched)  # no step may follow to do it
            # After every delivery already queued for it (the loop runs them in order).
            self._loop.call_soon_threadsafe(self._closing.discard, cmd.request_id)
            return
        try:
            self._add(cmd)
        finally:  # after the scheduler holds it: `stats` may count it twice, never not
            self._adds_done += 1

    def _add(self, cmd: _Add) -> None:
        sched = self.scheduler
        params = with_eos(cmd.params, self.more_eos_token_ids)
        try:  # a request either side refuses fails alone, before the engine holds it
            request = sched.make_request(
                cmd.request_id,
                cmd.prompt_token_ids,
                params,
                eos_token_id=self.eos_token_id,
                priority=cmd.priority,
                cache_salt=cmd.cache_salt,
                num_resumed=cmd.resumed,
            )
            self.processor.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.prompt_token_ids,
                params,
                resumed=cmd.resumed,
                resumed_chars=cmd.resumed_chars,
            )
            try:
                sched.add_request(request)
            except Exception:
                self.processor.abort(cmd.request_id)
                raise
        except Exception as exc:  # any error of this request's own (a tokenizer's too)
            if not isinstance(exc, ValueError):
                logger.exception("request %s refused", cmd.request_id)
            self._send(cmd.request_id, exc)
            return
        if self.metrics is not None:
            self.metrics.on_add(
                cmd.request_id,
                len(cmd.prompt_token_ids),
                n=cmd.params.n,
                arrival=cmd.arrival,
                lane=cmd.lane,
            )

    def _run(self) -> None:
        try:
            if self._on_thread_start is not None:
                self._on_thread_start()
            while not self._stop.is_set():
                if self.core.has_unfinished_requests():
                    cmds = self._drain()
                else:  # idle: block until work arrives
                    try:
                        cmds = [self._inbox.get(timeout=self.idle_wait_s), *self._drain()]
                    except queue.Empty:
                        continue
                self._unapplied = cmds  # what `_end` must still answer if this fails
                while cmds:
                    if cmds[0] is None:  # the stop signal
                        return
                    self._apply(cmds[0])
                    cmds.pop(0)
                if self.core.has_unfinished_requests():
                    self._step()
        except Exception:  # the engine is unusable: fail every stream loudly
            self.error = traceback.format_exc()
            logger.error("engine thread failed:\n%s", self.error)
        finally:
            self._end()

    def _end(self) -> None:
        """The engine thread's last act (it failed or was stopped). `error` is set first,
        so a caller that queued a command after this drained the inbox sees it and fails
        the command itself (`generate`, `_ask`); then every queued command and every
        open stream gets EngineDeadError, and the requests are aborted."""
        if self.error is None:
            self.error = "the engine was shut down"
        dead = EngineDeadError(self.dead_message)
        # Commands taken from the inbox but not applied (the thread failed in an earlier
        # one, or stopped) are answered like the ones still queued.
        left, self._unapplied = self._unapplied, []
        for cmd in [*left, *self._drain()]:
            if isinstance(cmd, _Add):
                self._send(cmd.request_id, dead)
            elif cmd is not None and not isinstance(cmd, _Abort):
                self._settle(cmd.done, error=dead)
        for rid in list(self._streams):
            self._send(rid, dead)
        for rid in list(self.scheduler.requests):
            self.scheduler.abort_requests(rid)
        self.processor.requests.clear()

    def _settle(
        self, done: asyncio.Future[Any], result: Any = None, *, error: Exception | None = None
    ) -> None:
        """Answer a caller's future from the engine thread (a caller that stopped
        waiting has cancelled it: then nothing is set)."""

        def settle() -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        self._loop.call_soon_threadsafe(settle)

    def _drain(self) -> list[_Command | None]:
        cmds: list[_Command | None] = []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _step(self) -> None:
        t0 = time.perf_counter()
        started = self.metrics.clock() if self.metrics is not None else 0.0
        self._step_started = time.monotonic()
        try:
            outputs, stats = self.core.step()
        finally:
            self._step_started = None
        self.num_steps += 1
        update = self.processor.process(outputs)
        if update.to_finish:
            self.scheduler.finish_requests(update.to_finish, RequestStatus.FINISHED_STOPPED)
        if self.metrics is not None:
            self.metrics.on_step(
                outputs,
                stats,
                self.scheduler,
                started=started,
                reasons=update.finish_reasons,
                kept=update.kept,
            )
            for rid in update.to_finish:
                self.metrics.finish(rid, "stop")
            if update.to_finish:  # the step's stats still count them: no step may follow
                self.metrics.refresh_gauges(self.scheduler)
        # One hand-over per step, not one per request: each wakes the event loop
        # thread, which then competes with this thread's forward for the GIL.
        items: list[Delta | RequestOutput] = [*update.deltas, *update.finished]
        if items:
            self._loop.call_soon_threadsafe(self._deliver_many, items)
        self._flush_kv_events()
        self.last_stats = {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_usage": stats.kv_usage,
            "num_free_blocks": stats.num_free_blocks,
            "total_preemptions": stats.total_preemptions,
            "kv_leak_violations": stats.kv_leak_violations,
            "step_seconds": time.perf_counter() - t0,
        }

    def _flush_kv_events(self) -> None:
        if not self.publish_kv_events:
            return
        events = self.scheduler.kv.take_events()
        if events:
            self.kv_batches.append(event_batch(self._next_seq, events, 0, self.state_group))
            self._next_seq += 1

    def take_arrived(self) -> list[str]:
        """The request ids that reached `generate` since the last call (event loop
        thread): `stats()` taken after this call counts each of them that is still in
        the engine, running, waiting or queued (the router's index stops adding them as
        routed-but-not-arrived load)."""
        ids, self._arrived = self._arrived, []
        return ids

    def return_arrived(self, ids: list[str]) -> None:
        """Give back ids `take_arrived` returned that could not be reported."""
        self._arrived[:0] = ids

    def stats(self) -> dict[str, Any]:
        """A snapshot (read from another thread: values may be one step old).
        `num_queued`: requests handed to the engine thread that it has not taken in
        yet (it does between steps); the router counts them as load, the autoscaling
        policy does not (every busy replica has some for part of each step). Read in
        the order a request moves (queued, waiting, running): one that moves meanwhile
        counts twice, never not."""
        kv = self.scheduler.kv
        queued = 0 if self.error is not None else max(0, self._adds_sent - self._adds_done)
        waiting = len(self.scheduler.waiting)
        running = len(self.scheduler.running)
        return {
            **self.last_stats,
            "num_running": running,
            "num_waiting": waiting,
            "num_queued": queued,
            "kv_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "num_blocks": kv.pool.num_blocks,
            "prefix_queries_total": kv.prefix_stats.total_queries,
            "prefix_hits_total": kv.prefix_stats.total_hits,
            "num_steps": self.num_steps,
            "alive": self.alive,
        }


def _merge(a: Delta, b: Delta) -> Delta:
    """Two consecutive deltas of one completion as one."""
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return Delta(
        a.request_id,
        a.index,
        a.text + b.text,
        a.token_ids + b.token_ids,
        b.finish_reason,
        b.stop_reason,
        logprobs,
    )
