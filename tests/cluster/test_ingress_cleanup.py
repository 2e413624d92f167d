"""The ingress gives back what a request holds however the client leaves: the
streamed response's cleanup runs even when its body never started, and a key's
lease granted after the client left (while the admission call was in flight) is
released. Ray is not started: the limits actor is a real LimitBook behind an
object with the actor handle's `.method.remote(...)` shape."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest

from spur.cluster.auth import Principal
from spur.cluster.ingress import Ingress, _ClosingStreamingResponse
from spur.cluster.limits import LimitBook


def test_cleanup_runs_when_the_client_left_before_the_body_started() -> None:
    started, closed = [], []

    async def body() -> AsyncIterator[bytes]:
        started.append(True)
        try:
            yield b"data: 1\n\n"
        finally:
            closed.append("body")

    async def run() -> None:
        response = _ClosingStreamingResponse(body(), on_close=lambda: closed.append("on_close"))
        # ASGI spec 2.3 (what Serve's replica passes): Starlette watches for a
        # disconnect while streaming, and this client is already gone.
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}

        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await asyncio.sleep(0.01)

        await response(scope, receive, send)

    asyncio.run(run())
    assert not started  # the body never ran, so its own `finally` could not help
    assert closed == ["on_close"]


class _Remote:
    """`handle.method.remote(*args)` of an actor whose method is `fn`: the call runs
    whether or not the caller still waits, and its reply comes back after `delay_s`."""

    def __init__(self, fn: Any, delay_s: float) -> None:
        self.fn, self.delay_s = fn, delay_s

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            out = self.fn(*args)
            await asyncio.sleep(self.delay_s)
            return out

        return asyncio.ensure_future(call())


@pytest.mark.parametrize("cancel", [False, True])
def test_a_lease_granted_after_the_client_left_is_released(cancel: bool) -> None:
    book = LimitBook()
    limits = types.SimpleNamespace(
        admit=_Remote(book.admit, 0.1), release=_Remote(book.release, 0.0)
    )
    ingress = types.SimpleNamespace(limits=limits)
    solo = Principal("kid", "solo", "t", False, max_concurrent_requests=1, tokens_per_minute=None)

    async def run() -> Any:
        task = asyncio.ensure_future(Ingress._admit(ingress, solo, 10))  # type: ignore[arg-type]
        if not cancel:
            return await task
        await asyncio.sleep(0.05)  # the actor has granted; its reply is on its way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = asyncio.get_running_loop().time() + 5
        while book.usage("kid")["in_flight"]:
            assert asyncio.get_running_loop().time() < deadline, book.usage("kid")
            await asyncio.sleep(0.01)
        return None

    out = asyncio.run(run())
    if cancel:
        # Released and refunded: nothing ran (its prompt was billed until 2026-12-07).
        assert book.usage("kid") == {"in_flight": 0, "tokens_last_minute": 0}
    else:
        assert out[1] is not None and book.usage("kid")["in_flight"] == 1
    book.check_integrity()
