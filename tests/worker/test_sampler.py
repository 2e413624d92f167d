"""Sampler and SamplerState: processing formulas, filters, seeding, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from spur.actors.step import SamplingParams
from spur.actors.worker.sampler import Sampler, apply_top_k, apply_top_p, greedy_ids_of
from spur.actors.worker.sampling_metadata import RowValues, SamplerState

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _state(vocab: int, seed: int | None = 0) -> SamplerState:
    return SamplerState(vocab, seed=seed)


def _add(state: SamplerState, params: SamplingParams, n: int, *, prompt=(0,), eos=None) -> list:
    ids = [f"r{len(state) + i}" for i in range(n)]
    for rid in ids:
        state.add_request(rid, params, list(prompt), eos)
    return ids


def _draw_counts(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Token frequencies of `draws` samples of one distribution, drawn as one batch."""
    vocab = logits_row.shape[0]
    state = _state(vocab, seed=1234)
    ids = _add(state, params, draws)
    out = Sampler()(logits_row.repeat(draws, 1), state.build(ids))
    return torch.bincount(out.sampled_token_ids, minlength=vocab)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---- greedy ------------------------------------------------------------------------------


def test_greedy_is_argmax_on_the_fast_path() -> None:
    state = _state(100)
    ids = _add(state, GREEDY, 7)
    meta = state.build(ids)
    assert meta.all_greedy and not meta.needs_processing
    logits = torch.randn(7, 100, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(-1)
    out = Sampler()(logits.clone(), meta)
    assert torch.equal(out.sampled_token_ids, expected)
    assert out.logprobs == [None] * 7
    state.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_pick_is_argmax_with_ties_nan_and_inf(dtype) -> None:
    """greedy_ids_of (the native argmax_rows for float32 rows, torch's max(dim=-1)
    otherwise) must pick argmax's index, the first maximal one, on rows full of ties
    (small integers), with NaNs (the first one wins, in the vector body or the tail),
    +inf, and every value -inf, at vocab sizes on both sides of the 16-lane widths."""
    from spur.kernels import native

    lib = native.ops()
    gen = torch.Generator().manual_seed(0)
    for case in range(160):
        rows = int(torch.randint(1, 40, (1,), generator=gen))
        vocab = int(torch.randint(1, 50_000 if case % 2 else 70, (1,), generator=gen))
        x = torch.randint(-3, 4, (rows, vocab), generator=gen).to(dtype)
        if case % 3 == 0:
            x[0, vocab // 2] = float("nan")
            x[0, -1] = float("nan")  # a later NaN (in the tail, for most vocab sizes)
        if case % 7 == 0:
            x[rows // 2, vocab - 1] = float("inf")
        if case % 5 == 0:
            x[-1] = float("-inf")
        expected = x.argmax(dim=-1)
        assert torch.equal(greedy_ids_of(x), expected), (rows, vocab, case)
        if lib is not None and dtype == torch.float32:
            assert torch.equal(lib.argmax_rows(x), expected), (rows, vocab, case)


def test_native_argmax_refuses_what_it_cannot_read() -> None:
    from spur.kernels import native

    lib = native.ops()
    if lib is None:
        pytest.skip("native ops not built here")
    for bad in (torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(4), torch.zeros(3, 0)):
        with pytest.raises(RuntimeError, match="argmax_rows: x must be"):
            lib.argmax_rows(bad)
    # a strided view (every other column) goes to torch's path in greedy_ids_of
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))[:, ::2]
    assert torch.equal(greedy_ids_of(x), x.argmax(dim=-1))


def test_fast_path_does_not_look_at_requests() -> None:
    # All-greedy states answer without per-request work: ids are not even looked up.
    state = _state(10)
    _add(state, GREEDY, 2)
    meta = state.build(["anything", "else", "here"])
    assert meta.num_reqs == 3 and meta.all_greedy and meta.penalties is None


def test_top_k_1_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen)
    state = _state(50)
    ids = _add(state, SamplingParams(temperature=1.3, top_k=1), 6)
    out = Sampler()(logits.clone(), state.build(ids))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    # The top-k filter itself with k=1 leaves exactly the maximum.
    x = logits.clone()
    apply_top_k(x, RowValues(rows=None, values=torch.ones(6, dtype=torch.int64), max_value=1))
    assert torch.equal(torch.isfinite(x).sum(-1), torch.ones(6, dtype=torch.int64))
    assert torch.equal(x.argmax(-1), logits.argmax(-1))


# ---- random sampling -----------------------------------------------------------------------


def test_temperature_sampling_matches_the_tempered_distribution() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    temperature = 0.7
    counts = _draw_counts(logits, SamplingParams(temperature=temperature), 4000)
    tempered = torch.softmax(logits / temperature, -1)
    # df = 4; 18.47 is the 0.1% critical value. The seed is fixed, so this is exact
    # and cannot flake; the bound only says the fixed draw looks like the target.
    assert _chi_square(counts, tempered) < 18.47
    # ... and it tells the tempered distribution from the untempered one.
    assert _chi_square(counts, torch.softmax(logits, -1)) > 50.0


def test_top_k_never_samples_outside_the_k_best() -> None:
    logits = torch.tensor([0.1, 2.0, 0.3, 1.9, -1.0, 1.8, 0.0, 1.7])
    counts = _draw_counts(logits, SamplingParams(temperature=1.0, top_k=3), 3000)
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 3, 5}


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    # Sorted: 0.5, 0.3 (mass 0.8 >= 0.75): the nucleus is {1, 3}.
    counts = _draw_counts(probs.log(), SamplingParams(temperature=1.0, top_p=0.75), 3000)
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 3}
    # Within the nucleus the renormalised odds hold (5:3); df = 1, 10.83 is the 0.1% value.
    assert _chi_square(counts[[1, 3]], torch.tensor([0.625, 0.375])) < 10.83


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token() -> None:
    """The API takes any top_p in (0, 1]; 1e-300 is 0 in float32, so no token held
    less than p before it: the sampler indexed -1 and the engine died (every request
    in flight with it). vLLM keeps at least one token; so does spur."""
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    for top_p in (1e-300, 1e-45, 1e-9):
        counts = _draw_counts(probs.log(), SamplingParams(temperature=1.0, top_p=top_p), 50)
        assert set(torch.nonzero(counts).flatten().tolist()) == {1}, top_p


def test_top_p_candidate_shortcut_matches_a_full_sort() -> None:
    # Peaked rows have their nucleus among the first 256 candidates; flat rows do not
    # and take the full-sort fallback. Both must keep exactly the sorted-prefix set.
    vocab = 1000
    gen = torch.Generator().manual_seed(4)
    scale = torch.tensor([8.0, 0.1, 3.0, 0.5, 12.0, 0.0]).unsqueeze(1)
    logits = torch.randn(6, vocab, generator=gen) * scale
    p = torch.tensor([0.9, 0.95, 0.5, 0.99, 0.7, 0.3])
    x = logits.clone()
    apply_top_p(x, RowValues(rows=None, values=p, max_value=float(p.max())))
    for row in range(6):
        probs = torch.softmax(logits[row].double(), -1)
        ordered = probs.sort(descending=True).values
        before = torch.cat([torch.zeros(1, dtype=torch.float64), ordered.cumsum(0)[:-1]])
        num_kept = int((before < p[row].item()).sum())
        expected = probs >= ordered[num_kept - 1]
        assert torch.equal(torch.isfinite(x[row]), expected), row
    assert int(torch.isfinite(x[1]).sum()) > 256  # the fallback path was exercised


def test_min_p_drops_unlikely_tokens() -> None:
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    # min_p = 0.15: threshold 0.075 keeps {1, 2, 3}.
    counts = _draw_counts(probs.log(), SamplingParams(temperature=1.0, min_p=0.15), 3000)
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 2, 3}


def test_top_p_measures_the_mass_left_after_min_p() -> None:
    """vLLM v1 applies min-p before top-k/top-p. min_p 0.3 drops 0.1 and leaves
    [0.444, 0.333, 0.222]; top_p 0.75 of that is the first two tokens. (top_p first,
    on the whole distribution, would keep three: 0.4 + 0.3 < 0.75.)"""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    params = SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3)
    counts = _draw_counts(probs.log(), params, 3000)
    assert set(torch.nonzero(counts).flatten().tolist()) == {0, 1}
    assert _chi_square(counts[[0, 1]], torch.tensor([4 / 7, 3 / 7])) < 10.83


def test_mixed_batch_of_greedy_and_random_rows() -> None:
    vocab = 20
    state = _state(vocab, seed=5)
    row_params = [GREEDY, SamplingParams(temperature=1.0), GREEDY, SamplingParams(seed=3)]
    ids = [f"m{i}" for i in range(4)]
    for rid, params in zip(ids, row_params, strict=True):
        state.add_request(rid, params, [1], None)
    flat = torch.zeros(vocab)
    flat[7] = 0.5  # argmax is 7, but random rows should see the whole vocabulary
    seen_random: list[set[int]] = [set(), set()]
    for _ in range(40):
        meta = state.build(ids)
        assert meta.greedy is not None and meta.greedy.tolist() == [True, False, True, False]
        out = Sampler()(flat.repeat(4, 1), meta)
        tokens = out.sampled_token_ids.tolist()
        assert tokens[0] == tokens[2] == 7
        seen_random[0].add(tokens[1])
        seen_random[1].add(tokens[3])
        state.append_sampled(ids, tokens)
    assert min(len(s) for s in seen_random) > 10
    state.check_integrity()


# ---- penalties and min_tokens -------------------------------------------------------------


def test_penalties_follow_the_formulas() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, -2.0, 3.0, 1.0])
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    state = _state(6)
    # Prompt {0, 1}; output so far: 1 once, 3 twice (one passed at add, two appended).
    state.add_request("p", params, [0, 1], None, output_token_ids=[3])
    state.add_request("plain", GREEDY, [0, 1], None)
    state.append_tokens("p", [1, 3])
    state.check_integrity()
    x = torch.stack([logits, logits])
    out = Sampler()(x, state.build(["plain", "p"]))
    # Repetition over {0, 1, 3}: 2 / 2 = 1, -1 * 2 = -2, -2 * 2 = -4.
    # Frequency: token 1 -= 0.5 * 1, token 3 -= 0.5 * 2. Presence: both -= 0.25.
    expected = torch.tensor([1.0, -2.75, 0.5, -5.25, 3.0, 1.0])
    torch.testing.assert_close(x[1], expected, rtol=0, atol=0)
    assert torch.equal(x[0], logits)  # the row without penalties is untouched
    assert out.sampled_token_ids.tolist() == [4, 4]
    state.check_integrity()

    # Counts are incremental: one more 4 now costs it 0.5 + 0.25 and halves it (3 -> 1.5 - 0.75).
    state.append_tokens("p", [4])
    x = logits.clone().unsqueeze(0)
    Sampler()(x, state.build(["p"]))
    assert x[0, 4].item() == pytest.approx(0.75)
    state.check_integrity()


def test_penalised_random_row_sees_penalised_logits() -> None:
    params = SamplingParams(temperature=1.0, presence_penalty=2.0)
    state = _state(4)
    state.add_request("a", params, [], None, output_token_ids=[2])
    x = torch.zeros(1, 4)
    Sampler()(x, state.build(["a"]))
    assert x.tolist() == [[0.0, 0.0, -2.0, 0.0]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    eos, stop = 4, 2
    logits = torch.tensor([0.0, 1.0, 5.0, 2.0, 9.0])  # EOS best, then the stop id
    state = _state(5)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(stop,))
    state.add_request("a", params, [0], eos)
    # With ignore_eos, min_tokens still masks EOS (vLLM semantics).
    ignoring = params.with_changes(ignore_eos=True)
    state.add_request("b", ignoring, [0], eos)
    # ignore_eos without min_tokens never masks EOS.
    state.add_request("c", SamplingParams(temperature=0.0, ignore_eos=True), [0], eos)
    ids = ["a", "b", "c"]
    for _ in range(2):
        out = Sampler()(logits.repeat(3, 1), state.build(ids))
        assert out.sampled_token_ids.tolist() == [3, 3, eos]
        state.append_sampled(ids, out.sampled_token_ids.tolist())
        state.check_integrity()
    out = Sampler()(logits.repeat(3, 1), state.build(ids))
    assert out.sampled_token_ids.tolist() == [eos, eos, eos]
    # Once no request waits on min_tokens, the O(1) greedy path is back.
    assert not state.build(ids).needs_processing


def test_min_tokens_masks_the_models_other_eos_ids_under_ignore_eos() -> None:
    """The generation config's EOS ids stop nothing under ignore_eos, but min_tokens
    masks them as it masks EOS (`masked_eos_token_ids`, set by `with_eos`)."""
    from spur.actors.generation_config import with_eos

    eos, other = 4, 3
    logits = torch.tensor([0.0, 1.0, 2.0, 7.0, 9.0])  # EOS best, then the other EOS
    params = with_eos(SamplingParams(temperature=0.0, min_tokens=1, ignore_eos=True), (other,))
    assert params.stop_token_ids == () and params.masked_eos_token_ids == (other,)
    state = _state(5)
    state.add_request("a", params, [0], eos)
    state.add_request("b", params.with_changes(masked_eos_token_ids=()), [0], eos)
    out = Sampler()(logits.repeat(2, 1), state.build(["a", "b"]))
    assert out.sampled_token_ids.tolist() == [2, other]  # without it: only EOS masked
    state.append_sampled(["a", "b"], out.sampled_token_ids.tolist())
    out = Sampler()(logits.repeat(2, 1), state.build(["a", "b"]))
    assert out.sampled_token_ids.tolist() == [eos, eos]  # min_tokens reached
    state.check_integrity()


# ---- seeds ---------------------------------------------------------------------------------


def _seeded_run(
    position: int, batch: int, steps: int, seed: int = 7, device: str = "cpu"
) -> list[int]:
    """Tokens of a seeded request at `position` of a batch of random other requests."""
    vocab = 64
    state = SamplerState(vocab, device=device, seed=99 + batch)  # shared stream differs
    target = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, frequency_penalty=0.3)
    others = [
        SamplingParams(temperature=1.0),
        GREEDY,
        SamplingParams(temperature=0.5, seed=11, top_k=5),
        SamplingParams(temperature=1.2, min_p=0.05),
    ]
    ids = [f"o{i}" for i in range(batch)]
    ids[position] = "target"
    for i, rid in enumerate(ids):
        params = target if rid == "target" else others[i % len(others)]
        state.add_request(rid, params, [1, 2, 3], 0)
    logit_gen = torch.Generator().manual_seed(2024)
    noise_gen = torch.Generator().manual_seed(batch * 31 + position)
    tokens = []
    for _ in range(steps):
        target_row = torch.randn(vocab, generator=logit_gen)  # same for every run
        logits = torch.randn(batch, vocab, generator=noise_gen) * 3
        logits[position] = target_row
        out = Sampler()(logits.to(device), state.build(ids))
        sampled = out.sampled_token_ids.tolist()
        tokens.append(sampled[position])
        state.append_sampled(ids, sampled)
    state.check_integrity()
    return tokens


def test_seed_gives_the_same_tokens_in_any_batch_at_any_row() -> None:
    alone = _seeded_run(position=0, batch=1, steps=8)
    assert _seeded_run(position=3, batch=5, steps=8) == alone
    assert _seeded_run(position=0, batch=5, steps=8) == alone
    assert _seeded_run(position=1, batch=2, steps=8) == alone
    assert _seeded_run(position=0, batch=1, steps=8, seed=8) != alone


def test_seed_minus_one_means_no_seed_as_in_vllm() -> None:
    """vLLM reads seed -1 as none; spur seeded a generator with it, so clients that
    send -1 for "random" got the same tokens on every request."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 2
    counts = _draw_counts(logits, SamplingParams(temperature=1.0, seed=-1), 64)
    assert (counts > 0).sum() > 1  # drawn, not one seeded stream repeated


def test_a_temperature_under_0_01_is_raised_to_it_as_in_vllm() -> None:
    """vLLM raises temperatures in (0, 0.01) to 0.01, so that only 0 is greedy; spur
    divided by them (1e-6 was greedy, 1e-3 nearly so). Two tokens 0.01 apart in logit
    are then drawn at e^-1 : 1 (0.269 for the second), as vLLM draws them."""
    assert SamplingParams(temperature=1e-6).temperature == 0.01
    assert not SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0.0).greedy
    logits = torch.tensor([1.0, 0.99] + [-30.0] * 8)
    counts = _draw_counts(logits, SamplingParams(temperature=1e-3), 4000)
    share = counts[1].item() / 4000
    assert 0.23 < share < 0.31, share  # 0.269 expected; 4000 draws: sd 0.007


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seed_reproducibility_on_cuda() -> None:
    alone = _seeded_run(position=0, batch=1, steps=8, device="cuda")
    assert _seeded_run(position=3, batch=5, steps=8, device="cuda") == alone
    assert _seeded_run(position=1, batch=2, steps=8, device="cuda") == alone


# ---- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top_n() -> None:
    vocab = 30
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=gen)
    state = _state(vocab)
    # Row 0 samples with filters and penalties: logprobs still come from the raw logits.
    state.add_request(
        "a", SamplingParams(temperature=0.5, top_k=4, logprobs=5, presence_penalty=1.0), [1], None
    )
    state.add_request("b", GREEDY, [1], None)
    state.add_request("c", SamplingParams(temperature=0.0, logprobs=0), [1], None)
    raw = torch.log_softmax(logits, -1)
    out = Sampler()(logits.clone(), state.build(["a", "b", "c"]))
    assert out.logprobs[1] is None
    sampled = out.sampled_token_ids.tolist()

    a = out.logprobs[0]
    assert a is not None
    assert a.logprob == pytest.approx(raw[0, sampled[0]].item(), abs=1e-6)
    expected_lp, expected_ids = raw[0].topk(5)
    assert [t for t, _ in a.top] == expected_ids.tolist()
    assert [lp for _, lp in a.top] == pytest.approx(expected_lp.tolist(), abs=1e-6)
    assert all(x[1] >= y[1] for x, y in zip(a.top, a.top[1:], strict=False))
    assert a.rank == int((raw[0] >= raw[0, sampled[0]]).sum())
    assert sampled[0] in expected_ids[:4].tolist()  # top_k=4 held

    c = out.logprobs[2]
    assert c is not None and c.top == [] and c.rank == 1
    assert sampled[2] == int(logits[2].argmax())
    assert c.logprob == pytest.approx(raw[2].max().item(), abs=1e-6)
    assert math.isclose(sum(math.exp(v) for v in raw[0].tolist()), 1.0, rel_tol=1e-5)


# ---- state bookkeeping ---------------------------------------------------------------------


def test_penalty_slots_grow_and_are_reused_clean() -> None:
    state = _state(16)
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    ids = [f"r{i}" for i in range(20)]  # more than the initial 8 slots: the tables grow
    for i, rid in enumerate(ids):
        state.add_request(rid, params, [i % 16], None, output_token_ids=[i % 16])
    state.check_integrity()
    for rid in ids[:10]:
        assert state.remove(rid)
    assert not state.remove("r0")
    state.append_tokens("r15", [5, 5])
    state.add_request("new", params, [], None)  # takes a freed slot: must start at zero
    state.check_integrity()
    x = torch.zeros(2, 16)
    Sampler()(x, state.build(["new", "r15"]))
    assert x[0].tolist() == [0.0] * 16
    assert x[1, 15].item() == -1.0 and x[1, 5].item() == -2.0
    state.check_integrity()


def test_state_rejects_bad_input() -> None:
    state = _state(8)
    state.add_request("a", GREEDY, [1], None)
    with pytest.raises(ValueError, match="already"):
        state.add_request("a", GREEDY, [1], None)
    with pytest.raises(ValueError, match="outside"):
        state.add_request("b", SamplingParams(repetition_penalty=1.5), [8], None)
    state.check_integrity()
    with pytest.raises(ValueError, match="num_reqs"):
        Sampler()(torch.zeros(2, 8), state.build(["a"]))


def test_a_seeded_request_samples_the_same_whether_or_not_a_neighbour_drafts() -> None:
    """Verification draws acceptance numbers for draft rows only: a seeded request
    with no draft (here it asks for logprobs, so it never drafts) keeps its own
    generator's sequence, and so its tokens, whatever the rest of the batch does."""
    vocab = 50
    torch.manual_seed(0)
    steps = [torch.randn(vocab) for _ in range(20)]
    seeded = SamplingParams(temperature=1.0, seed=1234, logprobs=1)

    def run(neighbour_drafts: bool) -> list[int]:
        state = SamplerState(vocab, seed=0)
        state.add_request("s", seeded, [1, 2], eos_token_id=None)
        state.add_request("b", SamplingParams(temperature=0), [1, 2], eos_token_id=None)
        out = []
        for logits in steps:
            if neighbour_drafts:
                batch = torch.stack([logits, torch.zeros(vocab), torch.zeros(vocab)])
                tokens, _ = Sampler().verify(batch, state.build(["s", "b", "b"]), [[], [7]])
                state.append_tokens("s", tokens[0])
                state.append_tokens("b", tokens[1])
                out.append(tokens[0][0])
            else:
                batch = torch.stack([logits, torch.zeros(vocab)])
                sampled = Sampler()(batch, state.build(["s", "b"])).sampled_token_ids.tolist()
                state.append_sampled(["s", "b"], sampled)
                out.append(sampled[0])
        return out

    assert run(neighbour_drafts=True) == run(neighbour_drafts=False)


def test_a_token_tied_with_others_ranks_last_of_them() -> None:
    """vLLM's rank counts the tokens whose logprob is at least the sampled one's: the
    greedy pick among two tied top tokens has rank 2, as vLLM reports it."""
    state = _state(4, seed=0)
    state.add_request("t", SamplingParams(temperature=0.0, logprobs=1), [1], None)
    out = Sampler()(torch.tensor([[2.0, 2.0, 0.0, -1.0]]), state.build(["t"]))
    (lp,) = out.logprobs
    assert out.sampled_token_ids.tolist() == [0] and lp is not None and lp.rank == 2
