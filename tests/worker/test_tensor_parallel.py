"""TP=2 over gloo on CPU gives the same logits as TP=1.

Two processes (torch.multiprocessing spawn) each load the tiny checkpoint
with tp_size=2 and run a flattened mixed batch through the paged KV path; each
rank must produce the full-vocabulary logits of the same model at tp_size=1.
Covered: head-split attention, KV-head replication (1 KV head over 2 ranks),
a vocabulary that does not split evenly (padded shards), tied and untied heads,
fused qkv / gate_up loading, and the row-parallel all-reduce.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
STEPS = [
    [(0, 6), (1, 5), (2, 3)],  # prefill chunks
    [(1, 1), (0, 4), (2, 1)],  # decode + rest of a prefill + one-token chunk
    [(0, 1), (1, 1), (2, 1)],  # decodes
]


def _seqs(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (11, 7, 5)]


def _run(model: torch.nn.Module, seqs: list[list[int]], block_size: int = 4) -> torch.Tensor:
    """Logits of every scheduled token over STEPS, concatenated in step order."""
    from spur.kernels import build_attention_metadata

    shape = model.kv_cache_shape(32, block_size)
    kv = [torch.zeros(shape) for _ in range(model.num_attention_layers)]
    tables = [[9, 3, 14, 0], [7, 1], [30, 22]]
    computed = [0] * len(seqs)
    out = []
    for step in STEPS:
        ids = [t for r, n in step for t in seqs[r][computed[r] : computed[r] + n]]
        pos = [p for r, n in step for p in range(computed[r], computed[r] + n)]
        md = build_attention_metadata(
            [computed[r] for r, _ in step],
            [n for _, n in step],
            [tables[r] for r, _ in step],
            block_size,
            num_padded_tokens=len(ids) + 2,
        )
        with torch.inference_mode():
            hidden = model(torch.tensor([*ids, 0, 0]), torch.tensor([*pos, 0, 0]), kv, md)
            out.append(model.compute_logits(hidden[: len(ids)]))  # [n, vocab]
        for r, n in step:
            computed[r] += n
    return torch.cat(out)


def _worker(rank: int, init_file: str, paths: dict[str, str]) -> None:
    torch.set_num_threads(1)
    os.environ["HF_HUB_OFFLINE"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from spur.actors.worker.loader import load_model

        for name, path in paths.items():
            tp = load_model(path, dtype=torch.float32, device="cpu", tp_rank=rank, tp_size=WORLD)
            ref = load_model(path, dtype=torch.float32, device="cpu")
            vocab = ref.config.vocab_size
            assert tp.model.num_kv_heads_per_rank == max(1, ref.config.num_key_value_heads // WORLD)
            seqs = _seqs(vocab)
            got, want = _run(tp.model, seqs), _run(ref.model, seqs)
            assert got.shape == want.shape == (sum(n for s in STEPS for _, n in s), vocab)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{name} rank {rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_file(tmp_path: Path) -> str:
    # file:// rendezvous needs a path that does not exist yet.
    return str(tmp_path / f"dist_init_{socket.gethostname()}_{os.getpid()}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tp2_logits_equal_tp1(tmp_path, tiny_model_dir):
    paths = {name: str(tiny_model_dir(name)) for name in ("llama", "llama_tied", "qwen3_tp")}
    mp.spawn(_worker, args=(_free_file(tmp_path), paths), nprocs=WORLD, join=True)


def test_tp_group_requires_initialised_distributed():
    from spur.actors.worker.layers.parallel_state import TPGroup

    with pytest.raises(ValueError, match="rank 2 / size 2 is invalid"):
        TPGroup(rank=2, size=2)
    if not dist.is_initialized():
        with pytest.raises(ValueError, match=r"init_process_group"):
            TPGroup(rank=0, size=2)


def _fake_groups(monkeypatch: pytest.MonkeyPatch, size: int) -> list:
    """TPGroups for every rank of a `size`-way group, without a process group (no collectives)."""
    from spur.actors.worker.layers.parallel_state import TPGroup

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
    return [TPGroup(rank=r, size=size) for r in range(size)]


def test_qkv_shards_with_replicated_kv_heads(monkeypatch):
    """4 ranks, 8 query heads, 2 KV heads: KV head r // 2 lives on rank r."""
    from spur.actors.worker.layers.linear import QKVParallelLinear

    d, hidden = 3, 5
    q, k, v = torch.randn(8 * d, hidden), torch.randn(2 * d, hidden), torch.randn(2 * d, hidden)
    for tp in _fake_groups(monkeypatch, 4):
        layer = QKVParallelLinear(hidden, d, 8, 2, bias=False, tp=tp)
        for shard_id, w in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, w, shard_id)
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        kv_head = tp.rank // 2
        expected = torch.cat(
            [
                q[tp.rank * 2 * d : (tp.rank + 1) * 2 * d],
                k[kv_head * d : (kv_head + 1) * d],
                v[kv_head * d : (kv_head + 1) * d],
            ]
        )
        assert torch.equal(layer.weight, expected), tp.rank


def test_column_row_and_vocab_shards_reassemble(monkeypatch):
    from spur.actors.worker.layers.embedding import VocabParallelEmbedding
    from spur.actors.worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    gate, up, down = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)
    emb = torch.randn(10, 4)  # 10 rows over 4 ranks: 3 + 3 + 3 + 1 (+ 2 zero padding rows)
    gates, ups, downs, embs = [], [], [], []
    for tp in _fake_groups(monkeypatch, 4):
        gate_up = MergedColumnParallelLinear(4, [8, 8], bias=False, tp=tp)
        gate_up.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight_loader(gate_up.weight, up, 1)
        gates.append(gate_up.weight[:2])
        ups.append(gate_up.weight[2:])
        row = RowParallelLinear(8, 4, bias=False, tp=tp)
        row.weight_loader(row.weight, down)
        downs.append(row.weight)
        e = VocabParallelEmbedding(10, 4, tp=tp)
        e.weight_loader(e.weight, emb)
        embs.append(e.weight)
    assert torch.equal(torch.cat(gates), gate)
    assert torch.equal(torch.cat(ups), up)
    assert torch.equal(torch.cat(downs, dim=1), down)
    assert torch.equal(torch.cat(embs)[:10], emb)
    assert not torch.cat(embs)[10:].any()


class _CollectiveWorker:
    """Mixed into `Worker` below: `fail_on(rank)` raises on that rank while every
    other rank waits for it in a barrier (a rank's OOM in the middle of a step);
    rank -1 makes every rank raise (a bad argument)."""

    def fail_on(self, rank: int) -> int:
        if rank in (-1, self.rank):
            raise RuntimeError(f"boom on rank {self.rank}")
        dist.barrier()
        return self.rank


def _collective_worker_cls() -> type:
    from spur.actors.worker.worker import Worker

    return type("CollectiveWorker", (_CollectiveWorker, Worker), {"__module__": __name__})


CollectiveWorker = _collective_worker_cls()


@pytest.mark.timeout(300)
def test_multiproc_executor_stops_the_group_when_one_rank_fails():
    """One rank's exception must not leave its peers in a collective until gloo's
    30-minute timeout: the call fails at once, naming the rank and its error, the
    worker processes are gone, and later calls say why. A failure on every rank
    (a bad argument) leaves the executor usable."""
    from spur.actors.worker.executors import MultiprocExecutor, WorkerError
    from spur.actors.worker.worker import WorkerConfig

    config = WorkerConfig(model="(never loaded)", tensor_parallel_size=WORLD, num_threads=1)
    ex = MultiprocExecutor(config, worker_cls=CollectiveWorker)
    try:
        assert ex.collective_rpc("fail_on", (WORLD,)) == [0, 1]  # no rank fails
        with pytest.raises(WorkerError, match="boom on rank 0") as every:
            ex.collective_rpc("fail_on", (-1,))
        assert "boom on rank 1" in str(every.value)
        assert len(ex.collective_rpc("ping")) == WORLD  # still usable
        procs = list(ex.procs)
        ex.failure_grace_s = 1.0
        with pytest.raises(WorkerError) as one:
            ex.collective_rpc("fail_on", (1,))
        message = str(one.value)
        assert "rank 1: Traceback" in message and "boom on rank 1" in message
        assert "rank 0: no answer 1 s after the failure" in message
        assert not any(p.is_alive() for p in procs)
        gone = r"stopped after a failure \(rank 1: boom on rank 1\); create a new LLM"
        with pytest.raises(WorkerError, match=gone):
            ex.collective_rpc("ping")
    finally:
        ex.shutdown()
