"""A spare serves several lanes: each request's series (tokens, finishes, latency
histograms) carry the lane it came for (the `lane` of the engine payload), so that
a dashboard's `$lane = chat` keeps chat's traffic while chat runs on its spare.
Its engine's own series (running, waiting, KV, capacity) stay on the spare's name.
Only the lanes the spare serves become labels. A real AsyncEngine (fake executor)
behind the replica's own `generate`."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.helpers import make_engine, prompts

from spur.actors.engine.shell.actor import EngineReplica
from spur.actors.engine.shell.async_engine import AsyncEngine
from spur.actors.engine.shell.metrics import EngineMetrics
from spur.cluster.metrics import MetricsStore, render
from spur.configs.loader import config_to_dict, parse_config

from .test_render import samples

CONFIG = config_to_dict(
    parse_config(
        {
            "version": 1,
            "lanes": [
                {"name": "chat", "served_model_names": ["smol", "chat"]},
                {"name": "reasoning", "served_model_names": ["think"]},
            ],
            "spare": {"name": "spare", "serves_lanes": ["chat", "reasoning"]},
        }
    )
)


def serve_on_spare(lanes: list[str | None]) -> dict[str, Any]:
    """Run one request per entry of `lanes` (its payload's lane; None: no lane field)
    through a spare replica's `generate`; returns the engine's metrics snapshot."""

    async def main() -> dict[str, Any]:
        core, _, _ = make_engine(block_size=4, num_blocks=64, budget=24)
        engine = AsyncEngine(core, None, eos_token_id=None, metrics=EngineMetrics(max_model_len=64))
        replica = EngineReplica.__new__(EngineReplica)  # the shell without Serve or a model
        replica.engine, replica.lane, replica.replica_id = engine, "spare", "spare-1"
        replica.draining_since, replica._tokens = None, 0

        async def one(i: int, lane: str | None, tokens: list[int]) -> None:
            payload: dict[str, Any] = {
                "request_id": f"r{i}",
                "prompt_token_ids": tokens,
                "sampling_params": {"max_tokens": 3 + i, "ignore_eos": True},
            }
            if lane is not None:
                payload["lane"] = lane
            items = [item async for item in replica.generate(payload)]
            assert items[-1]["type"] == "final", items

        work = prompts(len(lanes), 10)
        await asyncio.gather(*(one(i, lane, work[i]) for i, lane in enumerate(lanes)))
        assert engine.metrics is not None
        snapshot = engine.metrics.snapshot()
        await engine.shutdown()
        return snapshot

    return asyncio.run(main())


def test_a_spares_requests_carry_the_lane_they_came_for() -> None:
    snap = serve_on_spare(["chat", "chat", "reasoning", None, "spare", "elsewhere"])
    store = MetricsStore()
    store.update_engine("spare-1", "spare", snap)
    got = samples(render({"store": store.view()}, CONFIG).decode())

    def by_lane(name: str) -> dict[tuple[str, str, str], float]:
        out: dict[tuple[str, str, str], float] = {}
        for lab, v in got[name]:
            key = (lab["lane"], lab["model_name"], lab["serves"])
            out[key] = out.get(key, 0.0) + v
        return out

    # Two chat requests, one reasoning request; two of the spare's own (no lane, its
    # own name); one of a lane this config does not know (an ingress of another
    # config sent it): its own label, the lane's name as its model's.
    assert by_lane("vllm:request_success_total") == {
        ("chat", "smol", "chat,reasoning"): 2.0,
        ("reasoning", "think", "chat,reasoning"): 1.0,
        ("spare", "smol", "chat,reasoning"): 2.0,
        ("elsewhere", "elsewhere", "chat,reasoning"): 1.0,
    }
    counts = by_lane("vllm:time_to_first_token_seconds_count")
    assert counts[("chat", "smol", "chat,reasoning")] == 2.0
    assert counts[("reasoning", "think", "chat,reasoning")] == 1.0
    generated = by_lane("vllm:generation_tokens_total")
    assert generated[("chat", "smol", "chat,reasoning")] == 3 + 4
    assert generated[("reasoning", "think", "chat,reasoning")] == 5
    assert sum(generated.values()) == sum(3 + i for i in range(6))
    # The engine's own series stay on the spare's name, once.
    assert {lab["lane"] for lab, _ in got["vllm:num_requests_running"]} == {"spare"}
    assert {lab["lane"] for lab, _ in got["vllm:iteration_tokens_total_count"]} == {"spare"}
    assert {lab["lane"] for lab, _ in got["vllm:num_preemptions_total"]} == {"spare"}


def test_reported_lanes_are_labels_whatever_the_config_and_served_ones_start_at_0() -> None:
    """Every lane an engine reports is a label of its own, whichever ingress renders
    it (a counter must not move between series, and so go down, with the rendering
    replica's config); the lanes a spare serves exist at 0 before its first request
    of them (Prometheus's rate() misses a series that first appears above 0)."""
    m = EngineMetrics(max_model_len=64)
    for rid, lane in (("a", "reasoning"), ("b", None)):
        m.on_add(rid, 10, lane=lane)
        m.finish(rid, "stop")
    snap = m.snapshot()
    assert set(snap["lanes"]) == {"reasoning"}
    store = MetricsStore()
    store.update_engine("chat-1", "chat", snap)  # a primary's report, as an example
    got = samples(render({"store": store.view()}, CONFIG).decode())
    success = sorted((lab["lane"], v) for lab, v in got["vllm:request_success_total"] if v)
    assert success == [("chat", 1.0), ("reasoning", 1.0)]

    store = MetricsStore()
    store.update_engine("spare-1", "spare", EngineMetrics(max_model_len=64).snapshot())
    got = samples(render({"store": store.view()}, CONFIG).decode())
    lanes = {lab["lane"] for lab, _ in got["vllm:request_success_total"]}
    assert lanes == {"spare", "chat", "reasoning"}
    for name in ("vllm:request_success_total", "vllm:e2e_request_latency_seconds_count"):
        assert all(v == 0 for _, v in got[name]), name
    chat_reasons = {
        lab["finished_reason"]
        for lab, _ in got["vllm:request_success_total"]
        if lab["lane"] == "chat"
    }
    assert chat_reasons == {"stop", "length", "abort"}
    steps = {lab["lane"] for lab, _ in got["vllm:iteration_tokens_total_count"]}
    assert steps == {"spare"}  # per-step series: the engine's own lane only
