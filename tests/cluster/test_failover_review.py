"""Regression tests for the second lanes / failover review (s63, F1-F9): each test
plays one defect's scenario and fails on the code before its fix.

The lane monitor's tests' `Setup` (the real KV index class run in-process, a clock
the test moves, scripted engine streams) is reused; Ray is not started.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import types
from pathlib import Path
from typing import Any

import pytest

from spur.cluster.errors import ProtocolError, engine_error, error_body, queue_full
from spur.cluster.failover import (
    MAX_DRAINED_OPENS,
    SPARE_CONTEXT_CODE,
    EngineStream,
    LaneOpener,
    is_retriable,
)
from spur.cluster.fanout import FanOut
from spur.cluster.ingress import Ingress
from spur.cluster.lanes import Lane, LaneSelector, LaneView
from spur.cluster.readiness import SHUTTING_DOWN_CODE
from tests.cluster.test_failover import ActorDiedError, FakeGen, Opener, delta, final, run
from tests.cluster.test_ingress_lane import _fake_ingress, _stats
from tests.cluster.test_lane_monitor import PAYLOAD, Engine, Setup


def _dead(rid: str) -> dict[str, Any]:
    return {
        "type": "error",
        "status": 503,
        "message": "engine died",
        "param": None,
        "replica_id": rid,
    }


def _drained(rid: str) -> dict[str, Any]:
    return {
        "type": "error",
        "status": 503,
        "code": "draining",
        "param": None,
        "replica_id": rid,
        "message": "this replica of lane 'chat' is draining; retry",
    }


def _tok(rid: str, tok: int, finish: str | None = None) -> dict[str, Any]:
    return {
        "type": "delta",
        "index": 0,
        "token_ids": [tok],
        "text": "x",
        "finish_reason": finish,
        "replica_id": rid,
    }


class Events:
    """`on_event` as `Ingress._on_event` does it: count in the index, report failures."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.seen: list[tuple[str, str | None]] = []

    def __call__(self, name: str, replica_id: str | None) -> None:
        self.seen.append((name, replica_id))
        self.s.actor.count("chat", name)
        if name == "replica_failed" and replica_id:
            self.s.actor.report_failure(replica_id)

    def count(self, name: str) -> int:
        return self.s.actor.counters[("chat", name)]


def _opener(s: Setup, queues: dict[str, list[Engine]], *, chat: bool = False) -> LaneOpener:
    """A lane opener whose deployments answer from `queues[name]`, in order."""

    async def off_loop(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def send(target: Lane, payload: dict[str, Any]) -> Engine:
        s.sent.append((target.name, payload["request_id"]))  # type: ignore[arg-type]
        return queues[target.name].pop(0)

    return LaneOpener(s.monitor, s.lanes["chat"], chat=chat, off_loop=off_loop, send=send)


async def _drain(stream: EngineStream) -> list[dict[str, Any]]:
    return [await stream.start()] + [item async for item in stream]


# -- F8: the spare's vocabulary, checked once a primary answers -------------------------
def _tokenizer_dir(root: Path, vocab: dict[str, int]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(root)
    return root


@pytest.mark.parametrize("same_vocab", [False, True])
def test_a_lane_learned_from_its_spare_takes_its_primaries_tokenizer_and_checks_the_spare(
    tmp_path: Path, same_vocab: bool
) -> None:
    """F8: the primaries were down at the lane's first learn, so its tokenizer is the
    spare's. Once a primary answers, the re-read makes the primaries' tokenizer the
    lane's, drops the cached token bytes of the spare's, and disables the fallback
    when the spare's vocabulary differs (as `_init_lane` does when both answer)."""
    lane_vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    spare_vocab = lane_vocab if same_vocab else {"<unk>": 0, "</s>": 1, "world": 2, "hello": 3}
    lane_tok = _tokenizer_dir(tmp_path / "lane", lane_vocab)
    spare_tok = _tokenizer_dir(tmp_path / "spare", spare_vocab)
    answers: dict[str, Any] = {"chat": None, "spare": _stats(spare_tok, 64, 0.2)}
    fake = _fake_ingress(answers)
    lane = Lane("chat", None, {"block_size": 8, "hash_seed": "t"})

    async def scenario() -> None:
        await Ingress._init_lane(fake, lane)  # type: ignore[arg-type]
        spare_tokenizer = lane.tokenizer
        fake._token_bytes[id(spare_tokenizer)] = (spare_tokenizer, ["cached"])
        answers["chat"] = _stats(lane_tok, 96, 0.6)  # a primary is back
        fake._relearn_soon(lane, retry_s=0.0)
        assert lane.relearn is not None
        await lane.relearn
        assert lane.tokenizer is not spare_tokenizer
        assert id(spare_tokenizer) not in fake._token_bytes

    asyncio.run(scenario())
    assert lane.tokenizer("hello world")["input_ids"] == [2, 3]
    assert (lane.max_model_len, lane.limits_from_spare) == (96, False)
    if same_vocab:
        assert fake.selector.spare_of == {"chat": "spare"} and not fake.selector.disabled
    else:
        assert fake.selector.spare_of == {}
        why = fake.selector.disabled["chat"]
        assert why.startswith("spare 'spare' (") and "another vocabulary" in why
        assert "give the spare a model with the same tokenizer" in why


def test_a_failed_tokenizer_read_keeps_the_spares_until_the_next_try(tmp_path: Path) -> None:
    """F8: a primary that answers stats but whose tokenizer cannot be read leaves the
    lane as it was (limits and tokenizer from the spare), for the next re-read."""
    tok = _tokenizer_dir(tmp_path / "tok", {"<unk>": 0, "a": 1})
    answers: dict[str, Any] = {"chat": None, "spare": _stats(tok, 64, 0.2)}
    fake = _fake_ingress(answers)
    lane = Lane("chat", None, {"block_size": 8, "hash_seed": "t"})

    async def scenario() -> None:
        await Ingress._init_lane(fake, lane)  # type: ignore[arg-type]
        answers["chat"] = _stats(tmp_path / "missing", 96, 0.6)

        async def unreadable(name: str, tok_dir: str) -> Any:
            raise OSError(f"no tokenizer in {tok_dir}")

        fake._engine_tokenizer = unreadable
        fake._relearn_soon(lane, retry_s=0.0)
        assert lane.relearn is not None
        await lane.relearn
        assert lane.relearn is None

    asyncio.run(scenario())
    assert (lane.max_model_len, lane.limits_from_spare) == (64, True)


# -- F1: a continuation's opens are retries ---------------------------------------------
def test_a_continuation_refreshes_the_lane_and_fails_over_to_the_spare() -> None:
    """F1: the lane's one primary streams two tokens, then its engine dies and answers
    every new request with a 503. The continuation is a retry: it sees the failure,
    moves the lane to its spare and continues there (max_attempts 2 leaves it one
    open), instead of going back to the dead primary."""
    s = Setup()
    events = Events(s)
    queues = {
        "chat": [Engine([_tok("c1", 5), _tok("c1", 6), _dead("c1")]), Engine([_dead("c1")])],
        "spare": [Engine([_tok("s1", 7, "stop"), {"type": "final"}])],
    }

    async def scenario() -> list[dict[str, Any]]:
        s.register("c1", "chat")
        s.register("s1", "spare")
        await s.monitor.poll()
        payload = dict(PAYLOAD, sampling_params={"max_tokens": 10})
        stream = EngineStream(
            _opener(s, queues), payload, max_attempts=2, backoff_s=0.0, on_event=events
        )
        return await _drain(stream)

    items = asyncio.run(scenario())
    assert [t for it in items if it["type"] == "delta" for t in it["token_ids"]] == [5, 6, 7]
    assert items[-1]["type"] == "final"
    assert s.sent == [("chat", "req"), ("spare", "req-c1-a1")]  # type: ignore[comparison-overlap]


def test_a_continuations_opener_attempts_start_at_one() -> None:
    """F1: the opener's attempt numbers: 0 for the first open, 1 on for a
    continuation's (its own retries go on counting from there)."""
    opener = Opener(
        FakeGen([delta(10)], ActorDiedError()),
        ActorDiedError(),
        FakeGen([delta(11, "r3", finish="stop"), final("r3")]),
    )
    items, _, _ = run(opener)
    assert items[-1]["type"] == "final"
    assert opener.attempts == [0, 1, 2]


# -- F4: back from a dead spare at once -------------------------------------------------
def test_a_lane_on_a_dead_spare_returns_to_usable_primaries_at_once() -> None:
    """F4: moved to its spare because its primaries were down; they come back while
    the spare has lost its last replica: no hysteresis wait on a dead spare."""
    t = [0.0]
    sel = LaneSelector(
        ["chat"], spare_of={"chat": "sp"}, saturation={}, healthy_after_s=5.0, clock=lambda: t[0]
    )
    assert sel.update({"chat": LaneView(0, (), spare_healthy=1)}) == [("chat", "down")]
    t[0] = 1.0
    assert sel.update({"chat": LaneView(1, (0,), spare_healthy=1)}) == []  # hysteresis
    assert sel.target("chat") == "sp"
    t[0] = 2.0
    assert sel.update({"chat": LaneView(1, (0,), spare_healthy=0)}) == [("chat", "primary")]
    assert sel.target("chat") == "chat" and sel.report("chat")["reason"] == "primary"
    # Unknown spare health (None) keeps the hysteresis.
    assert sel.update({"chat": LaneView(0, (), spare_healthy=None)}) == [("chat", "down")]
    assert sel.update({"chat": LaneView(1, (0,), spare_healthy=None)}) == []
    assert sel.target("chat") == "sp"


def test_the_monitor_sends_new_requests_to_the_primaries_once_the_spare_dies() -> None:
    """F4 through the monitor (the review's r4): the next request goes to the primary."""
    s = Setup(healthy_after_s=5.0)

    async def scenario() -> None:
        s.register("s1", "spare")
        await s.monitor.poll()
        assert s.selector.target("chat") == "spare"
        s.clock.t += 4.0  # s1 stops heart-beating (3 s timeout); a primary comes back
        s.register("c1", "chat")
        await s.monitor.poll()
        assert (s.lanes["chat"].healthy, s.lanes["spare"].healthy) == (1, 0)
        assert s.selector.target("chat") == "chat"
        assert s.actor.counters[("chat", "to_primary")] == 1

    asyncio.run(scenario())


# -- F2: a drain refusal at open is not a failure ---------------------------------------
def test_a_drain_refusal_at_open_is_not_a_failure() -> None:
    """F2: with max_attempts 1, a replica that refuses the request because it drains
    does not use up the budget: the next open finds the other primary."""
    s = Setup()
    queues = {
        "chat": [Engine([_drained("c1")]), Engine([_tok("c2", 7, "stop"), {"type": "final"}])]
    }

    async def scenario() -> EngineStream:
        s.register("c1", "chat")
        s.register("c2", "chat")
        await s.monitor.poll()
        stream = EngineStream(_opener(s, queues), dict(PAYLOAD), max_attempts=1, backoff_s=0.0)
        items = await _drain(stream)
        assert items[-1]["type"] == "final"
        return stream

    stream = asyncio.run(scenario())
    assert stream.failures == 0 and stream.attempts == 2
    # a drain is planned: the replica is not reported failed to the index
    assert s.actor.healthy_counts(["chat"])["chat"]["healthy"] == 2


def test_drain_refusals_are_bounded_on_their_own() -> None:
    """F2: refusals do not count against max_attempts, so MAX_DRAINED_OPENS bounds
    them: then a 503 that names the attempts."""
    drained = ProtocolError(503, "draining", code="draining")
    opener = Opener(*(drained for _ in range(MAX_DRAINED_OPENS + 5)))
    with pytest.raises(ProtocolError) as info:
        run(opener, max_attempts=1)
    assert info.value.status == 503 and info.value.code == "service_unavailable"
    assert len(opener.payloads) == MAX_DRAINED_OPENS + 1
    assert f"after {MAX_DRAINED_OPENS + 1} attempts" in info.value.message


def test_the_opener_keeps_a_drains_code() -> None:
    """F2: the opener's exception for a drain refusal says so (code `draining`)."""
    s = Setup()

    async def scenario() -> ProtocolError:
        s.register("c1", "chat")
        await s.monitor.poll()
        s.engines.append(Engine([_drained("c1")]))
        with pytest.raises(ProtocolError) as info:
            await s.opener()(dict(PAYLOAD), 0)
        return info.value

    exc = asyncio.run(scenario())
    assert (exc.status, exc.code) == (503, "draining") and is_retriable(exc)


# -- F5: refresh waits for a round newer than the call ----------------------------------
class _GatedHandle:
    """An index handle whose answers are computed when sent (Ray runs calls in send
    order) and arrive once `gate` is set; `calls` lists the calls in send order."""

    def __init__(self, obj: Any, calls: list[str], gate: asyncio.Event) -> None:
        self._obj, self._calls, self._gate = obj, calls, gate

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._obj, name)

        def remote(*args: Any, **kwargs: Any) -> Any:
            self._calls.append(name)
            value = fn(*args, **kwargs)

            async def answer() -> Any:
                await self._gate.wait()
                return value

            return answer()

        return types.SimpleNamespace(remote=remote)


def test_refresh_does_not_join_a_round_sent_before_it() -> None:
    """F5: a round in flight when refresh() is called sent its calls before the
    caller's failure report: refresh() returns only after a round started later."""
    s = Setup()
    calls: list[str] = []

    async def scenario() -> None:
        gate = asyncio.Event()
        s.monitor.index = _GatedHandle(s.actor, calls, gate)
        s.register("c1", "chat")
        stale = asyncio.ensure_future(s.monitor.refresh())  # the loop's round
        while not calls:
            await asyncio.sleep(0)
        assert calls == ["report_spare_load"]
        s.actor.report_failure("c1")  # what a failed open reports
        mark = len(calls)
        fresh = asyncio.ensure_future(s.monitor.refresh())
        gate.set()
        await asyncio.wait_for(asyncio.gather(stale, fresh), timeout=5)
        assert "report_spare_load" in calls[mark:]  # a round sent after the report
        assert s.lanes["chat"].healthy == 0

    asyncio.run(scenario())


def test_concurrent_refreshes_share_the_next_round() -> None:
    """F5: callers that arrive while one round runs all wait for the same next one."""
    s = Setup()
    calls: list[str] = []

    async def scenario() -> None:
        gate = asyncio.Event()
        s.monitor.index = _GatedHandle(s.actor, calls, gate)
        first = asyncio.ensure_future(s.monitor.refresh())
        while not calls:
            await asyncio.sleep(0)
        waiters = [asyncio.ensure_future(s.monitor.refresh()) for _ in range(5)]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, *waiters), timeout=5)
        assert calls.count("report_spare_load") == 2

    asyncio.run(scenario())


# -- F6: shutdown's code reaches the client ---------------------------------------------
def test_a_stream_nobody_can_continue_during_shutdown_ends_with_shutting_down() -> None:
    """F6: the replica drains mid-stream while the server shuts down: the stream ends
    with code shutting_down, without another open on a draining replica."""
    s = Setup()
    queues = {"chat": [Engine([_tok("c1", 5), _drained("c1")]), Engine([_drained("c2")])]}

    async def scenario() -> tuple[EngineStream, ProtocolError]:
        s.register("c1", "chat")
        s.register("c2", "chat")
        await s.monitor.poll()
        payload = dict(PAYLOAD, sampling_params={"max_tokens": 10})
        stream = EngineStream(_opener(s, queues), payload, max_attempts=3, backoff_s=0.0)
        fan = FanOut([stream], buffer=4)
        await fan.ready()
        s.actor.set_draining("SIGTERM")
        await s.monitor.poll()
        with pytest.raises(ProtocolError) as info:
            async for _ in fan.items():
                pass
        fan.close()
        return stream, info.value

    stream, exc = asyncio.run(scenario())
    assert error_body(exc)["error"]["code"] == SHUTTING_DOWN_CODE
    assert exc.status == 503 and "shutting down (SIGTERM)" in exc.message
    assert s.sent == [("chat", "req")]  # type: ignore[comparison-overlap]
    assert stream.failures == 0


def test_engine_error_keeps_only_the_shutting_down_code_of_a_503() -> None:
    """F6: errors.engine_error passes `shutting_down` on (Retry-After 5 s); a drain's
    internal code still becomes service_unavailable."""
    down = engine_error({"status": 503, "message": "m", "code": SHUTTING_DOWN_CODE})
    assert (down.code, down.headers["Retry-After"]) == (SHUTTING_DOWN_CODE, "5")
    assert not is_retriable(down)
    drained = engine_error({"status": 503, "message": "m", "code": "draining"})
    assert drained.code == "service_unavailable"


# -- F9: a prompt only the spare cannot take --------------------------------------------
def _too_long(n: int, limit: int = 64) -> dict[str, Any]:
    return {
        "type": "error",
        "status": 400,
        "param": "prompt",
        "replica_id": "s1",
        "message": f"prompt has {n:,} tokens, max_model_len is {limit:,} (prompt plus at "
        "least one generated token): shorten the prompt or raise max_model_len",
    }


def test_a_prompt_over_the_spares_limit_is_a_503_while_on_the_spare() -> None:
    """F9: the lane accepts 80 tokens (its max_model_len 96), its spare (64) does not:
    while the lane is on its spare that is a 503 with Retry-After naming the spare
    and its limit, not the spare's 400; the next long prompt is not sent at all,
    and a short one still is."""
    s = Setup(healthy_after_s=7.0)
    s.lanes["chat"].max_model_len = 96
    ok = Engine([_tok("s1", 1, "stop"), {"type": "final"}])
    queues = {"spare": [Engine([_too_long(80)]), ok]}

    async def scenario() -> list[ProtocolError]:
        s.register("s1", "spare")
        await s.monitor.poll()
        assert s.selector.target("chat") == "spare"
        errors = []
        for _ in range(2):
            payload = {
                "request_id": "r",
                "prompt_token_ids": list(range(80)),
                "sampling_params": {"max_tokens": 8},
            }
            stream = EngineStream(_opener(s, queues, chat=True), payload, max_attempts=3)
            with pytest.raises(ProtocolError) as info:
                await stream.start()
            errors.append(info.value)
        short = {"request_id": "q", "prompt_token_ids": list(range(10)), "sampling_params": {}}
        stream = EngineStream(_opener(s, queues, chat=True), short, max_attempts=3)
        assert (await stream.start())["token_ids"] == [1]
        return errors

    errors = asyncio.run(scenario())
    for exc in errors:
        assert (exc.status, exc.code) == (503, SPARE_CONTEXT_CODE) and not is_retriable(exc)
        assert exc.headers["Retry-After"] == "7"
        assert "spare 'spare'" in exc.message and "max_model_len is 64" in exc.message
        assert "80 tokens" in exc.message
    assert [name for name, _ in s.sent] == ["spare", "spare"]  # not retried, not re-sent


def test_a_prompt_over_the_lanes_own_limit_keeps_the_engines_400() -> None:
    """F9: only prompts the lane itself accepts become the failover 503."""
    s = Setup()
    s.lanes["chat"].max_model_len = 64
    queues = {"spare": [Engine([_too_long(80)])]}

    async def scenario() -> ProtocolError:
        s.register("s1", "spare")
        await s.monitor.poll()
        payload = {"request_id": "r", "prompt_token_ids": list(range(80)), "sampling_params": {}}
        with pytest.raises(ProtocolError) as info:
            await _opener(s, queues, chat=True)(payload, 0)
        return info.value

    exc = asyncio.run(scenario())
    assert (exc.status, exc.code, exc.param) == (400, "context_length_exceeded", "messages")


# -- F3: an error first item cancels the stream -----------------------------------------
def test_an_error_first_item_cancels_the_stream_and_its_spare_count() -> None:
    """F3: the spare's 400 and a dead engine's 503 at open: each stream is cancelled
    before the error is raised, so the lane's spare demand drops at once (not when the
    exception, which references the stream, is collected)."""
    s = Setup()
    too_long = {
        "type": "error",
        "status": 400,
        "param": "prompt",
        "replica_id": "s1",
        "message": "prompt has 12 tokens, max_model_len is 8: shorten it",
    }
    engines = [Engine([too_long]), Engine([_dead("s1")]), Engine([StopAsyncIteration()])]
    s.engines += engines

    async def scenario() -> None:
        s.register("s1", "spare")
        await s.monitor.poll()
        for _ in engines:
            with pytest.raises(ProtocolError) as info:
                await s.opener()(dict(PAYLOAD), 0)
            assert info.value.status in (400, 503)
            assert s.monitor.on_spare["chat"] == 0  # while the exception is alive

    asyncio.run(scenario())
    assert [e.cancelled for e in engines] == [True, True, True]


# -- F7: event counters count what they say ---------------------------------------------
def _counted(s: Setup, queues: dict[str, list[Engine]], max_attempts: int = 3) -> Events:
    events = Events(s)

    async def scenario() -> None:
        await s.monitor.poll()
        payload = dict(PAYLOAD, sampling_params={"max_tokens": 5})
        stream = EngineStream(
            _opener(s, queues),
            payload,
            max_attempts=max_attempts,
            backoff_s=0.0,
            on_event=events,
        )
        # A stream ends with its final item, or an error item, or raises: all count.
        with contextlib.suppress(ProtocolError):
            await _drain(stream)

    asyncio.run(scenario())
    return events


def test_a_refused_continuation_counts_no_continuation_and_two_failures() -> None:
    """F7: a stream breaks, its continuation's open fails too (max_attempts 2):
    spur:replica_failures 2, spur:stream_continuations 0, spur:retries 0 (tokens came)."""
    s = Setup()
    s.register("c1", "chat")
    s.register("c2", "chat")
    events = _counted(
        s, {"chat": [Engine([_tok("c1", 1), _dead("c1")]), Engine([_dead("c2")])]}, max_attempts=2
    )
    assert events.count("replica_failed") == 2
    assert events.count("failover") == 0 and events.count("retry") == 0


def test_a_planned_drain_counts_its_continuation() -> None:
    """F7: a continuation after a planned drain is one (spur:stream_continuations)."""
    s = Setup()
    s.register("c1", "chat")
    s.register("c2", "chat")
    queues = {
        "chat": [
            Engine([_tok("c1", 1), _drained("c1")]),
            Engine([_tok("c2", 2, "stop"), {"type": "final"}]),
        ]
    }
    events = _counted(s, queues)
    assert events.count("failover") == 1 and events.count("replica_failed") == 0
    assert ("failover", "c1") in events.seen


def test_failed_opens_count_as_replica_failures_and_one_fallback_per_request() -> None:
    """F7: one request on the spare whose engine dies at open twice: 2 replica
    failures, 2 retries (before a first token), 1 spare fallback (a request, not
    an open)."""
    s = Setup()
    s.register("s1", "spare")
    queues = {
        "spare": [
            Engine([_dead("s1")]),
            Engine([_dead("s1")]),
            Engine([_tok("s1", 2, "stop"), {"type": "final"}]),
        ]
    }
    events = _counted(s, queues)
    assert events.count("fallback") == 1
    assert events.count("replica_failed") == 2 and events.count("retry") == 2


def test_retries_count_only_re_opens_before_a_first_token() -> None:
    """F7: a continuation's own retry (after tokens) is no spur:retries."""
    opener = Opener(
        FakeGen([delta(10)], ActorDiedError()),
        ActorDiedError(),
        FakeGen([delta(11, "r3", finish="stop"), final("r3")]),
    )
    _, events, _ = run(opener)
    names = [name for name, _ in events]
    assert "retry" not in names
    assert names.count("replica_failed") == 2 and names.count("failover") == 1


# -- the 429 of a full lane names its limit ---------------------------------------------
def test_queue_full_names_the_lane_and_its_limit_when_known() -> None:
    exc = queue_full(2.0, lane="chat", max_queued=512)
    assert (exc.status, exc.code, exc.headers) == (429, "queue_full", {"Retry-After": "2"})
    assert exc.message == (
        "lane 'chat' holds its max_queued_requests (512): retry after 2 s, or raise "
        "lanes[].max_queued_requests or autoscaling.max_replicas"
    )
    assert "request queue full" in queue_full(1.0).message  # callers without them


def test_the_ingress_cold_start_429_names_the_lane() -> None:
    """The ingress holds a cold lane's requests up to its max_queued_requests."""
    lane = Lane("chat", None, {"block_size": 8, "hash_seed": "t"})
    fake = types.SimpleNamespace(
        _ensure_monitor=lambda: None,
        draining=None,
        served=["tiny"],
        model_to_lane={"tiny": "chat"},
        lanes={"chat": lane},
        holding=collections.Counter({"chat": 3}),
        hold_limit={"chat": 3},
    )
    with pytest.raises(ProtocolError) as info:
        asyncio.run(Ingress._lane(fake, "tiny"))  # type: ignore[arg-type]
    assert info.value.status == 429 and info.value.code == "queue_full"
    assert "lane 'chat' holds its max_queued_requests (3)" in info.value.message


# -- s65 review: a spare with a shorter max_model_len ---------------------------------
def _payload(
    rid: str, prompt: int, max_tokens: int, *, asked: bool, min_tokens: int = 0
) -> dict[str, Any]:
    return {
        "request_id": rid,
        "prompt_token_ids": list(range(prompt)),
        "sampling_params": {"max_tokens": max_tokens, "min_tokens": min_tokens},
        "max_tokens_asked": asked,
    }


def test_a_named_max_tokens_the_spare_cannot_generate_is_a_503_a_default_one_is_lowered() -> None:
    """The lane (96) accepted 40 + 50 tokens; its spare (64), serving it now, would
    stop after 24 with a plain "length". A max_tokens the client named is a 503 that
    says so (Retry-After, not sent), as is a min_tokens over the spare's room; a
    default max_tokens is lowered to the spare's room."""
    s = Setup()
    s.lanes["chat"].max_model_len, s.lanes["spare"].max_model_len = 96, 64
    s.engines = [Engine([_tok("s1", 1, "length"), {"type": "final"}])]

    async def scenario() -> list[ProtocolError]:
        s.register("s1", "spare")
        await s.monitor.poll()
        assert s.selector.target("chat") == "spare"
        errors = []
        for refused in (
            _payload("a", 40, 50, asked=True),
            _payload("m", 40, 50, asked=False, min_tokens=30),
        ):
            with pytest.raises(ProtocolError) as info:
                await EngineStream(s.opener(), refused, max_attempts=3).start()
            errors.append(info.value)
        default = _payload("d", 40, 50, asked=False, min_tokens=20)
        await EngineStream(s.opener(), default, max_attempts=3).start()
        return errors

    for exc in asyncio.run(scenario()):
        assert (exc.status, exc.code) == (503, SPARE_CONTEXT_CODE) and not is_retriable(exc)
        assert "40 tokens and 50 more to generate" in exc.message
        assert "ask for at most 24 tokens" in exc.message
    ((name, payload),) = s.sent
    assert (name, payload["request_id"]) == ("spare", "d")
    assert payload["sampling_params"] == {"max_tokens": 24, "min_tokens": 20}


def test_a_continuation_the_spare_cannot_finish_ends_with_an_error_not_a_short_length() -> None:
    """A stream of 40 + 50 named tokens breaks after 2 on its primary: the spare
    (64) could generate 22 of the 48 left. The stream ends with an error item naming
    the spare's limit, not a "length" finish after 24 tokens."""
    s = Setup()
    s.lanes["chat"].max_model_len, s.lanes["spare"].max_model_len = 96, 64
    events = Events(s)
    queues = {"chat": [Engine([_tok("c1", 5), _tok("c1", 6), _dead("c1")])], "spare": []}

    async def scenario() -> list[dict[str, Any]]:
        s.register("c1", "chat")
        s.register("s1", "spare")
        await s.monitor.poll()
        payload = _payload("req", 40, 50, asked=True)
        stream = EngineStream(
            _opener(s, queues), payload, max_attempts=3, backoff_s=0.0, on_event=events
        )
        return await _drain(stream)

    items = asyncio.run(scenario())
    assert [it["type"] for it in items] == ["delta", "delta", "error"]
    assert "max_model_len is 64" in items[-1]["message"]
    assert "40 tokens and the 2 generated so far and 48 more" in items[-1]["message"]
    assert s.sent == [("chat", "req")]  # type: ignore[comparison-overlap]
