"""Helpers of the Serve replica shell that run without Ray."""

from __future__ import annotations

import threading

import pytest

from spur.actors.engine.shell.actor import _in_own_thread, _publish_due


def test_the_engine_is_built_in_a_thread_that_then_exits() -> None:
    seen: list[threading.Thread] = []

    def build() -> str:
        seen.append(threading.current_thread())
        return "built"

    assert _in_own_thread(build) == "built"
    assert seen[0] is not threading.current_thread()
    assert seen[0].name == "spur-engine-build" and not seen[0].is_alive()


def test_a_failed_build_raises_in_the_caller() -> None:
    def build() -> None:
        raise FileNotFoundError("no model at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        _in_own_thread(build)


def test_an_idle_replica_publishes_once_a_stats_period_with_metrics_off() -> None:
    """The publish loop's clock, stepped every 50 ms (events_period_s) over 10 s of
    an idle replica: a heartbeat a second with metrics off (it was 20 a second:
    the metrics timer never advanced when there were no metrics to send), and one
    publish a second, each with a snapshot, with metrics on."""
    for metrics_on in (False, True):
        last = 0.0
        last_metrics = 0.0 if metrics_on else None
        sent = snapshots = 0
        for tick in range(1, 201):
            now = tick * 0.05
            send, with_metrics = _publish_due(now, False, last, 1.0, last_metrics, 1.0)
            if send:
                sent += 1
                last = now
                if with_metrics:
                    snapshots += 1
                    last_metrics = now
        assert sent == 10, (metrics_on, sent)
        assert snapshots == (10 if metrics_on else 0)


def test_kv_batches_are_published_at_once_and_metrics_on_their_own_period() -> None:
    assert _publish_due(5.01, True, 5.0, 1.0, None, 1.0) == (True, False)
    assert _publish_due(5.01, True, 5.0, 1.0, 4.5, 1.0) == (True, False)
    assert _publish_due(5.6, False, 5.0, 2.0, 4.5, 1.0) == (True, True)  # metrics due
    assert _publish_due(5.6, False, 5.0, 2.0, None, 1.0) == (False, False)
    assert _publish_due(7.0, False, 5.0, 2.0, None, 1.0) == (True, False)  # heartbeat
