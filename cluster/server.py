"""Start (or join) Ray, deploy the app, serve until a signal, shut down cleanly."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from spur.configs.schema import SpurConfig

logger = logging.getLogger(__name__)

APP_NAME = "spur"


def start(cfg: SpurConfig) -> str:
    """Connect to Ray (embedded or `server.ray_address`), deploy, return the URL."""
    import ray
    from ray import serve

    from spur.cluster.app import build_app

    server = cfg.server
    if not ray.is_initialized():
        if server.embedded_ray:
            if server.data_plane == "grpc":
                # Read by Serve's HTTP proxy when it starts; Ray's processes inherit
                # this process's environment. An explicit value set by the user wins.
                os.environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")
            ray.init(
                namespace=server.namespace,
                num_cpus=server.num_cpus,
                object_store_memory=server.object_store_memory,
                include_dashboard=False,
            )
        else:
            ray.init(address=server.ray_address, namespace=server.namespace)
    serve.start(http_options={"host": server.host, "port": server.port})
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
    return server.url


def stop(cfg: SpurConfig) -> None:
    """Graceful: Serve drains replicas (in-flight requests finish or are aborted
    within graceful_shutdown_timeout_s), then an embedded Ray is shut down."""
    import ray
    from ray import serve

    from spur.cluster.limits import kill_limits
    from spur.cluster.routing.index_actor import kill_index

    try:
        serve.delete(APP_NAME)
        serve.shutdown()
        kill_index()
        kill_limits()
    finally:
        if cfg.server.embedded_ray:
            ray.shutdown()


def run_server(cfg: SpurConfig, announce: Callable[[str], Any] = print) -> int:
    """Serve until SIGINT / SIGTERM. Returns the process exit status."""
    stop_event = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        logger.warning("signal %d: shutting down", signum)
        stop_event.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = start(cfg)
        announce(url)
        while not stop_event.is_set():
            time.sleep(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        stop(cfg)
    return 0
