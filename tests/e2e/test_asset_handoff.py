"""The asset hand-off through a real scheduler: a validated dflash_generate run queues dflash_tokenize.

dflash_tokenize is scheduled on the `dflash_completions` asset; the scheduler creates its run from the
event that validate_and_count emitted, and its task reads the event's extra (the dataset's output_uri,
manifest and report keys) and checks the dataset. Other tests' runs emit events too, so the consumer
run is found by the output_uri it checked.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from dflash_pipeline.dev.stack import AirflowStack

pytestmark = pytest.mark.slow

CONSUMER = "dflash_tokenize"


def _consumer_results(stack: AirflowStack) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    runs = stack.rest("GET", f"/api/v2/dags/{CONSUMER}/dagRuns", params={"limit": 100}).json()["dag_runs"]
    out = []
    for run in runs:
        if run.get("state") != "success":
            continue
        resp = stack.rest(
            "GET",
            f"/api/v2/dags/{CONSUMER}/dagRuns/{run['dag_run_id']}/taskInstances/check_handoff/xcomEntries/return_value",
            params={"deserialize": True},
        )
        if resp.status_code == 200:
            value = resp.json().get("value")
            out.append((run, json.loads(value) if isinstance(value, str) else value))
    return out


def test_validated_run_triggers_the_consumer_with_the_dataset(
    airflow_stack: AirflowStack, sim_fleet, s3_client: Any, bucket: str
) -> None:
    fleet = sim_fleet(2, token_time_s=0.001, length_scale=0.05, max_running_requests=8)
    body = "\n".join(json.dumps({"id": f"h-{i}", "prompt": f"handoff question {i}"}) for i in range(120))
    s3_client.put_object(Bucket=bucket, Key="p/handoff.jsonl", Body=body.encode())
    output_uri = f"s3://{bucket}/ds/handoff"
    conf = {"prompts_uri": f"s3://{bucket}/p/handoff.jsonl", "output_uri": output_uri, "servers": fleet.urls,
            "save_every": 40}
    run_id = airflow_stack.trigger("dflash_generate", conf)
    assert airflow_stack.wait_run("dflash_generate", run_id, timeout_s=300) == "success"

    deadline = time.monotonic() + 120
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not found:
        for run, checked in _consumer_results(airflow_stack):
            found = [c for c in checked or [] if c.get("output_uri") == output_uri]
            if found:
                assert run["run_type"] == "asset_triggered"
                break
        else:
            time.sleep(2)
    assert found, f"no successful {CONSUMER} run checked {output_uri}"
    (checked,) = found
    event = checked["event"]
    assert event["manifest_key"] == "ds/handoff/manifest.json" and event["report_key"] == "ds/handoff/report.json"
    assert (event["prompts"], event["completions"], event["missing"]) == (120, 120, 0)
    assert event["status"] == "passed" and checked["parts"] >= 3
