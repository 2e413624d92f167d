"""spur's Serve request routers with every replica full: Serve asks them again and
again, and backs off (25 ms doubling to 0.5 s) only when the router sets the request's
`should_backoff`, as Serve's own routers do; without it each queued request called
the KV index in a tight loop. Serve's real routing loop runs; the index is a stand-in
(Ray is not started)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest

from spur.cluster.routing import router as router_mod


class _Index:
    def __init__(self) -> None:
        self.calls = 0

    def _answer(self, value: Any) -> Any:
        self.calls += 1
        future = asyncio.get_running_loop().create_future()
        future.set_result(value)
        return future

    def __getattr__(self, name: str) -> Any:
        index = self

        class Method:
            def remote(self, *args: Any) -> Any:
                ids = next((a for a in args if isinstance(a, list)), [])
                return index._answer(list(ids) if name in ("route", "round_robin") else None)

        return Method()


@pytest.mark.parametrize("cls", [router_mod.PrefixRouter, router_mod.RoundRobinRouter])
def test_a_router_backs_off_while_no_replica_takes_the_request(
    monkeypatch: pytest.MonkeyPatch, cls: Any
) -> None:
    index = _Index()
    # Patch the name where the method looks it up, and only there: Serve pickles a
    # request router class by value, and unpickled in a process that has the module (a
    # driver that ran an app with this router) cloudpickle sets the class's methods to
    # copies whose globals are their own dict, not the module's. (Patching the module
    # too, with setattr, would leak: pytest undoes every setattr before every setitem,
    # so the fake index outlived the test and later apps' routers pickled it.)
    monkeypatch.setitem(cls.initialize_state.__globals__, "get_index", lambda kwargs=None: index)

    async def scenario() -> int:
        deployment = DeploymentID(name="engine-chat", app_name="spur")
        router = cls(deployment, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(lane="chat", weights={}, index_kwargs=None)
        replicas = [
            SimpleNamespace(replica_id=ReplicaID(unique_id=f"r{i}", deployment_id=deployment))
            for i in range(2)
        ]
        router._replicas = {r.replica_id: r for r in replicas}
        router._replicas_list = replicas
        request = PendingRequest(
            args=[{"block_hashes": [1, 2], "session": None}],
            kwargs={},
            metadata=RequestMetadata(request_id="x", internal_request_id="ix"),
        )
        rounds = router._choose_replicas_with_backoff(request)
        began = time.monotonic()
        async for _ in rounds:  # every candidate is full: Serve asks again
            await asyncio.sleep(0)
            if time.monotonic() - began > 0.5:
                break
        await rounds.aclose()
        return index.calls

    calls = asyncio.run(scenario())
    assert 2 <= calls <= 20, f"{calls} index calls in 0.5 s: no back-off"


def test_the_router_module_is_left_as_it_was() -> None:
    """Runs after the test above (file order): its fake index must not outlive it. It
    did once (a setattr and a setitem on one name, undone in the wrong order), and the
    next module's Serve app pickled the fake into its routers: requests hung."""
    from spur.cluster.routing.index_actor import get_index

    assert router_mod.get_index is get_index
    assert router_mod.PrefixRouter.initialize_state.__globals__["get_index"] is get_index
