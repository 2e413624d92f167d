"""The engine streams of one request's prompts, run concurrently (a completions
request with several prompts, or one prompt): see `FanOut`. Pure asyncio: the
streams are `failover.EngineStream`s in the ingress and plain async iterators
with a `start()` in tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from spur.cluster.errors import engine_error


class Stream(Protocol):
    """What FanOut needs of a stream (EngineStream has it)."""

    async def start(self) -> dict[str, Any]: ...

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]: ...

    def cancel(self) -> None: ...


class FanOut:
    """The engine streams of one request's prompts, run concurrently.

    Each prompt has its own task that opens its stream (retries included) and
    pumps its items into one merged queue bounded at `buffer` items per prompt:
    when the client reads slowly, the pumps wait, and so do the engine streams
    behind them (back-pressure instead of memory). Prompts never wait for each
    other: a prompt queued behind another one of the same request (a replica
    with room for one) starts when that one has streamed, which it can because
    its items are consumed, not held until every prompt has opened.

    `ready()` returns once every prompt has its first item, or the buffer is full
    (the response must start for the streams to progress); it raises the first
    failure seen before then, so that an engine-side rejection becomes the HTTP
    status. `items()` yields (prompt index, item) until every stream ended; it
    raises a prompt's failure (an exception, or an engine error item). `close()`
    cancels everything (idempotent)."""

    def __init__(self, streams: list[Stream], buffer: int) -> None:
        self.streams = streams
        self.queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = (
            asyncio.Queue(maxsize=max(2, buffer) * len(streams))
        )
        self.opened = 0
        self.changed = asyncio.Event()
        self.failure: BaseException | None = None
        self.tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _put(self, entry: tuple[int, dict[str, Any] | BaseException | None]) -> None:
        # ready() must not wait for firsts that cannot come while the buffer is full:
        # tell it when a put finds it full, and when a put fills it.
        if self.queue.full():
            self.changed.set()
        await self.queue.put(entry)
        if self.queue.full():
            self.changed.set()

    async def _pump(self, i: int, stream: Stream) -> None:
        try:
            first = await stream.start()
            self.opened += 1
            self.changed.set()
            await self._put((i, first))
            async for item in stream:
                await self._put((i, item))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self.failure is None:
                self.failure = exc
            self.changed.set()
            await self._put((i, exc))
            return
        await self._put((i, None))

    async def ready(self) -> None:
        while True:
            if self.failure is not None:
                raise self.failure
            if self.opened == len(self.streams) or self.queue.full():
                return
            self.changed.clear()
            await self.changed.wait()

    async def items(self) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        open_streams = len(self.streams)
        while open_streams:
            i, item = await self.queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item["type"] == "error":
                raise engine_error(item)
            yield i, item

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for stream in self.streams:
            with contextlib.suppress(Exception):
                stream.cancel()
