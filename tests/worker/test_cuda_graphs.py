"""Decode CUDA graphs: the plan (sizes, padding) and the padded-buffer path.

Capture itself needs a GPU (the last test, skipped here). On CPU the runner's
graph path runs eagerly through the same persistent, padded buffers
(`capture=False`), so the plan, the padding and the buffer reuse across steps of
different batch sizes are checked against the ordinary eager path, token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from spur import SamplingParams
from spur.actors.llm import LLM
from spur.actors.worker.cuda_graphs import GraphPlan, HostBuffers, capture_sizes, fill_padded
from spur.actors.worker.input_batch import StepInputs


def test_default_sizes_and_requested_sizes():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(16, [16, 4, 4, 100]) == (4, 16)  # de-duplicated, 100 dropped
    with pytest.raises(ValueError, match=">= 1"):
        capture_sizes(16, [0, 4])


def _step(tables: list[list[int]], positions: list[int], *, query_lens=None, drafts=None):
    """A StepInputs of len(tables) requests (decodes unless query_lens says otherwise)."""
    n = len(tables)
    qlens = query_lens or [1] * n
    total = sum(qlens)
    width = max(len(t) for t in tables)
    table = np.zeros((n, width), np.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = t
    return StepInputs(
        req_ids=[f"r{r}" for r in range(n)],
        input_ids=np.arange(100, 100 + total, dtype=np.int64),
        positions=np.asarray(positions[:total], np.int64),
        slot_mapping=np.arange(7, 7 + total, dtype=np.int64),
        query_start_loc=np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32),
        seq_lens=np.asarray([p + 1 for p in positions[:n]], np.int32),
        block_table=table,
        logits_indices=np.arange(total, dtype=np.int64),
        sampling_req_ids=[f"r{r}" for r in range(n)],
        drafts=drafts or {},
        num_tokens=total,
        max_query_len=max(qlens),
        max_seq_len=max(positions[:n]) + 1,
    )


def test_plan_picks_the_smallest_size_that_fits_and_only_for_decodes():
    plan = GraphPlan.build(max_num_seqs=8, max_model_len=40, block_size=4, requested=[1, 2, 4, 8])
    assert plan.max_blocks_per_req == 10
    assert [plan.padded_size(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [None, 1, 2, 4, 8, 8, None]
    decode = _step([[3, 4], [5]], [6, 2])
    assert plan.size_for(decode) == 2
    assert plan.size_for(_step([[3, 4], [5]], [5, 6, 2], query_lens=[2, 1])) is None  # prefill
    assert plan.size_for(_step([[3]], [1], drafts={"r0": [9]})) is None  # a verify step
    too_wide = _step([list(range(1, 12))], [41])  # 11 blocks > 10 columns
    assert plan.size_for(too_wide) is None
    with pytest.raises(ValueError, match="ascending"):
        GraphPlan((4, 2), 3)


def test_padding_rows_are_null_requests_and_stale_columns_stay_unwritten():
    plan = GraphPlan.build(max_num_seqs=8, max_model_len=32, block_size=4, requested=[4, 8])
    buf = HostBuffers.zeros(plan)
    # A wide batch of 6 first, then a narrow batch of 3 in the same buffers.
    wide = _step([[1, 2, 3, 4, 5]] * 6, [17, 18, 16, 19, 17, 18])
    assert fill_padded(buf, wide, 8) == 5
    narrow = _step([[7], [8, 9], [6]], [2, 5, 0])
    assert fill_padded(buf, narrow, 4) == 2
    assert buf.input_ids[:4].tolist() == [100, 101, 102, 0]
    assert buf.positions[:4].tolist() == [2, 5, 0, 0]
    assert buf.slot_mapping[:4].tolist() == [7, 8, 9, -1]  # the padding row stores nothing
    assert buf.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    assert buf.seq_lens[:4].tolist() == [3, 6, 1, 1]  # padding attends to position 0 ...
    assert buf.block_table[:4, :2].tolist() == [[7, 0], [8, 9], [6, 0], [0, 0]]  # ... of block 0
    # Columns past the step's width keep the wide batch's ids: nothing reads them.
    assert buf.block_table[0, 2:5].tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="does not fit"):
        fill_padded(buf, wide, 4)


# --------------------------------------------------------------------------- end to end


def _generate(model_dir: Path, graphs: dict | None, prompts, params) -> tuple[list, dict]:
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=96,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    try:
        report = {}
        runner = llm.executor.worker.runner
        if graphs is not None:
            report = runner.capture_decode_graphs(
                llm.scheduler.config.max_model_len, 8, graphs["sizes"], capture=False
            )
        outs = llm.generate(prompts, params)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        report["steps_by_size"] = dict(runner.graphs.steps_by_size) if runner.graphs else {}
        report["null_block_zero"] = all(
            not cache[:, 0].any() for cache in runner.kv_caches
        )  # padding rows never write (the null block is never handed out)
        llm.scheduler.check_integrity()
    finally:
        llm.shutdown()
    return tokens, report


def test_padded_decode_path_gives_the_eager_tokens(tiny_model_dir: Callable[[str], Path]):
    """Seven requests of different prompt and output lengths: the decode batch shrinks
    from 7 to 1 as they finish, so steps pad to 8, 4, 2 and 1 in the same buffers."""
    gen = torch.Generator().manual_seed(3)
    lens = [5, 17, 9, 30, 3, 12, 22]
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]
    outs = [3, 11, 6, 16, 1, 8, 20]
    params = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in outs]
    # One sampled request: its seeded generator must advance the same way on both paths.
    params[2] = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    path = tiny_model_dir("llama")
    eager, eager_report = _generate(path, None, prompts, params)
    padded, report = _generate(path, {"sizes": [1, 2, 4, 8]}, prompts, params)
    assert report["enabled"] and not report["captured"]  # emulated: CPU has no capture
    assert padded == eager
    assert [len(t) for t in padded] == outs
    used = report["steps_by_size"]
    assert {1, 2, 4, 8} <= set(used), used  # every size served steps, one buffer set
    assert eager_report["steps_by_size"] == {}
    assert report["null_block_zero"] and eager_report["null_block_zero"]


def test_cpu_engine_ignores_cuda_graphs_unless_emulated(tiny_model_dir, caplog):
    """`cuda_graphs` is on by default: on CPU the engine logs that it ignores it."""
    import logging

    with caplog.at_level(logging.INFO, logger="spur.actors.builder"):
        llm = LLM(str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=32)
    try:
        assert llm.executor.worker.runner.graphs is None
        assert any("CUDA graphs: ignored on cpu" in r.getMessage() for r in caplog.records)
        runner = llm.executor.worker.runner
        report = runner.capture_decode_graphs(64, 8, capture=True)  # asked for, impossible
        assert not report["enabled"] and "CUDA device" in report["reason"]
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_give_the_eager_tokens_on_cuda(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40)), [7] * 9]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = []
    for graphs in (False, True):
        llm = LLM(str(path), dtype="float32", device="cuda", cuda_graphs=graphs, num_kv_blocks=64)
        try:
            runner = llm.executor.worker.runner
            assert (runner.graphs is not None) == graphs
            results.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
            if graphs:
                assert runner.graphs.graphs and sum(runner.graphs.steps_by_size.values()) > 0
        finally:
            llm.shutdown()
    assert results[0] == results[1]
