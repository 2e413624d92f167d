"""The `spur bench routing` workload and its oracle hit rate (pure Python, no Ray)."""

from __future__ import annotations

import json

import pytest

from spur.cluster.bench.workload import (
    WorkloadSpec,
    build_workload,
    describe,
    oracle_hit_rate,
    oracle_hit_tokens,
    oracle_order,
)


def test_same_seed_same_workload_other_seed_other_tokens() -> None:
    spec = WorkloadSpec()
    assert build_workload(spec) == build_workload(WorkloadSpec())
    other = build_workload(WorkloadSpec(seed=1))
    assert oracle_order(other) != oracle_order(build_workload(spec))


def test_prompt_structure() -> None:
    spec = WorkloadSpec(groups=2, users_per_group=3, rounds=4, system_prompt_tokens=40)
    scripts = build_workload(spec)
    assert len(scripts) == 6
    systems: dict[int, tuple[int, ...]] = {}
    for s in scripts:
        assert [t.round for t in s.turns] == list(range(spec.rounds))
        system = s.turns[0].prompt_token_ids[: spec.system_prompt_tokens]
        assert systems.setdefault(s.group, system) == system  # shared within a group
        for r, turn in enumerate(s.turns):
            assert (turn.group, turn.user) == (s.group, s.user)
            assert turn.max_tokens == len(turn.answer_token_ids) == spec.answer_tokens
            assert len(turn.prompt_token_ids) == (
                spec.system_prompt_tokens + (r + 1) * spec.question_tokens + r * spec.answer_tokens
            )
            assert turn.prompt_token_ids[: spec.system_prompt_tokens] == system
            assert all(1 <= t < spec.vocab_size for t in turn.prompt_token_ids)
        for prev, nxt in zip(s.turns, s.turns[1:], strict=False):
            history = prev.prompt_token_ids + prev.answer_token_ids
            assert nxt.prompt_token_ids[: len(history)] == history
    assert systems[0] != systems[1]  # groups do not share
    # Different users get different questions.
    firsts = {s.turns[0].prompt_token_ids for s in scripts}
    assert len(firsts) == len(scripts)


def test_start_times_poisson() -> None:
    spec = WorkloadSpec(
        groups=1,
        users_per_group=2000,
        rounds=1,
        system_prompt_tokens=0,
        question_tokens=1,
        answer_tokens=1,
        request_rate=8.0,
    )
    starts = [s.start_s for s in build_workload(spec)]
    assert starts[0] == 0.0
    assert starts == sorted(starts)
    mean_gap = starts[-1] / (len(starts) - 1)
    assert 0.85 / spec.request_rate < mean_gap < 1.15 / spec.request_rate
    # Arrival order is shuffled, not by user index.
    users = [s.user for s in build_workload(spec)]
    assert users != sorted(users)


def test_oracle_identical_prompts() -> None:
    p9 = list(range(1, 10))
    assert oracle_hit_tokens([p9, p9], 4) == (8, 18)
    p8 = list(range(1, 9))
    # (8 - 1) // 4 = 1 block: the last prompt token is always recomputed.
    assert oracle_hit_tokens([p8, p8], 4) == (4, 16)


def test_oracle_first_block_differs() -> None:
    a = list(range(1, 13))
    b = [99, *a[1:]]  # only the first block differs, but every block is keyed by its prefix
    assert oracle_hit_tokens([a, b], 4) == (0, 24)


def test_oracle_extension_and_partial_blocks() -> None:
    base = list(range(1, 11))  # 10 tokens: 2 full blocks cached, the tail 2 are not
    longer = [*base, 50, 51, 52, 53, 54, 55]  # 16 tokens, limit (16-1)//4 = 3 blocks
    assert oracle_hit_tokens([base, longer], 4) == (8, 26)
    # The longer prompt cached its 4 blocks: a 17-token extension hits all 4.
    assert oracle_hit_tokens([base, longer, [*longer, 7]], 4) == (8 + 16, 26 + 17)
    # A shared first block then a divergence: hit stops at the divergence.
    fork = [*base[:4], 77, *base[5:]]
    assert oracle_hit_tokens([base, fork], 4) == (4, 20)
    assert oracle_hit_tokens([], 4) == (0, 0)


def test_oracle_order_rounds_then_arrival() -> None:
    spec = WorkloadSpec(groups=2, users_per_group=2, rounds=2)
    scripts = build_workload(spec)
    expected = [list(s.turns[r].prompt_token_ids) for r in range(2) for s in scripts]
    assert oracle_order(scripts) == expected


def test_oracle_hit_rate_grows_with_users_per_group() -> None:
    rate = oracle_hit_rate(WorkloadSpec(), 16)
    assert 0.0 < rate < 1.0
    assert oracle_hit_rate(WorkloadSpec(users_per_group=8), 16) > rate


def test_describe_default() -> None:
    spec = WorkloadSpec()
    d = describe(spec, 16)
    json.dumps(d)
    assert d["requests"] == 48
    assert d["prompt_tokens"] == 16 * (544 + 592 + 640)
    assert d["max_prompt_tokens"] == 640
    # 4 system prompts x 32 blocks + 16 users x (640 - 512) / 16 own blocks.
    assert d["working_set_blocks"] == 4 * 32 + 16 * 8
    assert d["oracle_hit_rate"] == pytest.approx(oracle_hit_rate(spec, 16))
    # 12 non-first users hit the system prompt in round 0; rounds 1 and 2 hit
    # the previous round's prompt (544 and 592 tokens, both whole blocks).
    assert d["oracle_hit_tokens"] == 12 * 512 + 16 * 544 + 16 * 592


@pytest.mark.parametrize(
    "field, value",
    [
        ("groups", 0),
        ("users_per_group", 0),
        ("rounds", 0),
        ("system_prompt_tokens", -1),
        ("question_tokens", 0),
        ("answer_tokens", 0),
        ("request_rate", 0.0),
        ("request_rate", float("inf")),
        ("vocab_size", 1),
    ],
)
def test_bad_spec_raises_naming_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        WorkloadSpec(**{field: value})
