"""Reproductions of the defects of the third outside review of the dispatch protocol (issue 39),
against a real S3 protocol server (moto) and simulated servers over HTTP, through the Worker's kept
interfaces (`run`, `request_stop`, `stats`); faults come from SimServer knobs and the S3 fault front.

1. A transient failure on a busy server (a 500 for one input) was taken for a refusal: put back
   uncounted with no bound, each put-back lowering the in-flight cap to what was in flight.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from test_dispatch import Run
from test_protocol_review import _run_in_thread, _stop

from dflash_pipeline.steps.generate.state import MAX_REQUEUES
from dflash_pipeline.steps.validate import run_validation
from dflash_pipeline.steps.validate.report import Thresholds


def _validate_exact(run: Run) -> dict[str, Any]:
    report = run_validation(run.s3, run.cfg.output_uri, thresholds=Thresholds(max_error_rate=1.0))
    assert report["prompts"] == run.n
    assert report["missing"] == 0 and report["duplicates"] == 0 and report["unexpected_ids"] == 0
    return report


# -- 1: one prompt that always gets a 500 on a busy server ------------------------------------------

# 8 slots, generations of ~1.4 s: the server runs requests of ours all the time (a sign of life).
BUSY8 = {"token_time_s": 0.004, "length_scale": 0.2, "max_running_requests": 8}


@pytest.mark.timeout(120)
def test_a_prompt_failing_on_a_busy_server_is_bounded_and_keeps_the_slots_busy(
        s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    """Only a refusal that did not generate (503 queue full, 429) is "busy". A 500 for one input on a
    server generating the others is that prompt's counted failure: at most MAX_REQUEUES put-backs of
    max_attempts sends each, then an error row; the in-flight cap is not lowered. Before the fix it
    was re-sent until the run ended, and the cap fell to what was in flight."""
    fleet = sim_fleet(1, **BUSY8, poison_text="Question 3:")
    run = Run(s3_client, bucket, fleet.urls, n=32, save_every=16)
    attempts = 2
    worker = run.worker(0, concurrency=8, max_attempts=attempts, backoff_base_s=0.1, backoff_cap_s=0.5,
                        handoff_after_s=1.0, lease_s=30.0)
    started = time.monotonic()
    t, out = _run_in_thread(worker)
    t.join(timeout=45)
    finished = not t.is_alive()
    elapsed = out.get("ended_t", time.monotonic()) - started
    _stop(worker, t)
    stats = fleet.servers[0].stats()
    sends = int(stats["errors_by_code"].get("500", 0))
    slot_use = stats["busy_slot_seconds"] / (8 * elapsed)
    figures = (f"finished={finished} in {elapsed:.1f}s, poison sent {sends} times, slot use {slot_use:.2f}, "
               f"busy requeues {worker.stats.busy_requeues}, requeued {worker.stats.requests_requeued}")
    print(figures)
    assert finished and "result" in out, f"the run finishes ({figures}; {out.get('error')!r})"
    assert 1 <= sends <= (MAX_REQUEUES + 1) * attempts, figures
    assert worker.stats.busy_requeues == 0, figures
    assert slot_use >= 0.35, figures  # 0.56 without the poison prompt in this setup; 0.14 before the fix
    report = _validate_exact(run)
    assert report["errors"] == 1 and report["completions"] == 31
