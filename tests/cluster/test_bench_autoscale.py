"""`spur bench autoscale`'s lane watcher: what its waits see."""

from __future__ import annotations

import time

from spur.cluster.bench.autoscale import LaneWatcher, Sample


def test_a_wait_since_a_moment_sees_samples_taken_before_it_was_called():
    """The bench waited for the scale-down only after the load's threads had joined, and
    a wait saw only samples taken after the call: a scale-down already over was
    reported at the first sample after the join, seconds late."""
    watcher = LaneWatcher("http://unused", "auto", "unused")  # not started: no sampling
    now = time.monotonic()
    watcher.samples = [Sample(now - 3, 2, 2, 2), Sample(now - 2, 1, 1, 2), Sample(now - 1, 1, 1, 1)]
    assert watcher.wait(lambda s: s.replicas <= 1, 0.3) is None  # new samples only
    down = watcher.wait(lambda s: s.replicas <= 1, 0.3, since=now - 2.5)
    assert down is watcher.samples[1]
    gone = watcher.wait(lambda s: s.worker_nodes <= 1, 0.3, since=now - 2.5)
    assert gone is watcher.samples[2]
    assert watcher.wait(lambda s: s.replicas <= 1, 0.3, since=now) is None  # none since
