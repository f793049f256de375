"""The chunk protocol under a real Airflow (scheduler, DAG processor, API server, LocalExecutor).

- A generate task marked failed over REST gets SIGTERM from its supervisor: it must save what it
  finished and release its claims within seconds, not hold them for the 180 s lease.
- A second run into the same output_uri with a new server joins the first one's work (how a user
  adds GPUs mid-run): both runs succeed, every row exactly once, both servers worked.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from dflash_pipeline.dev.stack import AirflowStack

pytestmark = pytest.mark.slow

DAG = "dflash_generate"


def _upload(s3: Any, bucket: str, key: str, n: int, tag: str) -> str:
    body = "\n".join(json.dumps({"id": f"{tag}-{i}", "prompt": f"{tag} question {i}: what is {i} plus {i * 7}?"})
                     for i in range(n))
    s3.put_object(Bucket=bucket, Key=key, Body=body.encode())
    return f"s3://{bucket}/{key}"


def _claims_of(s3: Any, bucket: str, root: str, worker: str) -> list[str]:
    out = []
    for obj in s3.list_objects_v2(Bucket=bucket, Prefix=f"{root}/claims/").get("Contents", []):
        try:
            doc = json.loads(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
        except Exception:  # noqa: BLE001 - deleted between list and get
            continue
        if doc.get("worker") == worker:
            out.append(obj["Key"])
    return out


def _parts(s3: Any, bucket: str, root: str) -> int:
    return int(s3.list_objects_v2(Bucket=bucket, Prefix=f"{root}/completions/").get("KeyCount", 0))


def _report(s3: Any, bucket: str, root: str) -> dict[str, Any]:
    return json.loads(s3.get_object(Bucket=bucket, Key=f"{root}/report.json")["Body"].read())


def test_a_task_marked_failed_saves_and_releases_in_seconds(airflow_stack: AirflowStack, sim_fleet, s3_client,
                                                            bucket) -> None:
    fleet = sim_fleet(2, token_time_s=0.004, length_scale=0.05, max_running_requests=4)
    n, root = 800, "ds/stop"
    conf = {"prompts_uri": _upload(s3_client, bucket, "p/stop.jsonl", n, "stop"), "output_uri": f"s3://{bucket}/{root}",
            "servers": fleet.urls, "save_every": 40}
    run_id = airflow_stack.trigger(DAG, conf)
    deadline = time.monotonic() + 180
    while _parts(s3_client, bucket, root) < 4 or not _claims_of(s3_client, bucket, root, "w0000"):
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)
    resp = airflow_stack.rest("PATCH", f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/generate/0",
                              json={"new_state": "failed"})
    assert resp.status_code == 200, resp.text
    marked = time.monotonic()
    while _claims_of(s3_client, bucket, root, "w0000"):
        assert time.monotonic() - marked < 20, "the stopped task still holds claims (the lease is 180 s)"
        time.sleep(0.2)
    released_s = time.monotonic() - marked
    print(f"claims of the stopped task released {released_s:.1f}s after it was marked failed")
    airflow_stack.wait_run(DAG, run_id, timeout_s=300)
    states = {(t.task_id, t.map_index): t.state for t in airflow_stack.task_instances(DAG, run_id)}
    assert states[("generate", 0)] == "failed" and states[("generate", 1)] == "success"
    report = _report(s3_client, bucket, root)
    assert (report["prompts"], report["completions"], report["missing"], report["duplicates"]) == (n, n, 0, 0)
    requests = sum(s.stats()["generation_requests"] for s in fleet.servers)
    concurrency = 4 + 2  # derived: max_running_requests + 25 % (at least 2)
    # Only what was in flight at the stop is generated again; finished rows were saved.
    print(f"prompts generated twice: {requests - n}")
    assert requests - n <= 2 * concurrency, f"{requests - n} prompts generated twice (claims released in {released_s:.1f}s)"


def test_a_second_run_with_a_new_server_joins_the_first(airflow_stack: AirflowStack, sim_fleet, s3_client,
                                                        bucket) -> None:
    fleet = sim_fleet(2, token_time_s=0.004, length_scale=0.05, max_running_requests=4)
    n, root = 900, "ds/join"
    base = {"prompts_uri": _upload(s3_client, bucket, "p/join.jsonl", n, "join"), "output_uri": f"s3://{bucket}/{root}",
            "save_every": 30}
    first = airflow_stack.trigger(DAG, {**base, "servers": [fleet.urls[0]]})
    deadline = time.monotonic() + 180
    while _parts(s3_client, bucket, root) < 3:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)
    second = airflow_stack.trigger(DAG, {**base, "servers": [fleet.urls[1]]})
    assert airflow_stack.wait_run(DAG, second, timeout_s=400) == "success"
    assert airflow_stack.wait_run(DAG, first, timeout_s=400) == "success"
    report = _report(s3_client, bucket, root)
    assert (report["prompts"], report["completions"], report["missing"], report["duplicates"]) == (n, n, 0, 0)
    per_server = {name: s["rows"] for name, s in report["per_server"].items()}
    assert per_server.get(fleet.urls[0], 0) > 0 and per_server.get(fleet.urls[1], 0) > 0, per_server
    requests = sum(s.stats()["generation_requests"] for s in fleet.servers)
    assert requests == n, f"{requests - n} prompts generated twice"
