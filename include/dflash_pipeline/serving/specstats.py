"""Speculative-decoding statistics: one definition of acceptance across engines, and its arithmetic.

Why one module: the figure users judge a drafter by is its acceptance length, and SGLang and vLLM
each report it their own way. Rows, the validation report and `dflash_eval` all count it here.

Definition (ours, everywhere): a request's speculative decoding ran `verify_steps` verification
steps (forward passes of the target over a draft) and the target accepted `accepted_tokens` draft
tokens in all; every step also yields one token of the target's own (the bonus / corrected token).

    acceptance length = (verify_steps + accepted_tokens) / verify_steps = 1 + accepted / verify_steps

Across rows it is token-weighted: Σ(verify + accepted) / Σ verify, never the mean of per-row
figures (short rows would weigh as much as long ones). This is vLLM's `mean_acceptance_length`
and its `/metrics` figure `1 + Δaccepted / Δdrafts`. SGLang's own `spec_accept_length` is
`completion_tokens / spec_verify_ct`: it also counts the token produced by prefill (and a stop
token the draft never saw), so on a short output it reads higher than ours; we compute ours from
its counters, not its ratio.

`histogram[k]` is the number of verify steps that accepted exactly k draft tokens (k = 0 … draft
length). Acceptance is a prefix, so position i (1-based) was accepted in every step with k >= i:
the per-position acceptance rate is Σ_{k>=i} histogram[k] / Σ histogram (vLLM's
`num_accepted_tokens_per_pos / num_drafts`).

Null, never zero, where a server does not speculate or does not say: `SpecStats` is absent then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# The row/turn columns that carry a request's statistics (dataset/records.py declares their types).
SPEC_COLUMNS = ("spec_verify_steps", "spec_accepted_tokens", "spec_draft_tokens", "spec_accept_histogram")


@dataclass(frozen=True)
class SpecStats:
    """One request's (or a sum of requests') speculative-decoding counters."""

    verify_steps: int
    accepted_tokens: int
    # Draft tokens proposed; None where the engine does not count them (SGLang estimates them as
    # verify steps x (draft length - 1); such an estimate is stored as the engine gave it).
    draft_tokens: int | None = None
    histogram: tuple[int, ...] | None = None

    @property
    def acceptance_length(self) -> float | None:
        return acceptance_length(self.verify_steps, self.accepted_tokens)

    @property
    def draft_acceptance_rate(self) -> float | None:
        if not self.draft_tokens:
            return None
        return self.accepted_tokens / self.draft_tokens

    def __add__(self, other: SpecStats) -> SpecStats:
        draft = None if self.draft_tokens is None or other.draft_tokens is None else self.draft_tokens + other.draft_tokens
        return SpecStats(
            self.verify_steps + other.verify_steps,
            self.accepted_tokens + other.accepted_tokens,
            draft,
            add_histograms(self.histogram, other.histogram),
        )

    def to_columns(self) -> dict[str, Any]:
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accept_histogram": list(self.histogram) if self.histogram is not None else None,
        }

    @classmethod
    def from_columns(cls, row: Mapping[str, Any]) -> SpecStats | None:
        """A row's or turn's statistics, None when it has none (null columns)."""
        verify = row.get("spec_verify_steps")
        accepted = row.get("spec_accepted_tokens")
        if verify is None or accepted is None:
            return None
        hist = row.get("spec_accept_histogram")
        draft = row.get("spec_draft_tokens")
        return cls(int(verify), int(accepted), None if draft is None else int(draft),
                   None if hist is None else tuple(int(x) for x in hist))


def add_histograms(a: Sequence[int] | None, b: Sequence[int] | None) -> tuple[int, ...] | None:
    """Element-wise sum, the shorter padded with zeros; None if either is unknown."""
    if a is None or b is None:
        return None
    n = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))


def total(stats: Iterable[SpecStats | None]) -> SpecStats | None:
    """The sum of the known statistics; None when none is known."""
    out: SpecStats | None = None
    for s in stats:
        if s is not None:
            out = s if out is None else out + s
    return out


def acceptance_length(verify_steps: int | None, accepted_tokens: int | None) -> float | None:
    if not verify_steps or accepted_tokens is None:
        return None
    return 1.0 + accepted_tokens / verify_steps


def per_position_rates(histogram: Sequence[int] | None) -> list[float] | None:
    """rate[i-1] = share of verify steps that accepted draft position i (module docstring)."""
    if not histogram:
        return None
    steps = sum(histogram)
    if steps <= 0:
        return None
    tail = np.cumsum(np.asarray(histogram, dtype=np.float64)[::-1])[::-1]
    return [float(x) / steps for x in tail[1:]]


def token_weighted(verify: Sequence[int], accepted: Sequence[int]) -> float | None:
    v = float(np.sum(np.asarray(verify, dtype=np.float64)))
    if v <= 0:
        return None
    return 1.0 + float(np.sum(np.asarray(accepted, dtype=np.float64))) / v


def bootstrap_ci(
    verify: Sequence[int],
    accepted: Sequence[int],
    *,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Confidence interval of the token-weighted acceptance length, resampling requests (rows).

    scipy's bootstrap (BCa, paired: a row's verify steps and accepted tokens stay together). Rows,
    not tokens, are the unit: tokens of one request are not independent. None with fewer than two
    rows; a degenerate sample (every row the same ratio) gives the point as both ends.

    Above BOOTSTRAP_MAX_ROWS rows the interval is the delta method's (normal, ratio of sums): BCa's
    jackknife holds an n x n array and a resample n x n_resamples, which a 900k-row run cannot
    afford; at that size the ratio estimator is close to normal and the two agree."""
    v = np.asarray(verify, dtype=np.float64)
    a = np.asarray(accepted, dtype=np.float64)
    if len(v) < 2 or float(v.sum()) <= 0:
        return None
    point = token_weighted(v, a)
    assert point is not None
    ratios = np.divide(a, v, out=np.zeros_like(a), where=v > 0)
    if np.allclose(ratios[v > 0], ratios[v > 0][0]):
        return (point, point)
    if len(v) > BOOTSTRAP_MAX_ROWS:
        return delta_ci(v, a, confidence=confidence)
    from scipy import stats  # imported here: a heavy import only the report needs

    def statistic(vs: np.ndarray, acc: np.ndarray, axis: int = -1) -> np.ndarray:
        den = vs.sum(axis=axis)
        return 1.0 + acc.sum(axis=axis) / np.where(den > 0, den, np.nan)

    res = stats.bootstrap(
        (v, a), statistic, paired=True, vectorized=True, n_resamples=n_resamples, confidence_level=confidence,
        method="BCa", random_state=np.random.default_rng(seed),
    )
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (np.isfinite(low) and np.isfinite(high)):  # BCa can fail on tiny or skewed samples
        res = stats.bootstrap(
            (v, a), statistic, paired=True, vectorized=True, n_resamples=n_resamples,
            confidence_level=confidence, method="percentile", random_state=np.random.default_rng(seed),
        )
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return (low, high)


BOOTSTRAP_MAX_ROWS = 2000


def delta_ci(verify: Sequence[int], accepted: Sequence[int], *, confidence: float = 0.95) -> tuple[float, float] | None:
    """Normal interval of 1 + sum(a) / sum(v) by the delta method (linearised ratio of sums, rows iid)."""
    from scipy import stats

    v = np.asarray(verify, dtype=np.float64)
    a = np.asarray(accepted, dtype=np.float64)
    n = len(v)
    if n < 2 or v.sum() <= 0:
        return None
    r = a.sum() / v.sum()
    resid = a - r * v
    se = float(np.sqrt(resid.var(ddof=1) / n) / v.mean())
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    return (1.0 + r - z * se, 1.0 + r + z * se)


@dataclass(frozen=True)
class GroupFigure:
    """Acceptance of one group of rows (a domain, a thinking mode, a drafter)."""

    rows: int
    rows_with_stats: int
    verify_steps: int
    accepted_tokens: int
    acceptance_length: float | None
    ci: tuple[float, float] | None
    per_position: list[float] | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "rows_with_stats": self.rows_with_stats,
            "verify_steps": self.verify_steps,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_length": self.acceptance_length,
            "ci_low": self.ci[0] if self.ci else None,
            "ci_high": self.ci[1] if self.ci else None,
            "per_position": self.per_position,
        }


def group_figure(rows: Sequence[Mapping[str, Any]], *, confidence: float = 0.95, n_resamples: int = 2000,
                 seed: int = 0) -> GroupFigure:
    """Token-weighted acceptance, its CI and per-position rates over rows carrying SPEC_COLUMNS."""
    stats = [SpecStats.from_columns(r) for r in rows]
    known = [s for s in stats if s is not None and s.verify_steps > 0]
    verify = [s.verify_steps for s in known]
    accepted = [s.accepted_tokens for s in known]
    summed = total(known)
    return GroupFigure(
        rows=len(rows),
        rows_with_stats=len(known),
        verify_steps=int(sum(verify)),
        accepted_tokens=int(sum(accepted)),
        acceptance_length=token_weighted(verify, accepted),
        ci=bootstrap_ci(verify, accepted, confidence=confidence, n_resamples=n_resamples, seed=seed),
        per_position=per_position_rates(summed.histogram) if summed else None,
    )


def breakdown(
    rows: Sequence[Mapping[str, Any]],
    key: Callable[[Mapping[str, Any]], str],
    **kwargs: Any,
) -> dict[str, GroupFigure]:
    """`group_figure` per value of `key(row)` (e.g. domain, thinking mode, length bucket)."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return {k: group_figure(v, **kwargs) for k, v in sorted(groups.items())}
