"""A free TCP port for a server this process is about to start: the tensor-parallel
workers' rendezvous (torch.distributed's TCP store), the benches' servers, the test
suite's, the fake cluster's head. Here, under actors/, so that the workers (which import
nothing of cluster/) and cluster/ share one.

A port from `bind(port 0)` comes from the kernel's ephemeral range, which the kernel
hands out again to the next `bind(0)`: Ray starts a dozen listeners that way (raylet,
object manager, agents, metrics) in the moment between choosing a port and the server
binding it. One CI run lost its shared `spur serve` so ("Failed to bind to address
127.0.0.1:43789": address already in use). A port below the ephemeral range and above
Ray's worker ports (10002-19999 by default) is one no process takes without asking.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOW = 20_000  # above Ray's default worker ports (min_worker_port .. max_worker_port)
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768)."""
    try:
        return int(EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, between LOW and the ephemeral range, picked at random
    (callers in parallel processes rarely pick the same one; a taken one is skipped).
    Where that range is empty (a kernel configured so), the kernel's choice."""
    high = _ephemeral_low() - 1
    rng = random.Random()
    for _ in range(200 if high > LOW else 0):
        port = rng.randint(LOW, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
