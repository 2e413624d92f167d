"""`spur serve`'s signal handling (cluster/server.run_server) while the application
deploys: Serve's deploy waits for every replica, which may never come, so a signal
then interrupts the wait and the server stops. Ray is not started: `start` is
replaced by a wait that only a signal can end, as `serve.run`'s is."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from spur.cluster import server
from spur.configs.loader import parse_config


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_deploying_stops_the_server(
    monkeypatch: pytest.MonkeyPatch, signum: int
) -> None:
    calls: list[str] = []

    def deploy_forever(cfg: Any, on_ray_started: Any = None) -> str:
        # as ray.init does: its own SIGTERM handler (exit at once), which spur replaces
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if on_ray_started is not None:
            on_ray_started()
        calls.append("deploying")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # a replica that can never be placed
            time.sleep(0.05)
        raise AssertionError("the deploy was not interrupted")

    monkeypatch.setattr(server, "start", deploy_forever)
    monkeypatch.setattr(server, "stop", lambda cfg: calls.append("stopped"))
    cfg = parse_config({"lanes": [{"name": "chat"}]})
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signum))
    timer.start()
    began = time.monotonic()
    try:
        status = server.run_server(cfg, announce=lambda url: calls.append("announced"))
    finally:
        timer.cancel()
    assert status == 0 and time.monotonic() - began < 10
    assert calls == ["deploying", "stopped"]
    # the process's own handlers are back
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("slow", ["drain", "stop"])
def test_a_second_signal_stops_without_waiting(monkeypatch: pytest.MonkeyPatch, slow: str) -> None:
    """The first signal drains (which may take the lanes' drain_timeout_s), then stops
    gracefully (Serve waits for its replicas); a second signal during either stops at
    once, as an operator's second Ctrl-C expects."""
    calls: list[str] = []
    waiting = threading.Event()

    def wait_for_a_signal(name: str) -> None:
        calls.append(name)
        waiting.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise AssertionError(f"the {name} was not interrupted")

    def stop(cfg: Any, wait: bool = True) -> None:
        if wait and slow == "stop":
            wait_for_a_signal("stop")
        calls.append(f"stop(wait={wait})")

    def drain(cfg: Any, reason: str) -> None:
        if slow == "drain":
            wait_for_a_signal("drain")
        calls.append("drained")

    monkeypatch.setattr(server, "start", lambda cfg, on_ray_started=None: "http://spur")
    monkeypatch.setattr(server, "wait_ready", lambda url, stop_event: True)
    monkeypatch.setattr(server, "drain", drain)
    monkeypatch.setattr(server, "stop", stop)

    def signal_twice() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        if waiting.wait(30):
            os.kill(os.getpid(), signal.SIGTERM)

    cfg = parse_config({"lanes": [{"name": "chat"}]})
    began = time.monotonic()
    sender = threading.Timer(0.2, signal_twice)
    sender.start()
    try:
        status = server.run_server(cfg, announce=lambda url: calls.append("announced"))
    finally:
        sender.cancel()
        sender.join()
    assert status == 0 and time.monotonic() - began < 10
    if slow == "drain":
        assert calls == ["announced", "drain", "stop(wait=False)"]
    else:
        assert calls == ["announced", "drained", "stop", "stop(wait=False)"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
