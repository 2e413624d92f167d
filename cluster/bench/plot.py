"""`--plot PATH.png` for `spur bench serve` (needs matplotlib: the `bench` extra).

`draw(result, path)` picks the picture for the result: with `--peer`, spur and
llama.cpp side by side (`peer.plot`); otherwise the Serve path against its
baseline (the offline engine, or `--baseline-url`): tokens/s of both arms and the
served arm's TTFT p50 / p99 against concurrency.
"""

from __future__ import annotations

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
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
