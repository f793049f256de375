"""Reproductions of the five defects an outside review of the chunk protocol found (issue 24), each
against a real S3 protocol server (moto, behind the fault-injecting front where a fault is needed)
and simulated servers over HTTP:

1. a lease refused between the claimer opening a chunk and main getting it: requests for it
   were requeued forever (a busy loop; the task never ended);
2. a commit started after a stop that fails: its complete chunk's rows vanished (no partial);
3. a hand-off in progress when SIGTERM arrives ran to its own 30 s deadline, past the stop grace;
4. a server answering every chat request 500 while /health says 200 filled chunks with error rows;
5. a renewal rewrote identical bytes (same ETag), so a take-over or the sweep's conditional delete
   based on an older listing went through against a live claim.

Only the worker's kept interfaces are used (`run`, `request_stop`, `all_done`, `stats`, `leases`,
`keeper`, `chunks`, `Leases.move`, `ChunkStore`, `claim_body`); faults come from the outside
(S3FaultProxy rules, SimServer knobs), so each test keeps its meaning through rewrites.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from test_dispatch import SIM, Run

from dflash_pipeline.dataset.layout import chunk_of_key
from dflash_pipeline.dataset.records import decode_part, unit_key
from dflash_pipeline.dataset.store import ObjectInfo, PreconditionFailed, Store
from dflash_pipeline.dev.s3faults import S3FaultProxy
from dflash_pipeline.dev.stack.s3 import MOTO_ACCESS_KEY, MOTO_SECRET_KEY
from dflash_pipeline.steps.generate import ServerLost, Worker
from dflash_pipeline.steps.generate.chunks import ChunkStore, Leases, State, claim_body


@pytest.fixture
def proxy(moto_server: Any) -> Any:
    p = S3FaultProxy(moto_server.port, seed=24).start()
    yield p
    p.stop()


def _single_attempt_client(url: str) -> Any:
    """A client through the fault front whose every call is one request: botocore re-sends nothing,
    so an injected 503 reaches the worker at once and its own retries (with their deadlines) are all
    that decides when a write gives up (botocore's backoff would add seconds of jitter)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=MOTO_ACCESS_KEY,
                        aws_secret_access_key=MOTO_SECRET_KEY,
                        config=Config(retries={"total_max_attempts": 1, "mode": "standard"},
                                      connect_timeout=5, read_timeout=30))


def _run_in_thread(worker: Worker) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["result"] = worker.run()
        except BaseException as exc:  # noqa: BLE001 - asserted by the tests
            out["error"] = exc
        out["ended_t"] = time.monotonic()

    t = threading.Thread(target=go, name=f"test-{worker.settings.worker}", daemon=True)
    t.start()
    return t, out


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _stop(worker: Worker, t: threading.Thread, timeout_s: float = 15.0) -> None:
    """Cleanup: a worker still running is stopped (a livelocked one ends on the stop request)."""
    if t.is_alive():
        worker.request_stop()
        t.join(timeout=timeout_s)


def _rows_in_s3(run: Run) -> dict[int, set[str]]:
    """Unit keys of the rows kept in S3 per chunk: committed parts and partials (rows saved for the
    fleet by a worker that let go)."""
    keep: dict[int, set[str]] = {}
    for prefix in (run.layout.completions_prefix, run.layout.partials_prefix):
        for obj in run.store.list(prefix):
            got = run.store.get(obj.key)
            if got is None:
                continue
            c = chunk_of_key(obj.key, prefix)
            assert c is not None, obj.key
            keep.setdefault(c, set()).update(unit_key(row) for row in decode_part(got[0]).to_pylist())
    return keep


def _error_rows(run: Run) -> dict[str, int]:
    """Error rows in the committed parts, by error class."""
    by_class: dict[str, int] = {}
    for obj in run.store.list(run.layout.completions_prefix):
        got = run.store.get(obj.key)
        for row in decode_part(got[0]).to_pylist() if got is not None else []:
            if row.get("error_class"):
                by_class[row["error_class"]] = by_class.get(row["error_class"], 0) + 1
    return by_class


# -- 1 ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_lease_refused_between_open_and_main_ends_its_requests(
    s3_client: Any, bucket: str, sim_fleet: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after worker 0's claimer moves its first chunk to OPEN (before main has it), a peer
    overwrites the claim and a renewal runs, so the lease is refused in that gap. The chunk must be
    lost for worker 0 (its requests end), and worker 0 must end once worker 1 has finished the
    dataset (taking the chunk over when the peer's claim expires). Before the fix nothing flagged the
    chunk dropped: every request for it returned at once and was requeued, forever, at full CPU."""
    fleet = sim_fleet(2, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=120, save_every=20)
    w0 = run.worker(0, lease_s=2.0)
    w1 = run.worker(1, lease_s=2.0)
    refused: list[int] = []
    original_move = Leases.move

    def move(self: Leases, lease: Any, to: State, role: str) -> bool:
        moved = original_move(self, lease, to, role)
        if moved and to is State.OPEN and self is w0.leases and not refused:
            refused.append(lease.chunk)
            peer = claim_body("peer-run#w0009", "w0009", "peer", "peer-run", 1)("peer-nonce")
            run.store.put(run.layout.claim_key(lease.chunk), peer, content_type="application/json",
                          metadata={"nonce": "peer-nonce"})
            lease.last_renewed_t = 0.0  # due now: this renewal is refused (the claim is the peer's)
            w0.keeper.renew_due(wait=True)
        return moved

    monkeypatch.setattr(Leases, "move", move)
    t0, out0 = _run_in_thread(w0)
    t1, out1 = _run_in_thread(w1)
    try:
        t1.join(timeout=60)
        assert not t1.is_alive(), "worker 1 did not finish the dataset"
        assert isinstance(out1.get("result"), dict), out1
        assert refused, "the hook never saw worker 0 open a chunk: the test did not test anything"
        sent_at_end = w0.stats.requests_sent
        t0.join(timeout=10)
        if t0.is_alive():
            spun = w0.stats.requests_sent - sent_at_end
            pytest.fail(f"worker 0 still running 10 s after the dataset was complete (chunk {refused[0]}'s lease "
                        f"was refused before main got it): {spun} requests sent in those 10 s, "
                        f"{w0.stats.requests_sent} in all for {run.n} prompts -- requeued forever")
    finally:
        _stop(w0, t0)
        _stop(w1, t1)
    assert "result" in out0 or "error" in out0
    report = run.validate()
    assert report["completions"] == run.n and report["errors"] == 0


# -- 2 ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_commit_failing_after_the_stop_keeps_its_rows(
    proxy: S3FaultProxy, s3_client: Any, bucket: str, sim_fleet: Any
) -> None:
    """Part PUTs are slow (1 s each), so complete chunks queue behind the commit in flight. At the
    stop, part PUTs start answering 503: the committer finishes the commit in flight, then starts
    the next queued chunk's, which fails at the committer's deadline. Every row the worker finished
    must be in S3 afterwards (a part or a partial), and the next try must finish the dataset exactly.
    Before the fix the failed commit's chunk left the stop path's sight (its claim was released with
    no partial): its complete rows vanished. Partial PUTs and claim deletes are slowed a little at
    the stop so that the old stop path, which handed back open chunks before queued ones, was still
    busy when the failed commit dropped its chunk."""
    fleet = sim_fleet(1, **{**SIM, "token_time_s": 0.002})
    run = Run(s3_client, bucket, fleet.urls, n=400, save_every=20)
    worker = Worker(Store(_single_attempt_client(proxy.url), bucket), run.layout, run.manifest,
                    run.settings(0, stop_grace_s=6.0, held_rows_cap=100_000, lease_s=600.0))
    slow_parts = proxy.add_rule(method="PUT", key_regex=r"/completions/part-", delay_s=1.0)
    t, out = _run_in_thread(worker)
    try:
        # The second part PUT is being held: chunks completed meanwhile are queued behind it.
        _wait(lambda: slow_parts.hits >= 2 and slow_parts.in_flight >= 1 or not t.is_alive(), 60,
              "a second part PUT in flight")
        assert t.is_alive(), out
        refuse = proxy.add_rule(method="PUT", key_regex=r"/completions/part-", status=503)
        slow_handback = [proxy.add_rule(method="PUT", key_regex=r"/partials/", delay_s=0.5),
                         proxy.add_rule(method="DELETE", key_regex=r"/claims/", delay_s=0.5)]
        worker.request_stop()
        t.join(timeout=30)
        assert not t.is_alive(), "the worker did not stop"
    finally:
        _stop(worker, t)
    _wait(lambda: all(r.in_flight == 0 for r in (slow_parts, refuse, *slow_handback)), 10, "the held S3 requests")
    finished = worker.stats.completions + worker.stats.errors
    kept = _rows_in_s3(run)
    n_kept = sum(len(keys) for keys in kept.values())
    committed = run.committed()
    assert finished > 0 and len(committed) < len(run.manifest["chunks"]["sizes"]), "the run was not stopped mid-way"
    assert n_kept == finished, (
        f"{finished - n_kept} of the {finished} rows the worker finished are neither in a part nor in a partial "
        f"(parts: {sorted(committed)}; rows kept per chunk: { {c: len(k) for c, k in sorted(kept.items())} }; "
        f"part PUTs refused after the stop: {refuse.hits})")

    proxy.clear_rules()
    before = fleet.servers[0].stats()["generation_requests"]
    retry = run.worker(0, try_number=2, lease_s=600.0)
    result = run.run_all([retry])[0]
    assert isinstance(result, dict), result
    report = run.validate()
    assert report["completions"] == run.n and report["errors"] == 0
    assert fleet.servers[0].stats()["generation_requests"] - before == run.n - n_kept  # nothing kept is redone
    assert run.claims_left() == []


# -- 3 ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_stop_during_a_hand_off_ends_within_the_grace(
    proxy: S3FaultProxy, s3_client: Any, bucket: str, sim_fleet: Any
) -> None:
    """The server dies; after `handoff_after_s` the worker hands its open chunks to the fleet, whose
    partial PUTs S3 answers slowly (8 s). SIGTERM (request_stop) during that hand-off must still end
    the task within `stop_grace_s` (the supervisor SIGKILLs soon after). Before the fix the hand-off
    kept its own fixed 30 s deadline and waited for the slow PUTs."""
    fleet = sim_fleet(1, **{**SIM, "token_time_s": 0.004})
    run = Run(s3_client, bucket, fleet.urls, n=600, save_every=50)
    grace = 3.0
    worker = Worker(Store(_single_attempt_client(proxy.url), bucket), run.layout, run.manifest,
                    run.settings(0, stop_grace_s=grace, handoff_after_s=0.5, server_lost_after_s=60.0,
                                 max_attempts=2, backoff_base_s=0.05, backoff_cap_s=0.2, lease_s=600.0,
                                 checkpoint_every_s=0.0))
    slow_partials = proxy.add_rule(method="PUT", key_regex=r"/partials/", delay_s=8.0)
    t, out = _run_in_thread(worker)
    try:
        _wait(lambda: worker.stats.completions >= 80 or not t.is_alive(), 60, "the run's progress")
        assert t.is_alive(), out
        fleet.servers[0].crash(None)  # down for good
        _wait(lambda: slow_partials.in_flight >= 1 or not t.is_alive(), 30, "the hand-off's partial PUT")
        assert t.is_alive(), out
        stopped_at = time.monotonic()
        worker.request_stop()
        t.join(timeout=30)
        took = out.get("ended_t", time.monotonic()) - stopped_at
        assert not t.is_alive(), "the worker did not stop"
    finally:
        _stop(worker, t)
    assert "error" in out or "result" in out
    assert took < grace + 1.5, f"stopping took {took:.1f}s with a {grace:g} s grace (a hand-off was in progress)"


# -- 4 ----------------------------------------------------------------------------------------------

# Fast client-side retries, so a failing request is decided in a fraction of a second.
FAST_RETRIES = {"max_attempts": 2, "backoff_base_s": 0.05, "backoff_cap_s": 0.2, "handoff_after_s": 1.0}


@pytest.mark.timeout(120)
def test_a_server_failing_every_request_with_health_up_writes_no_error_rows(
    s3_client: Any, bucket: str, sim_fleet: Any
) -> None:
    """Server 0 answers every chat request 500 (transient) while /health says 200. Its worker must
    hand its chunks over and stop claiming; worker 1 finishes the dataset, with no error rows.
    Before the fix /health resumed the worker at once, each prompt was requeued a few times and then
    written as an error row: the bad server's chunks were committed full of them."""
    fleet = sim_fleet(2, **SIM)
    fleet.servers[0].update_config(error_rate=1.0)
    run = Run(s3_client, bucket, fleet.urls, n=300, save_every=25)
    workers = [run.worker(i, server_lost_after_s=8.0, **FAST_RETRIES) for i in range(2)]
    results = run.run_all(workers)
    assert isinstance(results[1], dict), results[1]
    assert isinstance(results[0], (dict, ServerLost)), results[0]
    assert fleet.servers[0].stats()["faults"]["error"] > 0, "the bad server was never asked: nothing tested"
    errors = _error_rows(run)
    assert not errors, (
        f"{sum(errors.values())} error rows in the dataset ({errors}); the failing server's worker committed "
        f"{workers[0].stats.chunks_committed} chunk(s)")
    report = run.validate()
    assert report["completions"] == run.n and report["errors"] == 0
    assert run.claims_left() == []


@pytest.mark.timeout(120)
def test_a_server_failing_every_request_takes_work_again_when_it_recovers(
    s3_client: Any, bucket: str, sim_fleet: Any
) -> None:
    """As above, then server 0 recovers (error_rate back to 0) while much of the dataset is left: its
    worker must take work again and commit chunks, and the dataset must hold no error rows."""
    fleet = sim_fleet(2, **{**SIM, "token_time_s": 0.004})
    fleet.servers[0].update_config(error_rate=1.0)
    run = Run(s3_client, bucket, fleet.urls, n=900, save_every=20)
    workers = [run.worker(i, server_lost_after_s=30.0, **FAST_RETRIES) for i in range(2)]
    threads, outs = zip(*(_run_in_thread(w) for w in workers))
    try:
        _wait(lambda: fleet.servers[0].stats()["faults"]["error"] >= 20, 30, "server 0's failures")
        time.sleep(1.5)  # long enough to be failing for handoff_after_s
        committed_while_failing = workers[0].stats.chunks_committed
        fleet.servers[0].update_config(error_rate=0.0)
        recovered_at = len(run.committed())
        for th in threads:
            th.join(timeout=60)
        assert not any(th.is_alive() for th in threads), "a worker did not finish"
    finally:
        for w, th in zip(workers, threads):
            _stop(w, th)
    assert recovered_at < len(run.manifest["chunks"]["sizes"]) // 2, "the dataset was mostly done at the recovery"
    assert isinstance(outs[0].get("result"), dict) and isinstance(outs[1].get("result"), dict), outs
    errors = _error_rows(run)
    assert not errors, (
        f"{sum(errors.values())} error rows in the dataset ({errors}); worker 0 committed "
        f"{committed_while_failing} chunk(s) while its server failed")
    report = run.validate()
    assert report["completions"] == run.n and report["errors"] == 0
    assert workers[0].stats.chunks_committed > committed_while_failing, "worker 0 took no work after the recovery"
    assert report["per_server"][fleet.urls[0]]["completions"] > 0
    assert run.claims_left() == []


# -- 5 ----------------------------------------------------------------------------------------------


def test_a_renewal_is_visible_to_a_take_over_and_to_the_sweep(s3_client: Any, bucket: str) -> None:
    """A peer lists our claim, we renew it, then the peer acts on its listing: its If-Match take-over
    must be refused and the sweep's conditional delete (If-Match the listed ETag) must fail. Before
    the fix a renewal rewrote the same bytes, S3 kept the ETag, and both went through against a claim
    renewed a moment ago."""
    store = Store(s3_client, bucket)

    def key(c: int) -> str:
        return f"ds/claims/chunk-{c:06d}.json"

    ours = ChunkStore(store, key, claim_body("run#w0000", "w0000", "s0", "run", 1))
    peer = ChunkStore(store, key, claim_body("run#w0001", "w0001", "s1", "run", 1))
    leases = {c: ours.claim(c, None) for c in (4, 5)}
    assert all(lease is not None for lease in leases.values())
    listed: dict[str, ObjectInfo] = {o.key: o for o in store.list("ds/claims/")}
    before = {c: listed[key(c)] for c in leases}
    headed = store.head(key(5))
    assert headed is not None and headed.etag == before[5].etag
    for lease in leases.values():
        assert lease is not None and ours.renew(lease), "our own renewal was refused"

    taken = peer.claim(4, before[4])
    try:
        store.delete(key(5), if_match=before[5].etag)
        swept = True
    except PreconditionFailed:
        swept = False
    after = {c: store.head(key(c)) for c in leases}
    assert taken is None and not swept, (
        f"based on a listing older than our renewal: take-over {'went through' if taken else 'refused'}, "
        f"sweep delete {'went through' if swept else 'refused'} (ETag before renewal {before[4].etag}, "
        f"after {leases[4].etag if leases[4] else None})")
    for c, lease in leases.items():
        info = after[c]
        assert lease is not None and info is not None and info.metadata == {"nonce": lease.nonce}
