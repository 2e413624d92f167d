"""Readiness, liveness and drain state of the ingress (pure Python: no Ray, no HTTP).

    GET /health/live   200 while the ingress process runs (a liveness probe)
    GET /health        readiness of the application:
                         503 {"status": "starting", "missing": {lane: why}}  until every
                             lane has an engine (or its spare) that answered a call made
                             through the same Serve handle requests take
                         200 {"status": "ok"}
                         503 {"status": "draining", "reason": ...}  once shutdown began

A lane counts as answered once the ingress learned its model from an engine (a real
round trip through Serve's router, so the first request after a 200 finds a replica);
it stops counting while the KV index sees no healthy replica of the lane nor of its
spare (all engines lost after start).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from spur.cluster.errors import SHUTTING_DOWN_CODE, ProtocolError


def shutting_down(reason: str) -> ProtocolError:
    """The 503 for a request that arrives (or must move) while the server drains."""
    return ProtocolError(
        503,
        f"the server is shutting down ({reason}); retry against another instance",
        code=SHUTTING_DOWN_CODE,
        headers={"Retry-After": "5"},
    )


def health_report(
    answered: Mapping[str, bool],
    healthy: Mapping[str, int],
    spare_of: Mapping[str, str],
    draining: str | None,
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) of GET /health.

    Args:
        answered: per primary lane, whether an engine of it (or its spare) answered.
        healthy: healthy replicas per deployment as the KV index last said (-1: not
            polled yet, which does not count against a lane that answered).
        spare_of: lane -> its spare's deployment name.
        draining: the shutdown reason, None while serving.
    """
    if draining is not None:
        return 503, {"status": "draining", "reason": draining}
    missing = {}
    for lane, ok in answered.items():
        spare = spare_of.get(lane)
        where = f"lane {lane!r}" + (f" (or its spare {spare!r})" if spare else "")
        if not ok:
            missing[lane] = f"no engine of {where} has answered yet"
            continue
        counts = [healthy.get(lane, -1)] + ([healthy.get(spare, -1)] if spare else [])
        if all(c == 0 for c in counts):
            missing[lane] = f"no healthy engine of {where}"
    if missing:
        return 503, {"status": "starting", "missing": missing}
    return 200, {"status": "ok"}


class CountedStream:
    """An engine stream that counts itself in `counter[key]` while open (the lane's
    requests on its spare, for the autoscaling policy). Iterates and cancels like the
    stream it wraps; the count drops once, when the stream ends, fails or is cancelled."""

    def __init__(self, gen: Any, counter: Counter[str], key: str) -> None:
        self.gen = gen
        self.counter = counter
        self.key = key
        self.open = True
        counter[key] += 1

    def _close(self) -> None:
        if self.open:
            self.open = False
            self.counter[self.key] -= 1

    def __aiter__(self) -> CountedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.gen.__anext__()
        except BaseException:
            self._close()
            raise

    def cancel(self) -> None:
        self._close()
        self.gen.cancel()

    def __del__(self) -> None:
        self._close()


_PROBE_LINE = re.compile(r"(?:^|\s)(?:GET|HEAD) (?:/health|/health/live|/metrics) 2\d\d ")
"""Serve's access-log line of a successful probe or scrape ("GET /health 200 0.4ms",
after the client's address when Serve logs it)."""


class QuietProbes(logging.Filter):
    """Drop Serve's access-log lines of successful `/health`, `/health/live` and
    `/metrics` requests: Kubernetes probes and Prometheus scrapes every few seconds
    would fill the ingress's log. Their failures (a 503 while starting or draining)
    and every other request's line stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "serve_access_log", False):
            return True
        return _PROBE_LINE.search(record.getMessage()) is None


def quiet_probe_logs(logger_name: str = "ray.serve") -> None:
    """Install `QuietProbes` on Serve's logger (once per process)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, QuietProbes) for f in logger.filters):
        logger.addFilter(QuietProbes())
