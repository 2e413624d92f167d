"""/health's answer and the spare-traffic counter (pure; no Ray, no HTTP)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from spur.cluster.readiness import CountedStream, health_report


def test_starting_until_every_lane_answered() -> None:
    status, body = health_report({"chat": True, "code": False}, {}, {}, None)
    assert status == 503 and body["status"] == "starting"
    assert list(body["missing"]) == ["code"] and "'code'" in body["missing"]["code"]
    assert health_report({"chat": True, "code": True}, {}, {}, None) == (200, {"status": "ok"})


def test_a_spare_that_serves_keeps_the_lane_ready() -> None:
    spare = {"chat": "spare"}
    assert health_report({"chat": True}, {"chat": 0, "spare": 1}, spare, None)[0] == 200
    status, body = health_report({"chat": True}, {"chat": 0, "spare": 0}, spare, None)
    assert status == 503 and "'spare'" in body["missing"]["chat"]
    # Not polled yet (-1) does not count against a lane that answered.
    assert health_report({"chat": True}, {"chat": -1}, {}, None)[0] == 200


def test_draining_wins() -> None:
    status, body = health_report({"chat": True}, {"chat": 1}, {}, "stop signal")
    assert (status, body) == (503, {"status": "draining", "reason": "stop signal"})


class Gen:
    def __init__(self, n: int, exc: BaseException | None = None) -> None:
        self.n, self.exc, self.cancelled = n, exc, False

    async def __anext__(self) -> Any:
        if self.n:
            self.n -= 1
            return {"type": "delta"}
        if self.exc is not None:
            raise self.exc
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("exc", [None, RuntimeError("gone")])
def test_counted_stream_counts_while_open(exc: BaseException | None) -> None:
    counter: Counter[str] = Counter()
    stream = CountedStream(Gen(2, exc), counter, "chat")
    assert counter["chat"] == 1

    async def drain() -> None:
        with pytest.raises(StopAsyncIteration if exc is None else RuntimeError):
            while True:
                await stream.__anext__()
                assert counter["chat"] == 1

    asyncio.run(drain())
    assert counter["chat"] == 0
    stream.cancel()  # after the end: counted once only
    assert counter["chat"] == 0


def test_counted_stream_cancel() -> None:
    counter: Counter[str] = Counter()
    gen = Gen(5)
    stream = CountedStream(gen, counter, "chat")
    stream.cancel()
    assert gen.cancelled and counter["chat"] == 0


def test_index_carries_spare_demand_and_the_drain_flag_to_engines() -> None:
    """The KV index actor's class (no Ray running): an ingress reports the lane's
    requests on the spare; the lane's replicas learn it (and the drain) from publish."""
    from spur.cluster.routing.index_actor import KVIndexActor

    index = KVIndexActor(heartbeat_timeout_s=1.0)
    index.register("r1", "chat", "n1")
    assert index.publish("r1", [], {})["spare_demand"] == 0
    assert index.report_spare_load("ingress-a", {"chat": 3}) is None
    index.report_spare_load("ingress-b", {"chat": 2, "code": 1})
    answer = index.publish("r1", [], {})
    assert answer["spare_demand"] == 5 and answer["draining"] is None
    index.set_draining("stop signal")
    assert index.report_spare_load("ingress-a", {}) == "stop signal"
    assert index.publish("r1", [], {})["draining"] == "stop signal"
    assert index.drain_status() == {"remaining": 1, "reports": 0}
    assert index.leave("r1")  # at the start of its drain: still draining
    assert index.drain_status()["remaining"] == 1
    index.record_drain({"replica_id": "r1", "aborted": 0, "integrity": "ok"})
    assert index.drain_status() == {"remaining": 0, "reports": 1}
    assert index.drained()[0]["integrity"] == "ok"


def test_successful_probes_and_scrapes_are_not_access_logged() -> None:
    """Serve logs a line per request at INFO: Kubernetes probes and Prometheus scrapes
    filled the ingress's log. Their successful lines go; failures and other routes'
    lines stay (formatted by Serve's own access-log function, with and without the
    client's address)."""
    import logging

    from ray.serve._private.logging_utils import access_log_msg

    from spur.cluster.readiness import quiet_probe_logs

    logger = logging.getLogger("spur-test-serve-access")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    quiet_probe_logs(logger.name)
    quiet_probe_logs(logger.name)  # once per process
    assert len(logger.filters) == 1
    lines = [
        ("GET", "/health", "200", ""),
        ("GET", "/health/live", "200", "10.0.0.7:4711"),
        ("GET", "/metrics", "200", ""),
        ("GET", "/health", "503", ""),
        ("POST", "/v1/chat/completions", "200", ""),
        ("GET", "/v1/models", "200", "10.0.0.7:4711"),
        ("GET", "/healthz", "200", ""),
    ]
    for method, route, status, client in lines:
        msg = access_log_msg(
            method=method, route=route, status=status, latency_ms=0.4, client=client
        )
        logger.info(msg, extra={"serve_access_log": True})
    logger.info("GET /health 200 0.4ms")  # not an access-log record: kept
    routes = [" ".join(line.split()[-3:-1]) for line in seen]
    assert routes == [
        "/health 503",
        "/v1/chat/completions 200",
        "/v1/models 200",
        "/healthz 200",
        "/health 200",
    ]
