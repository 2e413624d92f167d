"""The engine replica's publish loop against the real KV index actor, in process (no
Ray): a publish that fails while the index stays up loses no KV events. The engine
side is a stand-in holding what the loop reads (its batches use AsyncEngine's own
take/return methods); the index handle calls the actor's methods directly."""

from __future__ import annotations

import asyncio
import collections
import types
from typing import Any

from spur.actors.engine.core.block_pool import BlockRemoved, BlockStored
from spur.actors.engine.shell.actor import EngineReplica
from spur.actors.engine.shell.async_engine import AsyncEngine, event_batch
from spur.cluster.routing.index_actor import KVIndexActor

H = b"h" * 32


class _Handle:
    """`index.method.remote(...)` awaitable, calling the in-process actor; the next
    `fail_publishes` publish calls raise as a transient Ray error would."""

    def __init__(self, actor: KVIndexActor) -> None:
        self.actor, self.fail_publishes = actor, 0

    def __getattr__(self, name: str) -> Any:
        handle = self

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                async def call() -> Any:
                    if name == "publish" and handle.fail_publishes:
                        handle.fail_publishes -= 1
                        raise RuntimeError("ActorUnavailableError: transient")
                    return getattr(handle.actor, name)(*args, **kwargs)

                return asyncio.ensure_future(call())

        return Method()


class _Engine:
    take_kv_batches = AsyncEngine.take_kv_batches
    return_kv_batches = AsyncEngine.return_kv_batches
    take_arrived = AsyncEngine.take_arrived
    return_arrived = AsyncEngine.return_arrived

    def __init__(self) -> None:
        self.kv_batches: collections.deque[dict[str, Any]] = collections.deque()
        self._arrived: list[str] = []
        self.seq, self.cached, self.metrics = 0, set(), None

    def emit(self, event: Any) -> None:
        if isinstance(event, BlockStored):
            self.cached.update(event.block_hashes)
        else:
            self.cached.difference_update(event.block_hashes)
        self.kv_batches.append(event_batch(self.seq, [event]))
        self.seq += 1

    def stats(self) -> dict[str, Any]:
        return {"num_running": 0, "num_waiting": 0, "alive": True}

    async def snapshot(self) -> tuple[int, list[bytes], list[bytes] | None]:
        return self.seq - 1, sorted(self.cached), None  # no state layers


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_failed_publish_loses_no_eviction_and_no_arrival() -> None:
    actor = KVIndexActor(heartbeat_timeout_s=3.0)
    actor.register("r", "lane", "n")
    index, engine = _Handle(actor), _Engine()
    replica = types.SimpleNamespace(
        routing={"events_period_s": 0.01, "stats_period_s": 0.05},
        engine=engine,
        draining_since=None,
        index=index,
        replica_id="r",
        lane="lane",
        node_id="n",
        _spare_demand=0.0,
    )

    async def scenario() -> None:
        loop = asyncio.create_task(EngineReplica._publish_loop(replica))  # type: ignore[arg-type]
        engine.emit(BlockStored([H], 0))
        await _until(lambda: actor.index.match("r", [H]) == 1)
        actor.index.record("r", [H], "q1")  # routed there, in transit
        index.fail_publishes = 1  # the batch with the eviction does not arrive
        engine.emit(BlockRemoved([H], 0))
        engine._arrived.append("q1")  # nor the report that q1 reached the engine
        await _until(lambda: index.fail_publishes == 0)
        # The replica is idle now (heartbeats only): the eviction must still arrive,
        # and q1 stop counting as routed-but-not-arrived load (long before it expires).
        await _until(lambda: actor.index.match("r", [H]) == 0)
        await _until(lambda: not actor.index.replicas["r"].in_flight, timeout_s=2.0)
        loop.cancel()

    asyncio.run(scenario())
