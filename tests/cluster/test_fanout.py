"""FanOut: a request's prompts opened concurrently, with bounded buffers
(cluster/fanout.py), on fake streams; every wait has a deadline."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from spur.cluster.errors import ProtocolError
from spur.cluster.fanout import FanOut

DEADLINE_S = 10.0


class FakeStream:
    """`n` delta items then a final one; `start` waits for `gate` (a replica with
    room for one request) and holds it until the stream is fully consumed."""

    def __init__(
        self, n: int, gate: asyncio.Semaphore | None = None, fail: Exception | None = None
    ) -> None:
        self.n, self.gate, self.fail = n, gate, fail
        self.sent = 0
        self.cancelled = False
        self.started = asyncio.Event()

    async def start(self) -> dict[str, Any]:
        if self.gate is not None:
            await self.gate.acquire()
        self.started.set()
        if self.fail is not None:
            raise self.fail
        return self._item()

    def _item(self) -> dict[str, Any]:
        self.sent += 1
        return {"type": "delta", "index": 0, "token_ids": [self.sent], "text": "x",
                "finish_reason": None}  # fmt: skip

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        await asyncio.sleep(0)
        if self.sent < self.n:
            return self._item()
        if self.sent == self.n:
            self.sent += 1
            if self.gate is not None:
                self.gate.release()
            return {"type": "final", "num_cached_tokens": 0}
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


async def drain(fan: FanOut) -> dict[int, int]:
    counts: dict[int, int] = {}
    await fan.ready()
    async for i, item in fan.items():
        if item["type"] == "delta":
            counts[i] = counts.get(i, 0) + 1
    return counts


def test_prompts_queued_behind_each_other_do_not_deadlock() -> None:
    """Three prompts on a replica that runs one at a time, each longer than the
    buffer: waiting for every first item before consuming any would hang."""

    async def main() -> dict[int, int]:
        gate = asyncio.Semaphore(1)
        fan = FanOut([FakeStream(200, gate) for _ in range(3)], buffer=4)
        try:
            return await asyncio.wait_for(drain(fan), DEADLINE_S)
        finally:
            fan.close()

    assert asyncio.run(main()) == {0: 200, 1: 200, 2: 200}


def test_prompts_open_concurrently() -> None:
    """Every prompt's start runs before any first item is consumed (not one prefill
    after another)."""

    async def main() -> None:
        streams = [FakeStream(3) for _ in range(4)]
        fan = FanOut(streams, buffer=8)
        try:
            await asyncio.wait_for(fan.ready(), DEADLINE_S)
            assert all(s.started.is_set() for s in streams)
            assert fan.opened == 4
            assert await asyncio.wait_for(drain(fan), DEADLINE_S) == {i: 3 for i in range(4)}
        finally:
            fan.close()

    asyncio.run(main())


def test_a_rejected_prompt_fails_ready_and_close_cancels_the_others() -> None:
    async def main() -> None:
        bad = FakeStream(3, fail=ProtocolError(400, "prompt too long", param="prompt"))
        streams = [FakeStream(1000), bad, FakeStream(1000)]
        fan = FanOut(streams, buffer=2)
        with pytest.raises(ProtocolError, match="too long"):
            await asyncio.wait_for(fan.ready(), DEADLINE_S)
        fan.close()
        await asyncio.sleep(0)
        assert all(s.cancelled for s in streams)
        await asyncio.wait_for(asyncio.gather(*fan.tasks, return_exceptions=True), DEADLINE_S)

    asyncio.run(main())


def test_buffer_is_bounded_while_the_consumer_waits() -> None:
    async def main() -> None:
        stream = FakeStream(10_000)
        fan = FanOut([stream], buffer=16)
        try:
            await asyncio.wait_for(fan.ready(), DEADLINE_S)
            for _ in range(50):
                await asyncio.sleep(0)
            assert fan.queue.qsize() <= fan.queue.maxsize == 16
            assert stream.sent <= 18  # the pump waits: back-pressure to the stream
        finally:
            fan.close()

    asyncio.run(main())


def test_an_engine_error_item_is_raised_by_items() -> None:
    class ErrorAfterOne(FakeStream):
        async def __anext__(self) -> dict[str, Any]:
            return {"type": "error", "status": 503, "message": "replica died", "param": None}

    async def main() -> None:
        fan = FanOut([ErrorAfterOne(5)], buffer=4)
        with pytest.raises(ProtocolError, match="replica died"):
            await asyncio.wait_for(drain(fan), DEADLINE_S)
        fan.close()

    asyncio.run(main())


class _Stalling(FakeStream):
    """Its first item and `n` deltas come at once, then the next never does (a stream
    waiting on a failover, say)."""

    async def __anext__(self) -> dict[str, Any]:
        await asyncio.sleep(0)  # each item a step of the loop, as a real stream's
        if self.sent <= self.n:
            return self._item()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def test_ready_returns_when_the_buffer_fills() -> None:
    """Prompt 0 fills the buffer (2 items a prompt, 2 prompts) while prompt 1 waits for a
    replica: ready() must return then (the response starts and the consumer drains),
    not when prompt 0's next item comes."""

    async def scenario() -> None:
        waiting = asyncio.Semaphore(0)  # prompt 1's replica has no room yet
        fan = FanOut([_Stalling(3), FakeStream(2, gate=waiting)], buffer=2)
        try:
            await asyncio.wait_for(fan.ready(), timeout=5)
            assert fan.queue.full()
        finally:
            fan.close()

    asyncio.run(scenario())


class ErrorAfterOne(FakeStream):
    """One delta, then the engine's error item (what EngineStream yields mid-stream)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(1)
        self.error = error

    async def __anext__(self) -> dict[str, Any]:
        await asyncio.sleep(0)
        if self.error is None:
            raise StopAsyncIteration
        error, self.error = self.error, None
        return error


@pytest.mark.parametrize(
    ("item", "status", "code", "headers"),
    [
        # a replica died under an n > 1 stream: a 503 like every other one (it had no
        # code and no Retry-After)
        (
            {"type": "error", "status": 503, "message": "the replica failed", "param": None},
            503,
            "service_unavailable",
            {"Retry-After": "1"},
        ),
        # a spare with a smaller max_model_len refusing a continued prompt
        (
            {
                "type": "error",
                "status": 400,
                "param": "prompt",
                "message": "prompt of 300 tokens exceeds max_model_len 256",
            },
            400,
            "context_length_exceeded",
            {},
        ),
    ],
)
def test_an_engine_error_mid_stream_reaches_the_client_as_the_same_error_at_its_start(
    item: dict[str, Any], status: int, code: str, headers: dict[str, str]
) -> None:
    async def run() -> ProtocolError:
        fan = FanOut([ErrorAfterOne(item)], buffer=4)
        await asyncio.wait_for(fan.ready(), DEADLINE_S)
        with pytest.raises(ProtocolError) as info:
            async for _ in fan.items():
                pass
        return info.value

    err = asyncio.run(run())
    assert (err.status, err.code, err.headers) == (status, code, headers)
