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
