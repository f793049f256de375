"""serving/specstats.py: one definition of acceptance, per-position rates, intervals over prompts (with
samples and pooled conditions resampled together), paired differences, and no interval where none holds."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_pipeline.serving.specstats import (
    ALL_EQUAL,
    BOOTSTRAP_MAX_PROMPTS,
    DELTA,
    EXPANDED_PERCENTILE,
    MIN_PROMPTS_FOR_CI,
    SpecStats,
    acceptance_length,
    breakdown,
    group_figure,
    paired_difference,
    per_position_rates,
    ratio_ci,
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


def _draw(rng: np.random.Generator, n: int, p: float, k: int = 4, lo: int = 20, hi: int = 200
          ) -> tuple[list[int], list[int]]:
    steps = rng.integers(lo, hi, size=n)
    acc = [int(np.minimum(rng.geometric(1 - p, size=s) - 1, k).sum()) for s in steps]
    return [int(s) for s in steps], acc


def _rows(verify: list[int], accepted: list[int], prefix: str = "q") -> list[dict[str, int | str]]:
    return [{"id": f"{prefix}{i}", "spec_verify_steps": v, "spec_accepted_tokens": a}
            for i, (v, a) in enumerate(zip(verify, accepted))]


def test_interval_covers_a_known_truth_and_names_its_method() -> None:
    rng = np.random.default_rng(1)
    p, k = 0.6, 4  # per-token acceptance, draft length: truth 1 + sum p^i
    truth = 1 + sum(p**i for i in range(1, k + 1))
    verify, accepted = _draw(rng, 400, p, k)
    ci = ratio_ci(verify, accepted, n_resamples=1000)
    assert ci is not None and ci.method == EXPANDED_PERCENTILE and ci.prompts == 400
    assert ci.low < token_weighted(verify, accepted) < ci.high
    assert ci.low <= truth <= ci.high
    assert ci.high - ci.low < 0.2


def test_no_interval_under_the_prompt_floor_and_equal_prompts_give_the_point() -> None:
    rng = np.random.default_rng(2)
    v, a = _draw(rng, MIN_PROMPTS_FOR_CI - 1, 0.5)
    assert ratio_ci(v, a) is None
    fig = group_figure(_rows(v, a)).to_dict()
    assert fig["acceptance_length"] is not None and fig["ci_low"] is None and fig["prompts"] == MIN_PROMPTS_FOR_CI - 1
    assert fig["ci_note"] == f"no interval: {MIN_PROMPTS_FOR_CI - 1} prompt(s), fewer than {MIN_PROMPTS_FOR_CI}"
    v, a = _draw(rng, MIN_PROMPTS_FOR_CI, 0.5)
    assert ratio_ci(v, a) is not None
    n = MIN_PROMPTS_FOR_CI
    assert ratio_ci([5, 10] * n, [5, 10] * n) == (2.0, 2.0, ALL_EQUAL, 2 * n)


def test_a_prompts_rows_are_resampled_together() -> None:
    """Samples of one prompt (or one prompt pooled over conditions) are one unit: the same rows twice
    give exactly the interval of the rows once, never a narrower one (issue 37: pooled intervals were
    about half as wide as they should be)."""
    rng = np.random.default_rng(4)
    v, a = _draw(rng, 60, 0.6)
    once = group_figure(_rows(v, a)).to_dict()
    twice = group_figure(_rows(v, a) + _rows(v, a)).to_dict()
    assert (twice["acceptance_length"], twice["ci_low"], twice["ci_high"]) == pytest.approx(
        (once["acceptance_length"], once["ci_low"], once["ci_high"]))
    assert twice["rows_with_stats"] == 120 and twice["prompts"] == 60
    independent = ratio_ci(v + v, a + a)  # what pooling as independent rows gives: too narrow
    assert independent is not None and independent.high - independent.low < 0.8 * (once["ci_high"] - once["ci_low"])


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


def test_large_samples_use_the_delta_method() -> None:
    """Above BOOTSTRAP_MAX_PROMPTS the interval is the delta method's, and it says so; just under the
    limit the bootstrap and the delta method agree closely; a big sample covers its truth."""
    rng = np.random.default_rng(3)
    p, k = 0.7, 3
    truth = 1 + sum(p**i for i in range(1, k + 1))
    v, a = _draw(rng, BOOTSTRAP_MAX_PROMPTS, p, k, 10, 300)
    boot = ratio_ci(v, a, n_resamples=1000)
    assert boot is not None and boot.method == EXPANDED_PERCENTILE
    big = ratio_ci(v + v[:1], a + a[:1])  # one prompt over the limit
    assert big is not None and big.method == DELTA
    width = boot.high - boot.low
    assert abs(boot.low - big.low) < 0.25 * width and abs(boot.high - big.high) < 0.25 * width
    v, a = _draw(rng, 20_000, p, k, 10, 300)
    huge = ratio_ci(v, a)
    assert huge is not None and huge.method == DELTA and huge.low <= truth <= huge.high


def test_paired_difference_separates_what_separate_intervals_cannot() -> None:
    """Two drafters 0.08 apart on the same 200 prompts whose difficulty varies a lot: their separate
    intervals overlap, the paired difference's excludes 0 (issue 37's case)."""
    rng = np.random.default_rng(11)
    n, k = 200, 4
    ps = rng.beta(2.4, 1.6, size=n)
    steps = rng.integers(50, 400, size=n)
    rows_a, rows_b = [], []
    for i, (p, s) in enumerate(zip(ps, steps)):
        for rows, q in ((rows_a, p), (rows_b, 0.955 * p)):
            acc = int(np.minimum(rng.geometric(1 - q, size=int(s)) - 1, k).sum())
            rows.append({"id": f"q{i}", "spec_verify_steps": int(s), "spec_accepted_tokens": acc})
    fa, fb = group_figure(rows_a).to_dict(), group_figure(rows_b).to_dict()
    assert 0.03 < fa["acceptance_length"] - fb["acceptance_length"] < 0.15
    assert fb["ci_high"] > fa["ci_low"], "separate intervals overlap"
    pd = paired_difference(rows_a, rows_b)
    assert pd["prompts"] == n and pd["separable"] is True and pd["ci_low"] > 0
    assert pd["difference"] == pytest.approx(fa["acceptance_length"] - fb["acceptance_length"])
    same = paired_difference(rows_a, rows_a)
    assert same["difference"] == 0 and same["separable"] is False and same["ci_method"] == ALL_EQUAL


def test_paired_difference_uses_only_the_prompts_both_measured() -> None:
    a = [{"id": f"q{i}", "spec_verify_steps": 10, "spec_accepted_tokens": 20 + i % 3} for i in range(30)]
    b = [{"id": f"q{i}", "spec_verify_steps": 10, "spec_accepted_tokens": 10 + i % 2} for i in range(0, 30, 6)]
    b += [{"id": "other", "spec_verify_steps": 10, "spec_accepted_tokens": 0}]
    pd = paired_difference(a, b)
    assert pd["prompts"] == 5 and pd["separable"] is None and pd["ci_low"] is None
    assert "no interval: 5 prompt(s)" in pd["ci_note"]
    common = [0, 6, 12, 18, 24]
    expect_a = 1 + sum(20 + i % 3 for i in common) / 50
    assert pd["a_on_common"] == pytest.approx(expect_a) and pd["b_on_common"] == pytest.approx(2.0)
    assert pd["difference"] == pytest.approx(expect_a - 2.0)
