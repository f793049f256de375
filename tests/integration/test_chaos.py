"""Randomized fault schedules in CI (bench/chaos.py runs 50+): real processes, seeds not hand-picked.

Seeds come from the clock unless CHAOS_SEEDS="3,17" pins them; a failure names its seed, and
`.venv/bin/python bench/chaos.py --first-seed SEED --schedules 1` replays it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from dflash_pipeline.dev.chaos import random_schedule, run_schedule


def _seeds(n: int) -> list[int]:
    pinned = os.environ.get("CHAOS_SEEDS")
    if pinned:
        return [int(s) for s in pinned.split(",") if s.strip()]
    base = int(time.time()) % 100_000
    return [base + 1000 * i for i in range(n)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("i", range(3))
def test_random_fault_schedule_ends_exact(i: int, moto_server: Any, bucket: str, s3_client: Any) -> None:
    seeds = _seeds(3)
    if i >= len(seeds):
        pytest.skip("fewer CHAOS_SEEDS than schedules")
    seed = seeds[i]
    schedule = random_schedule(seed)
    r = run_schedule(schedule, s3_endpoint=moto_server.endpoint_url, s3_port=moto_server.port, bucket=bucket,
                     s3_client=s3_client, bound_s=240.0)
    print(f"chaos seed {seed}: {r}")
    assert not r.hung, f"seed {seed} hung: {r} (logs {r.log_dir})"
    assert (r.missing, r.duplicated, r.unfinished_stored, r.claims_left) == (0, 0, 0, 0), f"seed {seed}: {r}"
    assert r.rows == schedule.n_prompts, f"seed {seed}: {r}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lone_task_finishes_under_s3_faults(moto_server: Any, bucket: str, s3_client: Any) -> None:
    seed = _seeds(1)[0]
    schedule = random_schedule(seed, s3_only=True, n_servers=1)
    schedule.s3 = {"slowdown": 0.10, "conflict": 0.15, "lost": 0.05}  # the mix, at its full rates
    r = run_schedule(schedule, s3_endpoint=moto_server.endpoint_url, s3_port=moto_server.port, bucket=bucket,
                     s3_client=s3_client, bound_s=180.0)
    assert r.ok, f"seed {seed}: {r} (logs {r.log_dir})"
    assert r.wasted <= 0.01 * schedule.n_prompts, f"seed {seed}: {r.wasted} prompts generated twice"
