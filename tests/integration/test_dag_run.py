"""The whole DAG through `dag.test()`: a real S3-protocol server (moto), real HTTP simulated servers.

Each scenario runs in a fresh interpreter (tests/integration/dagtest_runner.py) with its own
AIRFLOW_HOME and a migrated SQLite DB; the servers and S3 live in this process's fixtures and are
reached over loopback sockets, and the S3 objects are then checked row by row.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from dflash_pipeline.dataset.prompts import derive_id
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.dev.sim.lengths import plan_lengths, render_completion
from dflash_pipeline.dev.stack import MotoServer
from dflash_pipeline.serving.sglang import split_reasoning

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("dagtest_runner.py")
LENGTH_SCALE = 0.05
MAX_TOKENS = 150
API_KEY = "sk-test-9f2b61d0c4e8a7"
N_PROMPTS = 240


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory):
    server = MotoServer(log_path=tmp_path_factory.mktemp("moto") / "moto.log").start()
    server.create_bucket("data")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fleet():
    """Two servers of one model: one splits reasoning (qwen3 parser), one returns <think> inline;
    the second requires an API key and is reached through an Airflow connection."""
    common = dict(token_time_s=0.0005, length_scale=LENGTH_SCALE, max_running_requests=8)
    parser = SimServer(SimConfig(**common)).start()
    inline = SimServer(SimConfig(**common, reasoning_parser=None, api_key=API_KEY)).start()
    yield parser, inline
    parser.stop()
    inline.stop()


def _prompts() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(N_PROMPTS):
        if i % 3 == 0:
            rows.append({"prompt": f"What is {i} plus {i * 7}? Explain step by step."})
        elif i % 3 == 1:
            rows.append({"id": f"q{i}", "messages": [
                {"role": "system", "content": "You are a careful math tutor."},
                {"role": "user", "content": f"Is {i * 13 + 1} a prime number?"}]})
        else:
            rows.append({"id": f"q{i}", "messages": [{"role": "user", "content": f"Sort the list {list(range(i % 9, 0, -1))} and add {i}."}]})
    return rows


def _upload_jsonl(moto: MotoServer, key: str, rows: list[Any]) -> str:
    body = b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)
    moto.client().put_object(Bucket="data", Key=key, Body=body)
    return f"s3://data/{key}"


def _run_dagtest(moto: MotoServer, tmp: Path, confs: list[dict[str, Any]], extra_env: dict[str, str]) -> tuple[list[dict], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(moto.env())
    env.update(
        {
            "AIRFLOW_HOME": str(tmp / "airflow"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        }
    )
    env.update(extra_env)
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(REPO / "dags"), json.dumps(confs)],
        capture_output=True, text=True, env=env, timeout=400,
    )
    log = proc.stdout + proc.stderr
    (tmp / "dagtest.log").write_text(log)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(confs), log[-5000:]
    return results, log


def _parts(moto: MotoServer, prefix: str) -> dict[str, Any]:
    c = moto.client()
    objs = c.list_objects_v2(Bucket="data", Prefix=prefix).get("Contents", [])
    return {o["Key"]: o for o in objs}


def _expected(messages: list[dict[str, str]], inline: bool) -> tuple[str | None, str, str, int]:
    plan = plan_lengths(messages, length_scale=LENGTH_SCALE)
    comp = render_completion(plan, max_tokens=MAX_TOKENS, separate_reasoning=not inline)
    reasoning, content = split_reasoning(comp.content, comp.reasoning_content)
    return reasoning, content, comp.finish_reason, comp.completion_tokens


@pytest.fixture(scope="module")
def full_run(moto: MotoServer, fleet, tmp_path_factory: pytest.TempPathFactory):
    parser, inline = fleet
    rows = _prompts()
    rows.append(rows[5])  # an exact duplicate: dropped in plan
    prompts_uri = _upload_jsonl(moto, "prompts/full.jsonl", rows)
    # dag.test() runs mapped tasks one after another, so one server does all the work of dataset
    # "full" (which one is up to Airflow); "only-parser" and "only-inline" pin each reasoning style.
    conf = {
        "prompts_uri": prompts_uri,
        "output_uri": "s3://data/datasets/full",
        "servers": ["sglang_gpu1", parser.url],
        "model": "Qwen/Qwen3-8B",
        "max_tokens": MAX_TOKENS,
        "save_every": 40,
        # max_tokens=150 truncates ~20% on purpose (truncation inside the thinking is exercised).
        "max_truncation_rate": 0.5,
    }
    conf_b = {**conf, "output_uri": "s3://data/datasets/only-parser", "servers": [parser.url]}
    conf_c = {**conf, "output_uri": "s3://data/datasets/only-inline", "servers": ["sglang_gpu1"]}
    conn = {"conn_type": "http", "host": "127.0.0.1", "port": inline.port, "password": API_KEY}
    before = [parser.stats()["generation_requests"], inline.stats()["generation_requests"]]
    results, log = _run_dagtest(
        moto, tmp_path_factory.mktemp("full"), [conf, conf, conf_b, conf_c], {"AIRFLOW_CONN_SGLANG_GPU1": json.dumps(conn)}
    )
    after = [parser.stats()["generation_requests"], inline.stats()["generation_requests"]]
    return {"conf": conf, "rows": rows, "results": results, "log": log, "requests": (before, after)}


def test_run_succeeds_and_every_task_succeeds(full_run) -> None:
    assert [r["state"] for r in full_run["results"]] == ["success"] * 4, full_run["log"][-4000:]
    first = full_run["results"][0]
    assert first["state"] == "success", full_run["log"][-4000:]
    states = {(t, m): s for t, m, s in first["tasks"]}
    assert states[("plan", -1)] == "success"
    assert states[("generate", 0)] == states[("generate", 1)] == "success"
    assert states[("validate_and_count", -1)] == "success"


@pytest.mark.parametrize(
    ("root", "only"), [("datasets/full", None), ("datasets/only-parser", "parser"), ("datasets/only-inline", "inline")]
)
def test_outputs_row_by_row(full_run, moto: MotoServer, fleet, root: str, only: str | None) -> None:
    parser, inline = fleet
    names = {"parser": {parser.url}, "inline": {"sglang_gpu1"}, None: {parser.url, "sglang_gpu1"}}[only]
    c = moto.client()
    manifest = json.loads(c.get_object(Bucket="data", Key=f"{root}/manifest.json")["Body"].read())
    assert manifest["input"]["prompts"] == N_PROMPTS
    assert manifest["input"]["duplicates_dropped"] == 1
    assert manifest["model_resolved"] == "Qwen/Qwen3-8B"
    assert {s["name"] for s in manifest["servers"]} == names
    assert all(s["max_running_requests"] == 8 for s in manifest["servers"])
    # Each run's in-flight limits: the start from preflight (8 declared slots + a quarter, at least
    # 2), and, copied by validate from the generate tasks' progress objects, how they ended.
    limits = [r.get("concurrency") or {} for r in manifest["runs"].values()]
    assert limits and all(set(c) == names and {v["mode"] for v in c.values()} == {"discovered"}
                          and {v["start"] for v in c.values()} == {10} for c in limits)
    assert any(v.get("evidence") == "load" and v.get("final_slots") is not None and v["final_slots"] <= 8
               and v["changes"] for c in limits for v in c.values())

    part_keys = sorted(k for k in _parts(moto, f"{root}/completions/"))
    assert len(part_keys) == len(manifest["chunks"]["sizes"])
    df = pd.concat(
        [pd.read_parquet(io.BytesIO(c.get_object(Bucket="data", Key=k)["Body"].read())) for k in part_keys]
    )
    assert len(df) == N_PROMPTS and df["id"].is_unique
    by_id = {r["id"]: r for r in df.to_dict("records")}
    expected_ids = set()
    truncated_in_thinking = 0
    for i, row in enumerate(_prompts()):
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        pid = row.get("id") or derive_id(messages)
        expected_ids.add(pid)
        got = by_id[pid]
        assert [dict(m) for m in got["messages"]] == messages
        inline_server = got["server"] == "sglang_gpu1"
        reasoning, content, finish, tokens = _expected(messages, inline_server)
        assert got["reasoning"] == reasoning, pid
        assert got["content"] == content, pid
        assert got["finish_reason"] == finish
        assert got["completion_tokens"] == tokens
        assert pd.isna(got["error_class"])
        assert got["attempts"] == 1 and got["latency_s"] > 0
        assert got["model"] == "Qwen/Qwen3-8B"
        truncated_in_thinking += finish == "length" and content == ""
    assert set(by_id) == expected_ids
    assert set(df["server"]) <= names
    assert truncated_in_thinking > 0, "the prompt set must exercise truncation inside the thinking"

    report = json.loads(c.get_object(Bucket="data", Key=f"{root}/report.json")["Body"].read())
    assert report["prompts"] == N_PROMPTS
    assert report["completions"] == N_PROMPTS and report["errors"] == 0
    assert report["missing"] == 0 and report["duplicates"] == 0
    assert report["truncated"] == int((df["finish_reason"] == "length").sum())
    assert report["empty_content"] == int((df["content"] == "").sum())
    assert report["output_tokens"] == int(df["completion_tokens"].sum())
    assert report["prompt_tokens"] == int(df["prompt_tokens"].sum())


def test_resume_sends_zero_requests_and_changes_nothing(full_run, moto: MotoServer) -> None:
    second = full_run["results"][1]
    assert second["state"] == "success"
    before, after = full_run["requests"]
    total = sum(after) - sum(before)
    assert total == 3 * N_PROMPTS, "each dataset's first run sent each prompt exactly once, the rerun none"
    assert "nothing to do" in full_run["log"]


def test_api_key_never_leaves_the_connection(full_run, moto: MotoServer) -> None:
    assert API_KEY not in full_run["log"], "the API key appeared in task logs"
    c = moto.client()
    for key in _parts(moto, "datasets/full/"):
        body = c.get_object(Bucket="data", Key=key)["Body"].read()
        assert API_KEY.encode() not in body, key
    assert API_KEY not in json.dumps(full_run["results"])


@pytest.fixture(scope="module")
def bad_runs(moto: MotoServer, fleet, tmp_path_factory: pytest.TempPathFactory):
    parser, _ = fleet
    good = [{"prompt": f"question {i}"} for i in range(10)]
    broken = good[:2] + [b'{"messages": [{"role": "user"'] + good[2:5] + [b'{"id": "x"}'] + good[5:]
    broken_uri = _upload_jsonl(moto, "prompts/broken.jsonl", broken)
    good_uri = _upload_jsonl(moto, "prompts/good.jsonl", good)
    base = {"prompts_uri": good_uri, "output_uri": "s3://data/datasets/bad", "servers": [parser.url]}
    confs = [
        {**base, "prompts_uri": broken_uri, "output_uri": "s3://data/datasets/broken"},
        {**base, "max_tokens": -1},
        {k: v for k, v in base.items() if k != "prompts_uri"},
        {**base, "servers": []},
    ]
    before = parser.stats()["generation_requests"]
    results, log = _run_dagtest(moto, tmp_path_factory.mktemp("bad"), confs, {})
    return {"results": results, "log": log, "requests": parser.stats()["generation_requests"] - before}


def test_malformed_lines_fail_in_plan_before_any_request(bad_runs, moto: MotoServer) -> None:
    res = bad_runs["results"][0]
    assert res["state"] == "failed"
    states = {(t, m): s for t, m, s in res["tasks"]}
    assert states[("plan", -1)] == "failed"
    assert bad_runs["requests"] == 0, "no generation request may be sent"
    log = bad_runs["log"]
    assert "line 3: malformed JSON" in log and "line 7: row has none of 'messages'" in log
    rejects = moto.client().get_object(Bucket="data", Key="datasets/broken/rejects/rejects.jsonl")["Body"].read()
    assert [json.loads(x)["line"] for x in rejects.splitlines()] == [3, 7]


@pytest.mark.parametrize(("index", "name"), [(1, "max_tokens"), (2, "prompts_uri"), (3, "servers")])
def test_bad_conf_is_refused_before_a_run_exists(bad_runs, index: int, name: str) -> None:
    res = bad_runs["results"][index]
    assert res["state"] is None and res["error"], res
    assert "ParamValidationError" in res["error"] and name in res["error"]
