"""The asset hand-off through a real scheduler: generate → validate → tokenize, then the shards are checked.

dflash_tokenize is scheduled on the `dflash_completions` asset; the scheduler creates its run from the
event that validate_and_count emitted; `prepare` reads the event's extra (the dataset's output_uri),
takes the generate run's tokenizer from its manifest (Qwen's real BPE, given to dflash_generate as a
Hugging Face id held by the stack's hub cache: plan checked it and recorded the snapshot's commit, and
tokenize loads that very snapshot), `tokenize` runs mapped over the workers and `report` writes
tokenized/report.json. Other tests' runs emit events too, so the consumer
run is found by the output_uri its report names.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.config import DFLASH_MIN_LOSS_TOKENS
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_part
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
            f"/api/v2/dags/{CONSUMER}/dagRuns/{run['dag_run_id']}/taskInstances/report/xcomEntries/return_value",
            params={"deserialize": True},
        )
        if resp.status_code == 200:
            value = resp.json().get("value")
            out.append((run, json.loads(value) if isinstance(value, str) else value))
    return out


HUB_ID = "dflash-test/qwen3-bpe"
"""Qwen's real BPE with the project's Qwen3-style template (dev/qwen_tokenizer.py), as a hub id."""


def test_validated_run_is_tokenized_by_the_scheduled_consumer(
    airflow_stack: AirflowStack, sim_fleet, s3_client: Any, bucket: str, qwen_tokenizer: Path, hf_hub_cache: Path
) -> None:
    from tokenizers import Tokenizer

    from dflash_pipeline.dev.hub_cache import fill_hub_cache

    commit = fill_hub_cache(hf_hub_cache, HUB_ID, qwen_tokenizer)

    # the servers "serve" Qwen's BPE: the vLLM-wire one returns its token ids, the SGLang-wire one plays a
    # version before 0.5.17 (none: its turns are re-encoded and checked)
    fleet = sim_fleet(engines=["sglang", "vllm"], token_time_s=0.001, length_scale=0.05, max_running_requests=8,
                      tokenizer_dir=str(qwen_tokenizer))
    fleet.servers[0].update_config(token_ids_supported=False)
    body = "\n".join(json.dumps({"id": f"h-{i}", "prompt": f"handoff question {i}"}) for i in range(120))
    s3_client.put_object(Bucket=bucket, Key="p/handoff.jsonl", Body=body.encode())
    output_uri = f"s3://{bucket}/ds/handoff"
    conf = {"prompts_uri": f"s3://{bucket}/p/handoff.jsonl", "output_uri": output_uri, "servers": fleet.urls,
            "save_every": 40, "tokenizer": HUB_ID}
    known = airflow_stack.run_ids(CONSUMER)
    run_id = airflow_stack.trigger("dflash_generate", conf)
    assert airflow_stack.wait_run("dflash_generate", run_id, timeout_s=300) == "success"

    # the run the asset event queued, waited for to its end (not for a guessed time)
    # (the session's stack is shared: an earlier test's event may queue a run first, passed over here)
    report_key = DatasetLayout.from_uri(output_uri).tokenized_report_key
    ended = airflow_stack.wait_new_run(
        CONSUMER, known, timeout_s=600,
        ours=lambda run: airflow_stack.run_logs_mention(CONSUMER, run["dag_run_id"], output_uri) and run["state"] == "failed"
        or bool(
            s3_client.list_objects_v2(Bucket=bucket, Prefix=report_key).get("KeyCount")))
    assert ended["state"] == "success", (ended, airflow_stack.task_instances(CONSUMER, ended["dag_run_id"]))
    found: list[dict[str, Any]] = []
    consumer_run: dict[str, Any] = {}
    for run, summaries in _consumer_results(airflow_stack):
        found = [s for s in summaries or [] if s.get("output_uri") == output_uri]
        if found:
            consumer_run = run
            break
    assert found, f"no successful {CONSUMER} run tokenized {output_uri}"
    assert consumer_run["run_type"] == "asset_triggered"
    (summary,) = found
    tis = airflow_stack.task_instances(CONSUMER, consumer_run["dag_run_id"])
    assert sorted(t.map_index for t in tis if t.task_id == "tokenize") == [0, 1, 2, 3]

    # What each prompt's training row must train on, from the completions and the engine's own count: the
    # generated tokens, plus the template's "\n" after <|im_end|> on a stopped turn. The sim's lengths are
    # drawn per prompt (heavy-tailed, short at length_scale 0.05); only a turn with fewer than the DFlash
    # minimum of trained tokens (min_loss_tokens, default 2: SpecForge 0.2.0's rule) may be dropped.
    layout = DatasetLayout.from_uri(output_uri)
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=layout.root + "/")["Contents"]
    completions = [o["Key"] for o in listed if o["Key"].startswith(layout.completions_prefix)]
    loss_tokens: dict[str, int] = {}
    for key in completions:
        for r in decode_part(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()).to_pylist():
            assert r["error_class"] is None, r
            (turn,) = r["turns"]
            loss_tokens[r["id"]] = turn["completion_tokens"] + (turn["finish_reason"] == "stop")
    assert sorted(loss_tokens) == sorted(f"h-{i}" for i in range(120))
    keep = {i for i, n in loss_tokens.items() if n >= DFLASH_MIN_LOSS_TOKENS}
    assert keep, sorted(loss_tokens.values())
    # one training row per prompt, kept exactly when DFlash can train on it
    assert (summary["rows_in"], summary["rows_out"], summary["rows_dropped"]) == (120, len(keep), 120 - len(keep))
    want = {"fewer_than_min_loss_tokens": 120 - len(keep)} if len(keep) < 120 else {}
    assert summary["dropped_by_reason"] == want, summary
    assert summary["gate"]["passed"] and summary["gate"]["rows_kept"] == len(keep), summary["gate"]

    # the shards: one per completions part, every row's mask on what the model generated only
    def files(folder: str) -> list[str]:
        return sorted(o["Key"] for o in listed if o["Key"].startswith(layout.key(f"tokenized/{folder}/part-")))

    shards = files("parquet")
    assert len(shards) == len(completions) == len(files("specforge")) == len(files("specforge-conversations")) >= 3
    assert files("speculators") == []  # not in the default formats (parquet + specforge)
    assert any(o["Key"] == layout.dataset_card_key for o in listed)
    tok = Tokenizer.from_file(str(qwen_tokenizer / "tokenizer.json"))
    rows = tokens = 0
    kept: list[str] = []
    for key in shards:
        table = pq.read_table(io.BytesIO(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()))
        for rid, ids, mask in zip(table.column("id").to_pylist(), table.column("input_ids").to_pylist(),
                                  table.column("loss_mask").to_pylist()):
            assert sum(mask) == loss_tokens[rid], rid
            kept.append(rid)
            text = tok.decode(ids, skip_special_tokens=False)
            trained = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
            assert text.startswith("<|im_start|>user\nhandoff question") and text.endswith(trained)
            assert trained.startswith("<think>\n") and trained.endswith("<|im_end|>\n")
            assert mask == [0] * mask.index(1) + [1] * (len(mask) - mask.index(1))
            rows += 1
            tokens += len(ids)
    assert rows == summary["rows_out"] and tokens == summary["tokens"]
    assert sorted(kept) == sorted(keep)  # each kept prompt exactly once, none lost, none wrongly dropped
    report = json.loads(s3_client.get_object(Bucket=bucket, Key=layout.tokenized_report_key)["Body"].read())
    # the generate run's tokenizer, at the snapshot its plan checked (the manifest's record), the same bytes
    manifest = json.loads(s3_client.get_object(Bucket=bucket, Key=layout.manifest_key)["Body"].read())
    assert (manifest["tokenizer"]["source"], manifest["tokenizer"]["kind"], manifest["tokenizer"]["revision"]) == (
        HUB_ID, "huggingface", commit)
    assert report["status"] == "complete" and report["settings"]["tokenizer"] == f"{HUB_ID}@{commit}"
    assert report["provenance"]["tokenizer"]["tokenizer_json_sha256"] == manifest["tokenizer"]["tokenizer_json_sha256"]
    validated = json.loads(s3_client.get_object(Bucket=bucket, Key=layout.report_key)["Body"].read())
    assert validated["token_recount"]["tokenizer"] == HUB_ID
    assert set(report["ids_source"]) == {"engine", "retokenized"} and report["unverified"] == 0
