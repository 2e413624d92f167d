"""Ray shell of the workers: one actor per device (TP rank), and the executor
that drives them.

The engine replica is deployed with placement-group bundles (bundle 0 for the
replica, bundles 1..TP for the workers, STRICT_PACK: one node). `RayExecutor`
places worker i in bundle i + 1 of the replica's own placement group; outside
a placement group it creates one, targeted at the current node.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from spur.actors.step import Executor, ModelRunnerOutput, SchedulerOutput
from spur.actors.worker.worker import Worker, WorkerConfig

logger = logging.getLogger(__name__)


class WorkerActor:
    """A `Worker` behind a Ray actor; `call` runs one of its methods."""

    def __init__(self, config: WorkerConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.worker: Worker | None = None

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def start(self, dist_init_method: str) -> None:
        self.worker = Worker(self.config, rank=self.rank, dist_init_method=dist_init_method)
        self.worker.init_device()

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self.worker is not None, "start() first"
        return getattr(self.worker, method)(*args, **kwargs)


def worker_bundles(config: WorkerConfig) -> list[dict[str, float]]:
    """Placement-group bundles for an engine replica and its TP workers."""
    gpu = 1.0 if config.device == "cuda" else 0.0
    per_worker = {"CPU": 1.0, "GPU": gpu} if gpu else {"CPU": 0.5}
    return [{"CPU": 0.5}] + [dict(per_worker) for _ in range(config.tensor_parallel_size)]


class RayExecutor(Executor):
    """TP worker actors on this node, joined by torch.distributed."""

    def __init__(self, config: WorkerConfig) -> None:
        tp = config.tensor_parallel_size
        pg = get_current_placement_group()
        offset = 1
        self._own_pg = None
        if pg is None:
            bundles = worker_bundles(config)[1:]
            node = ray.get_runtime_context().get_node_id()
            pg = placement_group(bundles, strategy="STRICT_PACK", _soft_target_node_id=node)
            ray.get(pg.ready(), timeout=120)
            self._own_pg, offset = pg, 0
        gpu = 1 if config.device == "cuda" else 0
        remote = ray.remote(WorkerActor)
        self.workers = [
            remote.options(
                num_cpus=0,
                num_gpus=gpu,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank + offset
                ),
            ).remote(config, rank)
            for rank in range(tp)
        ]
        ip = ray.get(self.workers[0].node_ip.remote())
        port = ray.get(self.workers[0].free_port.remote())
        ray.get([w.start.remote(f"tcp://{ip}:{port}") for w in self.workers])

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if not isinstance(method, str):
            raise TypeError("RayExecutor calls worker methods by name")
        return ray.get([w.call.remote(method, args, kwargs or {}) for w in self.workers])

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def shutdown(self) -> None:
        for w in getattr(self, "workers", []):
            ray.kill(w)
        self.workers = []
        if self._own_pg is not None:
            ray.util.remove_placement_group(self._own_pg)
            self._own_pg = None
