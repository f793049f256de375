"""dflash_generate through a real Airflow: scheduler + DAG processor + API server, LocalExecutor.

Runs are triggered with `airflow dags trigger`, followed over REST, and judged by what is in S3 and
what the simulated servers saw. Backfills use the three ways users do them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any
from urllib.parse import quote

import pytest
import requests

from dflash_pipeline.dev.stack import AirflowStack

pytestmark = pytest.mark.slow

DAG = "dflash_generate"


def _upload(s3: Any, bucket: str, key: str, n: int, tag: str) -> str:
    body = "\n".join(json.dumps({"id": f"{tag}-{i}", "prompt": f"{tag} question {i}: what is {i} times {i + 3}?"}) for i in range(n))
    s3.put_object(Bucket=bucket, Key=key, Body=body.encode())
    return f"s3://{bucket}/{key}"


def _report(s3: Any, bucket: str, root: str) -> dict[str, Any]:
    return json.loads(s3.get_object(Bucket=bucket, Key=f"{root}/report.json")["Body"].read())


def _states(stack: AirflowStack, run_id: str) -> dict[tuple[str, int], str]:
    return {(ti.task_id, ti.map_index): ti.state for ti in stack.task_instances(DAG, run_id)}


def _requests(fleet: Any) -> int:
    return sum(s.stats()["generation_requests"] for s in fleet.servers)


def test_triggered_run_succeeds_and_uses_every_server(airflow_stack: AirflowStack, sim_fleet, s3_client, bucket) -> None:
    fleet = sim_fleet(3, token_time_s=0.001, length_scale=0.05, max_running_requests=8)
    n = 600
    conf = {
        "prompts_uri": _upload(s3_client, bucket, "p/e2e.jsonl", n, "e2e"),
        "output_uri": f"s3://{bucket}/ds/e2e",
        "servers": fleet.urls,
        "save_every": 50,
    }
    run_id = airflow_stack.trigger(DAG, conf)
    assert airflow_stack.wait_run(DAG, run_id, timeout_s=300) == "success"
    states = _states(airflow_stack, run_id)
    assert states[("plan", -1)] == states[("preflight", -1)] == states[("validate_and_count", -1)] == "success"
    assert [states[("generate", i)] for i in range(3)] == ["success"] * 3
    report = _report(s3_client, bucket, "ds/e2e")
    assert (report["prompts"], report["completions"], report["missing"], report["duplicates"]) == (n, n, 0, 0)
    assert _requests(fleet) == n, "each prompt was sent exactly once"
    busy = [name for name, s in report["per_server"].items() if s["rows"] > 0]
    assert len(busy) >= 2, f"generate tasks ran in parallel on several servers: {report['per_server']}"


def test_bad_conf_is_refused_by_the_cli_before_a_run_exists(airflow_stack: AirflowStack, bucket) -> None:
    airflow_stack.wait_dag(DAG)
    before = airflow_stack.rest("GET", f"/api/v2/dags/{DAG}/dagRuns").json()["total_entries"]
    base = {"prompts_uri": f"s3://{bucket}/p.jsonl", "output_uri": f"s3://{bucket}/ds/x", "servers": ["http://127.0.0.1:1"]}
    for bad, name in (({**base, "max_tokens": -1}, "max_tokens"), ({**base, "servers": []}, "servers")):
        res = airflow_stack.cli("dags", "trigger", DAG, "--conf", json.dumps(bad))
        assert res.returncode != 0
        assert "ParamValidationError" in res.stdout + res.stderr and name in res.stdout + res.stderr
    after = airflow_stack.rest("GET", f"/api/v2/dags/{DAG}/dagRuns").json()["total_entries"]
    assert after == before


def _start_failing_run(stack: AirflowStack, fleet: Any, s3: Any, bucket: str, root: str, key: str, n: int) -> tuple[str, dict]:
    """A run whose generate tasks fail mid-way: the servers' API key is rotated under them (401)."""
    for i, server in enumerate(fleet.servers):
        conn = {"conn_type": "http", "host": "127.0.0.1", "port": server.port, "password": key}
        stack.cli("connections", "delete", f"bf_gpu{i}")
        stack.cli("connections", "add", f"bf_gpu{i}", "--conn-json", json.dumps(conn), check=True)
    conf = {
        "prompts_uri": _upload(s3, bucket, f"p/{root}.jsonl", n, root),
        "output_uri": f"s3://{bucket}/ds/{root}",
        "servers": [f"bf_gpu{i}" for i in range(len(fleet.servers))],
        "save_every": 20,
        "claim_lease_s": 15,
    }
    run_id = stack.trigger(DAG, conf)
    deadline = time.monotonic() + 120
    while not s3.list_objects_v2(Bucket=bucket, Prefix=f"ds/{root}/completions/").get("KeyCount"):
        assert time.monotonic() < deadline, "no part was committed"
        time.sleep(0.2)
    for server in fleet.servers:
        requests.post(f"{server.url}/sim/config", json={"api_key": key + "-rotated"}, timeout=5).raise_for_status()
    assert stack.wait_run(DAG, run_id, timeout_s=300) == "failed"
    states = _states(stack, run_id)
    assert {states[("generate", i)] for i in range(len(fleet.servers))} == {"failed"}
    assert states[("validate_and_count", -1)] == "failed"
    # issue 41: the run's page names each failed task's reason (not only the task logs)
    page = stack.rest("GET", f"/dflash/api/runs/{DAG}/{quote(run_id, safe='')}", timeout_s=120)
    assert page.status_code == 200, page.text[:500]
    failures = {(f["task_id"], f["map_index"]): f for f in page.json()["failures"]}
    for i in range(len(fleet.servers)):
        assert failures[("generate", i)]["state"] == "failed"
        assert "401" in failures[("generate", i)]["message"], failures[("generate", i)]
    assert failures[("validate_and_count", -1)]["message"]
    for server in fleet.servers:
        requests.post(f"{server.url}/sim/config", json={"api_key": key}, timeout=5).raise_for_status()
    return run_id, conf


def _assert_exact(s3: Any, bucket: str, root: str, n: int) -> dict[str, Any]:
    report = _report(s3, bucket, root)
    assert (report["prompts"], report["completions"], report["missing"], report["duplicates"]) == (n, n, 0, 0), report
    return report


@pytest.mark.parametrize("how", ["dags-clear", "rest-clear", "new-run"])
def test_backfill_failed_shards(airflow_stack: AirflowStack, sim_fleet, s3_client, bucket, how: str) -> None:
    key = "sk-e2e-" + how
    fleet = sim_fleet(2, token_time_s=0.004, length_scale=0.05, max_running_requests=4, api_key=key)
    n = 240
    root = f"bf-{how}"
    run_id, conf = _start_failing_run(airflow_stack, fleet, s3_client, bucket, root, key, n)
    sent_before = _requests(fleet)
    if how == "dags-clear":
        res = airflow_stack.cli("dags", "clear", DAG, "--run-id", run_id, "--only-failed", "-y")
        assert res.returncode == 0, res.stderr[-2000:]
        final_run = run_id
    elif how == "rest-clear":
        body = {
            "dag_run_id": run_id,
            "task_ids": [["generate", i] for i in range(len(fleet.servers))],
            "include_downstream": True,
            "only_failed": True,
            "dry_run": False,
        }
        resp = airflow_stack.rest("POST", f"/api/v2/dags/{DAG}/clearTaskInstances", json=body)
        assert resp.status_code == 200, resp.text
        final_run = run_id
    else:
        final_run = airflow_stack.trigger(DAG, conf)
    assert airflow_stack.wait_run(DAG, final_run, timeout_s=300) == "success"
    states = _states(airflow_stack, final_run)
    if how != "new-run":
        assert states[("plan", -1)] == "success"
        assert airflow_stack.get_run(DAG, final_run)["state"] == "success"
    _assert_exact(s3_client, bucket, f"ds/{root}", n)
    redone = _requests(fleet) - sent_before
    assert redone < n, "the backfill redid only what was missing"
    # Sent again: per failed task at most its uncommitted chunk (save_every) plus the requests in
    # flight (concurrency 6) and the refused ones (another 6) when the key was rotated.
    wasted = _requests(fleet) - n
    assert wasted <= 2 * (conf["save_every"] + 6 + 6), f"{wasted} requests beyond one per prompt"
    _assert_no_secret(airflow_stack, final_run, key, s3_client, bucket, f"ds/{root}")


def _assert_no_secret(stack: AirflowStack, run_id: str, key: str, s3: Any, bucket: str, root: str) -> None:
    """The API key lives in the connection only: not in task logs, XCom, manifest, report or parts."""
    for path in stack.home.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".json", ".txt", "") and path.stat().st_size < 50_000_000:
            if "connections" in path.parts:
                continue
            assert key.encode() not in path.read_bytes(), f"API key found in {path}"
    for ti in stack.task_instances(DAG, run_id):
        resp = stack.rest(
            "GET", f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/{ti.task_id}/xcomEntries",
            params={"map_index": ti.map_index, "deserialize": "true"},
        )
        assert resp.status_code == 200, resp.text
        assert key not in resp.text, f"API key in XCom of {ti.task_id}[{ti.map_index}]"
    for obj in s3.list_objects_v2(Bucket=bucket, Prefix=root + "/").get("Contents", []):
        assert key.encode() not in s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read(), obj["Key"]


def test_sigkill_of_a_generate_task_then_retry(airflow_stack: AirflowStack, sim_fleet, s3_client, bucket) -> None:
    fleet = sim_fleet(1, token_time_s=0.004, length_scale=0.05, max_running_requests=4)
    n = 300
    root = "sigkill"
    conf = {
        "prompts_uri": _upload(s3_client, bucket, "p/sigkill.jsonl", n, root),
        "output_uri": f"s3://{bucket}/ds/{root}",
        "servers": fleet.urls,
        "save_every": 30,
    }
    run_id = airflow_stack.trigger(DAG, conf)
    deadline = time.monotonic() + 120
    while s3_client.list_objects_v2(Bucket=bucket, Prefix=f"ds/{root}/completions/").get("KeyCount", 0) < 2:
        assert time.monotonic() < deadline, "no part was committed"
        time.sleep(0.2)
    ti = next(t for t in airflow_stack.task_instances(DAG, run_id) if t.task_id == "generate")
    pid = ti.raw.get("pid")
    assert pid, ti.raw
    os.kill(int(pid), signal.SIGKILL)
    assert airflow_stack.wait_run(DAG, run_id, timeout_s=400) == "success"
    final = next(t for t in airflow_stack.task_instances(DAG, run_id) if t.task_id == "generate")
    assert final.try_number >= 2, "the killed try was retried"
    _assert_exact(s3_client, bucket, f"ds/{root}", n)
    wasted = _requests(fleet) - n
    assert 0 <= wasted <= conf["save_every"] + 6 + 6, f"lost more than the open chunks: {wasted}"
