"""serving/specstats.py: one definition of acceptance, per-position rates, bootstrap intervals."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_pipeline.serving.specstats import (
    SpecStats,
    acceptance_length,
    bootstrap_ci,
    breakdown,
    group_figure,
    per_position_rates,
    token_weighted,
    total,
)


def test_acceptance_length_is_one_plus_accepted_per_step() -> None:
    assert acceptance_length(10, 25) == pytest.approx(3.5)
    assert acceptance_length(0, 0) is None
    assert acceptance_length(None, 3) is None


def test_rows_are_token_weighted_not_averaged() -> None:
    # one long row at 4.0, one short at 1.0: the mean of rows would be 2.5
    assert token_weighted([100, 1], [300, 0]) == pytest.approx(1 + 300 / 101)


def test_sums_keep_histograms_and_unknown_drafts() -> None:
    a = SpecStats(3, 4, 9, (1, 0, 2))
    b = SpecStats(2, 1, None, (1, 1))
    s = a + b
    assert (s.verify_steps, s.accepted_tokens, s.draft_tokens, s.histogram) == (5, 5, None, (2, 1, 2))
    assert total([None, a, None]) == a
    assert total([None]) is None
    assert SpecStats.from_columns(a.to_columns()) == a
    assert SpecStats.from_columns({"spec_verify_steps": None}) is None


def test_per_position_rates_from_the_histogram() -> None:
    # 10 steps: 2 accepted 0, 3 accepted 1, 5 accepted 2 drafts
    assert per_position_rates([2, 3, 5]) == pytest.approx([0.8, 0.5])
    assert per_position_rates([]) is None
    assert per_position_rates([0, 0]) is None


def test_bootstrap_interval_covers_a_known_truth() -> None:
    rng = np.random.default_rng(1)
    p, k = 0.6, 4  # per-token acceptance, draft length: truth 1 + sum p^i
    truth = 1 + sum(p**i for i in range(1, k + 1))
    verify, accepted = [], []
    for _ in range(400):
        steps = int(rng.integers(20, 200))
        acc = 0
        for _ in range(steps):
            n = 0
            while n < k and rng.random() < p:
                n += 1
            acc += n
        verify.append(steps)
        accepted.append(acc)
    ci = bootstrap_ci(verify, accepted, n_resamples=1000)
    assert ci is not None
    low, high = ci
    assert low < token_weighted(verify, accepted) < high
    assert low <= truth <= high
    assert high - low < 0.2


def test_degenerate_and_tiny_samples() -> None:
    assert bootstrap_ci([5], [5]) is None
    assert bootstrap_ci([5, 10], [5, 10]) == (2.0, 2.0)


def test_breakdown_by_key_counts_rows_without_stats() -> None:
    rows = [
        {"domain": "math", "spec_verify_steps": 10, "spec_accepted_tokens": 20, "spec_accept_histogram": [2, 4, 4]},
        {"domain": "math", "spec_verify_steps": 10, "spec_accepted_tokens": 10, "spec_accept_histogram": [4, 2, 4]},
        {"domain": "chat", "spec_verify_steps": None, "spec_accepted_tokens": None},
    ]
    out = breakdown(rows, key=lambda r: r["domain"])
    assert out["math"].acceptance_length == pytest.approx(2.5)
    assert out["math"].per_position == pytest.approx([14 / 20, 8 / 20])
    assert out["chat"].rows == 1 and out["chat"].rows_with_stats == 0 and out["chat"].acceptance_length is None
    assert group_figure([]).acceptance_length is None


def test_large_samples_use_the_delta_method_and_agree_with_bca() -> None:
    """Above BOOTSTRAP_MAX_ROWS the interval is the delta method's (BCa's jackknife is n x n); on a
    sample just under the limit both intervals agree closely, and a big one covers its truth."""
    from dflash_pipeline.serving.specstats import BOOTSTRAP_MAX_ROWS, delta_ci

    rng = np.random.default_rng(3)
    p, k = 0.7, 3
    truth = 1 + sum(p**i for i in range(1, k + 1))

    def sample(n: int) -> tuple[np.ndarray, np.ndarray]:
        steps = rng.integers(10, 300, size=n)
        acc = np.array([int(np.minimum(rng.geometric(1 - p, size=s) - 1, k).sum()) for s in steps])
        return steps, acc

    v, a = sample(BOOTSTRAP_MAX_ROWS)
    bca, delta = bootstrap_ci(v, a, n_resamples=1000), delta_ci(v, a)
    assert bca is not None and delta is not None
    assert abs(bca[0] - delta[0]) < 0.25 * (bca[1] - bca[0]) and abs(bca[1] - delta[1]) < 0.25 * (bca[1] - bca[0])
    v, a = sample(20_000)
    big = bootstrap_ci(v, a)
    assert big == delta_ci(v, a) and big[0] <= truth <= big[1]
