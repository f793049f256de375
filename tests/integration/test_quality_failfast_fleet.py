"""Fail fast on live quality (issue 40), end to end on the generate Workers: three simulated servers, one of
them cutting every thinking at max_tokens (a far too long length model) and one looping (the simulator's
loop_rate). Each Worker runs the generate task's on-part-committed hook (PartWatcher: digests, live figures,
the bound); the run stops after a bounded number of rows with a message naming the figure and the servers.
After the servers are fixed, a new run into the same output_uri continues where it stopped and validation
merges the digests the workers wrote."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from test_dispatch import Run

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.steps.generate import TaskStopped
from dflash_pipeline.steps.validate import Thresholds, run_validation
from dflash_pipeline.tasks import part_watcher

N = 1500
SAVE_EVERY = 50
PARAMS = {"max_tokens": 256, "max_loop_rate": 0.05}


def _run_with_watchers(run: Run, params: dict[str, Any], run_id: str) -> tuple[list[Any], list[Any]]:
    cfg = RunConfig.from_params({**params, **PARAMS})
    workers, watchers = [], []
    for i in range(len(run.specs)):
        store = Store(run.s3, run.bucket)
        w = part_watcher(cfg, {**params, **PARAMS}, store, run.layout, run.manifest, run_id, f"w{i:04d}",
                         server=run.specs[i].name)
        worker = run.worker(i, run_id=run_id)
        worker.committer._on_committed = w.committed  # noqa: SLF001 - what Worker(on_part_committed=...) sets
        w.on_stop = lambda message, worker=worker: worker.request_stop()
        workers.append(worker)
        watchers.append(w)
    results: list[Any] = [None] * len(workers)
    ended: list[float] = [0.0] * len(workers)
    started = time.monotonic()

    def go(i: int) -> None:
        try:
            results[i] = workers[i].run()
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            results[i] = exc
        ended[i] = time.monotonic() - started

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), f"workers still running: {[t.is_alive() for t in threads]}"
    for w in watchers:
        w.close(60)
    print("workers ended after", [round(x, 1) for x in ended], "s")
    return results, watchers


def test_planted_faults_stop_the_run_and_a_fixed_fleet_resumes(s3_client: Any, bucket: str, sim_fleet: Any) -> None:
    fleet = sim_fleet(3, token_time_s=0.002, length_scale=0.05, max_running_requests=8)
    # The faulty servers are the fast ones here, so that they would take most of the work if nothing stopped them.
    fleet.servers[1].update_config(length_scale=50.0, token_time_s=0.0002)  # every thinking longer than max_tokens
    fleet.servers[2].update_config(loop_rate=1.0, token_time_s=0.0002)  # every thinking loops
    params = {"prompts_uri": f"s3://{bucket}/in/prompts.jsonl", "output_uri": f"s3://{bucket}/ds",
              "servers": fleet.urls, "save_every": SAVE_EVERY}
    run = Run(s3_client, bucket, fleet.urls, N, SAVE_EVERY)

    results, watchers = _run_with_watchers(run, params, "run-1")
    # The healthy server carries on; each faulty one is stopped after a bounded number of its rows, named.
    assert isinstance(results[0], dict) and results[0]["completions"] > 0, results[0]
    assert isinstance(results[1], TaskStopped) and isinstance(results[2], TaskStopped), results
    cut, loops = watchers[1].verdict, watchers[2].verdict
    assert cut and f"server {fleet.urls[1]} alone breaks max_truncation_rate=0.1" in cut and "Raise max_tokens" in cut, \
        (cut, watchers[1].verdict_groups)
    assert loops and f"server {fleet.urls[2]} alone breaks max_loop_rate=0.05" in loops and "fail_fast: false" in loops
    live = [json.loads(run.store.get(o.key)[0]) for o in run.store.list(run.layout.run_key("run-1", "quality/"))]
    by_server = {g["server"]: g for doc in live for g in doc["groups"]}
    bad_cut, bad_loop = by_server[fleet.urls[1]], by_server[fleet.urls[2]]
    # (the simulator's length model gives a rare thinking shorter than max_tokens even at length_scale 50)
    assert bad_cut["truncated_thinking"] >= 0.9 * bad_cut["completions"] > 0, bad_cut
    assert bad_loop["loop"] >= 0.9 * bad_loop["completions"] > 0, bad_loop
    for stopped in (results[1], results[2]):
        assert stopped is not None
    rows = run.rows()
    per_server = {u: sum(1 for r in rows if r["server"] == u) for u in fleet.urls}
    assert per_server[fleet.urls[1]] <= 300 and per_server[fleet.urls[2]] <= 300, per_server  # bounded
    assert sum(1 for _ in run.store.list(run.layout.digests_prefix)) == sum(
        1 for _ in run.store.list(run.layout.completions_prefix))  # every part's digest, written as it landed

    # Fixed: a new run into the same output_uri continues where the stopped one left off.
    fleet.servers[1].update_config(length_scale=0.05)
    fleet.servers[2].update_config(loop_rate=0.0)
    results, watchers = _run_with_watchers(run, params, "run-2")
    assert not any(isinstance(r, BaseException) for r in results), results
    assert all(w.verdict is None for w in watchers)
    # The faulty servers' rows committed before their stop are in the dataset (flagged; tokenize drops them).
    report = run_validation(s3_client, run.cfg.output_uri, thresholds=Thresholds(max_truncation_rate=1.0))
    assert report["prompts"] == N and report["missing"] == 0 and report["duplicates"] == 0
    assert report["digests"]["computed"] == 0  # validation merged what the workers wrote
    flags = report["quality"]["flags"]
    assert flags["loop_reasoning"]["rows"] == per_server[fleet.urls[2]]  # the faulty server's rows, flagged


def test_a_fleet_wide_fault_stops_every_task_and_a_new_run_continues(s3_client: Any, bucket: str,
                                                                      sim_fleet: Any) -> None:
    """Every server cuts every thinking at max_tokens (max_tokens far too small for the model): every task
    stops after a bounded number of rows with the fleet's figure; once fixed (here: the servers' lengths), a
    new run into the same output_uri does only what is left, and its live figures start from zero."""
    fleet = sim_fleet(2, token_time_s=0.0005, length_scale=50.0, max_running_requests=8)
    params = {"prompts_uri": f"s3://{bucket}/in/prompts.jsonl", "output_uri": f"s3://{bucket}/ds",
              "servers": fleet.urls, "save_every": SAVE_EVERY}
    run = Run(s3_client, bucket, fleet.urls, N, SAVE_EVERY)
    results, watchers = _run_with_watchers(run, params, "run-1")
    assert all(isinstance(r, TaskStopped) for r in results), results
    msg = next(w.verdict for w in watchers if w.verdict)
    assert "the truncation rate is 100.0%" in msg and "surely above max_truncation_rate=0.1" in msg
    assert all(u in msg for u in fleet.urls) and "trigger a new run into the same output_uri" in msg
    first = len(run.rows())
    assert 200 <= first <= N // 2, first  # bounded: the bound needs 200 rows, the stop comes soon after

    for server in fleet.servers:
        server.update_config(length_scale=0.05)
    results, watchers = _run_with_watchers(run, params, "run-2")
    assert not any(isinstance(r, BaseException) for r in results), results
    assert all(w.verdict is None for w in watchers)  # run-1's cut rows do not count against run-2
    live = [json.loads(run.store.get(o.key)[0]) for o in run.store.list(run.layout.run_key("run-2", "quality/"))]
    assert sum(g["completions"] for d in live for g in d["groups"]) == N - first
    report = run_validation(s3_client, run.cfg.output_uri, thresholds=Thresholds(max_truncation_rate=1.0))
    assert report["prompts"] == N and report["missing"] == 0 and report["truncated"] >= first
