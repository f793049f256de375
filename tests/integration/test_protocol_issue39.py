"""Reproductions of the defects of the third outside review of the dispatch protocol (issue 39),
against a real S3 protocol server (moto) and simulated servers over HTTP, through the Worker's kept
interfaces (`run`, `request_stop`, `stats`); faults come from SimServer knobs and the S3 fault front.

1. A transient failure on a busy server (a 500 for one input) was taken for a refusal: put back
   uncounted with no bound, each put-back lowering the in-flight cap to what was in flight.
2. A server restarted mid-run with a smaller context committed its ContextLengthExceeded refusals
   as the prompts' error rows before the breaker suspected it (suspicion needs 20 of the last 40).
3. Prompts too long for every server (contexts 8192 and 4352, prompts of ~8310 tokens) got the
   healthy smaller server judged broken: its context was compared with the fleet's largest.
4. A retry took a live earlier try's claims when that try's renewal writes were slow (claim PUTs
   taking 3 s): the renewer timed each renewal from the end of the last one's write, and the
   retry's wait had about 1 s of slack for the write.
5. A stop left a claim whose answer was lost while its re-send was being retried: peers waited
   the whole lease for it.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
from test_dispatch import SIM, Run
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


# -- 2: a server restarted with a smaller context mid-run ------------------------------------------

# max_tokens is 4096 (RunConfig's default): 4096 + 256 holds the plan's short prompts with max_tokens;
# 4096 + 12 still holds a one-line prompt plus 1 token, not a question plus max_tokens.
CONTEXT = 4096 + 256


@pytest.mark.timeout(120)
def test_a_server_restarted_with_a_smaller_context_mid_run_commits_none_of_its_refusals(
        s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    """Its refusals depend on the server (its peer serves those prompts): none may be committed as
    the prompts' error rows, before or after the breaker suspects it. Before the fix the chunks it
    completed between the restart and the suspicion were committed with its error rows, and
    validation failed on the error rate."""
    fleet = sim_fleet(2, **SIM, context_length=CONTEXT)
    run = Run(s3_client, bucket, fleet.urls, n=400, save_every=10)
    workers = [run.worker(i, concurrency=8) for i in range(2)]
    threads = [_run_in_thread(w) for w in workers]
    try:
        deadline = time.monotonic() + 30
        while fleet.servers[0].stats()["completed"] < 40:
            assert time.monotonic() < deadline, "server 0 never got going"
            time.sleep(0.005)
        fleet.servers[0].update_config(context_length=4096 + 12)  # "restarted" smaller
        for t, _ in threads:
            t.join(timeout=60)
    finally:
        for w, (t, _) in zip(workers, threads):
            _stop(w, t)
    outs = [out for _, out in threads]
    assert isinstance(outs[1].get("result"), dict), outs[1]
    errors = [r for r in run.rows() if r.get("error_class")]
    print(f"server 0 ended {outs[0].get('error') or 'normally'!r:.200}; committed error rows {len(errors)}")
    assert not errors, f"{len(errors)} refusals of the restarted server committed as error rows"
    run.validate()


# -- 3: prompts too long for every server, in a fleet of two context lengths -------------------------


def _long_prompts(n: int, long: range, words: int = 4148) -> list[dict[str, Any]]:
    """`words` repeats of " every number" make a prompt of ~8310 tokens in the simulator's count."""
    out = []
    for i in range(n):
        text = f"Question {i}: how many primes are below {1000 + 7 * i}?"
        if i in long:
            text += " Consider" + " every number" * words + "."
        out.append({"id": f"q{i:05d}", "prompt": text})
    return out


@pytest.mark.timeout(120)
def test_prompts_too_long_for_every_server_are_error_rows_and_the_small_server_is_not_broken(
        s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    """Contexts 8192 and 4352 from preflight on, prompts of ~8310 tokens: too long for both. Each
    server meets a chunk of them (the breaker suspects both); the smaller one is the server preflight
    saw, so it is not broken, and the prompts end as their ContextLengthExceeded error rows. Before
    the fix it was ServerBroken ("restarted with a smaller --context-length"), lost for the run."""
    from test_liveness_servers import PromptRun

    fleet = sim_fleet(2, **SIM, context_length=8192)
    fleet.servers[1].update_config(context_length=4352)
    run = PromptRun(s3_client, bucket, fleet.urls, _long_prompts(240, long=range(0, 80)), save_every=40)
    assert [e["context_length"] for e in run.manifest["servers"]] == [8192, 4352]
    workers = [run.worker(i) for i in range(2)]
    results = run.run_all(workers)
    print("; ".join(f"{r!r}"[:200] if not isinstance(r, dict) else
                    f"{r['server']}: {r['completions']} completions, {r['permanent_errors']} permanent errors, "
                    f"breaker checks {r.get('breaker_checks')}" for r in results))
    assert all(isinstance(r, dict) for r in results), results
    _validate_exact(run)
    errors = [r for r in run.rows() if r.get("error_class")]
    assert sorted(r["id"] for r in errors) == [f"q{i:05d}" for i in range(80)]
    assert {r["error_class"] for r in errors} == {"ContextLengthExceeded"}
    assert run.claims_left() == []


# -- 4: a retry and its earlier try whose renewal writes are slow ------------------------------------


@pytest.fixture
def proxy(moto_server: Any) -> Any:
    from dflash_pipeline.dev.s3faults import S3FaultProxy

    p = S3FaultProxy(moto_server.port, seed=39).start()
    yield p
    p.stop()


@pytest.mark.timeout(150)
def test_a_retry_leaves_a_live_earlier_try_s_claims_alone_when_its_renewals_are_slow(
        s3_client: Any, bucket: str, sim_fleet: Any, proxy: Any) -> None:
    """Try 1 is still running and renewing, but each of its claim writes takes 3 s to land; try 2
    (same task, same owner) starts meanwhile. Try 2 must wait long enough for try 1's slow renewals:
    no chunk taken from it, no prompt generated twice. Before the fix try 2 took try 1's chunks
    (renewals landed every 5-6 s, try 2 took a claim quiet for 4 s)."""
    from test_protocol_review import _single_attempt_client

    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.steps.generate import Worker

    # ~1.8 s generations; try 1 runs 4 at a time, so it holds each chunk of 16 for several seconds.
    fleet = sim_fleet(1, token_time_s=0.002, length_scale=0.5, max_running_requests=16)
    run = Run(s3_client, bucket, fleet.urls, n=64, save_every=16)
    proxy.add_rule(method="PUT", key_regex=r"/claims/", delay_s=3.0)
    slow_store = Store(_single_attempt_client(proxy.url), bucket)
    try1 = Worker(slow_store, run.layout, run.manifest, run.settings(0, lease_s=8.0, try_number=1, concurrency=4))
    t1, out1 = _run_in_thread(try1)
    try2 = run.worker(0, lease_s=8.0, try_number=2, concurrency=4)
    t2 = None
    try:
        deadline = time.monotonic() + 60
        while not (len(try1.leases) >= 1 and try1.stats.completions >= 2):
            assert time.monotonic() < deadline and t1.is_alive(), f"try 1 never got going: {out1}"
            time.sleep(0.02)
        t2, out2 = _run_in_thread(try2)
        t1.join(timeout=100)
        t2.join(timeout=100)
        per_prompt: Counter[str] = Counter(fleet[0].stats()["ids"])
        twice = sorted(k for k, v in per_prompt.items() if v > 1)
        print(f"{len(twice)} of {run.n} prompts generated twice; try 1 completions {try1.stats.completions}, "
              f"chunks lost {try1.stats.chunks_lost_to_others}, rows discarded {try1.stats.rows_discarded}; try 2 "
              f"completions {try2.stats.completions}, chunks taken over {try2.stats.chunks_taken_over}")
        assert isinstance(out1.get("result"), dict), out1
        assert isinstance(out2.get("result"), dict), out2
        run.validate()
        assert try2.stats.chunks_taken_over == 0 and try1.stats.chunks_lost_to_others == 0
        assert not twice, f"{len(twice)} prompts generated twice"
    finally:
        proxy.clear_rules()
        _stop(try1, t1)
        if t2 is not None:
            _stop(try2, t2)


# -- 5: a stop while a claim whose answer was lost is being re-sent -----------------------------------


@pytest.mark.timeout(90)
def test_a_stop_releases_a_claim_whose_answer_was_lost_while_its_re_send_is_retried(
        s3_client: Any, bucket: str, sim_fleet: Any, proxy: Any) -> None:
    """The first claim lands but its answer is lost; every re-send is answered 503. A stop then
    comes while the claimer retries: the claim may be ours, so the stop must find it (its nonce)
    and release it within the grace. Before the fix it stayed until its lease expired."""
    from test_protocol_review import _single_attempt_client

    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.steps.generate import TaskStopped, Worker

    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=40, save_every=20)
    refused = proxy.add_rule(method="PUT", key_regex=r"/claims/", status=503)
    lost = proxy.add_rule(method="PUT", key_regex=r"/claims/", lose_answer=True, times=1)
    store = Store(_single_attempt_client(proxy.url), bucket)
    worker = Worker(store, run.layout, run.manifest, run.settings(0, lease_s=60.0, backoff_base_s=0.1))
    t, out = _run_in_thread(worker)
    try:
        deadline = time.monotonic() + 30
        while not (lost.hits >= 1 and refused.hits >= 2):
            assert time.monotonic() < deadline and t.is_alive(), f"the claim was never re-sent: {out}"
            time.sleep(0.01)
        assert run.claims_left(), "the first claim landed"
        stopped_at = time.monotonic()
        worker.request_stop()
        t.join(timeout=15)
        took = time.monotonic() - stopped_at
    finally:
        proxy.clear_rules()
        _stop(worker, t)
    assert isinstance(out.get("error"), TaskStopped), out
    assert took < 3.0 + 1.0, f"the stop took {took:.1f}s"
    assert run.claims_left() == [], "the claim whose answer was lost was left for its lease"
