"""The flat engine defaults snapshot (configs/engine_defaults.json) is generated from
the schema and used only where pydantic is missing (EngineArgs.of on a bare GPU
machine): it must say exactly what the schema says."""

from __future__ import annotations

import pytest

from spur.actors.builder import EngineArgs
from spur.configs import engine_args


def test_snapshot_is_fresh() -> None:
    assert engine_args.main(["--check"]) == 0, (
        "configs/engine_defaults.json is stale: python -m spur.configs.engine_args --write"
    )


def test_args_without_pydantic_equal_the_schemas() -> None:
    assert EngineArgs._of_snapshot({}) == EngineArgs.of()
    flat = {"max_num_seqs": 7, "block_size": 32, "model": "x"}
    assert EngineArgs._of_snapshot(flat) == EngineArgs.of(**flat)
    with pytest.raises(ValueError, match=r"max_num_seq.*valid ones"):
        EngineArgs._of_snapshot({"max_num_seq": 7})
