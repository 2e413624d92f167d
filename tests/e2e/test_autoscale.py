"""Autoscaling end to end on Ray's fake multi-node provider (spur.cluster.fake_cluster):
a head plus a worker node type that the autoscaler launches and terminates, the tiny
model, `spur serve` joined to that cluster.

A load ramp with the official client scales the lane from 1 to 2 replicas on a new
node; when the load falls it scales back to 1 and the extra node is terminated; no
request fails across both transitions (a light load keeps running through the
scale-down); the removal is planned (no failover, no failure mark); prefix hits go on
on the surviving replica.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from spur.actors.ports import free_port
from spur.cluster.bench.autoscale import (
    LaneWatcher,
    ServeProcess,
    autoscale_config,
    routing_events,
    worker_node_type,
)
from spur.cluster.fake_cluster import FakeCluster

from .conftest import _tiny_engine

pytestmark = pytest.mark.slow

LONG_PROMPT = " ".join(f"word{i}" for i in range(120))


class Load:
    """`n` threads of the official client, streaming completions one after the other."""

    def __init__(self, url: str) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120.0)
        self.active = 0
        self.done = 0
        self.failures: list[str] = []
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self, max_threads: int) -> None:
        for i in range(max_threads):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True)
            t.start()
            self.threads.append(t)

    def _loop(self, i: int) -> None:
        n = 0
        while not self.stop_event.is_set():
            if i >= self.active:
                time.sleep(0.05)
                continue
            n += 1
            try:
                stream = self.client.completions.create(
                    model="auto",
                    prompt=f"load {i} {n}",
                    max_tokens=48,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                usage = [chunk.usage for chunk in stream if chunk.usage is not None]
                if not usage or usage[-1].completion_tokens != 48:
                    self.failures.append(f"incomplete: {usage}")
                self.done += 1
            except Exception as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(120)


def test_lane_scales_out_and_back_on_new_nodes(tiny_model_dir: Path, tmp_path: Path) -> None:
    cluster = FakeCluster({"spur-worker": worker_node_type()}, idle_timeout_s=6.0)
    serve = watcher = load = None
    try:
        address = cluster.start()
        engine = _tiny_engine(tiny_model_dir)
        engine["scheduler"]["max_num_seqs"] = 4  # a small batch: 12 streams queue
        config = autoscale_config(
            str(tiny_model_dir), address=address, port=free_port(), engine=engine
        )
        env = cluster.process_env()
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        serve = ServeProcess(config, tmp_path, env)
        serve.start()
        serve.wait_ready(240)
        watcher = LaneWatcher(serve.url, "auto", address)
        watcher.start()
        first = watcher.wait(lambda s: True, 30)
        assert first is not None and (first.replicas, first.worker_nodes) == (1, 1), first

        load = Load(serve.url)
        load.client.completions.create(model="auto", prompt=LONG_PROMPT, max_tokens=1)
        load.start(12)
        load.active = 12
        up = watcher.wait(lambda s: s.serving >= 2 and s.worker_nodes >= 2, 240)
        assert up is not None, (watcher.samples[-3:], serve.log())
        load.active = 1  # light load through the scale-down
        down = watcher.wait(lambda s: s.replicas == 1 and s.worker_nodes == 1, 240)
        assert down is not None, (watcher.samples[-3:], serve.log())
        load.stop()
        assert not load.failures, load.failures[:5]
        assert load.done > 12

        events = routing_events(serve.url)
        assert events.get("auto/planned_leave", 0) >= 1, events
        for bad in ("replica_failed", "failover", "to_spare", "fallback"):
            assert not events.get(f"auto/{bad}"), events

        # Prefix caching goes on on the surviving replica.
        load.client.completions.create(model="auto", prompt=LONG_PROMPT, max_tokens=1)
        again = load.client.completions.create(model="auto", prompt=LONG_PROMPT, max_tokens=1)
        details = again.usage.prompt_tokens_details
        assert details is not None and (details.cached_tokens or 0) >= 64, again.usage
    finally:
        if load is not None:
            load.stop()
        if watcher is not None:
            watcher.stop()
        code = serve.stop() if serve is not None else 0
        cluster.shutdown()
    assert code == 0, serve.log() if serve else ""
