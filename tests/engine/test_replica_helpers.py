"""Helpers of the Serve replica shell that run without Ray."""

from __future__ import annotations

import threading

import pytest

from spur.actors.engine.shell.actor import _in_own_thread


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
