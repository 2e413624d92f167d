"""The sampler: one token per request from the model's last-position logits.

Input: `logits` float32 `[num_reqs, vocab]` (one row per request that samples this
step) and the step's `SamplingMetadata` (see `sampling_metadata.py`). Output:
`SamplerOutput`. The logits are processed **in place** (the runner makes them fresh
every step; a copy of a `[num_reqs, vocab]` tensor each step would be wasted memory).

Processing order, each step applied only to the rows that use it:

1. logprobs: log_softmax of the *raw* logits, before anything below (see below).
2. min_tokens: rows with fewer than min_tokens outputs get -inf on EOS and their
   stop_token_ids (EOS is masked even with ignore_eos, as in vLLM; ignore_eos itself
   never masks EOS, it only keeps EOS from ending the request).
3. repetition penalty over prompt + output tokens: positive logits are divided by it,
   negative ones multiplied.
4. frequency (times the count) and presence (once) penalties over output tokens,
   subtracted.
5. greedy rows: argmax of these processed logits. Steps 6-8 keep the argmax token,
   so doing it here gives the same answer for less work.
6. temperature: random rows' logits divided by T.
7. min-p (drop tokens with p < min_p * p_max, computed in logit space as
   l < l_max + log min_p), then top-k (ties at the k-th value are all kept), then top-p
   on the distribution left by both (the smallest set of most likely tokens with
   mass >= top_p, plus any tied with the last one; the top token always stays). This
   is vLLM v1's order (min-p is an argmax-invariant logits processor, run before its
   top-k/top-p sampler). min-p and top-k commute (both keep the top token and cut
   by a ratio or a rank), but top-p does not: after min-p it measures its mass on the
   renormalised rest, so [0.4, 0.3, 0.2, 0.1] with min_p 0.3 and top_p 0.75 keeps
   the first two tokens, not three.
8. sampling by exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. (made as
   -log u, u ~ U[0, 1)) is an exact draw from probs. A seeded row draws its own
   `[vocab]` u from its own generator, so its tokens depend on nothing but its seed and
   its own logits, not on the batch size or its row, nor on speculative decoding
   (`verify` takes one draw per emitted token too); unseeded rows share one generator.

Logprobs are those of the model's raw distribution (log_softmax of the unprocessed
logits), as vLLM returns by default: what the model believes, independent of the
sampling knobs. The rank is the number of tokens whose logprob is at least the sampled
one's (vLLM's `batched_count_greater_than`: a token tied with others ranks last of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from spur.actors.worker.sampling_metadata import (
    MinTokensMask,
    PenaltyMetadata,
    RowValues,
    SamplingMetadata,
)
from spur.kernels import native

# Top-p looks at this many most likely tokens before it resorts to a full sort.
_TOP_P_CANDIDATES = 256


class TokenLogprobs(NamedTuple):
    """Logprobs of one sampled token, from the raw distribution."""

    logprob: float
    """Logprob of the sampled token."""
    top: list[tuple[int, float]]
    """The top-N (token id, logprob) pairs, most likely first; empty when N = 0."""
    rank: int
    """Tokens whose logprob is at least the sampled one's (1 for a unique top token;
    ties rank last among themselves, as in vLLM)."""


@dataclass
class SamplerOutput:
    """The result of one sampling step."""

    sampled_token_ids: torch.Tensor
    """[num_reqs] int64 on the logits' device, one token per row."""
    logprobs: list[TokenLogprobs | None]
    """One entry per row; None where the request did not ask for logprobs."""


class Sampler:
    """Stateless: all per-request state lives in `SamplerState` / `SamplingMetadata`."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row. Mutates `logits`; see the module docstring."""
        if logits.dim() != 2 or logits.shape[0] != meta.num_reqs:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} for {meta.num_reqs} requests: "
                "expected [num_reqs, vocab]"
            )
        if logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32, got {logits.dtype}")
        raw_logprobs = None
        if meta.logprobs is not None:
            rows = meta.logprobs.rows
            # log_softmax allocates its result, so later in-place steps cannot alter it.
            raw_logprobs = torch.log_softmax(logits if rows is None else logits[rows], dim=-1)

        if not meta.needs_processing:
            sampled = greedy_ids_of(logits)  # the fast path: greedy, nothing to process
        else:
            sampled = self._process_and_sample(logits, meta)

        logprobs: list[TokenLogprobs | None] = [None] * meta.num_reqs
        if raw_logprobs is not None:
            assert meta.logprobs is not None
            _fill_logprobs(logprobs, raw_logprobs, sampled, meta)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _process_and_sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        apply_min_tokens(logits, meta.min_tokens)
        apply_penalties(logits, meta.penalties)
        if meta.all_greedy:
            return greedy_ids_of(logits)
        greedy_ids = greedy_ids_of(logits) if meta.greedy is not None else None
        if meta.temperature is not None:
            logits.div_(meta.temperature.unsqueeze(1))
        apply_min_p(logits, meta.min_p)
        apply_top_k(logits, meta.top_k)
        apply_top_p(logits, meta.top_p)
        random_ids = exponential_race(logits, meta)
        if greedy_ids is None:
            return random_ids
        assert meta.greedy is not None
        return torch.where(meta.greedy, greedy_ids, random_ids)

    def verify(
        self, logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
        """Sample, verifying draft tokens (speculative decoding). Mutates `logits`.

        Request i owns 1 + len(drafts[i]) consecutive rows of `logits`
        `[num_rows, vocab]` (rows of `meta`, built with its id repeated): row j is
        the model's distribution for the token after draft j (row 0: after its
        last known token). Returns per request its new tokens (the accepted drafts
        then one token of the model's own) and per request the logprobs of its
        single row (requests that draft never ask for logprobs).

        Each row draws its token x from its processed distribution p exactly as a
        step without drafts would (`race`, with the same noise: a seeded request's
        next draw from its own generator); draft j is accepted iff x equals it (greedy
        rows: iff it is the argmax), and the first row whose x differs gives x. So the
        emitted token at each position is x, distributed as p: the acceptance
        probability is p(draft) and a rejection's token is p without the draft,
        renormalised, as the rejection rule of speculative sampling with a one-hot
        draft distribution gives them. A seeded request's generator is then set back
        to just after the draws of the rows it emitted from, one draw per token: its
        tokens are those it samples without speculation (given the same logits),
        whatever the batch and whether it drafts, and a failover replays its draws by
        counting tokens.
        """
        num_rows = sum(1 + len(d) for d in drafts)
        if logits.dim() != 2 or logits.shape[0] != num_rows or meta.num_reqs != num_rows:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} and {meta.num_reqs} metadata rows "
                f"for {len(drafts)} requests owning {num_rows} rows: expected [{num_rows}, vocab]"
            )
        starts: list[int] = []
        draft_rows: list[int] = []
        draft_ids: list[int] = []
        row = 0
        for d in drafts:
            starts.append(row)
            draft_rows.extend(range(row, row + len(d)))
            draft_ids.extend(d)
            row += 1 + len(d)
        dev = logits.device
        rows_t = torch.tensor(draft_rows, dtype=torch.int64, device=dev)  # [D]
        ids_t = torch.tensor(draft_ids, dtype=torch.int64, device=dev)  # [D]

        snapshots: dict[int, torch.Tensor] = {}  # seeded row -> generator state before its draw
        raw_logprobs = None
        if meta.logprobs is not None:
            lp_rows = meta.logprobs.rows
            raw_logprobs = torch.log_softmax(logits if lp_rows is None else logits[lp_rows], -1)
        apply_min_tokens(logits, meta.min_tokens)
        apply_penalties(logits, meta.penalties)
        if meta.all_greedy:
            chosen = greedy_ids_of(logits)  # [num_rows]
            accept = chosen[rows_t] == ids_t  # [D]
        else:
            greedy_ids = greedy_ids_of(logits) if meta.greedy is not None else None
            if meta.temperature is not None:
                logits.div_(meta.temperature.unsqueeze(1))
            apply_min_p(logits, meta.min_p)
            apply_top_k(logits, meta.top_k)
            apply_top_p(logits, meta.top_p)
            chosen = race(logits.softmax(dim=-1), meta, snapshots)  # [num_rows]
            if greedy_ids is not None:
                assert meta.greedy is not None
                chosen = torch.where(meta.greedy, greedy_ids, chosen)
            accept = chosen[rows_t] == ids_t  # [D]

        row_logprobs: list[TokenLogprobs | None] = [None] * num_rows
        if raw_logprobs is not None:
            assert meta.logprobs is not None
            _fill_logprobs(row_logprobs, raw_logprobs, chosen, meta)
        chosen_list = chosen.tolist()
        accept_list = accept.tolist()
        tokens: list[list[int]] = []
        k = 0
        for start, d in zip(starts, drafts, strict=True):
            out: list[int] = []
            for j, draft in enumerate(d):
                if not accept_list[k + j]:
                    out.append(chosen_list[start + j])
                    break
                out.append(draft)
            else:
                out.append(chosen_list[start + len(d)])
            k += len(d)
            tokens.append(out)
        if snapshots:
            # Undo the draws of the rows after the last emitted one: one draw per token.
            generators = dict(meta.seeded)
            for start, d, out in zip(starts, drafts, tokens, strict=True):
                unused = start + len(out)
                if len(out) <= len(d) and unused in snapshots:
                    generators[unused].set_state(snapshots[unused])
        return tokens, [row_logprobs[start] for start in starts]


def greedy_ids_of(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row: [num_rows, vocab] -> [num_rows] int64.

    The index of the first maximal value, exactly `logits.argmax(dim=-1)` (ties, NaN
    and -inf rows included; tests/worker/test_sampler.py checks it against argmax). On
    CPU it is the native `argmax_rows` where the ops are built (float32 rows of unit
    stride): torch's argmax took 1.34 ms for [36, 49152] on 2 cores and its
    `max(dim=-1)`, the fallback here, 0.47-1.02 ms (the native op 0.14), once per step.
    """
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        lib = native.usable(logits) if logits.shape[0] and logits.shape[1] else None
        if lib is not None:
            return lib.argmax_rows(logits)
    return logits.max(dim=-1).indices


# ---- processing steps: each mutates logits [num_reqs, vocab] in place -------------------


def _rows_view(logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The selected rows: `logits` itself when rows is None, else a gathered copy."""
    return logits if rows is None else logits[rows]


def _write_back(logits: torch.Tensor, rows: torch.Tensor | None, sub: torch.Tensor) -> None:
    if rows is not None:
        logits[rows] = sub
    elif sub is not logits:
        logits.copy_(sub)


def apply_min_tokens(logits: torch.Tensor, mask: MinTokensMask | None) -> None:
    """Set the listed (row, token) logits to -inf."""
    if mask is not None:
        logits[mask.rows, mask.token_ids] = float("-inf")


def apply_penalties(logits: torch.Tensor, pen: PenaltyMetadata | None) -> None:
    """Repetition, then frequency and presence penalties (formulas in the module doc)."""
    if pen is None:
        return
    x = _rows_view(logits, pen.rows)  # [P, vocab]
    counts = pen.output_counts  # [P, vocab] int32
    if pen.repetition is not None:
        assert pen.prompt_mask is not None
        seen = pen.prompt_mask | (counts > 0)
        factor = torch.where(seen, pen.repetition.unsqueeze(1), 1.0)
        x = torch.where(x > 0, x / factor, x * factor)
    if pen.frequency is not None:
        x = x - pen.frequency.unsqueeze(1) * counts
    if pen.presence is not None:
        x = x - pen.presence.unsqueeze(1) * (counts > 0)
    _write_back(logits, pen.rows, x)


def apply_top_k(logits: torch.Tensor, top_k: RowValues | None) -> None:
    """Keep the k largest logits of each listed row (and any tied with the k-th)."""
    if top_k is None:
        return
    x = _rows_view(logits, top_k.rows)  # [S, vocab]
    k = top_k.values  # [S] int64, 1 <= k < vocab
    # One topk with the largest k of the batch; each row reads its own k-th value.
    top_values = x.topk(int(top_k.max_value), dim=-1).values  # [S, k_max], descending
    threshold = top_values.gather(1, (k - 1).unsqueeze(1))  # [S, 1]
    x.masked_fill_(x < threshold, float("-inf"))
    _write_back(logits, top_k.rows, x)


def apply_top_p(logits: torch.Tensor, top_p: RowValues | None) -> None:
    """Keep the smallest set of most likely tokens whose probability mass is >= p.

    Tokens tied with the least likely kept one are kept too. A full sort of the vocab is
    slow on CPU (about 4 ms per 49k-token row, single thread), so each row first looks
    at its `_TOP_P_CANDIDATES` most likely tokens and falls back to a full sort only
    when they hold less than p. The choice depends on the row alone, so a row's result
    does not depend on the batch.
    """
    if top_p is None:
        return
    x = _rows_view(logits, top_p.rows)  # [S, vocab]
    p = top_p.values.unsqueeze(1)  # [S, 1]
    probs = x.softmax(dim=-1)  # [S, vocab]
    candidates = probs.topk(min(_TOP_P_CANDIDATES, probs.shape[1]), dim=-1).values  # [S, C]
    threshold, covered = _nucleus_threshold(candidates, p)  # [S, 1], [S]
    if not bool(covered.all()):
        rest = torch.nonzero(~covered).squeeze(1)  # [U] rows whose nucleus is larger
        full = probs[rest].sort(dim=-1, descending=True).values  # [U, vocab]
        threshold[rest] = _nucleus_threshold(full, p[rest])[0]
    x.masked_fill_(probs < threshold, float("-inf"))
    _write_back(logits, top_p.rows, x)


def _nucleus_threshold(
    sorted_probs: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest kept probability of each row, and whether the given prefix holds p.

    sorted_probs: [S, C] descending (a prefix of the row's sorted probabilities);
    p: [S, 1]. Token i is kept when the tokens before it hold less than p. Returns
    ([S, 1] threshold, [S] bool covered). A row is covered when its C tokens hold
    >= p: the nucleus then lies within them and the threshold is exact.
    """
    cum = sorted_probs.cumsum(dim=-1)  # [S, C], non-decreasing even when rounded
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # mass before i
    # At least the top token, as vLLM keeps: a p > 0 that float32 rounds to 0 (1e-300)
    # keeps nothing else, and would index -1.
    num_kept = (before < p).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = sorted_probs.gather(1, num_kept - 1)  # [S, 1]
    return threshold, cum[:, -1] >= p.squeeze(1)


def apply_min_p(logits: torch.Tensor, min_p: RowValues | None) -> None:
    """Drop tokens with probability below min_p times the top one (in logit space)."""
    if min_p is None:
        return
    x = _rows_view(logits, min_p.rows)  # [S, vocab]
    threshold = x.amax(dim=-1, keepdim=True) + min_p.values.log().unsqueeze(1)  # [S, 1]
    x.masked_fill_(x < threshold, float("-inf"))
    _write_back(logits, min_p.rows, x)


def exponential_race(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One draw per row from softmax(logits): argmax(probs / q), q ~ Exp(1).

    Returns [num_reqs] int64. Greedy rows get an arbitrary token (the caller replaces it).
    Seeded rows draw their noise from their own generator, with the same shape every
    step. q is made as -log(u), u ~ U[0, 1): 4 times faster than `exponential_` on CPU,
    and q lies in (0, inf], so probs / q is never NaN (a zero-probability token scores 0).
    """
    return race(logits.softmax(dim=-1), meta)


def race(
    probs: torch.Tensor,
    meta: SamplingMetadata,
    snapshots: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`exponential_race` on probabilities (rows need not sum to 1: a draw from each
    row renormalised). Overwrites `probs`. Returns [num_reqs] int64. `snapshots`, when
    given, receives each seeded row's generator state from before its draw."""
    u = torch.empty_like(probs)  # [num_reqs, vocab]
    if meta.any_unseeded_random:
        u.uniform_(generator=meta.shared_generator)
    else:
        u.fill_(0.5)  # only greedy rows left to fill; their draw is discarded
    vocab = probs.shape[1]
    for row, generator in meta.seeded:
        if snapshots is not None:
            snapshots[row] = generator.get_state()
        u[row] = torch.rand(vocab, generator=generator, device=probs.device)
    q = u.log_().neg_()
    return probs.div_(q).argmax(dim=-1)


def _fill_logprobs(
    out: list[TokenLogprobs | None],
    raw_logprobs: torch.Tensor,
    sampled: torch.Tensor,
    meta: SamplingMetadata,
) -> None:
    """Fill `out` at the rows that asked for logprobs (raw_logprobs: [L, vocab])."""
    req = meta.logprobs
    assert req is not None
    chosen = sampled if req.rows is None else sampled[req.rows]  # [L]
    chosen_lp = raw_logprobs.gather(1, chosen.unsqueeze(1))  # [L, 1]
    ranks = (raw_logprobs >= chosen_lp).sum(dim=-1)  # [L]
    if req.max_num > 0:
        top_lp, top_ids = raw_logprobs.topk(req.max_num, dim=-1)  # [L, max_num], descending
        top_lp_list, top_ids_list = top_lp.tolist(), top_ids.tolist()
    else:
        top_lp_list = top_ids_list = [[] for _ in req.row_list]
    chosen_list = chosen_lp.squeeze(1).tolist()
    rank_list = ranks.tolist()
    for j, (row, n) in enumerate(zip(req.row_list, req.num, strict=True)):
        top = list(zip(top_ids_list[j][:n], top_lp_list[j][:n], strict=True))
        out[row] = TokenLogprobs(logprob=chosen_list[j], top=top, rank=rank_list[j])
