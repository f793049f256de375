"""dflash_eval through a real Airflow (scheduler + DAG processor + API server, LocalExecutor): triggered
with `airflow dags trigger`, it succeeds, the report is in S3 and the `dflash_eval` asset event names it.

Kept short: two simulated vLLM drafters of known acceptance and a baseline, 24 prompts, 48 tokens,
concurrency 1 only (2 conditions: sampled and greedy).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import pytest

from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.dev.stack import AirflowStack

pytestmark = pytest.mark.slow

DAG = "dflash_eval"


@pytest.fixture
def servers():
    common = dict(engine="vllm", length_scale=0.03, max_running_requests=4, token_time_s=0.001)
    spec = dict(spec_algorithm="draft_model", spec_num_draft_tokens=3)
    made = {"good": SimServer(SimConfig(**common, **spec, spec_accept_p=0.8)).start(),
            "poor": SimServer(SimConfig(**common, **spec, spec_accept_p=0.3)).start(),
            "base": SimServer(SimConfig(**common)).start()}
    yield made
    for s in made.values():
        s.stop()


def test_triggered_eval_succeeds_with_report_and_asset_event(airflow_stack: AirflowStack, servers, s3_client: Any,
                                                             bucket: str) -> None:
    body = "\n".join(json.dumps({"id": f"e-{i}", "domain": ["math", "chat"][i % 2],
                                 "prompt": f"eval question {i}: what is {i} times {i + 3}?"}) for i in range(24))
    s3_client.put_object(Bucket=bucket, Key="bench/e2e.jsonl", Body=body.encode())
    conf = {
        "prompts_uri": f"s3://{bucket}/bench/e2e.jsonl",
        "output_uri": f"s3://{bucket}/evals/e2e",
        "drafters": [{"name": "poor", "servers": [servers["poor"].url]}, {"name": "good", "servers": [servers["good"].url]}],
        "baseline": {"name": "base", "servers": [servers["base"].url]},
        "max_tokens": 48,
        "concurrency": [1],
        "save_every": 12,
    }
    run_id = airflow_stack.trigger(DAG, conf)
    assert airflow_stack.wait_run(DAG, run_id, timeout_s=400) == "success", airflow_stack.task_instances(DAG, run_id)
    states = {(ti.task_id, ti.map_index): ti.state for ti in airflow_stack.task_instances(DAG, run_id)}
    assert [states[("evaluate", i)] for i in range(3)] == ["success"] * 3
    report = json.loads(s3_client.get_object(Bucket=bucket, Key="evals/e2e/report.json")["Body"].read())
    assert report["status"] == "complete" and report["run_id"] == run_id
    assert all(fig["status"] == "complete" and fig["acceptance"]["rows_with_stats"] == 24
               for g in ("good", "poor") for fig in report["groups"][g].values())
    assert [e["drafter"] for e in report["rankings"]["greedy_think-on_c1"]] == ["good", "poor"]
    assert set(report["groups"]["good"]["greedy_think-on_c1"]["by_domain"]) == {"math", "chat"}
    assert all(x["status"] == "match" for g in ("good", "poor") for f in report["groups"][g].values()
               for x in f["crosscheck"])
    keys = {o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="evals/e2e/report").get("Contents", [])}
    assert {"evals/e2e/report.json", "evals/e2e/report.md", "evals/e2e/report-acceptance.png"} <= keys
    events = airflow_stack.rest("GET", "/api/v2/assets/events",
                                params={"source_dag_id": DAG, "source_run_id": run_id}).json()["asset_events"]
    assert len(events) == 1, events
    extra = events[0]["extra"]
    assert extra["report_key"] == "evals/e2e/report.json" and extra["ranking"] == ["good", "poor"]
    assert extra["status"] == "complete" and extra["ranks"] == {"good": 1, "poor": 2}
    assert extra["drafters"]["good"]["acceptance_length"] > extra["drafters"]["poor"]["acceptance_length"]

    # the progress page: the eval root shows the report and links each (group, condition) dataset, whose
    # own view shows its progress (the generate dataset's manifest, parts and the servers' progress objects)
    path = f"/dflash/api/runs/{quote(DAG, safe='')}/{quote(run_id, safe='')}"
    root = airflow_stack.rest("GET", path)
    assert root.status_code == 200, root.text[:500]
    view = root.json()
    assert view["report"]["status"] == "complete" and [p["name"] for p in view["plot_urls"]] == ["report-acceptance.png"]
    # the eval's own page: its verdict on the page itself, none of dflash_generate's text
    assert view["kind"] == "eval" and view["report"]["statuses"]["good"]["greedy_think-on_c1"] == "complete"
    page = airflow_stack.rest("GET", f"/dflash/runs/{quote(DAG, safe='')}/{quote(run_id, safe='')}")
    assert page.status_code == 200 and 'class="eval-ranking"' in page.text and 'class="eval-status"' in page.text
    assert "No plan yet" not in page.text and "validate_and_count" not in page.text
    datasets = [f"{g}/{c}" for g in ("poor", "good", "base") for c in ("sampled_think-on_c1", "greedy_think-on_c1")]
    assert view["datasets"] == datasets
    one = airflow_stack.rest("GET", path, params={"dataset": "good/greedy_think-on_c1"})
    assert one.status_code == 200, one.text[:500]
    progress = one.json()["progress"]
    assert progress["prompts_total"] == progress["completions"] == 24
    assert progress["chunks_committed"] == progress["chunks_total"] == 2
    assert one.json()["output_uri"] == f"s3://{bucket}/evals/e2e/good/greedy_think-on_c1"
    assert airflow_stack.rest("GET", path, params={"dataset": "../x"}).status_code == 404


def test_bad_drafters_are_refused_by_the_cli_before_a_run_exists(airflow_stack: AirflowStack, bucket: str) -> None:
    airflow_stack.wait_dag(DAG)
    before = airflow_stack.rest("GET", f"/api/v2/dags/{DAG}/dagRuns").json()["total_entries"]
    base = {"prompts_uri": f"s3://{bucket}/p.jsonl", "output_uri": f"s3://{bucket}/evals/x"}
    for drafters in ([{"name": "a b", "servers": ["http://127.0.0.1:1"]}], [{"name": "a"}], []):
        res = airflow_stack.cli("dags", "trigger", DAG, "--conf", json.dumps({**base, "drafters": drafters}))
        assert res.returncode != 0, drafters
        assert "ParamValidationError" in res.stdout + res.stderr and "drafters" in res.stdout + res.stderr
    after = airflow_stack.rest("GET", f"/api/v2/dags/{DAG}/dagRuns").json()["total_entries"]
    assert after == before
