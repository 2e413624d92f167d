"""LaneMonitor (lane health -> primary or spare) and LaneOpener (opening one engine
stream of a lane), against the real KV index actor class run in-process.

`KVIndexActor` is a plain class that `get_index` turns into a Ray actor; here its
methods are called directly behind a `.remote` shim, with a clock the test moves,
so the health rules (heartbeats, failures reported by callers, drain) are the
index's own. The engines are scripted streams: what a replica's `generate` yields.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from spur.cluster.errors import ProtocolError
from spur.cluster.failover import EngineStream, LaneOpener, is_retriable
from spur.cluster.lanes import Lane, LaneMonitor, LaneSelector
from spur.cluster.routing.index_actor import KVIndexActor

CACHE = {"block_size": 4, "hash_seed": "test-seed", "enable_prefix_caching": True}
HEARTBEAT_S = 3.0


class _Ref:
    """What `.remote(...)` returns: awaitable, or dropped (fire and forget)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        return self.value
        yield  # a generator: `await` works without an event-loop round trip


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> _Ref:
        return _Ref(self.fn(*args, **kwargs))


class InProcessHandle:
    """`handle.method.remote(...)` over a local object, as a Ray actor handle calls it."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Engine:
    """A replica's response stream: yields `items`; with `hold`, waits for it first."""

    def __init__(self, items: list[Any], hold: asyncio.Event | None = None) -> None:
        self.items = list(items)
        self.hold = hold
        self.cancelled = False

    def __aiter__(self) -> Engine:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.hold is not None:
            await self.hold.wait()
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class BackPressureError(Exception):
    """Named as Serve's (ray.serve.exceptions): every replica's queue is full."""


class Setup:
    """Lane `chat` with spare `spare`, an index whose clock starts past one heartbeat
    timeout (a fresh index reports nothing until then), and a monitor over both."""

    def __init__(self, healthy_after_s: float = 1.0) -> None:
        self.clock = Clock()
        self.actor = KVIndexActor(heartbeat_timeout_s=HEARTBEAT_S, clock=self.clock)
        self.clock.t = HEARTBEAT_S + 1.0
        self.lanes = {name: Lane(name, None, CACHE) for name in ("chat", "spare")}
        self.selector = LaneSelector(
            ["chat"],
            spare_of={"chat": "spare"},
            saturation={"chat": 8},
            healthy_after_s=healthy_after_s,
            clock=self.clock,
        )
        self.monitor = LaneMonitor(
            self.lanes,
            ["chat"],
            self.selector,
            InProcessHandle(self.actor),
            "ingress-1",
            metrics_on=False,
        )
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.engines: list[Engine] = []

    def register(self, replica_id: str, lane: str) -> None:
        self.actor.register(replica_id, lane, f"node-{replica_id}")

    def opener(self, *, chat: bool = False) -> LaneOpener:
        async def off_loop(fn: Any, *args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        def send(target: Lane, payload: dict[str, Any]) -> Engine:
            self.sent.append((target.name, payload))
            return self.engines.pop(0)

        return LaneOpener(self.monitor, self.lanes["chat"], chat=chat, off_loop=off_loop, send=send)


PAYLOAD = {"request_id": "req", "prompt_token_ids": list(range(10)), "sampling_params": {}}


def test_monitor_moves_a_lane_to_its_spare_and_back() -> None:
    s = Setup(healthy_after_s=1.0)

    async def scenario() -> None:
        s.register("s1", "spare")
        await s.monitor.poll()
        # No replica of chat: down, so its traffic goes to the spare.
        assert (s.lanes["chat"].healthy, s.lanes["spare"].healthy) == (0, 1)
        assert s.selector.target("chat") == "spare"
        assert s.actor.counters[("chat", "to_spare")] == 1

        s.register("c1", "chat")
        await s.monitor.poll()
        assert s.lanes["chat"].healthy == 1
        assert s.selector.target("chat") == "spare"  # not yet usable for healthy_after_s

        s.clock.t += 1.5
        await s.monitor.poll()
        assert s.selector.target("chat") == "chat"
        assert s.actor.counters[("chat", "to_primary")] == 1
        assert s.monitor.lane_states()["chat"]["target"] == "chat"

    asyncio.run(scenario())


def test_a_saturated_lane_keeps_its_primaries_while_its_spare_has_no_replica() -> None:
    """The poll gives the selector the spare's healthy count: saturated primaries (9
    waiting, threshold 8) stay the target until the spare has a healthy replica."""
    s = Setup()

    async def scenario() -> None:
        s.register("c1", "chat")
        s.actor.publish("c1", [], {"num_waiting": 9})
        await s.monitor.poll()
        assert (s.lanes["chat"].healthy, s.lanes["spare"].healthy) == (1, 0)
        assert s.selector.target("chat") == "chat"
        s.register("s1", "spare")
        await s.monitor.poll()
        assert s.selector.target("chat") == "spare"
        assert s.selector.report("chat")["reason"] == "saturated"

    asyncio.run(scenario())


def test_monitor_learns_the_drain_and_does_not_fail_over_during_it() -> None:
    s = Setup()

    async def scenario() -> None:
        s.register("s1", "spare")
        s.actor.set_draining("SIGTERM")
        await s.monitor.poll()
        assert s.monitor.draining == "SIGTERM"
        assert s.selector.target("chat") == "chat"  # replicas leave on shutdown
        s.actor.set_draining(None)
        await s.monitor.poll()
        assert s.monitor.draining is None
        assert s.selector.target("chat") == "spare"

    asyncio.run(scenario())


def test_opener_sends_to_the_primary_with_the_prompts_block_hashes() -> None:
    s = Setup()
    first = {"type": "delta", "token_ids": [7], "replica_id": "c1"}

    async def scenario() -> None:
        s.register("c1", "chat")
        await s.monitor.poll()
        s.engines.append(Engine([first]))
        _, got = await s.opener()(dict(PAYLOAD), 0)
        assert got == first
        ((target, payload),) = s.sent
        assert target == "chat" and payload["request_id"] == "req"
        # 10 tokens in blocks of 4: two full blocks, hashed with the lane's own hasher.
        assert payload["block_hashes"] == s.lanes["chat"].hasher.chain(PAYLOAD["prompt_token_ids"])
        assert len(payload["block_hashes"]) == 2

    asyncio.run(scenario())


def test_a_retry_with_the_primaries_gone_fails_over_at_once() -> None:
    """The monitor has not seen the primaries go yet; the retry moves the lane itself."""
    s = Setup()

    async def scenario() -> None:
        s.register("s1", "spare")
        s.lanes["chat"].healthy = 0  # as the last poll left it
        s.engines.append(Engine([{"type": "delta", "token_ids": [1], "replica_id": "s1"}]))
        gen, _ = await s.opener()(dict(PAYLOAD), 1)
        ((target, payload),) = s.sent
        assert target == "spare"
        assert payload["request_id"] == "req-a1"  # a retry never reuses the request id
        assert s.selector.target("chat") == "spare"
        assert s.actor.counters[("chat", "to_spare")] == 1
        assert s.actor.counters[("chat", "fallback")] == 1
        assert s.monitor.on_spare["chat"] == 1  # the lane's demand on its spare
        gen.cancel()
        assert s.monitor.on_spare["chat"] == 0

    asyncio.run(scenario())


def test_a_retry_sees_the_failure_its_request_reported_before_the_next_poll() -> None:
    """The lane's one replica answers with a dead engine's 503: the opener reports it
    to the index, and the retry, before the monitor's next round, refreshes the view
    and goes to the spare instead of back to the dead replica."""
    s = Setup()

    async def scenario() -> None:
        s.register("c1", "chat")
        s.register("s1", "spare")
        await s.monitor.poll()
        assert s.lanes["chat"].healthy == 1 and s.selector.target("chat") == "chat"
        dead = {"type": "error", "status": 503, "message": "the engine failed (x)"}
        s.engines.append(Engine([{**dead, "param": None, "replica_id": "c1"}]))
        s.engines.append(Engine([{"type": "delta", "token_ids": [1], "replica_id": "s1"}]))
        stream = EngineStream(s.opener(), dict(PAYLOAD), max_attempts=2, backoff_s=0.0)
        first = await stream.start()
        assert first["replica_id"] == "s1"
        assert [target for target, _ in s.sent] == ["chat", "spare"]
        assert s.selector.target("chat") == "spare"
        stream.gen.cancel()

    asyncio.run(scenario())


def test_engine_errors_become_the_clients_errors() -> None:
    s = Setup()
    too_long = {
        "type": "error",
        "status": 400,
        "message": "prompt has 12 tokens, max_model_len is 8: shorten it",
        "param": "prompt",
    }
    died = {"type": "error", "status": 503, "message": "engine died", "replica_id": "c1"}

    async def scenario() -> None:
        s.register("c1", "chat")
        await s.monitor.poll()
        s.engines.append(Engine([too_long]))
        with pytest.raises(ProtocolError) as info:
            await s.opener(chat=True)(dict(PAYLOAD), 0)
        assert (info.value.status, info.value.param) == (400, "messages")
        assert info.value.code == "context_length_exceeded"
        assert not is_retriable(info.value)

        s.engines.append(Engine([died]))
        with pytest.raises(ProtocolError) as info:
            await s.opener()(dict(PAYLOAD), 0)
        assert info.value.status == 503 and is_retriable(info.value)
        # Reported to the index: the replica no longer counts as healthy.
        assert s.actor.healthy_counts(["chat"])["chat"]["healthy"] == 0

        s.engines.append(Engine([BackPressureError("queues full")]))
        with pytest.raises(ProtocolError) as info:
            await s.opener()(dict(PAYLOAD), 0)
        assert (info.value.status, info.value.code) == (429, "queue_full")

    asyncio.run(scenario())


def test_a_request_waiting_on_a_lane_that_moves_to_its_spare_gives_up() -> None:
    """Serve would hold it until a primary returns; the opener answers a retriable
    503 instead, so EngineStream retries it on the spare."""
    s = Setup()

    async def scenario() -> None:
        s.register("c1", "chat")
        await s.monitor.poll()
        engine = Engine([{"type": "delta", "token_ids": [1]}], hold=asyncio.Event())
        s.engines.append(engine)
        opening = asyncio.ensure_future(s.opener()(dict(PAYLOAD), 0))
        await asyncio.sleep(0)  # the request is sent and waits for its first item
        assert s.selector.fail_over_now("chat", "down")
        with pytest.raises(ProtocolError) as info:
            await asyncio.wait_for(opening, timeout=10)
        assert info.value.status == 503 and "moved to its spare" in info.value.message
        assert is_retriable(info.value)
        assert engine.cancelled

    asyncio.run(scenario())


def test_a_request_waiting_on_a_dead_spare_goes_back_to_the_primaries() -> None:
    """The lane moved back to its primaries while a request waited on its spare, which
    has no healthy replica: it gives up at once (a retriable 503, retried on the
    primaries) instead of waiting NO_REPLICA_TIMEOUT_S for the spare."""
    s = Setup(healthy_after_s=0.0)

    async def scenario() -> None:
        assert s.selector.fail_over_now("chat", "down")
        engine = Engine([{"type": "delta", "token_ids": [1]}], hold=asyncio.Event())
        s.engines.append(engine)
        opening = asyncio.ensure_future(s.opener()(dict(PAYLOAD), 0))
        await asyncio.sleep(0)  # sent to the spare (no replica of it answers)
        assert s.sent[-1][0] == "spare"
        s.register("c1", "chat")
        await s.monitor.poll()  # the primaries are back: the lane returns to them
        assert s.selector.target("chat") == "chat" and s.lanes["spare"].healthy == 0
        with pytest.raises(ProtocolError) as info:
            await asyncio.wait_for(opening, timeout=5)
        assert info.value.status == 503 and "moved back to its primaries" in info.value.message
        assert is_retriable(info.value) and engine.cancelled

    asyncio.run(scenario())


def test_no_new_attempt_while_draining() -> None:
    s = Setup()

    async def scenario() -> None:
        s.actor.set_draining("SIGTERM")
        await s.monitor.poll()
        with pytest.raises(ProtocolError) as info:
            await s.opener()(dict(PAYLOAD), 1)
        assert info.value.code == "shutting_down" and not is_retriable(info.value)
        assert s.sent == []

    asyncio.run(scenario())
