"""dflash_eval's verdict through `dag.test()` (moto S3, simulated vLLM servers): a green eval means
measured, and the run state and the `dflash_eval` asset event say when it is not (issue 37).

Four runs of the same small eval (one condition: sampled, thinking on, concurrency 1; 24 prompts):
1. **prepare fails** (the prompt file does not exist): the report task fails after writing a report
   whose status is `failed`; no asset event (before: report succeeded, "status: complete", "prompts:
   None", `ranking: []`).
2. **a drafter measured nothing** (its server speculates but gives no per-request statistics): the
   report is written with that drafter `failed`, the task fails, no event.
3. **clean**: every drafter and condition `complete` with rows with statistics for every planned
   row, the speed-up checked; the event says so.
4. **another client on the baseline server** (requests sent to it all through the run): the
   baseline's generated tokens do not match its /metrics counter: status `untrusted`, the speed-up
   untrusted, and the event differs from the clean run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import requests

from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.dev.stack import MotoServer

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("eval_runner.py")
N = 24
BUCKET = "eval-status"
CONDITION = "sampled_think-on_c1"


@pytest.fixture(scope="module")
def fleet():
    common = dict(engine="vllm", length_scale=0.03, max_running_requests=8, seed=3, token_time_s=0.0005)
    spec = dict(spec_algorithm="draft_model", spec_num_draft_tokens=3, spec_accept_p=0.7)
    made = {"good": SimServer(SimConfig(**common, **spec)).start(),
            "nostats": SimServer(SimConfig(**common, **spec, spec_per_request_metrics="none")).start(),
            "quiet": SimServer(SimConfig(**common)).start(),
            "noisy": SimServer(SimConfig(**common)).start()}
    yield made
    for s in made.values():
        s.stop()


def _conf(root: str, drafters: dict[str, SimServer], baseline: SimServer, prompts: str = "bench/p.jsonl"
          ) -> dict[str, Any]:
    return {"prompts_uri": f"s3://{BUCKET}/{prompts}", "output_uri": f"s3://{BUCKET}/evals/{root}",
            "drafters": [{"name": n, "servers": [s.url]} for n, s in drafters.items()],
            "baseline": {"name": "base", "servers": [baseline.url]},
            "max_tokens": 60, "concurrency": [1], "greedy": False, "save_every": 12}


def _other_client(server: SimServer, stop: threading.Event, sent: list[int]) -> None:
    """Someone else's traffic on a shared server, all through the runs."""
    while not stop.is_set():
        try:
            r = requests.post(f"{server.url}/v1/chat/completions", timeout=30, json={
                "model": server.config.served_model_name, "max_tokens": 20, "messages": [{"role": "user", "content": "another user"}]})
            sent.append(r.status_code)
        except requests.RequestException:
            pass
        stop.wait(0.05)


@pytest.fixture(scope="module")
def runs(moto_server: MotoServer, fleet: dict[str, SimServer], tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, Any]:
    moto = moto_server
    moto.create_bucket(BUCKET)
    body = "".join(json.dumps({"id": f"q{i}", "domain": ("math", "chat")[i % 2],
                               "prompt": f"question {i}: what is {i} times {i + 2}?"}) + "\n" for i in range(N))
    moto.client().put_object(Bucket=BUCKET, Key="bench/p.jsonl", Body=body.encode())
    confs = {
        "prepare_fails": _conf("nothing", {"good": fleet["good"]}, fleet["quiet"], prompts="bench/missing.jsonl"),
        "nostats": _conf("nostats", {"good": fleet["good"], "nostats": fleet["nostats"]}, fleet["quiet"]),
        "clean": _conf("clean", {"good": fleet["good"]}, fleet["quiet"]),
        "noisy": _conf("noisy", {"good": fleet["good"]}, fleet["noisy"]),
    }
    tmp = tmp_path_factory.mktemp("eval-status")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(moto.env())
    env.update({"AIRFLOW_HOME": str(tmp / "airflow"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"), "AIRFLOW__CORE__UNIT_TEST_MODE": "False"})
    stop, sent = threading.Event(), []
    noise = threading.Thread(target=_other_client, args=(fleet["noisy"], stop, sent), daemon=True)
    noise.start()
    try:
        proc = subprocess.run([sys.executable, str(RUNNER), str(REPO / "dags"), json.dumps(list(confs.values()))],
                              capture_output=True, text=True, env=env, timeout=900)
    finally:
        stop.set()
        noise.join(timeout=40)
    log = proc.stdout + proc.stderr
    (tmp / "dagtest.log").write_text(log)
    results = [json.loads(x[len("RESULT "):]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    events = [json.loads(x[len("ASSETS "):]) for x in proc.stdout.splitlines() if x.startswith("ASSETS ")]
    assert proc.returncode == 0 and len(results) == len(confs), log[-6000:]
    assert sent and all(code == 200 for code in sent), sent[:5]
    out: dict[str, Any] = {"log": log}
    for (name, conf), result in zip(confs.items(), results):
        got = moto.client().get_object(Bucket=BUCKET, Key=f"evals/{conf['output_uri'].rsplit('/', 1)[1]}/report.json")
        out[name] = {"result": result, "report": json.loads(got["Body"].read()),
                     "tasks": {(t, m): s for t, m, s in result["tasks"]},
                     "events": [e for e in (events[0] if events else []) if e["source_run_id"] == result.get("run_id")]}
    return out


def test_a_failed_prepare_fails_the_run_after_writing_a_failed_report(runs: dict[str, Any]) -> None:
    run = runs["prepare_fails"]
    assert run["result"]["state"] == "failed", run["result"]
    assert run["tasks"][("prepare", -1)] == "failed" and run["tasks"][("report", -1)] == "failed"
    report = run["report"]
    assert report["status"] == "failed" and report["rankings"] == {} and report["run_id"] == run["result"]["run_id"]
    assert "prepare did not complete" in report["status_reasons"][0]
    assert run["events"] == []


def test_a_drafter_that_measured_nothing_fails_the_run(runs: dict[str, Any]) -> None:
    run = runs["nostats"]
    assert run["result"]["state"] == "failed" and run["tasks"][("report", -1)] == "failed"
    assert all(s == "success" for (t, _), s in run["tasks"].items() if t in ("prepare", "evaluate"))
    report = run["report"]
    assert report["status"] == "failed"
    assert report["statuses"] == {"good": {CONDITION: "complete"}, "nostats": {CONDITION: "failed"},
                                  "base": {CONDITION: "complete"}}
    fig = report["groups"]["nostats"][CONDITION]
    assert fig["completions"] == N and fig["acceptance"]["rows_with_stats"] == 0
    assert "--per-request-spec-decode-metrics" in fig["status_reasons"][0]
    assert [(e["drafter"], e["rank"]) for e in report["rankings"][CONDITION]] == [("good", 1), ("nostats", None)]
    assert run["events"] == []


def test_a_green_eval_measured_every_drafter_and_condition(runs: dict[str, Any]) -> None:
    run = runs["clean"]
    assert run["result"]["state"] == "success", runs["log"][-4000:]
    report = run["report"]
    assert report["status"] == "complete" and report["status_reasons"] == []
    for group, conds in report["groups"].items():
        for cond, fig in conds.items():
            assert fig["status"] == "complete" and fig["planned"] == fig["completions"] == N, (group, cond)
            if group != "base":
                assert fig["acceptance"]["rows_with_stats"] == N
            assert fig["crosscheck_verdict"] == "match", fig["crosscheck"]
    [event] = run["events"]
    extra = event["extra"]
    assert extra["status"] == "complete" and extra["ranking"] == ["good"]
    assert extra["conditions"]["good"][CONDITION] == {"status": "complete", "rows_with_stats": N, "completions": N,
                                                      "rows": N, "planned": N, "crosscheck": "match"}
    assert extra["drafters"]["good"]["speedup_status"] == "checked"


def test_another_clients_traffic_on_the_baseline_is_flagged_in_the_event(runs: dict[str, Any]) -> None:
    run = runs["noisy"]
    assert run["result"]["state"] == "success", runs["log"][-4000:]
    report = run["report"]
    assert report["status"] == "untrusted"
    base = report["groups"]["base"][CONDITION]
    [check] = base["crosscheck"]
    assert check["checks"]["generation_tokens"] == "mismatch"
    diff = check["differences"]["generation_tokens"]
    assert diff["metrics"] > diff["rows"] > 0
    [event] = run["events"]
    [clean] = runs["clean"]["events"]
    extra = event["extra"]
    assert extra["status"] == "untrusted" and extra["drafters"]["good"]["speedup_status"] == "untrusted"
    assert extra["conditions"]["base"][CONDITION]["status"] == "untrusted"
    assert extra["conditions"]["good"][CONDITION]["status"] == "complete"
    strip = ("output_uri", "report_key", "report_md_key", "run_id", "drafters")
    assert {k: v for k, v in extra.items() if k not in strip} != {k: v for k, v in clean["extra"].items()
                                                                  if k not in strip}
