"""Start (or join) Ray, deploy the app, announce it once `/health` says ready, serve
until a signal, then drain and shut down.

Drain (SIGTERM, Ctrl-C): the KV index's drain flag makes every ingress answer
`/health` with 503 and refuse new requests (503, code "shutting_down"); then the
application is deleted: each engine replica finishes its requests within its lane's
drain_timeout_s and ends the rest with an error item (code "draining"), checks its
pool, and Serve stops it; the ingress streams end with them. Exit status 0.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from spur.configs.schema import SpurConfig

logger = logging.getLogger(__name__)

APP_NAME = "spur"


def start(cfg: SpurConfig, on_ray_started: Callable[[], Any] | None = None) -> str:
    """Connect to Ray (embedded or `server.ray_address`), deploy, return the URL.
    `on_ray_started` runs once Ray runs, before the deployment (which waits for every
    replica): `ray.init` installs its own SIGTERM handler, which the caller may replace."""
    import ray
    from ray import serve

    from spur.cluster.app import build_app

    server = cfg.server
    if not ray.is_initialized():
        if server.embedded_ray:
            # Ray's processes inherit this process's environment as it is when
            # `ray.init` starts the raylet (not later): set before it. An explicit value
            # set by the user wins.
            if server.data_plane == "grpc":
                os.environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")  # the HTTP proxy's hop
            ray.init(
                # "local": a Ray of its own, as configured. Without an address, ray.init
                # joins RAY_ADDRESS or a cluster `ray start` left on this machine, which
                # spur would then shut down with its own Ray.
                address="local",
                namespace=server.namespace,
                num_cpus=server.num_cpus,
                object_store_memory=server.object_store_memory,
                include_dashboard=False,
            )
        else:
            ray.init(address=server.ray_address, namespace=server.namespace)
    if on_ray_started is not None:
        on_ray_started()
    # Proxies on the head only: the URL announced is the head's, and a proxy on an
    # engine node would go (cutting its connections) when the autoscaler removes the node.
    serve.start(http_options={"host": server.host, "port": server.port}, proxy_location="HeadOnly")
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
    return server.url


def wait_ready(
    url: str, stop_event: threading.Event, *, poll_s: float = 0.5, log_every_s: float = 30.0
) -> bool:
    """Poll GET {url}/health until it answers 200 (True) or `stop_event` is set (False);
    logs what is still missing every `log_every_s`."""
    import httpx

    last_log = time.monotonic()
    with httpx.Client(timeout=10.0) as client:
        while not stop_event.is_set():
            try:
                resp = client.get(f"{url}/health")
                if resp.status_code == 200:
                    return True
                detail: Any = resp.text[:300]
            except httpx.HTTPError as exc:
                detail = f"{type(exc).__name__}"
            if time.monotonic() - last_log >= log_every_s:
                logger.warning("not ready yet: %s", detail)
                last_log = time.monotonic()
            stop_event.wait(poll_s)
    return False


def serves_without_a_key(url: str) -> bool:
    """Whether `GET {url}/admin/config` answers 200 to a request without a key: the
    ingress that answered has no keys. False when it cannot be asked."""
    import httpx

    try:
        return httpx.get(f"{url}/admin/config", timeout=10.0).status_code == 200
    except httpx.HTTPError:
        return False


def drain(cfg: SpurConfig, reason: str, margin_s: float = 10.0) -> None:
    """Drain the deployment before it is deleted: the KV index's drain flag makes every
    ingress refuse new requests (and /health say 503) and every engine replica drain
    (finish its requests within its lane's drain_timeout_s, abort the rest, check its
    pool, leave the index). Returns once no replica is left in the index, or after the
    longest drain_timeout_s plus `margin_s`."""
    import ray

    from spur.cluster.routing.index_actor import get_index, index_kwargs_of

    lanes: list[Any] = [*cfg.lanes, *([cfg.spare] if cfg.spare else [])]
    deadline = time.monotonic() + max(lane.drain_timeout_s for lane in lanes) + margin_s
    try:
        index = get_index(index_kwargs_of(cfg.router.model_dump()))
        ray.get(index.set_draining.remote(reason), timeout=10)
        while time.monotonic() < deadline:
            if ray.get(index.drain_status.remote(), timeout=10)["remaining"] == 0:
                break
            time.sleep(0.2)
        time.sleep(1.0)  # the ingress streams end with their engines' last items
    except Exception as exc:  # the index is gone: Serve's own shutdown still drains
        logger.warning("could not drain through the KV index: %s", exc)


def _log_drains() -> None:
    """Log every engine's drain report (finished, aborted, pool integrity)."""
    import ray

    from spur.cluster.routing.index_actor import INDEX_NAME, INDEX_NAMESPACE

    try:
        index = ray.get_actor(INDEX_NAME, namespace=INDEX_NAMESPACE)
        for report in ray.get(index.drained.remote(), timeout=10):
            logger.warning("spur drain: %s", report)
    except Exception as exc:
        logger.warning("no drain reports: %s", exc)


def stop(cfg: SpurConfig, wait: bool = True) -> None:
    """Graceful: Serve drains replicas (in-flight requests finish or are aborted
    within graceful_shutdown_timeout_s), then an embedded Ray is shut down. On a
    joined cluster (`server.ray_address`) only spur's application and actors go:
    Serve itself stops only when no other application is left.

    `wait=False` (a second signal): an embedded Ray is shut down at once, with every
    replica; on a joined cluster the application's deletion is started, not awaited."""
    import ray
    from ray import serve

    from spur.cluster.limits import kill_limits
    from spur.cluster.routing.index_actor import kill_index

    if not ray.is_initialized():  # start failed before Ray ran: nothing to stop (and
        return  # serve.delete would start a Ray instance of its own)
    try:
        if not wait:
            if not cfg.server.embedded_ray:
                serve.delete(APP_NAME, _blocking=False)
                kill_index()
                kill_limits()
            return
        serve.delete(APP_NAME)
        _log_drains()
        # Serve on a joined cluster may run other applications: shutting it down
        # would delete them too. It stops only with the last application.
        if cfg.server.embedded_ray or not serve.status().applications:
            serve.shutdown()
        kill_index()
        kill_limits()
    finally:
        if cfg.server.embedded_ray:
            ray.shutdown()


def deploy_error(exc: BaseException, details: list[str] | None = None) -> str:
    """The reason for Serve's "Deploying application ... failed" error `exc`: the last
    exception line of the tracebacks in it or in `details` (its deployments' status
    messages; a replica's `ModelLoadError: ...`, which names the fix), else its first
    line."""
    texts = [*(details or ()), str(exc)]
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception): ", line)]
    return raised[-1] if raised else (lines[-1] if lines else type(exc).__name__)


def _deployment_messages() -> list[str]:
    """The status messages of spur's deployments that did not come up ([] when Serve
    cannot say)."""
    try:
        from ray import serve

        app = serve.status().applications.get(APP_NAME)
        if app is None:
            return []
        return [
            d.message
            for d in app.deployments.values()
            if d.message and str(d.status) not in ("HEALTHY", "DeploymentStatus.HEALTHY")
        ]
    except Exception:  # the report is a courtesy: never hide the failure behind another
        return []


def run_server(cfg: SpurConfig, announce: Callable[[str], Any] = print) -> int:
    """Serve until SIGINT / SIGTERM. Returns the process exit status.

    A signal while the application deploys (Serve waits for every replica, which may
    never come: no room for one) interrupts the deployment, then shuts down as after
    serving; later, it starts the drain. A second signal during the drain or the
    graceful stop cuts them short: `stop(wait=False)`."""
    stop_event = threading.Event()
    deploying = True
    hurried = False  # a second signal: stop without waiting

    def on_signal(signum: int, _frame: Any) -> None:
        if deploying:
            logger.warning("signal %d: shutting down", signum)
            stop_event.set()
            raise KeyboardInterrupt  # out of serve.run's wait
        if stop_event.is_set():
            logger.warning("signal %d again: stopping now, without waiting for the drain", signum)
            raise KeyboardInterrupt  # out of the drain's or the stop's wait
        logger.warning("signal %d: draining (a second signal stops at once)", signum)
        stop_event.set()

    def take_signals() -> None:  # ray.init installs its own SIGTERM handler (exit at once)
        for s in previous:
            signal.signal(s, on_signal)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            url = start(cfg, on_ray_started=take_signals)
        except KeyboardInterrupt:
            if not stop_event.is_set():
                raise
            logger.warning("stopped while the application was deploying")
            return 0
        except RuntimeError as exc:
            if not str(exc).startswith("Deploying application"):
                raise
            # Serve's messages hold the replicas' whole tracebacks: one line instead.
            logger.error(
                "the application failed to deploy: %s; stopping (the replicas' tracebacks "
                "are above)",
                deploy_error(exc, _deployment_messages()),
            )
            return 1
        finally:
            deploying = False
        take_signals()
        if wait_ready(url, stop_event):
            # Belt and braces for require_keys (on whenever `spur serve` found keys): an
            # ingress that ignores it (older spur code on a joined cluster's nodes) and
            # found no keys would serve everything open. Never announce that.
            if cfg.server.auth.require_keys and serves_without_a_key(url):
                logger.error(
                    "%s/admin/config answers without a key although server.auth.require_keys "
                    "is on: the ingress found no keys and ignored the setting (is this spur "
                    "version installed on every node?); stopping",
                    url,
                )
                return 1
            announce(url)
        while not stop_event.is_set():
            stop_event.wait(0.2)
        try:
            drain(cfg, "the server received a stop signal")
        except KeyboardInterrupt:
            hurried = True
    finally:
        try:
            if not hurried:
                try:
                    stop(cfg)
                except KeyboardInterrupt:
                    hurried = True
            if hurried:
                stop(cfg, wait=False)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    return 0
