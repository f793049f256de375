"""Who decides a server is broken or failing (issue 31, part A), against a real S3 protocol server
(moto) and simulated servers over HTTP, through the Worker's kept interfaces only (`run`,
`request_stop`, `stats`); the faults come from SimServer knobs.

1. A chunk nobody can serve: its prompts exceed every server's context. They must become
   ContextLengthExceeded error rows (counted, committed), never trip the breaker: before the fix the
   breaker's "alone" rule raised ServerBroken, the chunk was released without its error rows, and the
   next task failed the same way, so the run could never finish (1 server and 2 servers).
   The breaker keeps its meaning: a server that fails what the fleet serves (a one-line prompt, or
   prompts that fit the context it had at preflight) is still broken, alone or in a fleet.
2. One transient 503 on a busy server: all slots busy with long generations, the next request
   answered "The request queue is full." (SGLang's --max-queued-requests). Before the fix nothing
   had *finished* recently, so the server was "failing", its open chunks were handed off and the
   generations finishing in flight were thrown away (fixed concurrency: never finished; discovered
   concurrency: hand-offs and discarded rows). A load probe showing running requests is a sign of
   life: the server is busy, not failing.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from test_dispatch import RUN_ID, SIM, Run
from test_protocol_review import _run_in_thread, _stop

from dflash_pipeline.steps.generate import ServerBroken
from dflash_pipeline.steps.validate import run_validation
from dflash_pipeline.steps.validate.report import Thresholds

# max_tokens is 4096 (RunConfig's default): a context of 4096 + 256 holds the short prompts (~20
# tokens) with max_tokens, never a prompt of 600 words.
CONTEXT = 4096 + 256
LONG_WORDS = 600


class PromptRun(Run):
    """A planned root like test_dispatch.Run, with the prompts given (some of them too long)."""

    def __init__(self, s3: Any, bucket: str, urls: list[str], prompts: list[dict[str, Any]],
                 save_every: int) -> None:
        body = ("\n".join(json.dumps(p) for p in prompts) + "\n").encode()
        super().__init__(s3, bucket, urls, len(prompts), save_every, prompts=body)

    def validate(self) -> dict[str, Any]:
        """Exact (every prompt once); the unservable prompts' error rows are above the default 1 %."""
        report = run_validation(self.s3, self.cfg.output_uri, thresholds=Thresholds(max_error_rate=0.25))
        assert report["prompts"] == self.n
        assert report["missing"] == 0 and report["duplicates"] == 0 and report["unexpected_ids"] == 0
        return report


def _prompts(n: int, long: range) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        text = f"Question {i}: how many primes are below {1000 + 7 * i}?"
        if i in long:
            text += " Consider" + " every number" * (LONG_WORDS // 2) + "."
        out.append({"id": f"q{i:05d}", "prompt": text})
    return out


# -- 1: a chunk nobody can serve ----------------------------------------------------------------------


def _unservable_run(s3_client: Any, bucket: str, sim_fleet: Any, servers: int) -> tuple[Run, Any]:
    fleet = sim_fleet(servers, **SIM, context_length=CONTEXT)
    # 400 prompts in chunks of 40 (then shrinking): chunk 0 (prompts 0-39) is all too long, so the
    # first results of every server are its refusals.
    run = PromptRun(s3_client, bucket, fleet.urls, _prompts(400, long=range(0, 40)), save_every=40)
    assert run.manifest["chunks"]["sizes"][:2] == [40, 40]
    warning = run.manifest["runs"][RUN_ID].get("context_warning") or ""
    assert "will be ContextLengthExceeded error rows" in warning, "preflight says what becomes of them"
    return run, fleet


@pytest.mark.timeout(120)
@pytest.mark.parametrize("servers", [1, 2])
def test_a_chunk_no_server_can_serve_becomes_error_rows(s3_client: Any, bucket: str, sim_fleet: Any,
                                                        servers: int) -> None:
    run, _ = _unservable_run(s3_client, bucket, sim_fleet, servers)
    started = time.monotonic()
    results = run.run_all([run.worker(i) for i in range(servers)])
    print(f"{servers} server(s): {time.monotonic() - started:.1f}s, chunks committed {len(run.committed())} of "
          f"{len(run.manifest['chunks']['sizes'])}, " + "; ".join(
              f"{r['worker']}: {r['completions']} completions, {r['permanent_errors']} permanent errors, "
              f"breaker checks {r.get('breaker_checks')} (prompts' {r.get('prompt_verdicts')})" if isinstance(r, dict)
              else f"{r!r}"[:160] for r in results))
    assert all(isinstance(r, dict) for r in results), \
        f"every task ends normally; got {results}; chunks committed: {len(run.committed())} of " \
        f"{len(run.manifest['chunks']['sizes'])}"
    report = run.validate()
    assert len(run.committed()) == len(run.manifest["chunks"]["sizes"])
    rows = run.rows()
    errors = [r for r in rows if r.get("error_class")]
    assert sorted(r["id"] for r in errors) == [f"q{i:05d}" for i in range(0, 40)]
    assert {r["error_class"] for r in errors} == {"ContextLengthExceeded"}
    assert not any(r["retryable"] for r in errors)
    # Counted and reported: by the tasks and by validate.
    assert sum(r["permanent_errors"] for r in results) == 40
    assert sum(r["errors_by_class"].get("ContextLengthExceeded", 0) for r in results) == 40
    assert report["completions"] == 360
    assert run.claims_left() == []


@pytest.mark.timeout(120)
def test_a_lone_server_failing_a_one_line_prompt_is_still_broken(s3_client: Any, bucket: str,
                                                                 sim_fleet: Any) -> None:
    """No peer to compare with: a server that fails even a one-line prompt (restarted with a tiny
    --context-length, a broken template) is broken, and none of its error rows is committed."""
    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=600, save_every=100)
    fleet.servers[0].update_config(context_length=8)
    result = run.run_all([run.worker(0)])[0]
    assert isinstance(result, ServerBroken), result
    assert fleet.servers[0].url in str(result)
    assert not [r for r in run.rows() if r.get("error_class")], "no error row of the broken server was committed"


@pytest.mark.timeout(120)
def test_a_server_restarted_with_a_smaller_context_is_broken_though_short_prompts_pass(
        s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    """It answers a one-line prompt, but refuses the plan's prompts that fit the context the fleet had
    at preflight: it fails what its peers serve. Its peer finishes the dataset."""
    fleet = sim_fleet(2, **SIM, context_length=CONTEXT)
    run = Run(s3_client, bucket, fleet.urls, n=600, save_every=100)
    # Room for a one-line prompt plus 1 token, not for a question plus max_tokens.
    fleet.servers[0].update_config(context_length=4096 + 12)
    results = run.run_all([run.worker(i) for i in range(2)])
    assert isinstance(results[0], ServerBroken), results[0]
    assert "context" in str(results[0]) and fleet.servers[0].url in str(results[0])
    assert isinstance(results[1], dict), results[1]
    run.validate()
    assert not [r for r in run.rows() if r.get("error_class")], "no error row of the broken server was committed"


# -- 2: a busy server answering 503 "queue full" --------------------------------------------------------


def _run_busy(fleet: Any, worker: Any, label: str) -> tuple[bool, dict[str, Any], dict[str, Any], str]:
    """Run `worker` against the busy server for at most 80 s, then stop it: (finished, its result or
    error, the server's stats, the figures line, printed)."""
    t, out = _run_in_thread(worker)
    t.join(timeout=80)
    finished = not t.is_alive()
    _stop(worker, t)
    stats = fleet.servers[0].stats()
    figures = (f"{label}: finished={finished}, handoffs={worker.stats.handoffs}, "
               f"rows_discarded={worker.stats.rows_discarded}, generation requests={stats['generation_requests']}, "
               f"rejected queue full={stats['rejected_queue_full']}, error rows={worker.stats.errors}")
    print(figures)
    return finished, out, stats, figures


# 4 slots, 1 waiting: while 4 long generations (~2-4 s each) run and 1 waits, any further request is answered 503
# "The request queue is full." at once.
BUSY = {"token_time_s": 0.02, "length_scale": 0.2, "max_running_requests": 4, "max_queued_requests": 1}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["fixed", "discovered"])
def test_a_busy_server_shedding_load_with_503_is_not_failing(s3_client: Any, bucket: str, sim_fleet: Any,
                                                             mode: str) -> None:
    fleet = sim_fleet(1, **BUSY)
    run = Run(s3_client, bucket, fleet.urls, n=16, save_every=8)
    over = dict(concurrency=7, adaptive_headroom=mode == "discovered", handoff_after_s=1.0,
                backoff_base_s=0.1, backoff_cap_s=0.5, max_attempts=3, lease_s=30.0)
    worker = run.worker(0, **over)
    finished, out, stats, figures = _run_busy(fleet, worker, mode)
    assert stats["rejected_queue_full"] >= 1, "the server really shed load"
    assert finished and "result" in out, f"the run finishes ({figures}; {out.get('error')!r})"
    assert worker.stats.handoffs == 0, figures
    assert worker.stats.rows_discarded == 0, figures
    assert worker.stats.errors == 0, figures
    report = run.validate()
    assert report["completions"] == 16


@pytest.mark.timeout(120)
def test_a_hand_off_keeps_the_generations_finishing_in_flight(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    """The same busy server, seen without a load endpoint (a generic OpenAI server: no sign of life
    but its answers): the refusals make it failing and its chunks are handed off; a chunk whose
    requests are still generating is handed off only once they are back, with their rows, so no
    finished generation is thrown away."""
    fleet = sim_fleet(1, **BUSY)
    run = Run(s3_client, bucket, fleet.urls, n=16, save_every=8)
    worker = run.worker(0, engine="openai", concurrency=7, handoff_after_s=1.0, backoff_base_s=0.1,
                        backoff_cap_s=0.5, max_attempts=3, lease_s=30.0)
    finished, out, stats, figures = _run_busy(fleet, worker, "no load endpoint")
    assert stats["rejected_queue_full"] >= 1, "the server really shed load"
    assert finished and "result" in out, f"the run finishes ({figures}; {out.get('error')!r})"
    assert worker.stats.rows_discarded == 0, figures
    # Without a sign of life a prompt refused on every put-back may still end as a retryable error
    # row (three put-backs, as for any server answering the others): exact, not necessarily clean.
    report = run_validation(run.s3, run.cfg.output_uri, thresholds=Thresholds(max_error_rate=1.0))
    assert report["missing"] == 0 and report["duplicates"] == 0 and report["prompts"] == 16
    assert report["completions"] + report["errors"] == 16


@pytest.mark.timeout(120)
def test_a_stop_while_the_breaker_judges_keeps_none_of_the_suspects_error_rows(
        s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    """While the breaker judges a server (its permanent errors may be its own fault), a stop must not
    commit or save those error rows: the judgement is slow here (the server-info answer the context
    check reads comes 8 s late), and the stop comes while it runs. Before the fix the stop committed
    the complete chunk of the suspect's ContextLengthExceeded rows."""
    from dflash_pipeline.dev.sim import slowprobe

    run, fleet = _unservable_run(s3_client, bucket, sim_fleet, 1)
    slowprobe.set_info_delay(fleet.servers[0], 8.0)  # after preflight: only the breaker's check waits
    worker = run.worker(0)
    t, out = _run_in_thread(worker)
    try:
        deadline = time.monotonic() + 60
        while not worker.breaker.deciding:
            assert time.monotonic() < deadline and t.is_alive(), f"the breaker never judged: {out}"
            time.sleep(0.05)
        worker.request_stop()
        t.join(timeout=15)
        assert not t.is_alive(), "the stop did not end the task"
    finally:
        slowprobe.set_info_delay(fleet.servers[0], 0.0)
        _stop(worker, t)
    kept = []
    for prefix in (run.layout.completions_prefix, run.layout.partials_prefix):
        for obj in run.store.list(prefix):
            got = run.store.get(obj.key)
            if got is not None:
                from dflash_pipeline.dataset.records import decode_part
                kept += [r for r in decode_part(got[0]).to_pylist() if r.get("error_class")]
    assert not kept, f"{len(kept)} error rows of the suspect server were kept: {sorted({r['id'] for r in kept})[:5]}"
