"""actors/ports.py: ports for servers, outside the ranges other processes take from."""

from __future__ import annotations

import socket

from spur.actors import ports


def test_a_free_port_lies_below_the_ephemeral_range_and_binds():
    high = ports._ephemeral_low()
    got = {ports.free_port() for _ in range(20)}
    assert all(ports.LOW <= p < high for p in got), got
    assert len(got) > 1  # picked at random: parallel callers rarely collide
    with socket.socket() as s:
        s.bind(("127.0.0.1", got.pop()))


def test_a_taken_port_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(ports, "LOW", port)  # the range holds the taken port and one more
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: port + 2)
        assert {ports.free_port() for _ in range(10)} == {port + 1}


def test_without_room_below_the_ephemeral_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.LOW)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.free_port()))
