"""EngineStream: retries before the first token, continuation after a break."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from spur.cluster.errors import ProtocolError, bad_request, queue_full, service_unavailable
from spur.cluster.failover import EngineStream, is_retriable


class ActorDiedError(Exception):
    pass


def delta(tok: int, rid: str = "r1", finish: str | None = None) -> dict[str, Any]:
    return {
        "type": "delta",
        "index": 0,
        "token_ids": [tok],
        "text": str(tok),
        "finish_reason": finish,
        "replica_id": rid,
    }


def final(rid: str = "r1") -> dict[str, Any]:
    return {"type": "final", "replica_id": rid}


class FakeGen:
    """Yields `items`, then raises `exc` if given (else stops)."""

    def __init__(self, items: list[dict[str, Any]], exc: BaseException | None = None) -> None:
        self.items = list(items)
        self.exc = exc
        self.cancelled = False

    def __aiter__(self) -> FakeGen:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.items:
            return self.items.pop(0)
        if self.exc is not None:
            raise self.exc
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class Opener:
    """Per call, the next entry of `script`: an exception to raise, or a FakeGen."""

    def __init__(self, *script: BaseException | FakeGen) -> None:
        self.script = list(script)
        self.payloads: list[dict[str, Any]] = []
        self.attempts: list[int] = []

    async def __call__(self, payload: dict[str, Any], attempt: int) -> tuple[Any, dict[str, Any]]:
        self.payloads.append(payload)
        self.attempts.append(attempt)
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step, await step.__anext__()


PAYLOAD = {
    "request_id": "req",
    "prompt_token_ids": [1, 2, 3],
    "sampling_params": {"max_tokens": 10, "min_tokens": 1, "n": 1},
    "block_hashes": ["h1"],
}


def run(opener: Opener, payload: dict[str, Any] = PAYLOAD, max_attempts: int = 3):
    """Start and drain a stream; returns (items, events, stream)."""
    events: list[tuple[str, str | None]] = []
    stream = EngineStream(
        opener,
        payload,
        max_attempts=max_attempts,
        on_event=lambda name, rid: events.append((name, rid)),
        backoff_s=0,
    )

    async def drain() -> list[dict[str, Any]]:
        items = [await stream.start()]
        items += [item async for item in stream]
        return items

    return asyncio.run(drain()), events, stream


def tokens(items: list[dict[str, Any]]) -> list[int]:
    return [t for it in items if it["type"] == "delta" for t in it["token_ids"]]


def test_is_retriable():
    assert is_retriable(ActorDiedError())
    assert is_retriable(service_unavailable("engine died"))
    assert not is_retriable(bad_request("bad"))
    assert not is_retriable(ProtocolError(503, "busy", code="queue_full"))
    assert not is_retriable(queue_full(1.0))
    assert not is_retriable(ValueError("x"))


def test_retry_before_first_token():
    ok = FakeGen([delta(7, "r2"), final("r2")])
    opener = Opener(ActorDiedError("gone"), ok)
    items, events, stream = run(opener)
    assert items[0] == delta(7, "r2")
    assert tokens(items) == [7]
    assert items[-1]["type"] == "final"
    assert ("retry", None) in events
    assert opener.attempts == [0, 1]
    assert stream.replica_id == "r2"


def test_every_attempt_fails_503_naming_attempts():
    opener = Opener(*(ActorDiedError() for _ in range(3)))
    with pytest.raises(ProtocolError) as info:
        run(opener)
    assert info.value.status == 503
    assert "3 attempts" in info.value.message
    assert "ActorDiedError" in info.value.message
    assert len(opener.payloads) == 3


def test_non_retriable_error_propagates_at_once():
    opener = Opener(bad_request("bad prompt"), FakeGen([final()]))
    with pytest.raises(ProtocolError) as info:
        run(opener)
    assert info.value.status == 400
    assert len(opener.payloads) == 1


def test_break_after_tokens_continues_elsewhere():
    broken = FakeGen([delta(10), delta(11)], ActorDiedError("died"))
    rest = FakeGen([delta(12, "r2"), delta(13, "r2", finish="stop"), final("r2")])
    opener = Opener(broken, rest)
    items, events, stream = run(opener)
    assert tokens(items) == [10, 11, 12, 13]
    assert items[-1]["type"] == "final"
    assert broken.cancelled
    cont = opener.payloads[1]
    assert cont["prompt_token_ids"] == [1, 2, 3, 10, 11]
    assert cont["sampling_params"]["max_tokens"] == 8
    assert cont["sampling_params"]["min_tokens"] == 0
    assert cont["sampling_params"]["n"] == 1
    assert cont["request_id"] == "req-c1"
    assert cont["resumed"] == 2  # its prompt's last 2 ids are output already streamed
    assert "block_hashes" not in cont
    assert PAYLOAD["prompt_token_ids"] == [1, 2, 3]  # the original is untouched
    assert ("replica_failed", "r1") in events
    assert ("failover", "r1") in events
    assert stream.continuations == 1


def test_second_break_continues_again_from_the_original_prompt():
    opener = Opener(
        FakeGen([delta(10)], ActorDiedError()),
        FakeGen([delta(11, "r2")], ActorDiedError()),
        FakeGen([delta(12, "r3", finish="length"), final("r3")]),
    )
    items, events, _ = run(opener)
    assert tokens(items) == [10, 11, 12]
    last = opener.payloads[2]
    assert last["request_id"] == "req-c2"
    assert last["prompt_token_ids"] == [1, 2, 3, 10, 11]
    assert last["sampling_params"]["max_tokens"] == 8
    assert [e for e in events if e[0] == "replica_failed"] == [
        ("replica_failed", "r1"),
        ("replica_failed", "r2"),
    ]


def test_break_with_n2_ends_with_error_item():
    payload = {**PAYLOAD, "sampling_params": {"max_tokens": 10, "n": 2}}
    opener = Opener(FakeGen([delta(10), delta(11)], ActorDiedError()))
    items, _, _ = run(opener, payload)
    assert tokens(items) == [10, 11]
    errors = [it for it in items if it["type"] == "error"]
    assert len(errors) == 1
    assert items[-1] is errors[0]
    assert errors[0]["status"] == 503
    assert len(opener.payloads) == 1


def test_break_after_finished_delta_ends_cleanly():
    opener = Opener(FakeGen([delta(10), delta(11, finish="stop")], ActorDiedError()))
    items, events, _ = run(opener)
    assert tokens(items) == [10, 11]
    assert all(it["type"] == "delta" for it in items)
    assert len(opener.payloads) == 1
    assert ("failover", "r1") not in events


def test_midstream_503_error_item_is_a_break():
    err = {"type": "error", "status": 503, "message": "engine died", "replica_id": "r1"}
    opener = Opener(
        FakeGen([delta(10), err, delta(99)]),
        FakeGen([delta(11, "r2", finish="stop"), final("r2")]),
    )
    items, events, _ = run(opener)
    assert tokens(items) == [10, 11]
    assert not any(it["type"] == "error" for it in items)
    assert opener.payloads[1]["prompt_token_ids"] == [1, 2, 3, 10]
    assert ("failover", "r1") in events


def test_midstream_non_503_error_item_passes_through():
    err = {"type": "error", "status": 400, "message": "bad", "replica_id": "r1"}
    opener = Opener(FakeGen([delta(10), err]))
    items, _, stream = run(opener)
    assert items[-1] == err
    assert stream.finished
    assert len(opener.payloads) == 1


def test_continuation_nowhere_yields_error_naming_tokens_sent():
    opener = Opener(
        FakeGen([delta(10), delta(11), delta(12)], ActorDiedError()),
        ActorDiedError(),
        ActorDiedError(),
    )
    items, _, _ = run(opener, max_attempts=3)
    assert tokens(items) == [10, 11, 12]
    assert items[-1]["type"] == "error"
    assert items[-1]["status"] == 503
    assert "after 3 tokens" in items[-1]["message"]
    assert len(opener.payloads) == 3  # the broken replica and two failed opens: 3 failures


def test_max_attempts_bounds_the_replicas_a_request_breaks_on_its_whole_life():
    """Every replica sends one token and dies (a request that crashes its engine): each
    continuation's open had its own max_attempts, so the request ran on a new replica
    for every token of max_tokens (200 replicas for 200 tokens). Now max_attempts
    replicas may fail it in all; then one error item names them."""
    script = [FakeGen([delta(10 + i, f"r{i}")], ActorDiedError()) for i in range(200)]
    opener = Opener(*script)
    payload = {**PAYLOAD, "sampling_params": {"max_tokens": 200, "n": 1}}
    items, events, stream = run(opener, payload, max_attempts=3)
    assert len(opener.payloads) == 3 and stream.failures == 3
    assert tokens(items) == [10, 11, 12]
    assert items[-1]["type"] == "error" and "3 replicas have failed" in items[-1]["message"]
    assert events.count(("failover", "r0")) == 1 and events.count(("failover", "r1")) == 1


def test_a_planned_drain_is_not_a_failure():
    """Scale-down drains replica after replica: the stream continues each time, and
    the failure budget stays whole (max_attempts 1: a failure would have ended it)."""
    drained = {"type": "error", "status": 503, "code": "draining", "message": "draining"}
    script = [FakeGen([delta(10 + i, f"r{i}"), drained]) for i in range(3)]
    opener = Opener(*script, FakeGen([delta(13, "r3"), final("r3")]))
    payload = {**PAYLOAD, "sampling_params": {"max_tokens": 10, "n": 1}}
    items, _, stream = run(opener, payload, max_attempts=1)
    assert tokens(items) == [10, 11, 12, 13] and items[-1]["type"] == "final"
    assert stream.failures == 0 and stream.continuations == 3


def test_non_retriable_midstream_exception_propagates():
    opener = Opener(FakeGen([delta(10)], ValueError("bug")))
    with pytest.raises(ValueError):
        run(opener)
    assert len(opener.payloads) == 1


def test_error_item_is_the_last_item():
    payload = {**PAYLOAD, "sampling_params": {"max_tokens": 10, "n": 2}}
    err = {"type": "error", "status": 503, "message": "engine died", "replica_id": "r1"}
    items, events, _ = run(Opener(FakeGen([delta(10), err, delta(99)])), payload)
    assert items[-1]["type"] == "error"
    assert tokens(items) == [10]
    items, events, _ = run(Opener(FakeGen([delta(10)], ActorDiedError())), payload)
    assert events == [("replica_failed", "r1")]


def test_n2_break_after_one_completion_finished_still_ends_with_an_error():
    """With n=2, completion 0 finishing does not make the request complete: a break
    afterwards must end with an error item, not a clean (truncated) end."""
    payload = {**PAYLOAD, "sampling_params": {"max_tokens": 10, "n": 2}}
    second = {**delta(20), "index": 1}
    opener = Opener(FakeGen([delta(10, finish="stop"), second], ActorDiedError()))
    items, _, _ = run(opener, payload)
    assert items[-1]["type"] == "error" and items[-1]["status"] == 503


def test_drain_error_item_continues_elsewhere_without_a_failure():
    drained = {
        "type": "error",
        "status": 503,
        "code": "draining",
        "message": "drain_timeout_s passed",
        "param": None,
    }
    opener = Opener(FakeGen([delta(1), drained]), FakeGen([delta(2, "r2"), final("r2")]))
    items, events, _ = run(opener)
    assert tokens(items) == [1, 2]
    names = [name for name, _ in events]
    # a planned drain is no failure, but its continuation is one (spur:stream_continuations)
    assert names == ["drained", "failover"]


def test_shutting_down_is_not_retried_and_ends_the_stream():
    from spur.cluster.readiness import shutting_down

    assert not is_retriable(shutting_down("stop signal"))
    drained = {"type": "error", "status": 503, "code": "draining", "message": "m", "param": None}
    opener = Opener(FakeGen([delta(1), drained]), shutting_down("stop signal"))
    items, _, _ = run(opener)
    assert items[-1]["type"] == "error" and "shutting down" in items[-1]["message"]


def _delta_at(tok: int, index: int, rid: str, finish: str | None = None) -> dict[str, Any]:
    return {**delta(tok, rid, finish), "index": index}


def _n2_streams() -> tuple[FakeGen, FakeGen]:
    """Two completions: a stream that breaks after one token of each, and a whole one."""
    broken = FakeGen([_delta_at(1, 0, "r1"), _delta_at(2, 1, "r1")], ActorDiedError("gone"))
    whole = FakeGen(
        [
            _delta_at(5, 0, "r2"),
            _delta_at(6, 1, "r2"),
            _delta_at(7, 0, "r2", "length"),
            _delta_at(8, 1, "r2", "length"),
            final("r2"),
        ]
    )
    return broken, whole


N2 = {**PAYLOAD, "sampling_params": {"max_tokens": 2, "n": 2}}


def test_a_non_streamed_n_2_request_runs_again_when_its_replica_dies():
    """n > 1 cannot be continued, but when nothing reached the client yet (a
    non-streamed response: `restartable`) the request runs again from its start on
    another replica rather than end in a 503; the consumer is told to drop what it
    collected by a `restart` item. A streamed one still ends with the error item."""
    opener = Opener(*_n2_streams())
    events: list[tuple[str, str | None]] = []
    stream = EngineStream(
        opener,
        N2,
        max_attempts=3,
        on_event=lambda name, rid: events.append((name, rid)),
        backoff_s=0,
        restartable=True,
    )

    async def drain() -> list[dict[str, Any]]:
        return [await stream.start()] + [item async for item in stream]

    items = asyncio.run(drain())
    kinds = [it["type"] for it in items]
    cut = kinds.index("restart")
    assert tokens(items[:cut]) == [1, 2] and tokens(items[cut:]) == [5, 6, 7, 8]
    assert kinds[-1] == "final" and "error" not in kinds
    again = opener.payloads[1]
    assert again["request_id"] == "req-r1" and opener.attempts == [0, 1]
    assert (again["prompt_token_ids"], again["sampling_params"]) == (
        [1, 2, 3],
        N2["sampling_params"],
    )
    assert ("replica_failed", "r1") in events and ("retry", None) in events
    assert stream.generated == [5, 6, 7, 8] and stream.restarts == 1
    assert stream.discarded == 2  # computed by the broken run: billed too

    streamed = Opener(*_n2_streams())
    items, _, _ = run(streamed, N2)
    assert items[-1]["type"] == "error" and "n > 1" in items[-1]["message"]
    assert len(streamed.payloads) == 1


def test_a_restart_counts_against_max_attempts():
    opener = Opener(*_n2_streams())
    stream = EngineStream(opener, N2, max_attempts=1, backoff_s=0, restartable=True)

    async def drain() -> list[dict[str, Any]]:
        return [await stream.start()] + [item async for item in stream]

    items = asyncio.run(drain())
    assert items[-1]["type"] == "error" and "max_attempts" in items[-1]["message"]
    assert len(opener.payloads) == 1


def test_collect_keeps_only_the_run_after_a_restart():
    """The non-streamed answer holds the completions of the run that finished, not
    the tokens of the one that broke before it."""
    from spur.cluster.fanout import FanOut
    from spur.cluster.ingress import _collect

    async def answer() -> list[Any]:
        stream = EngineStream(
            Opener(*_n2_streams()), N2, max_attempts=3, backoff_s=0, restartable=True
        )
        fan = FanOut([stream], buffer=64)
        await fan.ready()
        return await _collect(fan, 2, [[1, 2, 3]])

    (out,) = asyncio.run(answer())
    assert [c.token_ids for c in out.outputs] == [[5, 7], [6, 8]]
    assert [c.text for c in out.outputs] == ["57", "68"]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
