"""Percentiles of the benches' latencies, one convention for all of them."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 to 100) of `values`, linearly interpolated between the
    two nearest ranks (numpy's default, as vLLM's serving benchmark reports them); None
    when empty. The p99 of 64 samples lies between the two slowest, the p50 of an even
    count is the mean of the middle two."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is in [0, 100], got {q}")
    xs = sorted(values)
    pos = q / 100 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
