"""Fail fast (issue 40): the live figures checked against the run's limits with a confidence bound. A planted
fault (one server cutting every thinking at max_tokens; another looping) stops within a bounded number of rows
with a message naming the figure, the rows and the server; healthy runs at the same limits over many seeds
never stop (the false-stop rate is measured and printed)."""

from __future__ import annotations

import numpy as np

from dflash_pipeline.monitor.livequality import merge_groups
from dflash_pipeline.steps.quality.live import (limits_from, surely_above, verdict, verdicts,
                                                wilson_lower, z_at)

LIMITS = limits_from(max_truncation_rate=0.10, max_missing_reasoning_rate=0.005, max_loop_rate=0.05)
PART = 500


def stream(rng: np.random.Generator, rates: dict[str, dict[str, float]], parts: int):
    """The fleet's merged groups after each committed part (parts round-robin over the servers), as the
    watcher sees them: each row a completion with thinking on, with independent truncation and loop draws."""
    servers = sorted(rates)
    acc = {s: {"server": s, "thinking": "on", "completions": 0, "truncated": 0, "loop": 0,
               "completions_thinking": 0, "reasoning_missing": 0} for s in servers}
    for i in range(parts):
        s = servers[i % len(servers)]
        g = acc[s]
        g["completions"] += PART
        g["completions_thinking"] += PART
        g["truncated"] += int(rng.binomial(PART, rates[s]["truncated"]))
        g["loop"] += int(rng.binomial(PART, rates[s]["loop"]))
        g["reasoning_missing"] += int(rng.binomial(PART, rates[s].get("missing", 0.0)))
        yield merge_groups([{"groups": [dict(v) for v in acc.values()]}])


HEALTHY = {"truncated": 0.0465, "loop": 0.01, "missing": 0.0005}
"""The simulator's truncation rate at the demo's lengths (docs/validation.md: 93 of 2000), 1% loops."""


def first_stop(groups_stream) -> tuple[int, str] | None:
    """Rows in when the first task is told to stop (a server alone, or the whole run), and the message."""
    for groups in groups_stream:
        found = verdicts(groups, LIMITS)
        if found:
            return sum(g["completions"] for g in groups), next(iter(found.values()))
    return None


def test_planted_faults_stop_within_a_bounded_number_of_rows_and_name_the_server() -> None:
    worst = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        got = first_stop(stream(rng, {"gpu-0": HEALTHY, "gpu-1": dict(HEALTHY, truncated=1.0),
                                      "gpu-2": HEALTHY}, parts=60))
        assert got is not None, seed
        rows, msg = got
        worst = max(worst, rows)
        assert "server gpu-1 alone breaks max_truncation_rate=0.1" in msg and "truncation rate is 100.0%" in msg
        assert "Raise max_tokens" in msg and "fail_fast: false" in msg
    assert worst <= 3 * PART  # the first round of parts: one from each server
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        got = first_stop(stream(rng, {"gpu-0": HEALTHY, "gpu-1": HEALTHY, "gpu-2": dict(HEALTHY, loop=1.0)},
                                parts=60))
        assert got is not None and got[0] <= 3 * PART, seed
        assert "server gpu-2 alone breaks max_loop_rate=0.05" in got[1]


def test_a_fleet_wide_fault_stops_the_whole_run_with_each_server_named() -> None:
    rng = np.random.default_rng(5)
    bad = {"truncated": 0.4, "loop": 0.0}
    got = first_stop(stream(rng, {f"gpu-{i}": bad for i in range(3)}, parts=30))
    assert got is not None and got[0] <= 3 * PART
    groups = list(stream(np.random.default_rng(5), {f"gpu-{i}": bad for i in range(3)}, parts=3))[-1]
    msg = verdicts(groups, LIMITS)[None]
    assert "the truncation rate is" in msg and "By server: gpu-0:" in msg and "gpu-2:" in msg
    assert "trigger a new run into the same output_uri" in msg and verdict(groups, LIMITS) == msg


def test_healthy_runs_never_stop_over_many_seeds() -> None:
    """A 902k-row run of 1,805 parts over 7 servers, checked after every part: 0 stops in 50 seeds each at the
    simulator's rates, and at rates just under the limits (9% truncation, 4.5% loops)."""
    stops = {"simulator rates": 0, "90% of the limits": 0}
    seeds = 50
    for name, rates in (("simulator rates", HEALTHY), ("90% of the limits", {"truncated": 0.09, "loop": 0.045})):
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            if first_stop(stream(rng, {f"gpu-{i}": rates for i in range(7)}, parts=1805)) is not None:
                stops[name] += 1
    print(f"false stops over {seeds} healthy 902k-row runs: {stops}")
    assert stops == {"simulator rates": 0, "90% of the limits": 0}


def test_bound_basics() -> None:
    assert not surely_above(199, 199, 0.1)  # fewer than MIN_ROWS rows: never
    assert surely_above(200, 200, 0.1)
    assert wilson_lower(10, 100, 2.0) < 0.1 < wilson_lower(30, 100, 2.0)
    assert z_at(200) < z_at(10_000) < z_at(1_000_000) < 6.5
