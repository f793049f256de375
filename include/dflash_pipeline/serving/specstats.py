"""Speculative-decoding statistics: one definition of acceptance across engines, and its arithmetic.

Why one module: the figure users judge a drafter by is its acceptance length, and SGLang and vLLM
each report it their own way. Rows, the validation report and `dflash_eval` all count it here.

Definition (ours, everywhere): a request's speculative decoding ran `verify_steps` verification
steps (forward passes of the target over a draft) and the target accepted `accepted_tokens` draft
tokens in all; every step also yields one token of the target's own (the bonus / corrected token).

    acceptance length = (verify_steps + accepted_tokens) / verify_steps = 1 + accepted / verify_steps

Across rows it is token-weighted: Σ(verify + accepted) / Σ verify, never the mean of per-row
figures (short rows would weigh as much as long ones). This is vLLM's `mean_acceptance_length`
and its `/metrics` figure `1 + Δaccepted / Δdrafts`. We compute ours from SGLang's counters, not
from its own `spec_accept_length` = `completion_tokens / spec_verify_ct`, which differs from ours:
a request's completion tokens are 1 + V + A - O (V verify steps, A accepted drafts as the server
counts them; the 1 is the token the prefill produces; O the drafts counted as accepted in the last
step but dropped because the answer ended inside it, past its stop token or max_tokens), so

    spec_accept_length - ours = (1 - O) / V.

It reads higher by 1/V where the server counts only the drafts it kept (O = 0: SGLang's DFlash
`verify` counts `appended - 1`), and lower where it counts drafts verified past the end and O > 1
(SGLang's overlap scheduler takes the verify's accept length before the output stops at the stop
token, `_resolve_spec_overlap_token_ids`). With DFlash's long blocks (up to 15 drafts a step) on a
short answer, O is large and V small: 4 steps whose last accepted 12 drafts past the stop read
10.0 there and 12.75 here. Either way the gap shrinks as 1 / V on long answers.

`histogram[k]` is the number of verify steps that accepted exactly k draft tokens (k = 0 … draft
length). Acceptance is a prefix, so position i (1-based) was accepted in every step with k >= i:
the per-position acceptance rate is Σ_{k>=i} histogram[k] / Σ histogram (vLLM's
`num_accepted_tokens_per_pos / num_drafts`).

Null, never zero, where a server does not speculate or does not say: `SpecStats` is absent then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

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


# ------------------------------------------------------------------------------------ intervals
#
# The unit of resampling is the prompt. A prompt's rows are not independent: its samples, and the
# same prompt measured under several conditions when conditions are pooled (the eval's "by thinking
# mode"), share the prompt's difficulty. So every interval first sums each prompt's counters (a
# cluster) and resamples prompts; with one row per prompt that is resampling rows. Treating a
# prompt's rows as independent made intervals too narrow (bench/eval_coverage.py measures it).
#
# Which interval, and when none (bench/eval_coverage.py measures the coverage of each, at 3 to 3,000
# prompts, on homogeneous, job-like and heavy-tailed lengths; docs/evaluation.md has its table):
# - fewer than MIN_PROMPTS_FOR_CI prompts: no interval (none holds there: at 3 prompts the interval
#   below covers the truth 68-76 % of the time at a nominal 95 %; from 10 prompts, 89-97 %);
# - up to BOOTSTRAP_MAX_PROMPTS prompts: scipy's percentile bootstrap over prompts at the *expanded*
#   level (Hesterberg 2015: the level whose normal quantile is sqrt(n / (n - 1)) t_{n-1}): BCa, used
#   before, was too narrow at small n (0.81-0.88 coverage at 10-100 prompts of heavy-tailed lengths);
# - above it: the delta method (normal, linearised ratio of sums): the bootstrap's n x n_resamples
#   resamples do not fit a 900k-row run, and at that size the ratio is close to normal.
# - every prompt with the same ratio (or, paired, the same difference): the point as both ends.

MIN_PROMPTS_FOR_CI = 10
BOOTSTRAP_MAX_PROMPTS = 2000
EXPANDED_PERCENTILE = "expanded percentile bootstrap"
DELTA = "delta method"
ALL_EQUAL = "all prompts equal"
CI_METHODS = {
    EXPANDED_PERCENTILE: "scipy.stats.bootstrap, percentile method, prompts resampled with their counters "
    "summed, at the expanded level (sqrt(n/(n-1)) t_{n-1} as a normal quantile; Hesterberg 2015)",
    DELTA: f"above {BOOTSTRAP_MAX_PROMPTS} prompts: normal interval of the linearised ratio of sums over prompts",
    ALL_EQUAL: "every prompt has the same figure: the point is both ends",
}


class Interval(NamedTuple):
    """A confidence interval, how it was computed (a CI_METHODS key) and the prompts it stands on."""

    low: float
    high: float
    method: str
    prompts: int


def no_interval_note(prompts: int) -> str:
    return f"no interval: {prompts} prompt(s), fewer than {MIN_PROMPTS_FOR_CI}"


def cluster_sums(columns: Sequence[Sequence[float]], clusters: Sequence[Hashable] | None) -> list[np.ndarray]:
    """Each column summed per cluster (prompt), clusters in sorted order; None: every row its own."""
    cols = [np.asarray(c, dtype=np.float64) for c in columns]
    if clusters is None:
        return cols
    _, inverse = np.unique(np.asarray(clusters), return_inverse=True)
    return [np.bincount(inverse, weights=c) for c in cols]


def expanded_level(n: int, confidence: float) -> float:
    """The bootstrap level whose normal quantile is sqrt(n / (n - 1)) * t_{n-1} at `confidence`: the
    percentile interval widened for small samples (Hesterberg 2015, "What teachers should know about
    the bootstrap"); tends to `confidence` as n grows."""
    from scipy import stats

    q = float(np.sqrt(n / (n - 1)) * stats.t.ppf(0.5 + confidence / 2, n - 1))
    return float(1.0 - 2.0 * stats.norm.sf(q))


def _ratio(v: np.ndarray, a: np.ndarray, axis: int = -1) -> np.ndarray:
    den = v.sum(axis=axis)
    return 1.0 + a.sum(axis=axis) / np.where(den > 0, den, np.nan)


def _interval(data: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray], influence: np.ndarray, point: float,
              *, confidence: float, n_resamples: int, seed: int) -> Interval:
    """The interval of `statistic` over prompts (module comment above); `influence` is each prompt's
    linearised contribution (the delta method's, and all zero when every prompt agrees)."""
    n = len(influence)
    if np.allclose(influence, 0.0, atol=1e-12):
        return Interval(point, point, ALL_EQUAL, n)
    if n > BOOTSTRAP_MAX_PROMPTS:
        from scipy import stats

        se = float(np.std(influence, ddof=1) / np.sqrt(n))
        z = float(stats.norm.ppf(0.5 + confidence / 2))
        return Interval(point - z * se, point + z * se, DELTA, n)
    from scipy import stats  # imported here: a heavy import only the reports need

    res = stats.bootstrap(data, statistic, paired=True, vectorized=True, n_resamples=n_resamples,
                          confidence_level=expanded_level(n, confidence), method="percentile",
                          rng=np.random.default_rng(seed))
    return Interval(float(res.confidence_interval.low), float(res.confidence_interval.high), EXPANDED_PERCENTILE, n)


def ratio_ci(
    verify: Sequence[float],
    accepted: Sequence[float],
    clusters: Sequence[Hashable] | None = None,
    *,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
    min_prompts: int = MIN_PROMPTS_FOR_CI,
) -> Interval | None:
    """Interval of the token-weighted acceptance length 1 + Σaccepted / Σverify, prompts resampled
    (`clusters`: each row's prompt; None: one row per prompt). None under `min_prompts` prompts."""
    v, a = cluster_sums((verify, accepted), clusters)
    keep = v > 0
    v, a = v[keep], a[keep]
    n = len(v)
    if n < max(2, min_prompts):
        return None
    r = float(a.sum() / v.sum())
    influence = (a - r * v) / v.mean()
    return _interval((v, a), _ratio, influence, 1.0 + r, confidence=confidence, n_resamples=n_resamples, seed=seed)


def ratio_difference_ci(
    verify_a: Sequence[float], accepted_a: Sequence[float], verify_b: Sequence[float], accepted_b: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
    min_prompts: int = MIN_PROMPTS_FOR_CI,
) -> tuple[float | None, Interval | None]:
    """The paired difference of two acceptance lengths measured on the same prompts (position i of
    every array is prompt i, counters summed over its rows), and its interval (prompts resampled
    together for both: what the prompts share cancels out). (None, None) without a prompt both measured."""
    va, aa, vb, ab = (np.asarray(x, dtype=np.float64) for x in (verify_a, accepted_a, verify_b, accepted_b))
    keep = (va > 0) & (vb > 0)
    va, aa, vb, ab = va[keep], aa[keep], vb[keep], ab[keep]
    n = len(va)
    if n == 0:
        return None, None
    ra, rb = float(aa.sum() / va.sum()), float(ab.sum() / vb.sum())
    point = ra - rb
    if n < max(2, min_prompts):
        return point, None

    def statistic(xa: np.ndarray, ya: np.ndarray, xb: np.ndarray, yb: np.ndarray, axis: int = -1) -> np.ndarray:
        return _ratio(xa, ya, axis) - _ratio(xb, yb, axis)

    influence = (aa - ra * va) / va.mean() - (ab - rb * vb) / vb.mean()
    return point, _interval((va, aa, vb, ab), statistic, influence, point, confidence=confidence,
                            n_resamples=n_resamples, seed=seed)


# ------------------------------------------------------------------------------------ figures


def prompt_of(row: Mapping[str, Any], index: int) -> str:
    """The cluster a row belongs to: its prompt id (rows without one stand alone)."""
    rid = row.get("id")
    return f"id:{rid}" if rid not in (None, "") else f"row:{index}"


@dataclass(frozen=True)
class GroupFigure:
    """Acceptance of one group of rows (a domain, a thinking mode, a drafter)."""

    rows: int
    rows_with_stats: int
    prompts: int  # distinct prompts among the rows with statistics
    verify_steps: int
    accepted_tokens: int
    acceptance_length: float | None
    ci: Interval | None
    per_position: list[float] | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "rows_with_stats": self.rows_with_stats,
            "prompts": self.prompts,
            "verify_steps": self.verify_steps,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_length": self.acceptance_length,
            "ci_low": self.ci.low if self.ci else None,
            "ci_high": self.ci.high if self.ci else None,
            "ci_method": self.ci.method if self.ci else None,
            "ci_note": None if self.ci or self.acceptance_length is None else no_interval_note(self.prompts),
            "per_position": self.per_position,
        }


def _known(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, SpecStats]]:
    """(prompt, statistics) of the rows with at least one verify step."""
    out = []
    for i, r in enumerate(rows):
        s = SpecStats.from_columns(r)
        if s is not None and s.verify_steps > 0:
            out.append((prompt_of(r, i), s))
    return out


def group_figure(rows: Sequence[Mapping[str, Any]], *, confidence: float = 0.95, n_resamples: int = 2000,
                 seed: int = 0) -> GroupFigure:
    """Token-weighted acceptance, its interval over prompts and per-position rates over rows carrying
    SPEC_COLUMNS (a row's prompt is its `id`: samples and pooled conditions of one prompt go together)."""
    known = _known(rows)
    verify = [s.verify_steps for _, s in known]
    accepted = [s.accepted_tokens for _, s in known]
    clusters = [c for c, _ in known]
    summed = total(s for _, s in known)
    return GroupFigure(
        rows=len(rows),
        rows_with_stats=len(known),
        prompts=len(set(clusters)),
        verify_steps=int(sum(verify)),
        accepted_tokens=int(sum(accepted)),
        acceptance_length=token_weighted(verify, accepted),
        ci=ratio_ci(verify, accepted, clusters, confidence=confidence, n_resamples=n_resamples, seed=seed),
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


def paired_difference(rows_a: Sequence[Mapping[str, Any]], rows_b: Sequence[Mapping[str, Any]], *,
                      confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """A's acceptance length minus B's on the prompts both measured (rows paired by `id`), with the
    interval of that paired difference. `separable`: the interval excludes 0 (True), holds it (False),
    or there is no interval (None: too few common prompts); only True orders A and B."""
    sums: list[dict[str, list[float]]] = [{}, {}]
    for side, rows in enumerate((rows_a, rows_b)):
        for prompt, s in _known(rows):
            acc = sums[side].setdefault(prompt, [0.0, 0.0])
            acc[0] += s.verify_steps
            acc[1] += s.accepted_tokens
    common = sorted(set(sums[0]) & set(sums[1]))
    cols = [[sums[side][p][j] for p in common] for side in (0, 1) for j in (0, 1)]
    point, ci = ratio_difference_ci(*cols, confidence=confidence, n_resamples=n_resamples, seed=seed)
    return {
        "difference": point,
        "ci_low": ci.low if ci else None,
        "ci_high": ci.high if ci else None,
        "ci_method": ci.method if ci else None,
        "ci_note": None if ci or point is None else no_interval_note(len(common)),
        "prompts": len(common),
        "a_on_common": token_weighted(cols[0], cols[1]),
        "b_on_common": token_weighted(cols[2], cols[3]),
        "separable": None if ci is None else not (ci.low <= 0.0 <= ci.high),
    }
