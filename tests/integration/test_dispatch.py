"""Dispatch outcomes of the generate Worker against a real S3 protocol server and simulated SGLang servers.

moto_server (subprocess, shared fixture) for S3, in-process SimServers on 127.0.0.1, the library's
run_plan / run_preflight / Worker / run_validation as the DAG calls them. The tests assert outcomes
(what is in the dataset, what the servers were asked), never timings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.steps.generate.chunks import State
from dflash_pipeline.dataset.store import PreconditionFailed, Store
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.steps.generate import ServerLost, Worker, WorkerSettings
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import run_preflight
from dflash_pipeline.steps.validate import run_validation

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "manual__2026-01-01T00:00:00+00:00"
# ~36 tokens per completion on average, 1 ms per token, 8 slots: a few hundred completions per second.
SIM = {"token_time_s": 0.001, "length_scale": 0.02, "max_running_requests": 8}


def _prompts(n: int) -> bytes:
    rows = [{"id": f"q{i:05d}", "prompt": f"Question {i}: how many primes are below {1000 + 7 * i}?"} for i in range(n)]
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


class Run:
    """One planned dataset root: plan and preflight done, Workers made on demand."""

    def __init__(self, s3: Any, bucket: str, urls: list[str], n: int, save_every: int,
                 prompts: bytes | None = None) -> None:
        s3.put_object(Bucket=bucket, Key="in/prompts.jsonl", Body=_prompts(n) if prompts is None else prompts)
        self.s3, self.bucket, self.n = s3, bucket, n
        self.cfg = RunConfig.from_params({
            "prompts_uri": f"s3://{bucket}/in/prompts.jsonl",
            "output_uri": f"s3://{bucket}/ds",
            "servers": urls,
            "save_every": save_every,
        })
        self.specs = [ServerSpec(u, u) for u in urls]
        run_plan(s3, self.cfg, RUN_ID)
        self.infos = run_preflight(s3, self.cfg, self.specs, RUN_ID)
        self.layout = DatasetLayout.from_uri(self.cfg.output_uri)
        self.store = Store(s3, bucket)
        self.manifest = json.loads(self.store.get(self.layout.manifest_key)[0])

    def settings(self, index: int, **overrides: Any) -> WorkerSettings:
        info = self.infos[index]
        values: dict[str, Any] = {
            "run_id": RUN_ID,
            "worker": f"w{index:04d}",
            "server": self.specs[index],
            "model": info["model"],
            "sampling": self.cfg.sampling,
            "concurrency": int(info["concurrency"]),
            "poll_s": 0.2,
            "engine": info.get("engine") or "sglang",
        }
        values.update(overrides)
        return WorkerSettings(**values)

    def worker(self, index: int, **overrides: Any) -> Worker:
        return Worker(Store(self.s3, self.bucket), self.layout, self.manifest, self.settings(index, **overrides))

    def run_all(self, workers: list[Worker]) -> list[Any]:
        """Run the workers as the DAG's mapped tasks would (concurrently); results or exceptions."""
        out: list[Any] = [None] * len(workers)

        def go(i: int) -> None:
            try:
                out[i] = workers[i].run()
            except BaseException as exc:  # noqa: BLE001 - asserted by the tests
                out[i] = exc

        threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a worker did not finish"
        return out

    def validate(self) -> dict[str, Any]:
        report = run_validation(self.s3, self.cfg.output_uri)  # raises ValidationFailed when not exact
        assert report["prompts"] == self.n
        assert report["missing"] == 0 and report["duplicates"] == 0 and report["unexpected_ids"] == 0
        return report

    def rows(self) -> list[dict[str, Any]]:
        """Every committed row, read from the parts."""
        rows: list[dict[str, Any]] = []
        for obj in self.store.list(self.layout.completions_prefix):
            got = self.store.get(obj.key)
            assert got is not None
            rows.extend(decode_part(got[0]).to_pylist())
        return rows

    def claims_left(self) -> list[str]:
        return [o.key for o in self.store.list(self.layout.claims_prefix)]

    def committed(self) -> set[int]:
        return {c for o in self.store.list(self.layout.completions_prefix) if (c := chunk_of_key(o.key, self.layout.completions_prefix)) is not None}


def _generation_requests(fleet: Any) -> int:
    return sum(s.stats()["generation_requests"] for s in fleet)


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_uniform_fleet_every_prompt_once_and_no_request_twice(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(3, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=600, save_every=25)
    results = run.run_all([run.worker(i) for i in range(3)])
    assert all(isinstance(r, dict) for r in results), results

    report = run.validate()
    assert report["completions"] == 600 and report["errors"] == 0
    assert _generation_requests(fleet) == 600  # no request was sent twice
    per_prompt = Counter()
    for s in fleet:
        per_prompt.update(s.stats()["ids"])
    assert len(per_prompt) == 600 and set(per_prompt.values()) == {1}
    assert all(report["per_server"][u]["rows"] > 0 for u in fleet.urls)
    assert run.claims_left() == []


@pytest.mark.timeout(180)
def test_slow_server_gets_less_work(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    # Slower tokens than SIM, so that the in-process fleet and clients are far from CPU-bound here: at
    # 3 ms per token (~200 completions/s in this process) a CI runner busy with a second test worker made
    # the CPU, not the simulated tokens, the bottleneck, and the three servers drew level (173/193/234).
    # At 15 ms the fleet makes ~40 completions/s.
    fleet = sim_fleet(3, **{**SIM, "token_time_s": 0.015})
    fleet[0].update_config(slow_factor=3.0)
    run = Run(s3_client, bucket, fleet.urls, n=600, save_every=25)
    results = run.run_all([run.worker(i) for i in range(3)])
    assert all(isinstance(r, dict) for r in results), results

    report = run.validate()
    assert report["completions"] == 600
    rows = {u: report["per_server"][u]["rows"] for u in fleet.urls}
    slow, fast = rows[fleet.urls[0]], [rows[u] for u in fleet.urls[1:]]
    # A static split would give each server 200; free capacity took the work (ideal: 1/7 vs 3/7 of it).
    assert slow < 0.6 * min(fast), rows
    assert _generation_requests(fleet) == 600


def _crash_run(s3: Any, bucket: str, sim_fleet: Any) -> dict[str, Any]:
    """Server 0 dies on its 60th request, for good; returns what the tests check."""
    fleet = sim_fleet(3, **SIM)
    fleet[0].update_config(crash_after_requests=60, restart_after_s=None)
    run = Run(s3, bucket, fleet.urls, n=600, save_every=25)
    # A long lease: if the lost worker did not release its chunks, the others would wait 10 minutes.
    fast = {"server_lost_after_s": 1.0, "max_attempts": 2, "backoff_base_s": 0.05, "backoff_cap_s": 0.2,
            "lease_s": 600.0}
    workers = [run.worker(i, **fast) for i in range(3)]
    results = run.run_all(workers)
    report = run.validate()
    crashed = fleet[0].stats()
    return {
        "run": run, "fleet": fleet, "workers": workers, "results": results, "report": report, "crashed": crashed,
        # At most `concurrency` requests are in flight on a server (the sim's own "aborted" counter misses
        # requests that raced the crash, so the client-side bound is the exact one).
        "in_flight_at_crash": workers[0].settings.concurrency,
        "wasted": _generation_requests(fleet) - 600,
        # completions of the lost worker that were in chunks it had not committed yet
        "discarded": workers[0].stats.completions - report["per_server"].get(fleet.urls[0], {}).get("rows", 0),
    }


@pytest.mark.timeout(60)
def test_crashed_server_releases_its_chunks_to_the_others(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    r = _crash_run(s3_client, bucket, sim_fleet)
    workers, results, report = r["workers"], r["results"], r["report"]
    assert isinstance(results[0], ServerLost), results[0]
    assert isinstance(results[1], dict) and isinstance(results[2], dict), results
    assert workers[1].stats.chunks_taken_over == 0 and workers[2].stats.chunks_taken_over == 0
    # Every prompt present exactly once (validate() checked missing == 0 and no duplicates), and the
    # requests cut by the crash were requeued, not written as error rows.
    assert report["completions"] == 600 and report["errors"] == 0
    assert r["run"].claims_left() == []  # released, then committed by the survivors
    assert r["crashed"]["crashes"] == 1 and not r["crashed"]["up"]
    assert r["crashed"]["aborted"] + 1 <= r["in_flight_at_crash"]  # + 1: the request that triggered it
    # What was sent again: the requests in flight at the crash, plus the completions the lost worker
    # held in chunks it had not committed (released chunks are redone whole).
    assert 0 <= r["wasted"] <= r["in_flight_at_crash"] + r["discarded"]


@pytest.mark.timeout(60)
def test_crash_wastes_only_the_requests_in_flight(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    r = _crash_run(s3_client, bucket, sim_fleet)
    assert r["wasted"] <= r["in_flight_at_crash"], r["discarded"]


# A generate task in its own process, so it can be SIGKILLed mid-chunk like a lost Airflow worker.
_CHILD = r"""
import json, sys
from dflash_pipeline.config import Sampling
from dflash_pipeline.dev.stack import s3_client
from dflash_pipeline.steps.generate import Worker, WorkerSettings
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.dataset.store import Store
a = json.loads(sys.argv[1])
layout = DatasetLayout.from_uri(a["output_uri"])
store = Store(s3_client(a["endpoint"]), layout.bucket)
manifest = json.loads(store.get(layout.manifest_key)[0])
s = WorkerSettings(run_id=a["run_id"], worker=a["worker"], server=ServerSpec(a["url"], a["url"]), model=a["model"],
                   sampling=Sampling(**a["sampling"]), concurrency=a["concurrency"], lease_s=a["lease_s"])
Worker(store, layout, manifest, s).run()
"""


def _start_child_worker(run: Run, moto_server: Any, index: int, lease_s: float) -> subprocess.Popen[bytes]:
    s = run.settings(index)
    arg = {"endpoint": moto_server.endpoint_url, "output_uri": run.cfg.output_uri, "run_id": RUN_ID,
           "worker": s.worker, "url": s.server.base_url, "model": s.model, "sampling": s.sampling.__dict__,
           "concurrency": s.concurrency, "lease_s": lease_s}
    env = {**os.environ, **moto_server.env()}
    return subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(arg)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.timeout(60)
def test_killed_worker_chunks_are_taken_over_after_the_lease(
    s3_client: Any, bucket: str, sim_fleet: Any, moto_server: Any
) -> None:
    fleet = sim_fleet(2, **SIM)
    fleet[0].update_config(slow_factor=4.0)  # so the doomed worker is surely mid-chunk when killed
    run = Run(s3_client, bucket, fleet.urls, n=300, save_every=25)
    child = _start_child_worker(run, moto_server, 0, lease_s=2.0)
    try:
        _wait(lambda: fleet[0].stats()["completed"] >= 30 or child.poll() is not None, 30, "the child's progress")
        assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
    done_by_child = run.committed()
    stale = [k for k in run.claims_left() if chunk_of_key(k, run.layout.claims_prefix) not in done_by_child]
    assert stale, "the killed worker left no claim behind; the test did not test anything"

    survivor = run.worker(1, lease_s=2.0)
    result = survivor.run()
    assert result["chunks_taken_over"] >= len(stale)
    report = run.validate()
    assert report["completions"] == 300
    assert run.claims_left() == []


@pytest.mark.timeout(60)
def test_retried_map_index_takes_back_its_own_claims_at_once(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(2, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=200, save_every=25)
    # What a killed first try of map index 0 leaves behind: fresh claims (lease far from expired).
    for c in (0, 1, 2):
        body = {"owner": f"{RUN_ID}#w0000", "worker": "w0000", "server": fleet.urls[0], "run_id": RUN_ID, "try": 1}
        run.store.put(run.layout.claim_key(c), json.dumps(body).encode(), if_none_match=True,
                      content_type="application/json")

    # Another map index must respect them ...
    other = run.worker(1, lease_s=600.0)
    first = other.claimer._try_claim()
    assert first is not None and first.index == 3
    assert other.leases.move(first.lease, State.RELEASED, "main") and other.chunks.release(first.lease, 10.0)

    # ... the same map index in its next try takes them back at once (a 10-minute lease would time out).
    retry = run.worker(0, lease_s=600.0, try_number=2)
    result = retry.run()
    assert result["chunks_taken_over"] == 0  # taking back one's own claims is not a takeover
    assert result["chunks_committed"] == len(run.manifest["chunks"]["sizes"])
    report = run.validate()
    assert report["completions"] == 200
    assert run.claims_left() == []


class _CountingStore(Store):
    """A Store that counts the claim writes S3 refused (412)."""

    refused = 0

    def put(self, key: str, data: bytes, **kwargs: Any) -> str:
        try:
            return super().put(key, data, **kwargs)
        except PreconditionFailed:
            type(self).refused += 1
            raise


@pytest.mark.timeout(60)
def test_simultaneous_claims_spread_without_refusals_and_keep_plan_order(
    s3_client: Any, bucket: str, sim_fleet: Any
) -> None:
    fleet = sim_fleet(4, **SIM)
    run = Run(s3_client, bucket, fleet.urls, n=400, save_every=25)
    workers = [
        Worker(_CountingStore(s3_client, bucket), run.layout, run.manifest, run.settings(i, map_index=i, n_workers=4))
        for i in range(4)
    ]
    # All four tasks claim their first chunk at the same moment, from the same (empty) listing.
    got: list[Any] = [None] * 4
    barrier = threading.Barrier(4)

    def first(i: int) -> None:
        barrier.wait()
        got[i] = workers[i].claimer._try_claim()

    threads = [threading.Thread(target=first, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(ch.index for ch in got) == [0, 1, 2, 3]  # the first four chunks, one each
    assert _CountingStore.refused == 0  # nobody queued up behind another's claim

    # Later claims keep plan order: the lowest free chunk goes to whoever asks next, whatever its
    # map index (a fixed place per worker would leave it to one worker, late if that one is slow).
    workers[0].claimer._last_scan = None  # a fresh listing (a reused one may not show chunk 4 yet)
    assert workers[3].claimer._try_claim().index == 4
    assert workers[0].claimer._try_claim().index == 5

    # Two workers racing for the same next chunk: one wins, the other is refused once and moves
    # to its own place among the next chunks rather than walking into the winner's next refusal.
    _CountingStore.refused = 0
    listing = workers[1].scanner.scan()
    assert workers[2].claimer._claim_from(*listing).index == 6
    second = workers[1].claimer._claim_from(*listing)
    assert second is not None and second.index == 8  # chunk 6 refused, then its place (1) among 7, 8, 9, 10
    assert _CountingStore.refused == 1
