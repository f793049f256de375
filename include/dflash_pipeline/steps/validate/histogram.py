"""Fixed-size histograms for token counts, so percentiles of a dataset of any size cost ~35 KB.

Why: validation streams hundreds of millions of rows; keeping every length to sort would grow
with the dataset. Values below 256 get a bucket each (exact); above, every power of two is split
into 128 buckets, so a percentile is within 0.4% of the true value (bucket midpoint), and the
mean, total and maximum are exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SUB_BITS = 7
SUB = 1 << SUB_BITS  # buckets per power of two
EXACT = SUB << 1  # values below this have their own bucket
MAX_EXP = 40  # values are clipped to 2**41 - 1 (far beyond any token count)
N_BUCKETS = EXACT + (MAX_EXP - SUB_BITS) * SUB


def bucket_index(values: np.ndarray) -> np.ndarray:
    v = np.clip(np.asarray(values, dtype=np.int64), 0, (1 << (MAX_EXP + 1)) - 1)
    idx = v.copy()
    big = v >= EXACT
    if big.any():
        vb = v[big]
        exp = np.frexp(vb.astype(np.float64))[1].astype(np.int64) - 1  # floor(log2 v), exact below 2**53
        sub = (vb >> (exp - SUB_BITS)) - SUB
        idx[big] = EXACT + (exp - SUB_BITS - 1) * SUB + sub
    return idx


def bucket_bounds(idx: int) -> tuple[int, int]:
    """[low, high) of bucket `idx`."""
    if idx < EXACT:
        return idx, idx + 1
    exp = (idx - EXACT) // SUB + SUB_BITS + 1
    sub = (idx - EXACT) % SUB
    width = 1 << (exp - SUB_BITS)
    low = (SUB + sub) * width
    return low, low + width


class Histogram:
    """Counts of non-negative integers in log-linear buckets, plus exact count/sum/min/max."""

    def __init__(self) -> None:
        self.counts = np.zeros(N_BUCKETS, dtype=np.int64)
        self.n = 0
        self.total = 0
        self.max: int | None = None
        self.min: int | None = None

    def add(self, values: Any) -> None:
        v = np.asarray(values, dtype=np.int64)
        if v.size == 0:
            return
        self.counts += np.bincount(bucket_index(v), minlength=N_BUCKETS)
        self.n += int(v.size)
        self.total += int(v.sum())
        hi, lo = int(v.max()), int(v.min())
        self.max = hi if self.max is None else max(self.max, hi)
        self.min = lo if self.min is None else min(self.min, lo)

    def merge(self, other: Histogram) -> None:
        self.counts += other.counts
        self.n += other.n
        self.total += other.total
        for name, pick in (("max", max), ("min", min)):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, theirs if mine is None else mine if theirs is None else pick(mine, theirs))

    def quantile(self, q: float) -> int | None:
        """Nearest-rank quantile: the bucket holding the ceil(q*n)-th value, as its midpoint."""
        if self.n == 0:
            return None
        rank = max(1, int(np.ceil(q * self.n)))
        idx = int(np.searchsorted(np.cumsum(self.counts), rank))
        low, high = bucket_bounds(idx)
        mid = (low + high - 1) // 2
        assert self.min is not None and self.max is not None
        return int(min(max(mid, self.min), self.max))

    def summary(self) -> dict[str, Any]:
        return {
            "rows": self.n,
            "total": self.total,
            "mean": round(self.total / self.n, 1) if self.n else None,
            "p50": self.quantile(0.50),
            "p90": self.quantile(0.90),
            "p99": self.quantile(0.99),
            "max": self.max,
        }

    def nonzero(self) -> list[tuple[int, int, int]]:
        """(low, high, count) of the non-empty buckets, for plots."""
        return [(*bucket_bounds(int(i)), int(self.counts[i])) for i in np.flatnonzero(self.counts)]


LOG_EDGES = np.unique(np.concatenate([[0, 1], np.round(np.geomspace(1, 1 << 20, 61))]).astype(np.int64))
"""Bin edges of the 2-D thinking-vs-answer histogram: 0, then ~60 log-spaced bins up to 1M tokens."""


class Histogram2D:
    """A fixed grid of (x, y) counts on LOG_EDGES (values clipped into the last bin)."""

    def __init__(self) -> None:
        self.edges = LOG_EDGES
        self.counts = np.zeros((len(LOG_EDGES) - 1, len(LOG_EDGES) - 1), dtype=np.int64)
        self.n = 0

    def add(self, x: Any, y: Any) -> None:
        xs = np.clip(np.asarray(x, dtype=np.int64), 0, self.edges[-1] - 1)
        ys = np.clip(np.asarray(y, dtype=np.int64), 0, self.edges[-1] - 1)
        if xs.size == 0:
            return
        ix = np.searchsorted(self.edges, xs, side="right") - 1
        iy = np.searchsorted(self.edges, ys, side="right") - 1
        cols = self.counts.shape[1]
        self.counts += np.bincount(ix * cols + iy, minlength=self.counts.size).reshape(self.counts.shape)
        self.n += int(xs.size)
