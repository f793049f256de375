"""dflash_generate scaled out: CeleryExecutor on PostgreSQL + Redis, two Celery workers.

One Airflow stack for this module only (separate from the session's LocalExecutor stack): a fresh
PostgreSQL database (metadata DB and Celery result backend; dropped afterwards), Redis on loopback
as the broker (this stack's keys under a random prefix), api-server, scheduler, dag-processor and
two ``airflow celery worker`` processes named ``w1`` and ``w2``. Every component shares one JWT
secret and execution-API URL (see ``AirflowStack``/``CeleryConfig`` in dflash_pipeline.dev.stack).

Needs PostgreSQL and Redis: ``scripts/ci_services.sh`` starts them. Without them the module is
skipped, except under CI (``CI`` set), where it fails.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.dev.stack import (
    AirflowStack,
    CeleryConfig,
    MotoServer,
    PostgresDatabase,
    TaskInstanceInfo,
    postgres_unavailable,
    redis_unavailable,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DAG = "dflash_generate"
WORKERS = ("w1", "w2")
#: Slots per worker. 3, with 4 servers in the spread test, means neither worker can hold every
#: generate task, so both must run some; with 3 servers in the kill test, the survivor always has
#: a free slot for each task of the killed worker.
CONCURRENCY = 3
#: [scheduler] task_instance_heartbeat_timeout for this stack (default 300 s): how long a task
#: whose worker died stays "running" before the scheduler fails it (and Airflow retries it).
HEARTBEAT_TIMEOUT_S = 20
#: A generate task's claims outlive this test: only a retry of the same map index (which takes its
#: own claims back at once) can finish a killed task's chunks in time.
LONG_LEASE_S = 900


@pytest.fixture(scope="module")
def celery_stack(tmp_path_factory: pytest.TempPathFactory, moto_server: MotoServer) -> Iterator[AirflowStack]:
    reason = postgres_unavailable() or redis_unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI must start PostgreSQL and Redis: scripts/ci_services.sh)")
        pytest.skip(f"{reason}; start them with scripts/ci_services.sh")
    # scripts/ci_services.sh may have made a fresh database for this run; else make our own.
    db = PostgresDatabase(name=os.environ.get("DFLASH_CELERY_DB") or None)
    if not db.exists():
        db.create()
    plugins = REPO / "plugins"
    stack = AirflowStack(
        tmp_path_factory.mktemp("celery-stack"),
        REPO / "dags",
        plugins if plugins.is_dir() else None,
        moto_server.env(),
        executor="celery",
        celery=CeleryConfig.for_database(db, workers=WORKERS, concurrency=CONCURRENCY),
        parallelism=len(WORKERS) * CONCURRENCY,
        task_heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )
    try:
        t0 = time.monotonic()
        stack.start()
        print(f"\ncelery stack ready in {time.monotonic() - t0:.1f} s: {stack.memory_usage()}")
        yield stack
    finally:
        t0 = time.monotonic()
        stack.stop()
        db.drop()
        print(f"\ncelery stack stopped and {db.name} dropped in {time.monotonic() - t0:.1f} s")


def _upload(s3: Any, bucket: str, key: str, n: int, tag: str) -> str:
    body = "\n".join(json.dumps({"id": f"{tag}-{i}", "prompt": f"{tag} question {i}: what is {i} plus {i * 7}?"}) for i in range(n))
    s3.put_object(Bucket=bucket, Key=key, Body=body.encode())
    return f"s3://{bucket}/{key}"


def _report(s3: Any, bucket: str, root: str) -> dict[str, Any]:
    return json.loads(s3.get_object(Bucket=bucket, Key=f"{root}/report.json")["Body"].read())


def _assert_exact(s3: Any, bucket: str, root: str, n: int) -> dict[str, Any]:
    report = _report(s3, bucket, root)
    assert (report["prompts"], report["completions"], report["missing"], report["duplicates"]) == (n, n, 0, 0), report
    return report


def _requests(fleet: Any) -> int:
    return sum(s.stats()["generation_requests"] for s in fleet.servers)


def _generate_tis(stack: AirflowStack, run_id: str) -> list[TaskInstanceInfo]:
    return [ti for ti in stack.task_instances(DAG, run_id) if ti.task_id == "generate"]


def _worker_of(ti: TaskInstanceInfo) -> str | None:
    """``w1`` for a task instance whose hostname is ``w1@host`` (see dflash_pipeline.dev.stack.services.worker_hostname)."""
    return ti.hostname.split("@", 1)[0] if ti.hostname and "@" in ti.hostname else None


def _xcom(stack: AirflowStack, run_id: str, task_id: str, map_index: int) -> dict[str, Any]:
    resp = stack.rest(
        "GET", f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value",
        params={"map_index": map_index, "deserialize": True},
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    value = resp.json()["value"]
    return json.loads(value) if isinstance(value, str) else dict(value)


def test_generate_tasks_spread_over_two_celery_workers(celery_stack: AirflowStack, sim_fleet, s3_client, bucket) -> None:
    fleet = sim_fleet(4, token_time_s=0.004, length_scale=0.05, max_running_requests=4)
    n = 800
    root = "celery-spread"
    conf = {
        "prompts_uri": _upload(s3_client, bucket, f"p/{root}.jsonl", n, root),
        "output_uri": f"s3://{bucket}/ds/{root}",
        "servers": fleet.urls,
        "save_every": 25,
    }
    t0 = time.monotonic()
    run_id = celery_stack.trigger(DAG, conf)
    assert celery_stack.wait_run(DAG, run_id, timeout_s=240) == "success"
    print(f"\nspread run: {n} prompts over 4 servers and 2 workers in {time.monotonic() - t0:.1f} s (trigger to success)")
    tis = celery_stack.task_instances(DAG, run_id)
    assert {(ti.task_id, ti.state) for ti in tis} == {
        ("plan", "success"), ("preflight", "success"), ("generate", "success"), ("validate_and_count", "success"),
        ("digest_shards", "success"), ("digest_parts", "success"), ("near_duplicates", "success"),
    }  # fmt: skip
    gen = [ti for ti in tis if ti.task_id == "generate"]
    assert len(gen) == 4
    ran_on = {ti.map_index: _worker_of(ti) for ti in gen}
    print(f"generate map index -> worker: {ran_on}")
    assert set(ran_on.values()) == set(WORKERS), f"generate tasks ran on both workers: {ran_on}"
    _assert_exact(s3_client, bucket, f"ds/{root}", n)
    assert _requests(fleet) == n, "each prompt was sent exactly once"


def test_killed_celery_worker_task_is_retried_on_the_other_and_resumes(
    celery_stack: AirflowStack, sim_fleet, s3_client, bucket
) -> None:
    fleet = sim_fleet(3, token_time_s=0.004, length_scale=0.05, max_running_requests=4)
    n = 1200
    save_every = 20
    root = "celery-kill"
    conf = {
        "prompts_uri": _upload(s3_client, bucket, f"p/{root}.jsonl", n, root),
        "output_uri": f"s3://{bucket}/ds/{root}",
        "servers": fleet.urls,
        "save_every": save_every,
        "claim_lease_s": LONG_LEASE_S,
    }
    run_id = celery_stack.trigger(DAG, conf)
    parts = f"ds/{root}/completions/"
    deadline = time.monotonic() + 150
    victim: str | None = None
    while victim is None:
        assert time.monotonic() < deadline, "no generate task was running with parts committed"
        if s3_client.list_objects_v2(Bucket=bucket, Prefix=parts).get("KeyCount", 0) >= 4:
            running = [ti for ti in _generate_tis(celery_stack, run_id) if ti.state == "running" and _worker_of(ti)]
            if running:
                victim = _worker_of(running[0])
        time.sleep(0.3)
    survivor = next(w for w in WORKERS if w != victim)
    killed = {ti.map_index for ti in _generate_tis(celery_stack, run_id) if ti.state == "running" and _worker_of(ti) == victim}
    committed_at_kill = s3_client.list_objects_v2(Bucket=bucket, Prefix=parts).get("KeyCount", 0)
    t_kill = time.monotonic()
    pids = celery_stack.kill_worker(victim)
    print(f"\nkilled worker {victim} ({len(pids)} processes) running generate {sorted(killed)}; {committed_at_kill} parts committed")
    try:
        # When does the scheduler notice, and when does the retry start on the survivor?
        noticed = retried = None
        while retried is None:
            assert time.monotonic() - t_kill < 200, "the killed tasks were not retried"
            states = {ti.map_index: ti for ti in _generate_tis(celery_stack, run_id)}
            if noticed is None and any(states[m].state in ("up_for_retry", "failed") for m in killed):
                noticed = time.monotonic() - t_kill
            if all(states[m].try_number >= 2 and states[m].state in ("running", "success") for m in killed):
                retried = time.monotonic() - t_kill
            time.sleep(0.5)
        assert celery_stack.wait_run(DAG, run_id, timeout_s=240) == "success"
        done = time.monotonic() - t_kill
        print(f"kill -> failed/up_for_retry {noticed if noticed is None else round(noticed, 1)} s, "
              f"-> retry running {retried:.1f} s, -> run success {done:.1f} s "
              f"(heartbeat timeout {HEARTBEAT_TIMEOUT_S} s, generate retry_delay 20 s with backoff)")  # fmt: skip
        final = {ti.map_index: ti for ti in _generate_tis(celery_stack, run_id)}
        for m in killed:
            assert final[m].state == "success"
            assert final[m].try_number >= 2, final[m]
            assert _worker_of(final[m]) == survivor, f"generate {m} retried on {final[m].hostname}"
        _assert_exact(s3_client, bucket, f"ds/{root}", n)
        # The retry resumed from S3: it took its own claims back (nobody waited out the 900 s lease
        # or took a chunk over) and redid only what had not been committed.
        summaries = {m: _xcom(celery_stack, run_id, "generate", m) for m in final}
        assert all(s.get("chunks_taken_over", 0) == 0 for s in summaries.values()), summaries
        retry_logs = [
            p.read_text(errors="replace")
            for m in killed
            for p in celery_stack.home.glob(f"logs/dag_id={DAG}/run_id={run_id}/task_id=generate/map_index={m}/attempt=*.log")
            if not p.name.startswith("attempt=1.")
        ]
        assert any("taking back" in text for text in retry_logs), "a retry took back its claims"
        wasted = _requests(fleet) - n
        concurrency = 4 + 2  # max_running_requests + 25 % (at least 2)
        assert 0 <= wasted <= len(killed) * (2 * save_every + 2 * concurrency), f"{wasted} requests beyond one per prompt"
        print(f"requests beyond one per prompt: {wasted}; retry summaries: "
              f"{ {m: {k: summaries[m].get(k) for k in ('completions', 'chunks_committed')} for m in killed} }")  # fmt: skip
    finally:
        celery_stack.start_worker(victim)
