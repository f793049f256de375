"""Randomized fault schedules in CI (bench/chaos.py runs 100): real processes, seeds not hand-picked.

Each of the mixed schedules also draws faults at the protocol's state transitions
(dev/transitions.py: delays, leases lost in the windows between claim, open, queued, committing and
committed, stops landing in those windows, checkpoints in flight at a stop). A schedule passes when
the dataset is exact, no claim is left, no process hung (the runner's thread dumps are in the
failure message) and every stop ended within stop_grace_s + STOP_MARGIN_S.

Seeds come from the clock unless CHAOS_SEEDS="3,17" pins them; a failure names its seed, and
`.venv/bin/python bench/chaos.py --first-seed SEED --schedules 1` replays it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from dflash_pipeline.dev.chaos import Event, Schedule, random_schedule, run_schedule


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
    schedule = random_schedule(seed, always_transitions=True)
    r = run_schedule(schedule, s3_endpoint=moto_server.endpoint_url, s3_port=moto_server.port, bucket=bucket,
                     s3_client=s3_client, bound_s=240.0)
    print(f"chaos seed {seed}: {schedule.describe()}\n  stops {r.stops} (bound {r.stop_bound_s:.1f}s), "
          f"transition faults {r.transition_faults}, wasted {r.wasted}")
    dumps = "\n".join(r.thread_dumps)
    assert not r.hung, f"seed {seed} hung: {r.hangs} (logs {r.log_dir})\n{dumps}"
    assert not r.slow_stops, \
        f"seed {seed}: stops over {r.stop_bound_s:.1f}s: {r.slow_stops} (logs {r.log_dir})\n{dumps}"
    assert not r.protocol_errors, f"seed {seed}: {r.protocol_errors} (logs {r.log_dir})"
    assert not r.failed_tries and not r.thread_errors, \
        f"seed {seed}: {r.failed_tries_detail} {r.thread_errors} (logs {r.log_dir})"
    # Every schedule has a stop; it goes unmeasured only when a SIGTERM came before the child's handler
    # or a SIGKILL pre-empted it (both counted by the runner).
    assert r.stops or r.early_sigterms or r.stops_preempted, \
        f"seed {seed}: no stop was measured and nothing pre-empted one (logs {r.log_dir})"
    assert (r.missing, r.duplicated, r.unfinished_stored, r.claims_left) == (0, 0, 0, 0), f"seed {seed}: {r}"
    assert r.rows == schedule.n_prompts, f"seed {seed}: {r}"
    assert not r.liveness_problems, f"seed {seed}: unservable prompts not stored as their error rows: {r.liveness_problems}"


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_that_does_not_end_in_time_is_a_hang_with_its_thread_dump(moto_server: Any, bucket: str,
                                                                          s3_client: Any) -> None:
    """The runner's hang detection, end to end, on a real worker: with no time allowed after a stop,
    the SIGTERMed worker is a hang; the result names it and carries every thread's stack (the child's
    faulthandler on SIGUSR1, with the threads' names), the process is SIGKILLed and retried like
    Airflow's supervisor would, and the dataset still ends exact."""
    schedule = Schedule(seed=_seeds(1)[0], n_prompts=300, save_every=50, n_servers=1,
                        s3={"slowdown": 0.0, "conflict": 0.0, "lost": 0.0}, servers=[{}],
                        events=[Event(6.0, "sigterm", 0)])
    r = run_schedule(schedule, s3_endpoint=moto_server.endpoint_url, s3_port=moto_server.port, bucket=bucket,
                     s3_client=s3_client, bound_s=180.0, hang_after_stop_s=0.0)
    assert r.hung and r.hangs and r.hangs[0].startswith("w0 try1 not ended"), r
    dump = "\n".join(r.thread_dumps)
    assert "chaos-threads" in dump and "'MainThread'" in dump, dump
    assert 'File "' in dump and "Thread 0x" in dump, dump
    assert not r.ok and r.tries >= 2, r
    assert (r.missing, r.duplicated, r.claims_left, r.rows) == (0, 0, 0, 300), r
