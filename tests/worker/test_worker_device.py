"""Which CUDA device a TP worker uses. Ray narrows each worker actor's
CUDA_VISIBLE_DEVICES to the one GPU it gives it, so rank r must use device 0 of its
process, not cuda:r (an invalid ordinal for every rank but 0). Ray runs here with
two logical GPUs: it assigns and narrows them as on a GPU node."""

from __future__ import annotations

import pytest
import torch

from spur.actors.worker.actor import WorkerActor, local_cuda_index
from spur.actors.worker.worker import Worker, WorkerConfig


def test_the_local_index_of_the_gpu_ray_gave() -> None:
    assert local_cuda_index([], None) is None  # no GPU: the worker's rank stands
    assert local_cuda_index(["3"], "3") == 0  # narrowed: its own GPU is device 0
    assert local_cuda_index([3], None) == 3  # not narrowed: the id is the index
    assert local_cuda_index(["1"], "0, 1") == 1


def test_a_worker_uses_its_local_device_not_its_rank() -> None:
    config = WorkerConfig(model="unused", device="cuda", tensor_parallel_size=2)
    assert Worker(config, rank=1).device == torch.device("cuda", 1)  # sees every GPU
    assert Worker(config, rank=1, local_rank=0).device == torch.device("cuda", 0)
    pinned = WorkerConfig(model="unused", device="cuda:1")
    assert Worker(pinned, rank=0, local_rank=0).device == torch.device("cuda", 1)


def test_ray_worker_actors_each_get_device_0_of_their_own_gpu() -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(WorkerActor)
        config = WorkerConfig(model="unused", device="cuda", tensor_parallel_size=2)
        actors = [remote.options(num_cpus=0, num_gpus=1).remote(config, r) for r in (0, 1)]
        seen = ray.get(
            [
                a.__ray_call__.remote(lambda self: (self.local_rank, ray.get_gpu_ids()))
                for a in actors
            ]
        )
        assert [local for local, _ in seen] == [0, 0]
        assert sorted(str(ids[0]) for _, ids in seen) == ["0", "1"]  # two different GPUs
    finally:
        ray.shutdown()
