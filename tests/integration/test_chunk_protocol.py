"""The chunk protocol against a real S3 protocol server (moto) and real simulated servers.

Each test is one of the defects issue 13 reported against the code before the protocol module
(aborted answers stored, a stale marker polled forever, one 503 stranding a chunk, a stop that
saved nothing, a dead server's chunks locked for the lease, a broken server committing error rows).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from test_dispatch import RUN_ID, SIM, Run

from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dataset.store import KeyGone, PreconditionFailed, Store, StoreUnavailable
from dflash_pipeline.steps.generate import ServerBroken, ServerLost, TaskStopped


def test_store_maps_conditional_outcomes_on_a_real_s3_server(s3_client: Any, bucket: str) -> None:
    store = Store(s3_client, bucket)
    etag = store.put("k/claim.json", b"a", if_none_match=True, metadata={"nonce": "n1"})
    info = store.head("k/claim.json")
    assert info is not None and info.etag == etag and info.metadata == {"nonce": "n1"}
    with pytest.raises(PreconditionFailed) as refused:
        store.put("k/claim.json", b"b", if_none_match=True)
    assert not isinstance(refused.value, KeyGone) and not refused.value.retried
    # A conditional delete of an object that changed is refused; of our own ETag it goes through.
    with pytest.raises(PreconditionFailed):
        store.delete("k/claim.json", if_match='"0000"')
    store.delete("k/claim.json", if_match=etag)
    assert store.head("k/claim.json") is None
    # An If-Match write on a key that was deleted: 404 NoSuchKey on AWS and moto -> KeyGone.
    with pytest.raises(KeyGone):
        store.put("k/claim.json", b"c", if_match=etag)


@pytest.mark.timeout(120)
def test_aborted_requests_are_retried_never_stored(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(2, **SIM, abort_rate=0.05)
    run = Run(s3_client, bucket, fleet.urls, n=400, save_every=50)
    results = run.run_all([run.worker(i, backoff_base_s=0.01) for i in range(2)])
    assert all(isinstance(r, dict) for r in results), results
    report = run.validate()
    aborted = sum(s["faults"]["abort"] for s in fleet.stats())
    assert aborted >= 5, "the fault was really injected"
    rows = run.rows()
    assert len(rows) == 400
    assert {r["finish_reason"] for r in rows if not r.get("error_class")} <= {"stop", "length"}
    assert report["completions"] == 400  # every abort was retried into a finished answer


@pytest.mark.timeout(120)
def test_a_marker_with_nothing_to_redo_does_not_hang_later_tasks(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=60, save_every=20)
    run.run_all([run.worker(0)])
    # What a repair killed between its part PUT and its marker DELETE leaves: a marker of an
    # earlier run asking for retries, over a part with no error rows.
    key = run.layout.retry_key(1)
    run.store.put(key, json.dumps({"run_id": "an-old-run", "retryable": 3, "permanent": 0}).encode())
    later = run.worker(0, run_id="a-later-run")
    assert not later._all_done()
    started = time.monotonic()
    result = run.run_all([later])[0]
    assert isinstance(result, dict), result
    assert time.monotonic() - started < 30
    assert run.store.head(key) is None, "the stale marker was settled"
    assert run.worker(0, run_id="a-third-run")._all_done()
    assert run.claims_left() == []


class _FlakyInputs(Store):
    """S3 answering the first reads of input chunks with 503 SlowDown (what AWS does under load)."""

    def __init__(self, *args: Any, fail: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail = fail
        self.failed = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bytes, str] | None:
        if "/inputs/" in key:
            with self._lock:
                if self.failed < self.fail:
                    self.failed += 1
                    raise StoreUnavailable("S3 error SlowDown (HTTP 503)")
        return super().get(key)


@pytest.mark.timeout(120)
def test_a_throttled_input_read_does_not_strand_its_chunk(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=120, save_every=20)
    from dflash_pipeline.steps.generate import Worker

    store = _FlakyInputs(s3_client, bucket, fail=3)
    worker = Worker(store, run.layout, run.manifest, run.settings(0, lease_s=3.0, poll_s=0.1))
    started = time.monotonic()
    result = run.run_all([worker])[0]
    assert isinstance(result, dict), result
    assert store.failed == 3
    assert time.monotonic() - started < 45
    assert result["chunks_taken_over"] == 0
    run.validate()
    assert run.claims_left() == []


@pytest.mark.timeout(120)
def test_request_stop_saves_finished_rows_and_releases_claims(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(1, **{**SIM, "token_time_s": 0.01})
    run = Run(s3_client, bucket, fleet.urls, n=600, save_every=100)
    worker = run.worker(0, lease_s=600.0)
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["result"] = worker.run()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            out["error"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while worker.stats.completions < 150 and time.monotonic() < deadline:
        time.sleep(0.05)
    stopped_at = time.monotonic()
    worker.request_stop()
    t.join(timeout=10)
    took = time.monotonic() - stopped_at
    assert not t.is_alive()
    assert isinstance(out.get("error"), TaskStopped), out
    assert took < 5.0, f"stopping took {took:.1f}s"
    assert run.claims_left() == [], "every claim released (a 600 s lease would otherwise lock them)"
    saved = sum(len(decode_part(run.store.get(o.key)[0])) for o in run.store.list(run.layout.partials_prefix))
    committed = sum(len(decode_part(run.store.get(o.key)[0])) for o in run.store.list(run.layout.completions_prefix))
    assert saved + committed >= worker.stats.completions - 2 * 8, "finished rows were saved, not lost"

    # The next try picks everything up at once and redoes none of the saved rows.
    before = fleet.servers[0].stats()["completed"]
    result = run.run_all([run.worker(0, lease_s=600.0, try_number=2)])[0]
    assert isinstance(result, dict), result
    run.validate()
    redone = fleet.servers[0].stats()["completed"] - before
    assert redone <= 600 - saved - committed + 2 * 8


@pytest.mark.timeout(120)
def test_a_dead_servers_chunks_move_in_seconds_not_a_lease(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(2, **{**SIM, "token_time_s": 0.004})
    run = Run(s3_client, bucket, fleet.urls, n=1200, save_every=100)
    workers = [run.worker(i, lease_s=90.0, handoff_after_s=1.0, server_lost_after_s=12.0, request_timeout_s=5)
               for i in range(2)]
    finished: dict[int, float] = {}
    out: list[Any] = [None, None]

    def go(i: int) -> None:
        try:
            out[i] = workers[i].run()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            out[i] = exc
        finished[i] = time.monotonic()

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    while workers[0].stats.completions < 150:
        time.sleep(0.02)
    fleet.servers[0].crash()
    crashed = time.monotonic()
    threads[1].join(timeout=60)
    assert isinstance(out[1], dict), out
    survivor_s = finished[1] - crashed
    # The survivor alone needs about (1200 - done) / its rate; the point is it never waits the
    # 90 s lease for the dead server's claimed chunks.
    assert survivor_s < 30, f"the survivor finished {survivor_s:.0f}s after the crash"
    assert workers[0].stats.handoffs >= 1
    run.validate()
    threads[0].join(timeout=60)
    assert isinstance(out[0], ServerLost), out[0]


@pytest.mark.timeout(120)
def test_a_server_answering_only_permanent_errors_trips_the_breaker(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(2, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=600, save_every=100)
    # Restarted with a smaller --context-length: every request is an instant 400.
    fleet.servers[0].update_config(context_length=8)
    results = run.run_all([run.worker(i) for i in range(2)])
    assert isinstance(results[0], ServerBroken), results[0]
    assert "permanent" in str(results[0]) and fleet.servers[0].url in str(results[0])
    assert isinstance(results[1], dict), results[1]
    run.validate()
    rows = run.rows()
    assert not [r for r in rows if r.get("error_class")], "no error row of the broken server was committed"


@pytest.mark.timeout(180)
def test_two_runs_on_one_root_repair_a_chunk_once_each(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    # A server that always fails some prompts (transiently: HTTP 500) while it serves the others,
    # so their rows end as retryable error rows (a server failing every request is "failing"
    # instead: it hands its work over and is probed, test_protocol_review.py).
    fleet = sim_fleet(1, **{**SIM, "poison_text": "Question 1"})
    run = Run(s3_client, bucket, fleet.urls, n=40, save_every=20)
    first = run.run_all([run.worker(0, max_attempts=1, backoff_base_s=0.01)])[0]
    assert isinstance(first, dict) and first["errors"] > 0
    assert run.store.head(run.layout.retry_key(0)) is not None, "chunk 0 has error rows to repair"
    # Two later runs on the same root while the server still fails: each repairs each chunk at
    # most once, so they end instead of repairing each other's rows back and forth.
    a = run.worker(0, run_id="run-a", max_attempts=1, backoff_base_s=0.01)
    b = run.worker(0, run_id="run-b", max_attempts=1, backoff_base_s=0.01, worker="w0001")
    results = run.run_all([a, b])
    assert all(isinstance(r, dict) for r in results), results
    assert sum(r["errors"] for r in results) <= 2 * first["errors"]
    marker = json.loads(run.store.get(run.layout.retry_key(0))[0])
    assert RUN_ID in marker["runs"] and len(marker["runs"]) == len(set(marker["runs"]))


@pytest.mark.timeout(120)
def test_unfinished_rows_stored_by_older_code_are_errors_and_get_redone(s3_client: Any, bucket: str,
                                                                         sim_fleet: Any) -> None:
    from dflash_pipeline.dataset.records import encode_part
    from dflash_pipeline.steps.validate import run_validation
    from dflash_pipeline.steps.validate.report import Thresholds

    fleet = sim_fleet(1, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=40, save_every=20)
    run.run_all([run.worker(0)])
    # What the old client stored for an aborted request: a "completion" with finish_reason abort.
    key = run.layout.part_key(0)
    rows = decode_part(run.store.get(key)[0]).to_pylist()
    rows[3]["finish_reason"] = "abort"
    run.store.put(key, encode_part(rows))
    report = run_validation(s3_client, run.cfg.output_uri, Thresholds(max_error_rate=0.5))
    assert report["unfinished_as_completions"] == 1 and report["errors_by_class"].get("Unfinished") == 1
    assert report["completions"] == 39 and report["retryable_errors"] == 1
    assert run.store.head(run.layout.retry_key(0)) is not None, "validation flagged the part for a retry"
    result = run.run_all([run.worker(0, run_id="next-run")])[0]
    assert isinstance(result, dict) and result["completions"] == 1
    assert run.validate()["completions"] == 40


def test_plan_reads_exactly_the_input_version_it_pins(s3_client: Any, bucket: str) -> None:
    from dflash_pipeline.config import RunConfig
    from dflash_pipeline.steps.plan import PlanError, run_plan

    key = "in/replaced.jsonl"
    s3_client.put_object(Bucket=bucket, Key=key, Body=b'{"prompt": "old"}\n')

    class Replacing:
        """The input is replaced between plan's HEAD (which it pins) and its read."""

        def __getattr__(self, name: str) -> Any:
            return getattr(s3_client, name)

        def head_object(self, **kwargs: Any) -> Any:
            resp = s3_client.head_object(**kwargs)
            if kwargs.get("Key") == key:
                s3_client.put_object(Bucket=bucket, Key=key, Body=b'{"prompt": "new"}\n{"prompt": "newer"}\n')
            return resp

    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/{key}", "output_uri": f"s3://{bucket}/ds-replaced",
                                 "servers": ["http://127.0.0.1:1"]})
    with pytest.raises(PlanError, match="replaced"):
        run_plan(Replacing(), cfg, RUN_ID)
    assert Store(s3_client, bucket).head("ds-replaced/manifest.json") is None
