"""`--plot PATH.png` for `spur bench serve`, `spur bench engine` and `spur bench spec`
(needs matplotlib: the `bench` extra).

`draw(result, path)` picks the picture for the result: with `--peer`, spur and
llama.cpp side by side (`peer.plot`); otherwise the Serve path against its
baseline (the offline engine, or `--baseline-url`): tokens/s of both arms and the
served arm's TTFT p50 / p99 against concurrency. `engine_profile(runs, path)`:
where a `bench engine` run's seconds went per dtype, as stacked bars, beside
earlier runs (`--plot-with LABEL=RUN.json`: the same workload before a lever).
`spec_itl(result, path)`: a `bench spec` run's inter-token latency p50 / p99 and
tokens/s with speculation off and on, per workload and concurrency.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; RuntimeError naming the fix."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'spur[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt: Any, fig: Any, path: str | Path) -> Path:
    """Write `fig` as PNG at `path` (its folder made), close it; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def draw(result: dict[str, Any], path: str | Path) -> Path:
    """Write the PNG for a `bench serve` result; returns its path."""
    if result.get("peer"):
        from spur.cluster.bench import peer

        return peer.plot(result, path)
    plt = pyplot()
    levels = result["levels"]
    cs = [lv["serve"]["concurrency"] for lv in levels]
    other = "baseline server" if result.get("baseline_url") else "offline engine"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    left.plot(cs, [lv["serve"]["tokens_per_s"] for lv in levels], "o-", label="spur serve")
    left.plot(cs, [lv["offline"]["tokens_per_s"] for lv in levels], "s--", label=other)
    left.set(title="output tokens/s", xlabel="concurrency", ylabel="tokens/s")
    for q, style in (("p50", "o-"), ("p99", "s--")):
        right.plot(cs, [lv["serve"][f"ttft_ms_{q}"] for lv in levels], style, label=f"TTFT {q}")
    right.set(title="spur serve: time to first token", xlabel="concurrency", ylabel="ms")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    title = f"spur bench serve: {result.get('model', '')}, {result.get('url', '')}"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save(plt, fig, path)


# Segments of a spur run's bar, bottom to top: (profile key, legend).
ENGINE_SEGMENTS = (
    ("matmuls_s", "matmuls (linear layers, LM head)"),
    ("kv_read_floor_s", "decode attention's K/V reads at the measured memory read rate"),
    ("outside_matmuls_s", "rest of the forward (attention, norms, RoPE, KV store, dispatch)"),
    ("prepare_s", "step inputs"),
    ("sample_s", "sampling"),
    ("engine_s", "engine (scheduling, outputs, Python between steps)"),
)


def engine_segments(spur: dict[str, Any]) -> dict[str, float]:
    """Seconds per segment of one `bench engine` spur arm. A run without the phase
    profile (older JSON) splits into its matmul floor and the rest; without the floor
    the forward stays whole (as "rest of the forward"). With the K/V read floor
    (`kv_read_floor_s`), that much of the rest is drawn as its own segment: the part
    of decode attention no kernel can remove."""
    prof = spur.get("profile")
    if not prof:
        total, mm = spur["elapsed_s"], spur.get("matmul_s") or 0.0
        out = {"matmuls_s": mm, "outside_matmuls_s": max(0.0, total - mm)}
    else:
        out = {key: float(prof.get(key) or 0.0) for key, _ in ENGINE_SEGMENTS}
        if "matmuls_s" not in prof:
            out["outside_matmuls_s"] = prof["forward_s"] + prof["logits_s"]
    kv = min(float(spur.get("kv_read_floor_s") or 0.0), out["outside_matmuls_s"])
    out["kv_read_floor_s"] = kv
    out["outside_matmuls_s"] -= kv
    return out


def engine_profile(runs: list[tuple[str, dict[str, Any]]], path: str | Path) -> Path:
    """Stacked bars of where spur's seconds went, one panel per dtype, one bar per run
    (`label`, a `bench engine` result) plus transformers' time in that run as a
    marker; returns the PNG's path."""
    plt = pyplot()
    dtypes = sorted({dt for _, r in runs for dt in r["results"]})
    # one panel gets the width its legend's long labels need in two columns
    width = 5.5 * len(dtypes) if len(dtypes) > 1 else 9.0
    fig, axes = plt.subplots(1, len(dtypes), figsize=(width, 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, dt in zip(axes[0], dtypes, strict=True):
        have = [(label, r["results"][dt]) for label, r in runs if dt in r["results"]]
        xs = range(len(have))
        bottoms = [0.0] * len(have)
        for i, (key, legend) in enumerate(ENGINE_SEGMENTS):
            heights = [engine_segments(e["spur"]).get(key, 0.0) for _, e in have]
            ax.bar(xs, heights, bottom=bottoms, color=colors[i % len(colors)], label=legend)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        hf = [e["hf"]["elapsed_s"] if "hf" in e else None for _, e in have]
        ax.scatter(
            [x for x, h in zip(xs, hf, strict=True) if h],
            [h for h in hf if h],
            marker="_",
            s=900,
            color="black",
            label="transformers, static batches (same run)",
            zorder=3,
        )
        for x, (_, e) in zip(xs, have, strict=True):
            if e.get("throughput_ratio"):
                ceiling = e.get("matmul_ceiling_ratio")
                share = f"\nshare {e['throughput_ratio'] / ceiling:.2f}" if ceiling else ""
                bound = e["spur"].get("matmul_share_bound")
                share += f"\nbound {bound:.2f}" if bound else ""
                ax.annotate(
                    f"{e['throughput_ratio']:.2f}x{share}",
                    (x, bottoms[x]),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(list(xs), [textwrap.fill(label, 16) for label, _ in have], fontsize=7)
        ax.set(title=f"{dt}: seconds of one generate()", ylabel="s")
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = 3 if len(dtypes) > 1 else 2
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=ncol, frameon=False)
    model = runs[-1][1].get("model", "")
    fig.suptitle(f"spur bench engine: {model}, where spur's time went", fontsize=9)
    fig.tight_layout(rect=(0, 0.02 + 0.04 * math.ceil(len(labels) / ncol), 1, 1))
    return save(plt, fig, path)


# (arm, label, color) of `spec_itl`'s bars; p99 is the same color, hatched and lighter.
SPEC_ARMS = (("off", "speculation off", "#4c72b0"), ("on", "speculation on", "#dd8452"))


def spec_levels(result: dict[str, Any]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Per workload, its levels as (concurrency, level) sorted by concurrency.
    ValueError when `result` is not a `bench spec` result (names what it is)."""
    if not isinstance(result, dict) or result.get("bench") != "spec":
        kind = result.get("bench") if isinstance(result, dict) else type(result).__name__
        raise ValueError(f"not a `spur bench spec` result (bench is {kind!r}): rerun with --json")
    try:
        levels = {
            workload: sorted((int(c), lv) for c, lv in entry["levels"].items())
            for workload, entry in result["results"].items()
        }
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"a `bench spec` result without its levels ({e!r})") from None
    if not levels or not all(levels.values()):
        raise ValueError("a `bench spec` result without its levels (no workload ran)")
    return levels


def spec_arm(level: dict[str, Any], arm: str, key: str) -> float | None:
    """Median over rounds of one figure of one arm of a level (None if no round has it)."""
    runs = level[arm] if isinstance(level[arm], list) else [level[arm]]
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def spec_itl(result: dict[str, Any], path: str | Path) -> Path:
    """Write the PNG of a `bench spec` result: per workload (a column), ITL p50 and p99
    (top) and tokens/s (bottom) of both arms at each concurrency, each the median of
    the rounds, with the level's median ratio on / off over the tokens/s bars.
    Returns its path; ValueError for a result of another bench (nothing written)."""
    workloads = spec_levels(result)
    plt = pyplot()
    cols = len(workloads)
    fig, axes = plt.subplots(
        2,
        cols,
        figsize=(5.2 * cols, 7.0),
        squeeze=False,
        gridspec_kw={"height_ratios": (3, 2)},
    )
    sp = result.get("speculative", {})
    limit = sp.get("disable_by_batch_size")
    width = 0.2
    for col, (workload, levels) in enumerate(workloads.items()):
        top, bottom = axes[0][col], axes[1][col]
        xs = range(len(levels))
        # Four bars a level: off p50, on p50, off p99, on p99.
        for i, (q, hatch, alpha) in enumerate((("p50", "", 1.0), ("p99", "//", 0.55))):
            for j, (arm, label, color) in enumerate(SPEC_ARMS):
                offset = (2 * i + j - 1.5) * width
                ys = [spec_arm(lv, arm, f"itl_ms_{q}") or 0.0 for _, lv in levels]
                bars = top.bar(
                    [x + offset for x in xs],
                    ys,
                    width,
                    color=color,
                    alpha=alpha,
                    hatch=hatch,
                    edgecolor="white" if not hatch else color,
                    label=f"ITL {q}, {label}",
                )
                top.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
        top.set(title=f'"{workload}": inter-token latency', ylabel="ms")
        top.margins(y=0.12)
        for j, (arm, label, color) in enumerate(SPEC_ARMS):
            ys = [spec_arm(lv, arm, "tokens_per_s") or 0.0 for _, lv in levels]
            bars = bottom.bar(
                [x + (j - 0.5) * 2 * width for x in xs], ys, 2 * width, color=color, label=label
            )
            bottom.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
        for x, (c, lv) in zip(xs, levels, strict=True):
            ratio = lv.get("speedup")
            drafts = spec_arm(lv, "on", "draft_tokens")
            accepted = spec_arm(lv, "on", "accepted_tokens")
            note = f"on/off {ratio:.2f}x tokens/s" if ratio else "on/off n/a"
            if drafts:
                note += f"\n{accepted or 0:.0f} of {drafts:.0f} drafts kept"
            else:
                note += "\nno drafts"
            if limit and c >= limit:
                note += f"\n(drafts only while < {limit} run)"
            high = max(spec_arm(lv, a, "tokens_per_s") or 0.0 for a, _, _ in SPEC_ARMS)
            bottom.annotate(
                note,
                (x, high),
                xytext=(0, 12),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
                fontweight="bold",
            )
        bottom.set(title=f'"{workload}": output tokens/s', ylabel="tokens/s")
        bottom.margins(y=0.6)
        for ax in (top, bottom):
            ax.set_xticks(list(xs), [f"concurrency {c}" for c, _ in levels])
            ax.set_ylim(bottom=0)
            ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4, frameon=False)
    cpu = result.get("cpu", {})
    title = (
        f"spur bench spec: {result.get('model', '')} {result.get('dtype', '')}, "
        f"{cpu.get('model', 'unknown CPU')} ({cpu.get('cores', '?')} cores)\n"
        f"{sp.get('method', 'ngram')} speculation, "
        f"num_speculative_tokens={sp.get('num_speculative_tokens', '?')}, "
        f"disable_by_batch_size={limit if limit else 'off (drafts at any size)'}"
        f"\nmedian of {result.get('rounds', '?')} alternating rounds; "
        "ITL = gap between a request's steps / tokens that step gave it"
    )
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return save(plt, fig, path)
