"""`spur bench autoscale`: a step load (low -> high -> none) on a lane that autoscales
between 1 and 2 replicas on Ray's fake multi-node provider (spur.cluster.fake_cluster),
each replica on a worker node the autoscaler launches and later terminates.

Reported (JSON):
    scale_up_s          load step -> the second replica has served a request
    goal_scale_up_s     the configured upscale_delay_s + one engine start (the first
                        replica's start, measured in the same run)
    node_terminated_s   high load's end (the step down to `low`) -> the extra worker
                        node is gone
    replica_down_s      high load's end -> the lane is back to one replica (the
                        scale-down starts there: `low` streams fit one replica)
    requests, failed    every request of the run; failed must be 0
    to_spare            requests the lane sent to a spare (none configured: 0)
    replica_seconds     integral of the lane's replicas over the load window, against
                        a fixed 2-replica deployment over the same window
    ttft_ms             p50 / p95 per load phase (no goal on 2 cores)

The pieces (ServeProcess, LoadDriver, LaneWatcher) are shared with the e2e test.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from spur.actors.ports import free_port
from spur.cluster.bench.cpu import cpu_info
from spur.cluster.bench.serve import sse_json
from spur.cluster.bench.stats import percentile
from spur.cluster.fake_cluster import FakeCluster, NodeType, alive_nodes, session_processes

logger = logging.getLogger(__name__)

READY_LINE = "spur is serving at "
NODE_RESOURCE = "spur-auto"


def autoscale_config(
    model: str,
    *,
    address: str,
    port: int,
    lane: str = "auto",
    max_replicas: int = 2,
    upscale_delay_s: float = 2.0,
    downscale_delay_s: float = 6.0,
    target_ongoing_requests: float = 4.0,
    drain_timeout_s: float = 20.0,
    engine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A spur config: one autoscaling lane pinned to the fake worker nodes, joining the
    cluster at `address`."""
    engine = engine or {
        "model": {"path": model, "dtype": "float32"},
        "cache": {"block_size": 16, "num_kv_blocks": 1024},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 1024},
        "parallelism": {"device": "cpu"},
        "runtime": {"num_threads": 1},
    }
    return {
        "version": 1,
        "lanes": [
            {
                "name": lane,
                "served_model_names": [lane],
                "engine": engine,
                "resources": {NODE_RESOURCE: 1},
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": max_replicas,
                    "upscale_delay_s": upscale_delay_s,
                    "downscale_delay_s": downscale_delay_s,
                    "look_back_period_s": 2.0,
                    "target_ongoing_requests": target_ongoing_requests,
                    "waiting_per_replica_high": 1.0,
                },
                "drain_timeout_s": drain_timeout_s,
                "max_ongoing_requests": 32,
                "max_queued_requests": 128,
            }
        ],
        "router": {"stats_period_s": 0.5},
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "ray_address": address,
            # The API stays on the head: worker nodes come and go.
            "ingress_resources": {"node:__internal_head__": 0.001},
        },
    }


def worker_node_type(max_workers: int = 2) -> NodeType:
    """The fake worker node: one CPU and the lane's resource."""
    return NodeType({"CPU": 1, NODE_RESOURCE: 1}, min_workers=0, max_workers=max_workers)


# -- spur serve as a subprocess ---------------------------------------------------------
@dataclass
class ServeProcess:
    """`spur serve CONFIG` in a session of its own, joined to a cluster."""

    config: dict[str, Any]
    workdir: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config['server']['port']}"

    def start(self) -> None:
        path = self.workdir / "spur.yaml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.log_path = self.workdir / "serve.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spur.cluster.cli", "serve", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.workdir,
                start_new_session=True,
            )

    def log(self, num_chars: int = 6000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until the ready line; raises RuntimeError with the log's tail."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            assert self.proc is not None
            if READY_LINE in self.log(10**7):
                return time.monotonic() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"spur serve exited {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.5)
        raise RuntimeError(f"spur serve not ready after {timeout_s:.0f} s:\n{self.log()}")

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """SIGTERM (a drain), wait; SIGKILL its session if needed. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        for pid in session_processes(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(10)


# -- load -------------------------------------------------------------------------------
@dataclass
class Outcome:
    phase: str
    ok: bool
    ttft_s: float | None
    tokens: int
    error: str | None = None


@dataclass
class LoadDriver:
    """`concurrency` client threads, each sending one streaming completion after the
    other (httpx); change `concurrency` at any time (extra threads park)."""

    url: str
    model: str
    max_tokens: int = 48
    max_threads: int = 32
    prompt: str = "Tell me a long story about a lighthouse keeper and the sea."
    concurrency: int = 0
    phase: str = "idle"
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(self.max_threads):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)

    def set(self, concurrency: int, phase: str) -> None:
        self.concurrency, self.phase = concurrency, phase

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _loop(self, i: int) -> None:
        with httpx.Client(timeout=120.0) as client:
            n = 0
            while not self._stop.is_set():
                if i >= self.concurrency:
                    time.sleep(0.05)
                    continue
                n += 1
                self.outcomes.append(self._one(client, f"{self.prompt} ({i}.{n})"))

    def _one(self, client: httpx.Client, prompt: str) -> Outcome:
        phase = self.phase
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.monotonic()
        ttft, tokens = None, 0
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    return Outcome(phase, False, None, 0, f"{resp.status_code} {resp.text[:200]}")
                for line in resp.iter_lines():
                    if (chunk := sse_json(line)) is None:
                        continue
                    if "error" in chunk:
                        return Outcome(phase, False, ttft, tokens, str(chunk["error"])[:200])
                    if any(c.get("text") for c in chunk.get("choices", ())):
                        ttft = ttft if ttft is not None else time.monotonic() - t0
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
        except httpx.HTTPError as exc:
            return Outcome(phase, False, ttft, tokens, f"{type(exc).__name__}: {exc}")
        ok = tokens == self.max_tokens
        return Outcome(phase, ok, ttft, tokens, None if ok else f"{tokens} tokens")


# -- what the lane and the cluster look like ----------------------------------------------
@dataclass
class Sample:
    t: float
    replicas: int
    """Healthy replicas of the lane in the KV index."""
    serving: int
    """Of those, replicas that have scheduled at least one request."""
    worker_nodes: int


@dataclass
class LaneWatcher:
    """Samples /admin/lanes and the cluster's alive worker nodes every `period_s`."""

    url: str
    lane: str
    address: str
    period_s: float = 0.5
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def _loop(self) -> None:
        with httpx.Client(timeout=10.0) as client:
            while not self._stop.is_set():
                with contextlib.suppress(Exception):
                    reps = client.get(f"{self.url}/admin/lanes").json()[self.lane]["replicas"]
                    healthy = [r for r in reps if r["healthy"]]
                    serving = [
                        r for r in healthy if r["prefix_queries_total"] > 0 or r["running"] > 0
                    ]
                    nodes = [
                        n for n in alive_nodes(self.address) if NODE_RESOURCE in n["resources"]
                    ]
                    self.samples.append(
                        Sample(time.monotonic(), len(healthy), len(serving), len(nodes))
                    )
                self._stop.wait(self.period_s)

    def wait(self, pred: Any, timeout_s: float, since: float | None = None) -> Sample | None:
        """The first sample with pred(sample) within `timeout_s`, else None: among new
        samples, or with `since` (a monotonic time) among those taken since then too."""
        deadline = time.monotonic() + timeout_s
        seen = len(self.samples)
        if since is not None:
            seen = next((i for i, s in enumerate(self.samples) if s.t >= since), seen)
        while time.monotonic() < deadline:
            for s in self.samples[seen:]:
                if pred(s):
                    return s
            seen = len(self.samples)
            time.sleep(0.2)
        return None


def routing_events(url: str) -> dict[str, int]:
    """(lane, event) counters of /admin/routing as "lane/event" -> count."""
    data = httpx.get(f"{url}/admin/routing", timeout=10).json()
    return {f"{e['lane']}/{e['name']}": int(e["count"]) for e in data.get("events", ())}


def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q * 100)


def run(
    *,
    model: str = "SmolLM2-135M-Instruct",
    low: int = 2,
    high: int = 16,
    low_s: float = 10.0,
    high_hold_s: float = 20.0,
    max_tokens: int = 48,
    upscale_delay_s: float = 2.0,
    downscale_delay_s: float = 6.0,
    idle_timeout_s: float = 6.0,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """The benchmark (see the module docstring). Starts and stops its own cluster."""
    cluster = FakeCluster({"spur-worker": worker_node_type()}, idle_timeout_s=idle_timeout_s)
    work = Path(tempfile.mkdtemp(prefix="spur-bench-autoscale-"))
    serve = None
    load = watcher = None
    try:
        address = cluster.start()
        config = autoscale_config(
            model,
            address=address,
            port=free_port(),
            upscale_delay_s=upscale_delay_s,
            downscale_delay_s=downscale_delay_s,
        )
        env = cluster.process_env()
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        serve = ServeProcess(config, work, env)
        serve.start()
        cold_start_s = serve.wait_ready(timeout_s)
        watcher = LaneWatcher(serve.url, "auto", address)
        watcher.start()
        events_before = routing_events(serve.url)
        load = LoadDriver(serve.url, "auto", max_tokens=max_tokens, max_threads=high)
        load.start()
        t_load = time.monotonic()
        load.set(low, "low")
        time.sleep(low_s)
        t_step = time.monotonic()
        load.set(high, "high")
        up = watcher.wait(lambda s: s.serving >= 2, timeout_s)
        t_up = up.t if up else None
        time.sleep(high_hold_s)
        load.set(low, "low2")
        t_low2 = time.monotonic()
        time.sleep(low_s)
        load.set(0, "end")
        t_end = time.monotonic()
        load.stop()
        # The scale-down may be over before the load ends: look from the step down.
        down = watcher.wait(lambda s: s.replicas <= 1, timeout_s, since=t_low2)
        gone = watcher.wait(lambda s: s.worker_nodes <= 1, timeout_s, since=t_low2)
        events = routing_events(serve.url)
        watcher.stop()
        window = [s for s in watcher.samples if t_load <= s.t <= (down.t if down else t_end)]
        replica_s = sum(a.replicas * (b.t - a.t) for a, b in itertools.pairwise(window))
        span = window[-1].t - window[0].t if len(window) > 1 else 0.0
        outcomes = load.outcomes
        ttft: dict[str, Any] = {}
        for phase in ("low", "high", "low2"):
            vals = [o.ttft_s * 1000 for o in outcomes if o.phase == phase and o.ttft_s]
            ttft[phase] = {"p50": _pct(vals, 0.5), "p95": _pct(vals, 0.95), "n": len(vals)}
        failed = [o for o in outcomes if not o.ok]
        spare = sum(v for k, v in events.items() if k.endswith("/fallback")) - sum(
            v for k, v in events_before.items() if k.endswith("/fallback")
        )
        return {
            "model": model,
            "cpu": cpu_info(),
            "load": {"low": low, "high": high, "max_tokens": max_tokens},
            "cold_start_s": round(cold_start_s, 1),
            "upscale_delay_s": upscale_delay_s,
            "scale_up_s": round(t_up - t_step, 1) if t_up else None,
            "goal_scale_up_s": round(upscale_delay_s + cold_start_s, 1),
            "replica_down_s": round(down.t - t_low2, 1) if down else None,
            "node_terminated_s": round(gone.t - t_low2, 1) if gone else None,
            "requests": len(outcomes),
            "failed": len(failed),
            "failures": [o.error for o in failed[:5]],
            "to_spare": spare,
            "replica_seconds": {
                "autoscaled": round(replica_s, 1),
                "fixed_2": round(2 * span, 1),
                "window_s": round(span, 1),
            },
            "ttft_ms": ttft,
            "events": {k: v - events_before.get(k, 0) for k, v in events.items()},
        }
    finally:
        if load is not None:
            load.stop()
        if watcher is not None:
            watcher.stop()
        if serve is not None:
            serve.stop()
        cluster.shutdown()
