"""What the ingress learns of a lane from its engines' stats (`Ingress._init_lane`):
the limits and sampling defaults come from the primaries; when only the spare answers
at the lane's first request they come from the spare, and are read again from a
primary once one answers. Ray is not started: the ingress's `_stats` is replaced by
a table of what each deployment answers."""

from __future__ import annotations

import asyncio
import types
from pathlib import Path
from typing import Any

import pytest

from spur.actors.generation_config import SamplingDefaults
from spur.cluster.ingress import Ingress
from spur.cluster.lanes import Lane, LaneSelector


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out)
    return out


def _stats(tok: Path, max_model_len: int, temperature: float) -> dict[str, Any]:
    defaults = SamplingDefaults({"temperature": temperature, "max_tokens": 5})
    return {
        "max_model_len": max_model_len,
        "model_dir": str(tok),
        "tokenizer_dir": str(tok),
        "sampling_defaults": defaults.to_dict(),
    }


def _fake_ingress(answers: dict[str, Any]) -> Any:
    """What `_init_lane` and `_relearn_soon` use of an Ingress; `answers[name]` is what
    deployment `name` answers to a stats call (None: no replica answers)."""

    async def _stats(name: str, timeout_s: float = 10.0, *, quiet: bool = False) -> Any:
        return answers[name]

    fake = types.SimpleNamespace(
        selector=LaneSelector(
            ["chat"], spare_of={"chat": "spare"}, saturation={}, healthy_after_s=1
        ),
        draining=None,
        _stats=_stats,
        _token_bytes={},
        monitor=types.SimpleNamespace(
            lanes={"spare": Lane("spare", None, {"block_size": 8, "hash_seed": "t"})}
        ),
    )
    fake._relearn_soon = lambda lane, retry_s=2.0: Ingress._relearn_soon(fake, lane, retry_s)
    fake._check_spare_vocab = lambda *args: Ingress._check_spare_vocab(fake, *args)
    # the real method: the tokenizer folders are on this node, so no engine is asked
    fake._engine_tokenizer = lambda name, tok_dir: Ingress._engine_tokenizer(fake, name, tok_dir)
    return fake


def test_limits_come_from_the_primaries_when_they_answer(tokenizer_dir: Path) -> None:
    answers = {"chat": _stats(tokenizer_dir, 96, 0.6), "spare": _stats(tokenizer_dir, 64, 0.2)}
    lane = Lane("chat", None, {"block_size": 8, "hash_seed": "t"})
    fake = _fake_ingress(answers)
    asyncio.run(Ingress._init_lane(fake, lane))  # type: ignore[arg-type]
    assert (lane.max_model_len, lane.sampling_defaults.values["temperature"]) == (96, 0.6)
    assert not lane.limits_from_spare
    # The spare's own limit is known before any failover (the opener fits requests to it).
    assert fake.monitor.lanes["spare"].max_model_len == 64


def test_limits_learned_from_the_spare_are_read_again_from_a_primary(
    tokenizer_dir: Path,
) -> None:
    answers: dict[str, Any] = {"chat": None, "spare": _stats(tokenizer_dir, 64, 0.2)}
    fake = _fake_ingress(answers)
    lane = Lane("chat", None, {"block_size": 8, "hash_seed": "t"})

    def state() -> tuple[int, float, bool]:
        temperature = lane.sampling_defaults.values["temperature"]
        return lane.max_model_len, temperature, lane.limits_from_spare

    async def scenario() -> list[tuple[int, float, bool]]:
        seen = []
        await Ingress._init_lane(fake, lane)  # type: ignore[arg-type]
        seen.append(state())
        fake._relearn_soon(lane, retry_s=0.0)  # the primaries are still down
        assert lane.relearn is not None
        await lane.relearn
        seen.append(state())
        assert lane.relearn is None
        answers["chat"] = _stats(tokenizer_dir, 96, 0.6)  # a primary is back
        fake._relearn_soon(lane, retry_s=60.0)
        first = lane.relearn
        fake._relearn_soon(lane, retry_s=60.0)  # one re-read at a time
        assert first is not None and lane.relearn is first
        await first
        seen.append(state())
        return seen

    assert asyncio.run(scenario()) == [(64, 0.2, True), (64, 0.2, True), (96, 0.6, False)]


def test_the_tokenizer_warm_up_names_modules_that_exist() -> None:
    """`start_tokenizer_import` skips a module that a transformers release moved, so
    the warm-up would shrink unnoticed: every name must import with the pinned one."""
    import importlib

    from spur.cluster import ingress

    for name in ingress._TOKENIZER_MODULES:
        importlib.import_module(name)


def test_a_tokenizer_load_waits_for_the_warm_up_import(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads importing transformers at once can leave it half-initialised: the
    lane's tokenizer loads only once the warm-up thread has ended."""
    import threading

    from spur.cluster import ingress

    gate = threading.Event()
    order: list[str] = []

    def warm_up() -> None:
        gate.wait(30)
        order.append("warm-up done")

    def load(tok_dir: str) -> Any:
        order.append("load")
        return object()

    thread = threading.Thread(target=warm_up, daemon=True)
    thread.start()
    monkeypatch.setattr(ingress, "_tokenizer_code", thread)
    # The method reads its names from Serve's copy of the module's globals.
    monkeypatch.setitem(Ingress._engine_tokenizer.__globals__, "_load_tokenizer", load)
    fake = _fake_ingress({})

    async def scenario() -> None:
        task = asyncio.ensure_future(fake._engine_tokenizer("chat", str(tokenizer_dir)))
        await asyncio.sleep(0)  # the task runs up to its wait
        assert not task.done() and order == []
        gate.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(scenario())
    assert order == ["warm-up done", "load"]
