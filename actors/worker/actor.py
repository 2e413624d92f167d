"""Ray shell of the workers: one actor per device (TP rank), and the executor
that drives them.

The engine replica is deployed with placement-group bundles (bundle 0 for the
replica, bundles 1..TP for the workers, STRICT_PACK: one node). `RayExecutor`
places worker i in bundle i + 1 of the replica's own placement group; outside
a placement group it creates one, targeted at the current node.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from spur.actors.ports import free_port
from spur.actors.step import Executor, ModelRunnerOutput, SchedulerOutput
from spur.actors.worker.worker import Worker, WorkerConfig
from spur.configs.env import cuda_visible_devices

logger = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """A TP worker actor of this engine is gone (its process was killed, or its node
    lost): the engine cannot step again and its replica must be replaced."""


def local_cuda_index(gpu_ids: list[Any], visible: str | None) -> int | None:
    """The index, among the CUDA devices this process sees, of the first GPU Ray gave
    it (`gpu_ids`, from `ray.get_gpu_ids()`); None when it gave none. Ray narrows
    `CUDA_VISIBLE_DEVICES` (`visible`) to an actor's GPUs, so its own is device 0;
    unnarrowed (unset), the id is the index."""
    if not gpu_ids:
        return None
    gpu = str(gpu_ids[0])
    if visible is None:
        return int(gpu)
    seen = [v.strip() for v in visible.split(",")]
    return seen.index(gpu) if gpu in seen else 0


class WorkerActor:
    """A `Worker` behind a Ray actor; `call` runs one of its methods. Its CUDA device
    is the GPU Ray gave it (`local_cuda_index`), not `cuda:<rank>`: rank 1 of a TP
    group sees one GPU, device 0."""

    def __init__(self, config: WorkerConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_cuda_index(ray.get_gpu_ids(), cuda_visible_devices())
        self.worker: Worker | None = None

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def where(self) -> tuple[str, int]:
        """(node id, pid) of this worker's process."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def free_port(self) -> int:
        """A port free on every interface of this node (rank 0's rendezvous)."""
        return free_port("")

    def start(self, dist_init_method: str) -> None:
        self.worker = Worker(
            self.config,
            rank=self.rank,
            dist_init_method=dist_init_method,
            local_rank=self.local_rank,
        )
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
    """TP worker actors on this node, joined by torch.distributed.

    A worker that dies (kill -9, OOM killer) must not hang the engine: its peers may
    sit in a collective waiting for it (gloo's timeout is 30 minutes), so
    `collective_rpc` returns as soon as any rank's call fails and raises `WorkerDied`
    (the engine thread then fails its requests with a retriable error), and
    `check_health` raises it too, for a worker that dies while the engine is idle
    (Serve's health check then replaces the replica, and the workers go with it)."""

    poll_s = 0.5
    """How often a call in flight checks its workers' processes."""

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
        self.pids = ray.get([w.where.remote() for w in self.workers])
        """(node id, pid) per rank: what `check_health` looks at."""
        self._node_id = ray.get_runtime_context().get_node_id()
        self._wait([w.start.remote(f"tcp://{ip}:{port}") for w in self.workers], "start")

    def check_health(self) -> None:
        """Raise `WorkerDied` if a worker's process on this node is gone. Cheap (no call
        to the workers, which may be busy in a step): workers on another node, which
        STRICT_PACK placement never makes, are not checked."""
        for rank, (node_id, pid) in enumerate(self.pids):
            if node_id != self._node_id:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise WorkerDied(
                    f"TP worker rank {rank} (pid {pid}) of this engine is gone: the "
                    "replica must be restarted"
                ) from None
            except PermissionError:  # exists, owned by someone else (pid reused)
                pass

    def _wait(self, refs: list[Any], method: str) -> list[Any]:
        """Results of one call per rank, in rank order; raises `WorkerDied` as soon as
        one rank's actor is dead or a worker process is gone, without waiting for the
        others (a worker's own exception is re-raised as `ray.get` raises it)."""
        pending = list(refs)
        while True:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
            if not pending:
                try:
                    return ray.get(refs)
                except ray.exceptions.RayActorError as exc:
                    raise WorkerDied(f"a TP worker died during {method!r}: {exc}") from exc
            for ref in done:  # rare: a rank finished long before the others
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise WorkerDied(
                        f"TP worker rank {refs.index(ref)} died during {method!r}: {exc}"
                    ) from exc
            self.check_health()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if not isinstance(method, str):
            raise TypeError("RayExecutor calls worker methods by name")
        refs = [w.call.remote(method, args, kwargs or {}) for w in self.workers]
        return self._wait(refs, method)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def shutdown(self) -> None:
        for w in getattr(self, "workers", []):
            ray.kill(w)
        self.workers = []
        if self._own_pg is not None:
            ray.util.remove_placement_group(self._own_pg)
            self._own_pg = None
