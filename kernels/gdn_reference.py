"""Torch reference ops of Gated DeltaNet (GDN) layers: causal conv1d and the gated delta rule.

These run on any device and are the CPU serving path of hybrid models (Qwen3.5,
Qwen3-Next). They follow transformers 5.24's `modeling_qwen3_next.py`
(`causal_conv1d_fn` / `causal_conv1d_update` with SiLU,
`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`); the tests
compare against those functions directly.

Two levels:

- Per-sequence ops (no batch dimension, or a batch of single steps), the math:
  `causal_conv1d_ref`, `causal_conv1d_update_ref`, `chunk_gated_delta_rule_ref`,
  `recurrent_gated_delta_rule_ref`, `gated_delta_rule_step_ref`.
- Varlen ops over one step's flattened batch (prefill chunks and decodes laid end
  to end, as attention sees them), reading initial states from and writing final
  states to a state pool through per-sequence slot indices:
  `causal_conv1d_varlen_ref`, `gated_delta_rule_varlen_ref`, both described by one
  `GDNMetadata` per step (`build_gdn_metadata`). The Triton launchers
  (kernels/gdn_triton.py, kernels/gdn_conv_triton.py) take the same arguments.

State pool layout of one GDN layer (a "slot" is one state block of a state group):

```
conv_state [num_slots, conv_kernel - 1, conv_dim]      the last K-1 conv INPUTS (pre-activation)
ssm_state  [num_slots, num_v_heads, k_head_dim, v_head_dim]   recurrent state S, out = q @ S
```

Each slot's state is contiguous (inner dimensions dense); the slot stride is free,
so both states of a layer may be views into one page buffer. The state dtype may
differ from the activations' (float32 by default, like transformers' cache): the
math runs in float32 and the final state is cast to the pool's dtype when stored.

Flattened step (same convention as kernels/metadata.py):

```
tokens            | s0: 5 (prefill chunk) | s1: 1 (decode) | s2: 3 | pad |
query_start_loc   0                       5                6       9     (num_actual_tokens = 9)
src_slots         [7, 2, 4]      read the initial state here when has_initial_state
dst_slots         [7, 3, 4]      write the final state here (s1: copy-on-write into 3)
has_initial_state [T, T, F]      F: start from zeros (a sequence's first chunk)
```

Contract on slots: `dst_slots` are distinct, and a sequence's dst slot is never
another sequence's src slot (the kernels read and write states in parallel);
`dst == src` for the same sequence is the usual in-place update. Padding rows
past `num_actual_tokens` get zero output. A sequence with zero tokens this step
leaves its dst slot untouched.

Conventions of the gated delta rule (transformers'): q, k [*, num_k_heads, k_head_dim],
v [*, num_v_heads, v_head_dim]; each q/k head serves `num_v_heads // num_k_heads`
consecutive v heads; g is the log-decay (<= 0; the state is multiplied by exp(g)
before each token's update), beta the write strength in (0, 1); q is multiplied
by `scale` (default k_head_dim ** -0.5) after the optional L2 normalisation of q
and k (`x * rsqrt(sum(x^2) + 1e-6)`, in float32). Per token t, per v head:

```
S = S * exp(g_t)
S = S + k_t^T ((v_t - k_t S) * beta_t)       the delta rule write   S [k_head_dim, v_head_dim]
o_t = (scale * q_t) S
```
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
ACTIVATIONS = ("silu", "swish", None)

# --------------------------------------------------------------------------- metadata


@dataclass
class GDNMetadata:
    """Where each sequence's tokens and states are, for one step of GDN layers.

    Tensors without the `_cpu` suffix live on the model's device; the `_cpu`
    copies carry the same values so that host code (this reference, launch
    grids) never forces a device sync. Build with `build_gdn_metadata`, which
    validates the slot contract. Shared by every GDN layer of a step (each layer
    has its own pool tensors; the slots are the same).
    """

    num_seqs: int
    # Tokens of real sequences; rows past this in the flattened inputs are padding.
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative token counts
    src_slots: torch.Tensor  # [num_seqs] int64, slot holding the initial state
    dst_slots: torch.Tensor  # [num_seqs] int64, slot receiving the final state
    has_initial_state: torch.Tensor  # [num_seqs] bool, False = start from zeros
    query_start_loc_cpu: torch.Tensor  # [num_seqs + 1] int32 on CPU
    src_slots_cpu: torch.Tensor  # [num_seqs] int64 on CPU
    dst_slots_cpu: torch.Tensor  # [num_seqs] int64 on CPU
    has_initial_state_cpu: torch.Tensor  # [num_seqs] bool on CPU
    # Per-step values a backend derives once and reuses in every layer (keyed by
    # the backend; a step's metadata never changes, so they never go stale).
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """Tokens per sequence this step, on CPU.  # [num_seqs] int32"""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    def to(self, device: torch.device | str) -> GDNMetadata:
        """A copy whose device tensors live on `device` (the `_cpu` ones stay; no memo)."""
        return GDNMetadata(
            num_seqs=self.num_seqs,
            num_actual_tokens=self.num_actual_tokens,
            max_query_len=self.max_query_len,
            query_start_loc=self.query_start_loc.to(device),
            src_slots=self.src_slots.to(device),
            dst_slots=self.dst_slots.to(device),
            has_initial_state=self.has_initial_state.to(device),
            query_start_loc_cpu=self.query_start_loc_cpu,
            src_slots_cpu=self.src_slots_cpu,
            dst_slots_cpu=self.dst_slots_cpu,
            has_initial_state_cpu=self.has_initial_state_cpu,
        )


def build_gdn_metadata(
    query_lens: Sequence[int],
    src_slots: Sequence[int],
    has_initial_state: Sequence[bool],
    dst_slots: Sequence[int] | None = None,
    *,
    device: torch.device | str = "cpu",
) -> GDNMetadata:
    """Build one step's GDNMetadata from host lists (one entry per sequence).

    `dst_slots` defaults to `src_slots` (update in place). Raises ValueError
    when lengths differ, a length or slot is negative, dst slots repeat, or a
    dst slot is another sequence's src slot (the kernels would race).
    """
    n = len(query_lens)
    dst = list(src_slots) if dst_slots is None else list(dst_slots)
    if not (len(src_slots) == len(has_initial_state) == len(dst) == n):
        raise ValueError(
            f"query_lens, src_slots, has_initial_state and dst_slots need one entry per sequence, "
            f"got {n}, {len(src_slots)}, {len(has_initial_state)}, {len(dst)}"
        )
    if any(q < 0 for q in query_lens):
        raise ValueError(f"query_lens must be >= 0, got {list(query_lens)}")
    if any(s < 0 for s in (*src_slots, *dst)):
        raise ValueError("state slots must be >= 0: give every sequence a slot (padding: any free)")
    if len(set(dst)) != n:
        raise ValueError(f"dst_slots must be distinct, got {dst}: give each sequence its own block")
    readers: dict[int, list[int]] = {}  # slot -> sequences reading it (several may share one)
    for j, s in enumerate(src_slots):
        if has_initial_state[j]:
            readers.setdefault(s, []).append(j)
    for i, d in enumerate(dst):
        others = [j for j in readers.get(d, ()) if j != i]
        if others:
            raise ValueError(
                f"sequence {i} writes slot {d} that sequence {others[0]} reads: copy the state "
                "first or choose another destination block"
            )
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    if n:
        qsl[1:] = torch.cumsum(torch.tensor(list(query_lens), dtype=torch.int64), 0)
    src_cpu = torch.tensor(list(src_slots), dtype=torch.int64)
    dst_cpu = torch.tensor(dst, dtype=torch.int64)
    init_cpu = torch.tensor([bool(h) for h in has_initial_state], dtype=torch.bool)
    return GDNMetadata(
        num_seqs=n,
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens, default=0),
        query_start_loc=qsl.to(device),
        src_slots=src_cpu.to(device),
        dst_slots=dst_cpu.to(device),
        has_initial_state=init_cpu.to(device),
        query_start_loc_cpu=qsl,
        src_slots_cpu=src_cpu,
        dst_slots_cpu=dst_cpu,
        has_initial_state_cpu=init_cpu,
    )


# --------------------------------------------------------------------------- validation


def check_conv_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    activation: str | None,
) -> None:
    """Raise ValueError naming the problem if the varlen conv's arguments do not fit."""
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, conv_dim], got shape {tuple(x.shape)}")
    conv_dim = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != conv_dim or weight.shape[1] < 2:
        raise ValueError(
            f"weight must be [conv_dim={conv_dim}, kernel_size>=2] (squeeze nn.Conv1d's "
            f"[C, 1, K] weight), got shape {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (conv_dim,):
        raise ValueError(f"bias must be [conv_dim={conv_dim}], got shape {tuple(bias.shape)}")
    kernel = weight.shape[1]
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (kernel - 1, conv_dim):
        raise ValueError(
            f"conv_state must be [num_slots, kernel_size - 1 = {kernel - 1}, conv_dim = "
            f"{conv_dim}], got shape {tuple(conv_state.shape)}"
        )
    if conv_state.stride(2) != 1 or conv_state.stride(1) != conv_dim:
        raise ValueError(
            "conv_state must be contiguous within a slot (only the slot stride is free)"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is unsupported: use 'silu' or None")


def check_gdn_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
) -> None:
    """Raise ValueError naming the problem if the varlen gated delta rule's arguments do not fit."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(
            f"q and k must both be [num_tokens, num_k_heads, k_head_dim], got {tuple(q.shape)} "
            f"and {tuple(k.shape)}"
        )
    num_tokens, num_k_heads, k_head_dim = q.shape
    if v.dim() != 3 or v.shape[0] != num_tokens:
        raise ValueError(
            f"v must be [num_tokens={num_tokens}, num_v_heads, v_head_dim], got {tuple(v.shape)}"
        )
    num_v_heads, v_head_dim = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise ValueError(
            f"num_v_heads={num_v_heads} must be a multiple of num_k_heads={num_k_heads}"
        )
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (num_tokens, num_v_heads):
            raise ValueError(
                f"{name} must be [num_tokens={num_tokens}, num_v_heads={num_v_heads}], got "
                f"{tuple(t.shape)}"
            )
    expected = (num_v_heads, k_head_dim, v_head_dim)
    if ssm_state.dim() != 4 or tuple(ssm_state.shape[1:]) != expected:
        raise ValueError(
            f"ssm_state must be [num_slots, num_v_heads, k_head_dim, v_head_dim] = "
            f"[*, {', '.join(map(str, expected))}], got shape {tuple(ssm_state.shape)}"
        )
    if (
        ssm_state.stride(3) != 1
        or ssm_state.stride(2) != v_head_dim
        or (ssm_state.stride(1) != k_head_dim * v_head_dim)
    ):
        raise ValueError(
            "ssm_state must be contiguous within a slot (only the slot stride is free)"
        )


# --------------------------------------------------------------------------- varlen plumbing


@dataclass
class _Plan:
    """Host-side view of one step: which sequences run, which are single-token decodes."""

    qsl: list[int]  # query_start_loc as a list
    live: list[int]  # sequences with tokens this step
    live_t: torch.Tensor  # the same, int64 on CPU
    decodes: list[int]  # positions in `live` of single-token sequences
    decode_rows: slice | list[int]  # their token rows (a slice when consecutive)

    @property
    def all_decodes(self) -> bool:
        return len(self.decodes) == len(self.live)


def _plan(metadata: GDNMetadata) -> _Plan:
    qsl = metadata.query_start_loc_cpu.tolist()
    live = [i for i in range(metadata.num_seqs) if qsl[i + 1] > qsl[i]]
    decodes = [j for j, i in enumerate(live) if qsl[i + 1] - qsl[i] == 1]
    rows = [qsl[live[j]] for j in decodes]
    consecutive = bool(rows) and rows == list(range(rows[0], rows[0] + len(rows)))
    return _Plan(
        qsl=qsl,
        live=live,
        live_t=torch.tensor(live, dtype=torch.int64),
        decodes=decodes,
        decode_rows=slice(rows[0], rows[0] + len(rows)) if consecutive else rows,
    )


def _gather_initial(pool: torch.Tensor, metadata: GDNMetadata, plan: _Plan) -> torch.Tensor:
    """float32 initial states of the live sequences (zeros without one), a copy.

    [num_live, *pool.shape[1:]]; copied before any final state is written, so
    a sequence may write the slot it read (dst == src).
    """
    src = metadata.src_slots_cpu[plan.live_t].to(pool.device)
    init = pool.index_select(0, src)
    init = init if init.dtype == torch.float32 else init.float()
    fresh = ~metadata.has_initial_state_cpu[plan.live_t]
    if bool(fresh.any()):
        init[fresh.to(pool.device)] = 0
    return init


def _scatter_final(pool: torch.Tensor, metadata: GDNMetadata, plan: _Plan, finals) -> None:
    dst = metadata.dst_slots_cpu[plan.live_t].to(pool.device)
    pool.index_copy_(0, dst, finals.to(pool.dtype))


def _pick(t: torch.Tensor, rows: slice | list[int]) -> torch.Tensor:
    return t[rows] if isinstance(rows, slice) else t[torch.tensor(rows, device=t.device)]


def _put(out: torch.Tensor, rows: slice | list[int], values: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = values
    else:
        out[torch.tensor(rows, device=out.device)] = values


# --------------------------------------------------------------------------- conv1d


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(x)
    if activation is None:
        return x
    raise ValueError(f"activation {activation!r} is unsupported: use 'silu' or None")


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence, continuing from `initial_state`.

    x: [seq_len, conv_dim]; weight: [conv_dim, K]; bias: [conv_dim] | None;
    initial_state: [K-1, conv_dim] (the previous K-1 inputs) | None = zeros.
    Returns (out [seq_len, conv_dim] in x's dtype, final_state [K-1, conv_dim] in
    float32: the last K-1 inputs of initial_state ++ x). Pure (mutates nothing).
    out[t] = act(bias + sum_j weight[:, j] * xx[t + j]) over xx = initial_state ++ x,
    computed in float32.
    """
    kernel = weight.shape[1]
    conv_dim = x.shape[1]
    if initial_state is None:
        initial_state = x.new_zeros((kernel - 1, conv_dim), dtype=torch.float32)
    xx = torch.cat([initial_state.float(), x.float()], dim=0)  # [K-1 + seq_len, C]
    out = F.conv1d(
        xx.t().unsqueeze(0),
        weight.float().unsqueeze(1),
        None if bias is None else bias.float(),
        groups=conv_dim,
    )[0].t()  # [seq_len, C]
    return _activate(out, activation).to(x.dtype), xx[xx.shape[0] - (kernel - 1) :].clone()


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step of a batch: conv over the saved K-1 inputs and the new one.

    x: [batch, conv_dim]; conv_state: [batch, K-1, conv_dim], updated in place
    (shifted left by one, x appended). Returns out [batch, conv_dim] in x's dtype.
    """
    xx = torch.cat([conv_state.float(), x.float().unsqueeze(1)], dim=1)  # [B, K, C]
    out = (xx * weight.float().t().unsqueeze(0)).sum(1)
    if bias is not None:
        out = out + bias.float()
    conv_state.copy_(xx[:, 1:])
    return _activate(out, activation).to(x.dtype)


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    metadata: GDNMetadata,
    activation: str | None = "silu",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal conv over one step's flattened batch, states read from / written to the pool.

    x: [num_tokens, conv_dim] (rows past metadata.num_actual_tokens are padding);
    weight: [conv_dim, K]; bias: [conv_dim] | None; conv_state: [num_slots, K-1,
    conv_dim], mutated: each sequence with tokens writes its last K-1 inputs to
    its dst slot (read from the src slot first when has_initial_state, zeros
    otherwise). Returns out [num_tokens, conv_dim] in x's dtype (padding rows 0),
    written into `out` when given.
    """
    check_conv_args(x, weight, bias, conv_state, activation)
    if out is None:
        out = torch.empty_like(x)
    out[metadata.num_actual_tokens :] = 0
    plan = _plan(metadata)
    if not plan.live:
        return out
    init = _gather_initial(conv_state, metadata, plan)  # [num_live, K-1, C]
    if plan.decodes:
        state = init if plan.all_decodes else init[plan.decodes]
        o = causal_conv1d_update_ref(_pick(x, plan.decode_rows), state, weight, bias, activation)
        _put(out, plan.decode_rows, o)
        if not plan.all_decodes:
            init[plan.decodes] = state
    qsl = plan.qsl
    for j, i in enumerate(plan.live):
        if qsl[i + 1] - qsl[i] == 1:
            continue
        rows = slice(qsl[i], qsl[i + 1])
        out[rows], init[j] = causal_conv1d_ref(x[rows], weight, bias, init[j], activation)
    _scatter_final(conv_state, metadata, plan, init)
    return out


# --------------------------------------------------------------------------- gated delta rule


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) along `dim` (transformers' / FLA's form, not F.normalize)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float | None, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 q (normalised, scaled) and k (normalised), heads repeated to num_v_heads.

    q, k: [..., num_k_heads, k_head_dim] -> [..., num_v_heads, k_head_dim].
    """
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = num_v_heads // q.shape[-2]
    if group > 1:
        q = q.repeat_interleave(group, dim=-2)
        k = k.repeat_interleave(group, dim=-2)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def gated_delta_rule_step_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of a batch of sequences (the decode form).

    q, k: [batch, num_k_heads, k_head_dim]; v: [batch, num_v_heads, v_head_dim];
    g, beta: [batch, num_v_heads]; state: [batch, num_v_heads, k_head_dim,
    v_head_dim] (not mutated). Returns (out [batch, num_v_heads, v_head_dim] in
    q's dtype, new_state float32 [batch, num_v_heads, k_head_dim, v_head_dim]).
    """
    batch, num_v_heads, v_head_dim = v.shape
    k_head_dim = q.shape[-1]
    bh = batch * num_v_heads
    qf, kf = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm)
    # Batched matmuls over (batch x head): a few passes over the state instead of
    # broadcast-and-sum temporaries (the decode path is state-bandwidth bound).
    s = (state.float() * g.float().exp()[..., None, None]).reshape(bh, k_head_dim, v_head_dim)
    kv_mem = torch.bmm(kf.reshape(bh, 1, k_head_dim), s).view(batch, num_v_heads, v_head_dim)
    delta = (v.float() - kv_mem) * beta.float().unsqueeze(-1)  # [B, Hv, dv]
    s = s.baddbmm_(kf.reshape(bh, k_head_dim, 1), delta.reshape(bh, 1, v_head_dim))
    out = torch.bmm(qf.reshape(bh, 1, k_head_dim), s).view(batch, num_v_heads, v_head_dim)
    return out.to(q.dtype), s.view(batch, num_v_heads, k_head_dim, v_head_dim)


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule of one sequence, token by token (transformers' recurrent form).

    q, k: [seq_len, num_k_heads, k_head_dim]; v: [seq_len, num_v_heads,
    v_head_dim]; g, beta: [seq_len, num_v_heads]; initial_state: [num_v_heads,
    k_head_dim, v_head_dim] | None = zeros (not mutated). Returns (out [seq_len,
    num_v_heads, v_head_dim] in q's dtype, final_state float32 [num_v_heads,
    k_head_dim, v_head_dim]).
    """
    seq_len, num_v_heads, v_head_dim = v.shape
    state = _initial(initial_state, num_v_heads, q.shape[-1], v_head_dim, v.device)
    out = torch.empty((seq_len, num_v_heads, v_head_dim), dtype=q.dtype, device=q.device)
    state = state.unsqueeze(0)
    for t in range(seq_len):
        o, state = gated_delta_rule_step_ref(
            q[t : t + 1],
            k[t : t + 1],
            v[t : t + 1],
            g[t : t + 1],
            beta[t : t + 1],
            state,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
        )
        out[t] = o[0]
    return out, state[0]


def _initial(
    initial_state: torch.Tensor | None, heads: int, dk: int, dv: int, device: torch.device
) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros((heads, dk, dv), dtype=torch.float32, device=device)
    return initial_state.float()


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule of one sequence in chunks (the prefill form; transformers' algorithm).

    Same arguments and results as `recurrent_gated_delta_rule_ref`; equal to it
    up to float32 rounding (about 1e-6 relative). Within a chunk of C tokens the
    C delta-rule writes are condensed by a unit lower-triangular solve (the UT
    transform), then one matmul reads and one updates the state per chunk:

    ```
    A[i, j]  = beta_i (k_i . k_j) exp(G_i - G_j)   for j < i    G = cumsum(g) in the chunk
    U = (I + A)^-1 (beta v)      W = (I + A)^-1 (beta k exp(G))
    V' = U - W S                 (the part of the values the old state does not predict)
    o  = (q exp(G)) S + [(q k^T) exp(G_i - G_j)]_{j <= i} V'
    S  = S exp(G_last) + (k exp(G_last - G))^T V'
    ```
    """
    seq_len, num_v_heads, v_head_dim = v.shape
    k_head_dim = q.shape[-1]
    state = _initial(initial_state, num_v_heads, k_head_dim, v_head_dim, v.device)
    if seq_len == 0:
        return v.new_zeros((0, num_v_heads, v_head_dim), dtype=q.dtype), state
    qf, kf = _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm)
    # [Hv, T, d] layout, padded to whole chunks (padding: zero k, v, beta and g).
    qf, kf, vf = (t.transpose(0, 1) for t in (qf, kf, v.float()))
    bf, gf = beta.float().t(), g.float().t()
    pad = (-seq_len) % chunk_size
    qf, kf, vf = (F.pad(t, (0, 0, 0, pad)) for t in (qf, kf, vf))
    bf, gf = F.pad(bf, (0, pad)), F.pad(gf, (0, pad))
    n = (seq_len + pad) // chunk_size
    qf, kf, vf = (t.reshape(num_v_heads, n, chunk_size, -1) for t in (qf, kf, vf))
    bf, gf = bf.reshape(num_v_heads, n, chunk_size), gf.reshape(num_v_heads, n, chunk_size)

    cum = gf.cumsum(-1)  # [Hv, n, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = kf * bf.unsqueeze(-1)
    system = (k_beta @ kf.transpose(-1, -2)) * decay  # the diagonal is ignored (unitriangular)
    # One solve for both right-hand sides: U = T^-1 (beta v), W = T^-1 (beta k exp(G)).
    rhs = torch.cat([vf * bf.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    uw = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :v_head_dim], uw[..., v_head_dim:]
    attn = (qf @ kf.transpose(-1, -2)) * decay
    q_decayed = qf * cum.exp().unsqueeze(-1)
    k_decayed = kf * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [Hv, n, 1, 1]
    out = torch.empty_like(vf)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ v_new
        state = state * chunk_decay[:, i] + k_decayed[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(num_v_heads, -1, v_head_dim)[:, :seq_len].transpose(0, 1)
    return out.to(q.dtype).contiguous(), state


def gated_delta_rule_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    metadata: GDNMetadata,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated delta rule over one step's flattened batch, states through the pool.

    q, k: [num_tokens, num_k_heads, k_head_dim]; v: [num_tokens, num_v_heads,
    v_head_dim]; g, beta: [num_tokens, num_v_heads] (g the log-decay, already
    `-exp(A_log) * softplus(a + dt_bias)`; beta already sigmoid(b)); ssm_state:
    [num_slots, num_v_heads, k_head_dim, v_head_dim], mutated: each sequence with
    tokens writes its final state to its dst slot (starting from its src slot
    when has_initial_state, zeros otherwise). Single-token sequences take the
    recurrent step (batched), longer ones the chunked form, as transformers does.
    Returns out [num_tokens, num_v_heads, v_head_dim] in q's dtype (padding rows
    0), written into `out` when given.
    """
    check_gdn_args(q, k, v, g, beta, ssm_state)
    num_v_heads, v_head_dim = v.shape[1:]
    if out is None:
        out = q.new_empty((q.shape[0], num_v_heads, v_head_dim))
    out[metadata.num_actual_tokens :] = 0
    plan = _plan(metadata)
    if not plan.live:
        return out
    init = _gather_initial(ssm_state, metadata, plan)  # [num_live, Hv, dk, dv] float32
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm)
    finals = init
    if plan.decodes:
        rows = plan.decode_rows
        state = init if plan.all_decodes else init[plan.decodes]
        picked = (_pick(t, rows) for t in (q, k, v, g, beta))
        o, new = gated_delta_rule_step_ref(*picked, state, **kw)
        _put(out, rows, o)
        if plan.all_decodes:
            finals = new
        else:
            init[plan.decodes] = new
    qsl = plan.qsl
    for j, i in enumerate(plan.live):
        if qsl[i + 1] - qsl[i] == 1:
            continue
        s = slice(qsl[i], qsl[i + 1])
        out[s], init[j] = chunk_gated_delta_rule_ref(
            q[s], k[s], v[s], g[s], beta[s], init[j], chunk_size=chunk_size, **kw
        )
    _scatter_final(ssm_state, metadata, plan, finals)
    return out
