"""`spur top --url URL`: a live terminal view of a running deployment.

Reads `GET /metrics` (the whole cluster's view, from any ingress) and
`GET /admin/lanes`, and draws with rich: per lane its target and why, per
replica its health, running / waiting, a KV-usage bar, blocks held vs
geometry, prefix hit rate and tokens/s (from two readings: the generated
tokens between two of the engine's reports, over the time between those reports,
`spur:engine_stats_age_seconds`; the readings' own times would alias with the
engines' one-second reports), and the failovers counted so far. `--once` prints
one frame (from the first reading to the one after every engine reported again)
and exits, for scripts.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Reading:
    """One poll: samples by (name, labels) and the lane report."""

    at: float
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    lanes: dict[str, Any] = field(default_factory=dict)

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return self.samples.get(name, [])

    def by_engine(self, name: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for labels, value in self.series(name):
            out[labels.get("engine", "")] += value
        return out

    def reported_at(self) -> dict[str, float]:
        """Engine -> when its counters were reported (this reading's clock)."""
        ages = self.by_engine("spur:engine_stats_age_seconds")
        return {rid: self.at - age for rid, age in ages.items()}


def report_gaps(now: Reading, before: Reading) -> dict[str, float]:
    """Engine -> seconds between its reports seen by `before` and by `now`, for the
    engines that reported in between (ages are rounded to the millisecond)."""
    at, then = now.reported_at(), before.reported_at()
    gaps = {rid: t - then[rid] for rid, t in at.items() if rid in then}
    return {rid: gap for rid, gap in gaps.items() if gap > 0.05}


def rates(now: Reading, before: Reading, name: str) -> dict[str, float]:
    """Engine -> the per-second rate of counter `name` from its report seen by `before`
    to the one seen by `now` (absent: no report in between)."""
    value, earlier = now.by_engine(name), before.by_engine(name)
    return {
        rid: (value.get(rid, 0.0) - earlier.get(rid, 0.0)) / gap
        for rid, gap in report_gaps(now, before).items()
    }


class TopError(Exception):
    """The server could not be read (printed as one line by the CLI)."""


def _get(url: str, admin_key: str | None) -> bytes:
    req = urllib.request.Request(url)
    if admin_key:
        req.add_header("Authorization", f"Bearer {admin_key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return bytes(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:200].decode(errors="replace")
        raise TopError(f"{url} answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise TopError(f"cannot reach {url}: {exc}") from None
    except ValueError:  # http.client's header check quotes the header, key included
        raise TopError(f"cannot send a request to {url}: the URL or the key is invalid") from None


def read(url: str, admin_key: str | None = None) -> Reading:
    url = url.rstrip("/")
    text = _get(f"{url}/metrics", admin_key).decode(errors="replace")
    reading = Reading(time.monotonic())
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                reading.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except ValueError:
        raise TopError(f"{url}/metrics is not Prometheus text: is this a spur server?") from None
    try:
        reading.lanes = json.loads(_get(f"{url}/admin/lanes", admin_key))
    except ValueError:
        raise TopError(f"{url}/admin/lanes is not JSON: is this a spur server?") from None
    return reading


def _bar(fraction: float, width: int = 12) -> str:
    fraction = min(1.0, max(0.0, fraction))
    full = round(fraction * width)
    return "█" * full + "·" * (width - full) + f" {fraction * 100:5.1f}%"


def frame(now: Reading, before: Reading | None = None) -> Any:
    """A rich renderable of one reading (tokens/s from `before`, when given)."""
    from rich.console import Group
    from rich.table import Table

    lanes = Table(title="lanes", expand=True)
    for col in ("lane", "kind", "target", "reason", "spare", "switches"):
        lanes.add_column(col)
    for name, lane in sorted(now.lanes.items()):
        lanes.add_row(
            name,
            str(lane.get("kind", "")),
            str(lane.get("target", name)),
            str(lane.get("reason", "")),
            str(lane.get("spare") or "-"),
            str(lane.get("switches", "-")),
        )

    running = now.by_engine("vllm:num_requests_running")
    waiting = now.by_engine("vllm:num_requests_waiting")
    usage = now.by_engine("vllm:kv_cache_usage_perc")
    held = now.by_engine("spur:kv_blocks_held")
    geometry = now.by_engine("spur:kv_blocks_geometry")
    hits = now.by_engine("vllm:prefix_cache_hits_total")
    queries = now.by_engine("vllm:prefix_cache_queries_total")
    per_s = rates(now, before, "vllm:generation_tokens_total") if before else {}

    replicas = Table(title="replicas", expand=True)
    for col in ("lane", "replica", "node", "health", "run", "wait", "KV usage", "held/geom",
                "prefix hit", "tok/s", "restarts"):  # fmt: skip
        replicas.add_column(col)
    for name, lane in sorted(now.lanes.items()):
        for r in lane.get("replicas", ()):
            rid = r["replica_id"]
            rate = per_s.get(rid)
            q = queries.get(rid, 0.0)
            replicas.add_row(
                name,
                rid,
                str(r.get("node", ""))[:16],
                "[green]healthy[/]" if r.get("healthy") else "[red]down[/]",
                str(int(running.get(rid, r.get("running", 0)))),
                str(int(waiting.get(rid, r.get("queue", 0)))),
                _bar(usage.get(rid, r.get("kv_usage", 0.0))),
                f"{int(held.get(rid, 0))}/{int(geometry.get(rid, 0))}",
                f"{hits.get(rid, 0.0) / q * 100:.0f}%" if q else "-",
                f"{rate:.1f}" if rate is not None else "-",
                str(r.get("restarts", 0)),
            )
        for slot in lane.get("down_slots", ()):
            replicas.add_row(name, "-", str(slot["node"])[:16], "[red]restart loop[/]",
                             "", "", "", "", "", "", str(slot["restarts"]))  # fmt: skip

    failovers = Table(title="failovers (since start)", expand=True)
    for col in ("lane", "from", "to", "reason", "count"):
        failovers.add_column(col)
    for labels, value in now.series("spur:lane_failovers_total"):
        if value:
            failovers.add_row(
                labels["lane"], labels["from"], labels["to"], labels["reason"], str(int(value))
            )
    return Group(lanes, replicas, failovers)


def run(url: str, *, once: bool, interval_s: float = 2.0, admin_key: str | None = None) -> int:
    """Draw until Ctrl-C (or one frame with `once`). Raises TopError."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    before = read(url, admin_key)
    if once:  # until every engine reported again (about a second), at most 5 s
        deadline = time.monotonic() + 5.0
        while True:
            time.sleep(0.25)
            now = read(url, admin_key)
            if set(report_gaps(now, before)) >= set(before.reported_at()):
                break
            if time.monotonic() > deadline:
                break
        console.print(frame(now, before))
        return 0
    with Live(frame(before), console=console, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                now = read(url, admin_key)
                live.update(frame(now, before))
                before = now
        except KeyboardInterrupt:
            return 0
