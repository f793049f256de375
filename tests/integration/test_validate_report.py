"""validate_and_count through dag.test(): the report against the parts, plots, thresholds, the asset hand-off.

One runner process (tests/integration/asset_runner.py) runs dflash_generate twice into one dataset
root: first with thresholds the dataset breaks (the run must fail, naming each threshold and its
figure, and emit no asset event), then with thresholds it meets and the training tokenizer given. Then
the scheduler's own step queues dflash_tokenize from the asset event and that run tokenizes the dataset.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.config.quality import QualitySettings
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.dev.sim.lengths import VOCAB, count_tokens
from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer
from dflash_pipeline.dev.stack import MotoServer
from dflash_pipeline.steps.quality import QUALITY_FLAGS, flags_of, row_signals

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("asset_runner.py")
BUCKET = "validated-data"
ROOT = "datasets/validated"
N_PROMPTS = 60
N_TOO_LONG = 3
N_NEAR_DUPS = 2
CONTEXT = 300
MAX_TOKENS = 120


def _prompts() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(N_PROMPTS - N_TOO_LONG):
        words = " ".join(VOCAB[(i * 7 + k) % len(VOCAB)] for k in range(5 + i % 11))
        rows.append({"id": f"v{i}", "messages": [{"role": "user", "content": f"{words} {i}?"}]})
    for i in range(N_NEAR_DUPS):  # the same prompt re-cased and re-punctuated as an earlier one (by id)
        rows[-1 - i]["messages"][0]["content"] = rows[i]["messages"][0]["content"].upper().replace("?", " !?")
    for i in range(N_TOO_LONG):  # longer than the servers' context: permanent error rows
        rows.append({"id": f"long{i}", "prompt": " ".join(["value"] * (CONTEXT + 10)) + f" {i}"})
    return rows


@pytest.fixture(scope="module")
def handoff_run(moto_server: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    moto_server.create_bucket(BUCKET)
    tmp = tmp_path_factory.mktemp("validate")
    # The servers "serve" the sim tokenizer (dev/sim/tokens.py): usage counts what a real engine counts
    # (the think markers and the stop token included), so tokenization can check re-encoded turns.
    tokenizer = build_sim_tokenizer(tmp / "tokenizer")
    common = dict(token_time_s=0.0005, length_scale=0.05, max_running_requests=8, context_length=CONTEXT,
                  tokenizer_dir=str(tokenizer), token_ids_supported=False)
    servers = [SimServer(SimConfig(**common)).start(), SimServer(SimConfig(**common, reasoning_parser=None)).start()]
    try:
        body = b"".join(json.dumps(r).encode() + b"\n" for r in _prompts())
        moto_server.client().put_object(Bucket=BUCKET, Key="prompts/v.jsonl", Body=body)
        base = {"prompts_uri": f"s3://{BUCKET}/prompts/v.jsonl", "output_uri": f"s3://{BUCKET}/{ROOT}",
                "servers": [s.url for s in servers], "model": "Qwen/Qwen3-8B", "max_tokens": MAX_TOKENS,
                "save_every": 16}
        confs = [
            {**base, "max_error_rate": 0.01, "max_truncation_rate": 0.05},
            {**base, "max_error_rate": 0.2, "max_truncation_rate": 0.9, "tokenizer": str(tokenizer), "languages": ["en"]},
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        env.update(moto_server.env())
        env.update({
            "AIRFLOW_HOME": str(tmp / "airflow"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        })
        proc = subprocess.run([sys.executable, str(RUNNER), str(REPO / "dags"), json.dumps(confs)],
                              capture_output=True, text=True, env=env, timeout=400)
    finally:
        for s in servers:
            s.stop()
    log = proc.stdout + proc.stderr
    (tmp / "runner.log").write_text(log)

    def tagged(tag: str) -> list[Any]:
        return [json.loads(line[len(tag) + 1:]) for line in proc.stdout.splitlines() if line.startswith(tag + " ")]

    results = tagged("RESULT")
    assert proc.returncode == 0 and len(results) == len(confs), log[-6000:]
    return {"results": results, "assets": tagged("ASSETS")[0], "consumer": tagged("CONSUMER")[0], "log": log}


def _states(result: dict[str, Any]) -> dict[tuple[str, int], str]:
    return {(t, m): s for t, m, s in result["tasks"]}


def _parts(client: Any) -> pd.DataFrame:
    objs = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{ROOT}/completions/")["Contents"]
    return pd.concat([pd.read_parquet(io.BytesIO(client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()))
                      for o in objs])


def test_thresholds_fail_the_task_naming_threshold_and_figure(handoff_run: dict[str, Any]) -> None:
    first = handoff_run["results"][0]
    assert first["state"] == "failed"
    assert _states(first)[("validate_and_count", -1)] == "failed"
    assert all(s == "success" for (t, _), s in _states(first).items() if t != "validate_and_count")
    log = handoff_run["log"]
    assert f"error rate 5.00% ({N_TOO_LONG} error rows of {N_PROMPTS}) is above max_error_rate=1.00%" in log
    assert "is above max_truncation_rate=5.00%" in log


def test_report_matches_the_parts(handoff_run: dict[str, Any], moto_server: MotoServer) -> None:
    last = handoff_run["results"][1]
    assert last["state"] == "success", handoff_run["log"][-4000:]
    c = moto_server.client()
    r = json.loads(c.get_object(Bucket=BUCKET, Key=f"{ROOT}/report.json")["Body"].read())
    df = _parts(c)
    ok = df[df["error_class"].isna()]
    assert r["status"] == "passed" and r["problems"] == []
    assert (r["prompts"], r["missing"], r["duplicates"]) == (N_PROMPTS, 0, 0)
    assert (r["completions"], r["errors"]) == (len(ok), N_TOO_LONG) == (N_PROMPTS - N_TOO_LONG, N_TOO_LONG)
    assert r["errors_by_class"] == {"ContextLengthExceeded": N_TOO_LONG}
    truncated = ok["finish_reason"] == "length"
    assert r["truncated"] == int(truncated.sum()) > 0
    assert r["truncated_in_thinking"] == int((truncated & (ok["content"] == "")).sum()) > 0
    assert r["truncated_in_answer"] == r["truncated"] - r["truncated_in_thinking"]
    assert r["output_tokens"] == int(ok["completion_tokens"].sum())
    assert r["prompt_tokens"] == int(ok["prompt_tokens"].sum())
    assert r["token_stats"]["output_tokens"]["max"] == int(ok["completion_tokens"].max())
    assert r["think_markers_in_content"] == 0 and r["reasoning_missing"] == 0
    assert {k: v["rows"] for k, v in r["per_server"].items()} == df["server"].value_counts().to_dict()
    # recount with the sim tokenizer: exact, and training tokens as the ChatML template renders them
    rc = r["token_recount"]
    assert rc["mismatches"] == 0 and rc["compared"] == len(ok)
    expected = 0
    for _, row in ok.iterrows():
        expected += sum(count_tokens(m["content"]) + 3 for m in row["messages"]) + 3
        expected += count_tokens(row["reasoning"] or "") + count_tokens(row["content"]) + (2 if row["reasoning"] else 0)
    assert r["training_tokens"] == expected
    assert handoff_run["results"][1]["validate_xcom"]["training_tokens"] == expected
    # quality signals: counted over the completions, from the DAG's params, never failing the run
    q = r["quality"]
    assert q["rows"] == len(ok) and q["settings"]["languages"] == ["en"]
    # validation counts an empty answer at length; the signal also counts an unclosed <think> (no parser)
    assert q["flags"]["truncated_thinking"]["rows"] >= r["truncated_in_thinking"] > 0
    settings = QualitySettings(languages=("en",))
    table = pa.concat_tables(pq.read_table(io.BytesIO(c.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()))
                             for o in c.list_objects_v2(Bucket=BUCKET, Prefix=f"{ROOT}/completions/")["Contents"])
    recount: Counter[str] = Counter()
    for rec in table.to_pylist():
        if rec["error_class"] is None:
            recount.update(flags_of(row_signals(rec, settings), settings))
    assert {f: v["rows"] for f, v in q["flags"].items() if f != "near_duplicate"} == {
        f: recount[f] for f in QUALITY_FLAGS if f != "near_duplicate"}
    near = pq.read_table(io.BytesIO(c.get_object(Bucket=BUCKET, Key=r["files"]["near_duplicates"])["Body"].read()))
    pairs = dict(zip(near.column("id").to_pylist(), near.column("duplicate_of").to_pylist()))
    n_ok = N_PROMPTS - N_TOO_LONG
    assert {f"v{n_ok - 1 - i}": f"v{i}" for i in range(N_NEAR_DUPS)}.items() <= pairs.items()
    assert q["flags"]["near_duplicate"]["rows"] == len(pairs) == q["near_duplicates"]["duplicates"]
    assert "## quality signals" in c.get_object(Bucket=BUCKET, Key=f"{ROOT}/report.md")["Body"].read().decode()
    # plots: valid PNGs of a sensible size
    assert len(r["files"]["plots"]) == 4 and r["files"]["plots"][-1] == f"{ROOT}/report-mix.png"  # + the mix
    for key in r["files"]["plots"]:
        png = c.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", png[16:24])
        assert 300 < width < 2000 and 200 < height < 1000 and len(png) < 200_000
    assert f"{ROOT}/report.json" in handoff_run["log"]


def test_successful_run_emits_the_asset_event_with_the_handoff_fields(handoff_run: dict[str, Any]) -> None:
    assets = handoff_run["assets"]
    last = handoff_run["results"][1]
    assert assets["uri"] == "x-dflash://completions"
    assert [e["source_run_id"] for e in assets["events"]] == [last["run_id"]], "only the passing run emits"
    extra = assets["events"][0]["extra"]
    assert extra["output_uri"] == f"s3://{BUCKET}/{ROOT}"
    assert extra["manifest_key"] == f"{ROOT}/manifest.json" and extra["report_key"] == f"{ROOT}/report.json"
    assert (extra["prompts"], extra["completions"], extra["errors"]) == (N_PROMPTS, N_PROMPTS - N_TOO_LONG, N_TOO_LONG)
    assert extra["status"] == "passed" and extra["training_tokens"] == last["validate_xcom"]["training_tokens"]
    assert assets["queued_dag_ids"] == ["dflash_tokenize"]


def test_consumer_dag_is_triggered_and_receives_the_fields(handoff_run: dict[str, Any]) -> None:
    consumer = handoff_run["consumer"]
    extra = handoff_run["assets"]["events"][0]["extra"]
    assert consumer["state"] == "success", handoff_run["log"][-4000:]
    assert consumer["run_type"] == "asset_triggered"
    assert [e["extra"] for e in consumer["consumed_events"]] == [extra]
    # the default tokenizer is the one validation recounted with (the sim tokenizer), mapped over 4 workers
    assert [tuple(t) for t in consumer["tasks"] if t[0] == "tokenize"] == [("tokenize", i, "success") for i in range(4)]
    (summary,) = consumer["report"]
    assert summary["output_uri"] == extra["output_uri"]
    # every completion is one training row (single-turn prompts), kept unless DFlash cannot train on it
    dropped = dict(summary["dropped_by_reason"])
    assert dropped.pop("error_row") == extra["errors"] and summary["unverified"] == 0, summary
    # the default drop_quality drops thinking cut at max_tokens (120 here) and the planted near-duplicates
    # (unless flagged first as truncated); the gate passed
    assert set(dropped) <= {"fewer_than_min_loss_tokens", "quality:truncated_thinking", "quality:near_duplicate"}, dropped
    assert dropped.get("quality:near_duplicate", 0) <= N_NEAR_DUPS, dropped
    assert summary["gate"]["passed"], summary["gate"]
    assert summary["rows_in"] == extra["prompts"] and summary["rows_out"] + sum(dropped.values()) == extra["completions"]
    assert summary["rows_out"] > 0 and 0 < summary["loss_tokens"] < summary["tokens"]
    assert summary["ids_source"] == {"retokenized": summary["rows_out"]}  # these servers return no ids
