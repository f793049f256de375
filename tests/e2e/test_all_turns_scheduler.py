"""regenerate=all_turns with samples_per_prompt=2 through a real Airflow scheduler (LocalExecutor)."""

from __future__ import annotations

import io
import json
from collections import Counter
from typing import Any

import pandas as pd
import pytest
import requests

from dflash_pipeline.dev.stack import AirflowStack

pytestmark = pytest.mark.slow

DAG = "dflash_generate"


def _conversations(s3: Any, bucket: str, key: str, n: int) -> str:
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Answer briefly."}]
        for k in range(1 + i % 3):
            msgs += [{"role": "user", "content": f"e2e conversation {i}, question {k}: {i} plus {k}?"},
                     {"role": "assistant", "content": f"ORIGINAL {i}.{k}: {i + k}"}]
        rows.append({"id": f"conv-{i}", "messages": msgs})
    s3.put_object(Bucket=bucket, Key=key, Body="\n".join(json.dumps(r) for r in rows).encode())
    return f"s3://{bucket}/{key}"


def test_all_turns_two_samples_through_the_scheduler(airflow_stack: AirflowStack, sim_fleet, s3_client, bucket) -> None:
    fleet = sim_fleet(2, token_time_s=0.001, length_scale=0.05, max_running_requests=8, track_history=True)
    n = 150
    conf = {"prompts_uri": _conversations(s3_client, bucket, "p/conv.jsonl", n), "output_uri": f"s3://{bucket}/ds/conv",
            "servers": fleet.urls, "save_every": 20, "regenerate": "all_turns", "samples_per_prompt": 2, "seed": 5}
    run_id = airflow_stack.trigger(DAG, conf)
    assert airflow_stack.wait_run(DAG, run_id, timeout_s=300) == "success"
    report = json.loads(s3_client.get_object(Bucket=bucket, Key="ds/conv/report.json")["Body"].read())
    assert (report["prompts"], report["completions"], report["missing"], report["duplicates"]) == (2 * n, 2 * n, 0, 0)
    assert report["rows_by_sample"] == {"0": n, "1": n}
    assert report["turns_generated"] > 2 * n and report["cached_prompt_tokens"] > 0
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="ds/conv/completions/")["Contents"]]
    df = pd.concat([pd.read_parquet(io.BytesIO(s3_client.get_object(Bucket=bucket, Key=k)["Body"].read())) for k in keys])
    assert Counter(zip(df["id"], df["sample"])).most_common(1)[0][1] == 1 and len(df) == 2 * n
    audits = [requests.get(f"{u}/sim/stats", timeout=5).json()["conversation"] for u in fleet.urls]
    assert sum(a["foreign_history_turns"] for a in audits) == 0 and sum(a["own_history_turns"] for a in audits) > 0
    manifest = json.loads(s3_client.get_object(Bucket=bucket, Key="ds/conv/manifest.json")["Body"].read())
    assert manifest["pinned"]["input"]["regenerate"] == "all_turns" and manifest["pinned"]["input"]["samples_per_prompt"] == 2
