"""Liveness (issue 31, part B): one stop deadline for every blocking call on a worker's main thread,
claims that are never stuck behind a lost answer or a still-running earlier try, sweeps that retry
per object.

Each test reproduces one defect of the second outside review against a real S3 protocol server
(moto, behind the fault-injecting front: a rule holds, refuses or loses one kind of request) and
simulated servers over HTTP (dev/sim/slowprobe.py holds their load probes). Only the worker's kept
interfaces are used (`run`, `request_stop`, `all_done`, `stats`, `settings`); which call main is
blocked in is read from the outside, from main's stack, so the tests keep their meaning through
rewrites.

Stops are measured from the request to `run()`'s return (the process-exit measure is the chaos
bench's, bench/chaos.py); the bound asserted is `stop_grace_s + STOP_SLACK_S`.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections import Counter
from typing import Any

import pytest
from test_dispatch import RUN_ID, SIM, Run
from test_protocol_review import _run_in_thread, _single_attempt_client, _stop, _wait

from dflash_pipeline.dataset.records import encode_part
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.dev.s3faults import S3FaultProxy
from dflash_pipeline.dev.sim.slowprobe import set_probe_delay
from dflash_pipeline.steps.generate import TaskStopped, Worker
from dflash_pipeline.steps.generate.chunks import claim_body

#: What a stop may take past its grace, measured to run()'s return on 2 busy cores (the chaos bench
#: allows 1.5 s to the process's exit).
STOP_SLACK_S = 1.0
GRACE_S = 3.0


@pytest.fixture
def proxy(moto_server: Any) -> Any:
    p = S3FaultProxy(moto_server.port, seed=31).start()
    yield p
    p.stop()


def _worker(run: Run, client: Any, index: int = 0, **overrides: Any) -> Worker:
    return Worker(Store(client, run.bucket), run.layout, run.manifest, run.settings(index, **overrides))


def _in_stack(thread: threading.Thread, name: str) -> bool:
    """Whether `thread` is now inside a function called `name` (read from its frames)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def _bucket_path(bucket: str) -> str:
    """A rule's key_regex for the bucket's own path: ListObjectsV2 (the query string is not matched)."""
    return rf"^/{re.escape(bucket)}/?$"


def _stop_and_time(worker: Worker, t: threading.Thread, out: dict[str, Any]) -> float:
    t0 = time.monotonic()
    worker.request_stop()
    t.join(timeout=30)
    assert not t.is_alive(), "the worker did not end within 30 s of its stop"
    return out["ended_t"] - t0


# -- 3: a stop waits for slow S3 calls on main ------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["scan", "claims_sweep", "partials_sweep"])
def test_a_stop_never_waits_for_slow_s3_calls_on_main(
    s3_client: Any, bucket: str, sim_fleet: Any, proxy: Any, where: str
) -> None:
    """Every chunk is committed (by an earlier worker); a worker starting on the complete dataset checks
    that it is done (`all_done`: a LIST of the parts and the claims, then the sweeps). S3 answers, but
    slowly: each LIST (scan) or each DELETE of a stale partial (partials sweep) is held 4 s before it
    is forwarded. SIGTERM arrives while main waits for one: the stop must end within the grace.
    Before the fix main only looked at the stop after a failure, and a slow call that succeeds is no
    failure: 12.1 s against a 3 s grace (the review measured 7.8 s)."""
    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=40, save_every=10)
    assert isinstance(run.worker(0).run(), dict)
    if where == "scan":
        rule = proxy.add_rule(method="GET", key_regex=_bucket_path(bucket), delay_s=4.0)
    elif where == "claims_sweep":
        # a claim an earlier try of this task left on a committed chunk (SIGKILLed between its commit
        # and its release): the retry's sweep reads it (is it ours?) and deletes it
        body = claim_body(run.settings(0).owner, "w0000", fleet.urls[0], RUN_ID, 1)("earlier-nonce")
        run.store.put(run.layout.claim_key(0), body, content_type="application/json",
                      metadata={"nonce": "earlier-nonce"})
        rule = proxy.add_rule(method="GET", key_regex=r"/claims/", delay_s=4.0)
    else:
        # stale partials of committed chunks (a stop saved them while a commit was in flight)
        for c in range(4):
            run.store.put(run.layout.partial_key(c), encode_part([]))
        rule = proxy.add_rule(method="DELETE", key_regex=r"/partials/", delay_s=4.0)
    w = _worker(run, _single_attempt_client(proxy.url), stop_grace_s=GRACE_S, poll_s=0.2, try_number=2)
    t, out = _run_in_thread(w)
    try:
        _wait(lambda: rule.in_flight > 0 and _in_stack(t, "all_done"), 60,
              f"main waiting on a slow {where} call in all_done")
        took = _stop_and_time(w, t, out)
        print(f"figure: stop during a slow {where} took {took:.2f}s")  # -rP shows it (docs/liveness.md)
        assert took <= GRACE_S + STOP_SLACK_S, f"the stop took {took:.2f}s (grace {GRACE_S}s)"
        assert isinstance(out.get("error"), TaskStopped) or isinstance(out.get("result"), dict), out
    finally:
        proxy.clear_rules()
        _stop(w, t)


@pytest.mark.timeout(60)
def test_main_s_store_cuts_a_slow_call_at_the_stop_and_only_then(s3_client: Any, bucket: str, proxy: Any) -> None:
    """The primitive under every S3 call main makes (dataset/store.StopBoundStore): a LIST held 2 s
    is waited for while no stop is asked (it succeeds), and abandoned at once when one is (StopCut
    within a poll of the request, not after the call)."""
    from dflash_pipeline.dataset.store import StopCut, stop_bound

    s3_client.put_object(Bucket=bucket, Key="x/a", Body=b"1")
    stop = threading.Event()
    asked: list[float] = []
    store = stop_bound(Store(_single_attempt_client(proxy.url), bucket), stop,
                       lambda: asked[0] if asked else float("inf"))
    proxy.add_rule(method="GET", key_regex=_bucket_path(bucket), delay_s=2.0)
    t0 = time.monotonic()
    assert [o.key for o in store.list("x/")] == ["x/a"]
    assert time.monotonic() - t0 >= 1.9

    def ask() -> None:
        time.sleep(0.5)
        asked.append(time.monotonic())
        stop.set()

    threading.Thread(target=ask, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(StopCut):
        list(store.list("x/"))
    assert asked and time.monotonic() - asked[0] < 0.3, time.monotonic() - t0


# -- 4: a stop waits for the concurrency pilot ------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_stop_never_waits_for_a_slow_load_probe(
    s3_client: Any, bucket: str, sim_fleet: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The in-flight limit is discovered (the pilot probes /v1/loads from its own thread), and the
    server answers its load probes 6 s late. SIGTERM mid-run: the stop ends within the grace, and the
    "stop ... took" line it logs is not shorter than the stop really took (before the fix the
    `finally` joined the pilot for up to 5 s after that line: 5.1 s against a 3 s grace, logged 0.07 s)."""
    fleet = sim_fleet(1, token_time_s=0.004, length_scale=0.05, max_running_requests=8)
    run = Run(s3_client, bucket, fleet.urls, n=400, save_every=20)
    w = run.worker(0, stop_grace_s=GRACE_S, adaptive_headroom=True, declared_slots=8, probe_every_s=0.3)
    t, out = _run_in_thread(w)
    try:
        _wait(lambda: w.stats.completions >= 20, 60, "generation under way")
        set_probe_delay(fleet[0], 6.0)
        _wait(lambda: any(_in_stack(th, "_probe") or _in_stack(th, "server_load_sample")
                          for th in threading.enumerate() if th.name.startswith("pilot-")), 30,
              "the pilot waiting on a slow load probe")
        caplog.set_level(logging.INFO, logger="dflash_pipeline")
        took = _stop_and_time(w, t, out)
        print(f"figure: stop during a slow load probe took {took:.2f}s")
        assert took <= GRACE_S + STOP_SLACK_S, f"the stop took {took:.2f}s (grace {GRACE_S}s)"
        logged = [float(m.group(1)) for r in caplog.records
                  if (m := re.search(r"stop of worker \S+ took ([0-9.]+)s", r.getMessage()))]
        assert logged, "no 'stop took' line"
        assert logged[-1] >= took - 0.3, f"the log says the stop took {logged[-1]}s; it took {took:.2f}s"
    finally:
        set_probe_delay(fleet[0], 0.0)
        _stop(w, t)


# -- 5: the partials sweep stops at its first error -------------------------------------------------


@pytest.mark.timeout(90)
def test_the_partials_sweep_retries_each_object(s3_client: Any, bucket: str, sim_fleet: Any, proxy: Any) -> None:
    """Four stale partials of committed chunks; the first DELETE of one is answered 503. The sweep
    must retry that object and go on with the others (before: the first error ended the sweep and
    4 of 4 partials stayed)."""
    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=40, save_every=10)
    assert isinstance(run.worker(0).run(), dict)
    for c in range(4):
        run.store.put(run.layout.partial_key(c), encode_part([]))
    rule = proxy.add_rule(method="DELETE", key_regex=r"/partials/", status=503, times=1)
    w = _worker(run, _single_attempt_client(proxy.url))
    assert w.all_done()
    assert rule.hits == 1, "the 503 was never answered: the test did not test anything"
    left = [o.key for o in run.store.list(run.layout.partials_prefix)]
    assert left == [], f"stale partials left: {left}"


# -- 1: a lost claim answer blocks its chunk for a whole lease --------------------------------------


@pytest.mark.timeout(120)
def test_a_lost_claim_answer_does_not_block_its_chunk_for_a_lease(
    s3_client: Any, bucket: str, sim_fleet: Any, proxy: Any
) -> None:
    """The first claim PUT lands but its answer is lost; then the claim's key answers 503 for 3 s,
    past the claim's own deadline (2 s), so the claim attempt ends StoreUnavailable. The worker's
    next attempt must find its own claim (same nonce) and go on; before the fix it forgot the
    nonce, read its own claim as a peer's and waited for the lease (30 s) to expire."""
    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=40, save_every=10)
    claim0 = rf"/claims/chunk-0*0\.json$"
    box: list[Any] = []
    # `refuse` first, so `lost` (added last) decides while it is live: one lost answer, then 503s
    # for 3 s from that moment
    refuse = proxy.add_rule(key_regex=claim0, status=503,
                            until=lambda: box[0].first_hit_t is not None
                            and time.monotonic() > box[0].first_hit_t + 3.0)
    lost = proxy.add_rule(method="PUT", key_regex=claim0, lose_answer=True, times=1)
    box.append(lost)
    w = _worker(run, _single_attempt_client(proxy.url), lease_s=30.0, store_deadline_s=2.0, poll_s=0.2)
    t0 = time.monotonic()
    t, out = _run_in_thread(w)
    try:
        t.join(timeout=60)
        took = time.monotonic() - t0
        print(f"figure: the run with a lost claim answer took {took:.2f}s (lease 30 s)")
        assert lost.hits == 1 and refuse.hits > 0, (lost.hits, refuse.hits)
        assert isinstance(out.get("result"), dict), out
        assert took < 15.0, f"the run took {took:.1f}s: chunk 0 waited for its own claim's lease (30 s)"
        run.validate()
        assert run.claims_left() == []
    finally:
        proxy.clear_rules()
        _stop(w, t)


# -- 2: a retry and its still-running earlier try both generate ------------------------------------


@pytest.mark.timeout(180)
def test_a_retry_leaves_its_live_earlier_try_s_claims_alone(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    """Try 1 of a task is still running (its supervisor lost it; its claims are renewed) when try 2
    starts on the same server. Try 2 must not take back claims that are still being renewed: no
    prompt may be generated twice. Before the fix try 2 took every claim of its owner at once: 100
    of 600 prompts were generated twice."""
    fleet = sim_fleet(1, token_time_s=0.004, length_scale=0.05, max_running_requests=16)
    run = Run(s3_client, bucket, fleet.urls, n=600, save_every=25)
    try1 = run.worker(0, lease_s=8.0, try_number=1)
    t1, out1 = _run_in_thread(try1)
    try2 = run.worker(0, lease_s=8.0, try_number=2)
    t2: threading.Thread | None = None
    try:
        _wait(lambda: len(try1.leases) >= 2 and try1.stats.completions >= 10, 60, "try 1 generating")
        t2, out2 = _run_in_thread(try2)
        t1.join(timeout=120)
        t2.join(timeout=120)
        assert isinstance(out1.get("result"), dict), out1
        assert isinstance(out2.get("result"), dict), out2
        run.validate()
        per_prompt: Counter[str] = Counter(fleet[0].stats()["ids"])
        twice = sorted(k for k, v in per_prompt.items() if v > 1)
        print(f"figure: {len(twice)} of {run.n} prompts generated twice; completions try 1 "
              f"{try1.stats.completions}, try 2 {try2.stats.completions}")
        assert not twice, f"{len(twice)} prompts generated twice, e.g. {twice[:5]}"
        assert try2.stats.completions > 0 or try1.stats.completions == 600
    finally:
        _stop(try1, t1)
        if t2 is not None:
            _stop(try2, t2)

