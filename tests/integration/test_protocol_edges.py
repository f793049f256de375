"""Edges of the chunk protocol a code review found (issue 13's second round), against a real S3
protocol server (moto, behind the fault-injecting front where a fault is needed) and simulated servers:
a stop during an S3 outage, answers lost to renewals / releases / claims that botocore did not
re-send, leftovers of older code in partials, and a commit that never sees its part."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from botocore.config import Config
from test_dispatch import SIM, Run

from dflash_pipeline.dataset.records import decode_part, encode_part
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.dev.s3faults import S3FaultProxy
from dflash_pipeline.dev.stack import s3_client as make_client
from dflash_pipeline.dev.stack.s3 import MOTO_ACCESS_KEY, MOTO_SECRET_KEY
from dflash_pipeline.steps.generate import TaskStopped
from dflash_pipeline.steps.generate.chunks import ChunkStore, Lease, claim_body
from dflash_pipeline.steps.generate.worker import Worker


@pytest.fixture
def proxy(moto_server: Any) -> Any:
    p = S3FaultProxy(moto_server.port, seed=7).start()
    yield p
    p.stop()


def _chunks(store: Store) -> ChunkStore:
    return ChunkStore(store, lambda c: f"ds/claims/chunk-{c:06d}.json", claim_body("r#w", "w", "s", "r", 1))


def _run_in_thread(worker: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["result"] = worker.run()
        except BaseException as exc:  # noqa: BLE001 - asserted by the tests
            out["error"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


@pytest.mark.timeout(180)
def test_a_stop_during_an_s3_outage_ends_within_the_grace(proxy: S3FaultProxy, s3_client: Any, bucket: str,
                                                          sim_fleet: Any) -> None:
    """SIGTERM while S3 is unreachable: the task must still end within `stop_grace_s` (the supervisor
    SIGKILLs it soon after), whatever it holds (open, queued and committing chunks); the next try
    then takes its own claims back once they are not renewed for one renewal period and one for
    its write (22 s with this 60 s lease; issues 31 and 39: a still-running earlier try keeps
    renewing and keeps them), well before the lease, and the dataset ends exact."""
    fleet = sim_fleet(1, **{**SIM, "token_time_s": 0.004})
    run = Run(s3_client, bucket, fleet.urls, n=900, save_every=60)
    faulty = Store(make_client(proxy.url), bucket)
    from dflash_pipeline.steps.generate import Worker

    worker = Worker(faulty, run.layout, run.manifest, run.settings(0, lease_s=60.0, stop_grace_s=3.0))
    t, out = _run_in_thread(worker)
    deadline = time.monotonic() + 60
    while worker.stats.completions < 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.stats.completions >= 200, "the run did not get going"
    proxy.outage(120)
    time.sleep(0.5)  # commits and renewals now hang in retries
    held = len(worker.leases)
    stopped_at = time.monotonic()
    worker.request_stop()
    t.join(timeout=30)
    took = time.monotonic() - stopped_at
    assert not t.is_alive(), "the worker did not stop"
    assert isinstance(out.get("error"), TaskStopped), out
    assert took < 3.0 + 1.0, f"stopping took {took:.1f}s with a 3 s grace ({held} leases held)"

    proxy.outage(0)
    retry = run.worker(0, lease_s=60.0, try_number=2)
    started = time.monotonic()
    result = run.run_all([retry])[0]
    assert isinstance(result, dict), result
    run.validate()
    assert time.monotonic() - started < 50, "the next try waited for leases instead of taking its own back"
    assert run.claims_left() == []


def test_renewal_and_release_recognise_our_own_unanswered_write(s3_client: Any, bucket: str) -> None:
    """A renewal whose answer was lost changed the claim's ETag without telling us (where ETags
    are not the body's MD5, e.g. SSE-KMS buckets; botocore did not re-send it, so the 412 that
    follows is not flagged `retried`). The next renewal and the release must see the claim is still
    ours (its nonce), not read it as a take-over. moto's ETags are MD5s, so the stale ETag we last
    heard is stood in by one that cannot match."""
    store = Store(s3_client, bucket)
    chunks = _chunks(store)
    lease = chunks.claim(3, None)
    assert lease is not None
    key = chunks.claim_key(3)
    store.put(key, chunks.claim_body(lease.nonce), if_match=lease.etag,  # the unanswered renewal
              content_type="application/json", metadata={"nonce": lease.nonce})
    lease.etag = '"0000000000000000000000000000000f"'  # what we last heard: stale for certain
    assert chunks.renew(lease) is True, "our own claim was read as a take-over"
    assert lease.etag == store.head(key).etag

    lease.etag = '"0000000000000000000000000000000f"'
    assert chunks.release(lease, deadline_s=10.0)
    assert store.head(key) is None, "the release left our claim behind"

    # A peer's claim (another nonce) is neither renewed nor deleted.
    peer = chunks.claim(3, None)
    assert peer is not None
    mine = Lease(3, '"0000000000000000000000000000000f"', "not-the-peers-nonce")
    assert chunks.renew(mine) is False
    assert chunks.release(mine, deadline_s=10.0)
    info = store.head(key)
    assert info is not None and info.metadata == {"nonce": peer.nonce}


def test_a_claim_we_re_sent_ourselves_is_ours(proxy: S3FaultProxy, moto_server: Any, bucket: str) -> None:
    """The claim PUT takes effect, its answer is lost, and botocore does not re-send (retries off):
    our own retry re-sends the same nonce, gets 412 and must recognise the claim as ours."""
    import boto3

    no_retries = boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1",
                              aws_access_key_id=MOTO_ACCESS_KEY, aws_secret_access_key=MOTO_SECRET_KEY,
                              config=Config(retries={"max_attempts": 1, "mode": "standard"}, read_timeout=5))
    chunks = _chunks(Store(no_retries, bucket))
    proxy.set_rates(lost=1.0)
    lease = chunks.claim(5, None, deadline_s=20.0)
    proxy.set_rates(lost=0.0)
    assert proxy.counts["lost"] >= 1
    assert lease is not None, "our own claim was read as a peer's: the chunk would stay locked for a lease"
    info = Store(no_retries, bucket).head(chunks.claim_key(5))
    assert info is not None and info.metadata == {"nonce": lease.nonce} and info.etag == lease.etag


@pytest.mark.timeout(120)
def test_partials_reuse_only_rows_that_are_results_for_good(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    """A partial written by older code may hold an aborted answer stored as a completion or a
    transient error row: they are redone, only finished completions and permanent errors reused."""
    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=40, save_every=20)
    inputs = run.manifest  # the chunk's ids come from its input
    from dflash_pipeline.dataset.records import decode_inputs

    got = run.store.get(run.layout.input_key(inputs["plan_id"], 0))
    prompts = decode_inputs(got[0])
    base = {"reasoning": "r", "matched_stop": None, "prompt_tokens": 5, "completion_tokens": 3,
            "reasoning_tokens": 1, "model": "m", "server": "old", "attempts": 1, "latency_s": 0.1,
            "error_class": None, "error_message": None, "retryable": None, "chunk": 0, "run_id": "old"}
    kept = {**base, "id": prompts[0]["id"], "messages": prompts[0]["messages"], "content": "KEPT",
            "finish_reason": "stop"}
    aborted = {**base, "id": prompts[1]["id"], "messages": prompts[1]["messages"], "content": "half",
               "finish_reason": "abort"}
    transient = {**base, "id": prompts[2]["id"], "messages": prompts[2]["messages"], "content": None,
                 "finish_reason": None, "error_class": "ServerError", "error_message": "503", "retryable": True}
    permanent = {**base, "id": prompts[3]["id"], "messages": prompts[3]["messages"], "content": None,
                 "finish_reason": None, "error_class": "ContextLengthExceeded", "error_message": "too long",
                 "retryable": False}
    run.store.put(run.layout.partial_key(0), encode_part([kept, aborted, transient, permanent]))

    before = fleet.servers[0].stats()["completed"]
    result = run.run_all([run.worker(0)])[0]
    assert isinstance(result, dict), result
    rows = {r["id"]: r for o in run.store.list(run.layout.completions_prefix)
            for r in decode_part(run.store.get(o.key)[0]).to_pylist()}
    assert rows[kept["id"]]["content"] == "KEPT"
    assert rows[permanent["id"]]["error_class"] == "ContextLengthExceeded"
    assert rows[aborted["id"]]["finish_reason"] in ("stop", "length") and rows[aborted["id"]]["content"] != "half"
    assert rows[transient["id"]]["error_class"] is None
    assert fleet.servers[0].stats()["completed"] - before == 40 - 2
    assert list(run.store.list(run.layout.partials_prefix)) == []


@pytest.mark.timeout(120)
def test_a_claim_left_between_commit_and_release_is_swept_by_the_next_try(s3_client: Any, bucket: str,
                                                                            sim_fleet: Any) -> None:
    """A try SIGKILLed after committing a chunk and before releasing its claim leaves a claim of a
    done chunk: the next try of the same task deletes it at once (its owner is read from S3);
    a live peer's claim is left alone."""
    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=60, save_every=20)
    assert isinstance(run.run_all([run.worker(0)])[0], dict)
    w = run.worker(0, try_number=2)
    ours = claim_body(w.settings.owner, "w0000", "s", w.settings.run_id, 1)("n1")
    peers = claim_body("other-run#w0001", "w0001", "s", "other-run", 1)("n2")
    run.store.put(run.layout.claim_key(0), ours, content_type="application/json", metadata={"nonce": "n1"})
    run.store.put(run.layout.claim_key(1), peers, content_type="application/json", metadata={"nonce": "n2"})
    assert w._all_done()
    assert run.claims_left() == [run.layout.claim_key(1)], "ours swept at once, the peer's (not expired) kept"


@pytest.mark.timeout(120)
def test_the_sweep_deletes_an_earlier_tries_claim_through_refused_deletes(proxy: S3FaultProxy, s3_client: Any,
                                                                          bucket: str, sim_fleet: Any) -> None:
    """The end-of-run sweep is the only thing that deletes an earlier try's claim of a committed
    chunk before it expires (peers wait for expiry, and may have ended): S3 answering its first
    conditional DELETEs 409 / 503 (both "retry") must not leave the claim behind (chaos seed 3008
    ended with one such claim). Fails when the sweep gives a claim up on one refused request."""
    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=40, save_every=20)
    assert isinstance(run.run_all([run.worker(0)])[0], dict)
    via_proxy = make_client(proxy.url)
    w = Worker(Store(via_proxy, bucket), run.layout, run.manifest, run.settings(0, try_number=2))
    ours = claim_body(w.settings.owner, "w0000", "s", w.settings.run_id, 1)("n1")
    run.store.put(run.layout.claim_key(1), ours, content_type="application/json", metadata={"nonce": "n1"})
    claim_re = r"/claims/chunk-000001"
    refused = [proxy.add_rule(method="DELETE", key_regex=claim_re, status=409, code="ConditionalRequestConflict",
                              times=2),
               proxy.add_rule(method="DELETE", key_regex=claim_re, status=503, code="SlowDown", times=4)]
    assert w._all_done()
    assert run.claims_left() == [], "the earlier try's claim was left behind after refused deletes"
    assert sum(r.hits for r in refused) == 6, "the fault front did not refuse the sweep's deletes"


@pytest.mark.timeout(120)
def test_a_stop_while_a_complete_run_releases_its_claims_ends_within_the_grace(
        proxy: S3FaultProxy, s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    """The dataset is complete and the worker's normal end releases a claim it still holds (one its
    claimer took from a stale listing as the last part landed) while S3 holds the DELETE: a SIGTERM
    then must end the task within `stop_grace_s` (the supervisor SIGKILLs it soon after), the
    release's wait re-read from the stop's deadline. Fails when the normal end's releases wait out
    their own 30 s bound whatever the stop says."""
    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=40, save_every=20)
    assert isinstance(run.run_all([run.worker(0)])[0], dict)
    w = Worker(Store(make_client(proxy.url), bucket), run.layout, run.manifest,
               run.settings(0, try_number=2, stop_grace_s=2.0))
    lease = w.chunks.claim(0, None, deadline_s=10.0)
    assert lease is not None
    w.leases.add(lease)
    held = proxy.add_rule(method="DELETE", key_regex=r"/claims/chunk-000000", delay_s=10.0, times=1)
    t = threading.Thread(target=w.closer.end_normally, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while held.hits == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert held.hits == 1, "the normal end did not release the claim it held"
    stopped_at = time.monotonic()
    w.request_stop()
    t.join(timeout=30)
    took = time.monotonic() - stopped_at
    assert not t.is_alive()
    assert took < 2.0 + 1.0, f"the normal end took {took:.1f}s after the stop with a 2 s grace"
