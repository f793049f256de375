"""dflash_generate → dflash_tokenize through a real Airflow scheduler against a real vLLM server, token-exact.

The server is vLLM 0.32 (CPU build) serving the tiny designed Qwen3 checkpoint (conftest.py): reasoning,
`</think>`, an answer, `<|im_end|>`, both finish reasons, and about a third of the thinking rows sampled
as a non-canonical BPE sequence of their text. Two datasets go through the DAGs: thinking on with every
assistant turn regenerated (multi-turn conversations), and thinking off regenerating the last turn
(histories with the input's answers). The asset-triggered `dflash_tokenize` tokenizes each with its
defaults; then every finished turn is tokenized again (a copy of the dataset, `min_loss_tokens` 1) and
**every training row is checked against the engine itself**, not against what the pipeline stored:

* its prompt part equals the engine's own tokenization of that turn's request (vLLM `/tokenize` with
  the messages, the generation prompt and the thinking switch);
* the whole row equals what the engine generates when that turn's request is sent again (same
  messages, sampling and seed, `return_token_ids`): `prompt_token_ids` then `token_ids`, plus the
  template's `\\n` after `<|im_end|>` on a stopped turn;
* the loss mask is 0 on the prompt and 1 on exactly the generated tokens (and that `\\n`).

Then the trainers read what the DAG wrote, with their own code (SpecForge 0.2.0's pre-tokenized
path, speculators 0.9.0's prepare-data + dataset on the files of a second, named tokenization with the
speculators format, which the default formats leave out, `datasets` through the dataset card): the same
ids and masks as our Parquet.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests

from dflash_pipeline.config import Sampling, TokenizeConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dev.stack import AirflowStack
from dflash_pipeline.serving.sglang import build_chat_body
from dflash_pipeline.steps.tokenize import plan, run_assignment, write_report
from dflash_pipeline.steps.tokenize.profiles import profile_keys

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 160
SEED = 42


def _prompts(n_multi: int, n_single: int) -> list[dict[str, Any]]:
    """Rows of the repo's sample prompts (multi-turn ones with their original answers, single-turn ones),
    plus a few with a system prompt, non-ASCII text and several lines."""
    rows = [json.loads(line) for line in (REPO / "data" / "sample_prompts.jsonl").read_text().splitlines()]
    multi = [r for r in rows if "messages" in r and any(m["role"] == "assistant" for m in r["messages"])][:n_multi]
    single = [r for r in rows if "messages" in r and len(r["messages"]) == 1][:n_single]
    extra = [
        {"id": "sys-unicode", "messages": [{"role": "system", "content": "Réponds brièvement. 简短回答。"},
                                           {"role": "user", "content": "Combien font 7 × 8 ?\nMontre le calcul."}]},
        {"id": "emoji", "messages": [{"role": "user", "content": "Explain 🙂 and naïve café in one line."}]},
    ]
    return multi + single + extra


def _generate(stack: AirflowStack, s3: Any, bucket: str, name: str, rows: list[dict[str, Any]], vllm: Any,
              tokenize_gate_may_fail: bool = False, **conf: Any) -> str:
    known = stack.run_ids("dflash_tokenize")
    key = f"prompts/{name}.jsonl"
    s3.put_object(Bucket=bucket, Key=key, Body="".join(json.dumps(r) + "\n" for r in rows).encode())
    output_uri = f"s3://{bucket}/ds/{name}"
    run_id = stack.trigger("dflash_generate", {
        "prompts_uri": f"s3://{bucket}/{key}", "output_uri": output_uri, "servers": [vllm.base_url],
        "model": vllm.model, "max_tokens": MAX_TOKENS, "seed": SEED, "save_every": 12,
        "tokenizer": str(vllm.tokenizer_dir), "max_truncation_rate": 0.5, **conf})
    state = stack.wait_run("dflash_generate", run_id, timeout_s=900)
    assert state == "success", stack.task_instances("dflash_generate", run_id)
    # the completions asset event queues dflash_tokenize: wait for that run to end, however long it is queued
    layout = DatasetLayout.from_uri(output_uri)

    def ours(run: dict[str, Any]) -> bool:  # the run that tokenized this dataset (or failed on it)
        return (run["state"] == "failed" and stack.run_logs_mention("dflash_tokenize", run["dag_run_id"], output_uri)) \
            or _exists(s3, bucket, layout.tokenized_report_key)

    consumer = stack.wait_new_run("dflash_tokenize", known, timeout_s=900, ours=ours)
    if tokenize_gate_may_fail and consumer["state"] == "failed":
        # The tiny model's thinking is mostly cut at max_tokens: the gate (min_kept_share) fails the asset-triggered
        # run, as it should, after writing the report. Accept the rows kept, as its message says: again with 0.
        report = _json(s3, bucket, layout.tokenized_report_key)
        assert report["status"] == "kept_too_few", report
        again = stack.trigger("dflash_tokenize", {"output_uri": output_uri, "min_kept_share": 0})
        assert stack.wait_run("dflash_tokenize", again, timeout_s=900) == "success", \
            stack.task_instances("dflash_tokenize", again)
        return output_uri
    assert (consumer["run_type"], consumer["state"]) == ("asset_triggered", "success"), \
        (consumer, stack.task_instances("dflash_tokenize", consumer["dag_run_id"]))
    return output_uri


def _exists(s3: Any, bucket: str, key: str) -> bool:
    return bool(s3.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount"))


def _json(s3: Any, bucket: str, key: str, timeout_s: float = 0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        except s3.exceptions.NoSuchKey:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def _keys(s3: Any, bucket: str, prefix: str) -> list[str]:
    out: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def _table(s3: Any, bucket: str, keys: list[str]) -> pa.Table:
    import io

    return pa.concat_tables([pq.read_table(io.BytesIO(s3.get_object(Bucket=bucket, Key=k)["Body"].read()))
                             for k in sorted(keys)])


def _all_turns_tokenized(s3: Any, bucket: str, layout: DatasetLayout) -> tuple[pa.Table, dict[str, Any]]:
    """Every finished turn as a training row: the dataset copied (tokenized/ left out) and tokenized with
    DFlash's minimum of trained tokens and the quality filter off."""
    copy = DatasetLayout(bucket, layout.root + "-all-turns")
    for key in _keys(s3, bucket, layout.root + "/"):
        rel = key[len(layout.root) + 1:]
        if not rel.startswith("tokenized/") and rel != "README.md":
            s3.copy_object(Bucket=bucket, Key=copy.key(rel), CopySource={"Bucket": bucket, "Key": key})
    planned = plan(s3, [copy.uri], TokenizeConfig(min_loss_tokens=1, require_consecutive_loss_tokens=False,
                                                  workers=1, profiles=("parquet",), drop_quality=()))
    for a in planned["assignments"]:
        run_assignment(s3, a)
    report = write_report(s3, planned["datasets"][0])
    return _table(s3, bucket, _keys(s3, bucket, copy.key("tokenized/parquet/"))), report


def _context(row: dict[str, Any], turn: int) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """The messages the request of assistant turn `turn` of this completions row carried, and that turn's usage."""
    conv = row["conversation"]
    positions = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    regenerated = positions[len(positions) - len(row["turns"]):]
    pos = positions[turn]
    return ([{"role": m["role"], "content": m["content"]} for m in conv[:pos]],
            row["turns"][regenerated.index(pos)])


def _engine_check(vllm: Any, rows: pa.Table, completions: dict[tuple[str, int], dict[str, Any]], thinking: bool,
                  newline: list[int]) -> Counter[str]:
    """Each training row against the engine: its /tokenize of the request, and the request sent again."""
    sampling = Sampling(max_tokens=MAX_TOKENS, enable_thinking=thinking, seed=SEED)
    session = requests.Session()

    def one(r: dict[str, Any]) -> str:
        src = completions[(r["id"], r["sample"])]
        messages, usage = _context(src, r["turn"])
        tokenized = session.post(f"{vllm.base_url}/tokenize", json={
            "model": vllm.model, "messages": messages, "add_generation_prompt": True,
            "chat_template_kwargs": {"enable_thinking": thinking}}, timeout=60).json()
        body = build_chat_body(messages, vllm.model, sampling, r["id"], engine="vllm", sample=r["sample"])
        again = session.post(f"{vllm.base_url}/v1/chat/completions", json=body, timeout=300).json()
        prompt_ids, out_ids = again["prompt_token_ids"], again["choices"][0]["token_ids"]
        finish = again["choices"][0]["finish_reason"]
        ids, mask = r["input_ids"], r["loss_mask"]
        tail = newline if finish == "stop" else []
        assert tokenized["tokens"] == prompt_ids == ids[: len(prompt_ids)], r["key"]
        assert ids == prompt_ids + out_ids + tail, r["key"]
        assert mask == [0] * len(prompt_ids) + [1] * (len(out_ids) + len(tail)), r["key"]
        assert (finish, len(out_ids), len(prompt_ids)) == (r["finish_reason"], usage["completion_tokens"],
                                                           usage["prompt_tokens"]), r["key"]
        return finish

    with ThreadPoolExecutor(8) as pool:
        return Counter(pool.map(one, rows.to_pylist()))


def test_generate_and_tokenize_on_a_real_vllm_server_are_token_exact(
    airflow_stack: AirflowStack, vllm_server: Any, s3_client: Any, bucket: str, run_loaders: Any, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    from dflash_pipeline.dataset.records import decode_part

    tok = Tokenizer.from_file(str(vllm_server.tokenizer_dir / "tokenizer.json"))
    newline = tok.encode("\n", add_special_tokens=False).ids
    runs = {
        "thinking": (_prompts(50, 60), {"regenerate": "all_turns"}, True),
        "no-thinking": (_prompts(10, 100), {"enable_thinking": False}, False),
    }
    checked: dict[str, Any] = {}
    for name, (rows, conf, thinking) in runs.items():
        output_uri = _generate(airflow_stack, s3_client, bucket, name, rows, vllm_server, **conf)
        layout = DatasetLayout.from_uri(output_uri)
        validated = _json(s3_client, bucket, layout.report_key)
        completions = [r for k in _keys(s3_client, bucket, layout.completions_prefix)
                       for r in decode_part(s3_client.get_object(Bucket=bucket, Key=k)["Body"].read()).to_pylist()]
        assert validated["status"] == "passed" and validated["errors"] == 0 and len(completions) == len(rows)
        assert validated["engine_token_ids"] == {"rows_with": len(rows), "rows_without": 0,
                                                 "rows_whose_ids_disagree_with_usage": 0}
        assert validated["reasoning_tokens"] is not None and validated["token_recount"]["tokenizer"]
        turns = sum(len(r["turns"]) for r in completions)

        # the asset-triggered dflash_tokenize (defaults: DFlash-ready rows) wrote every profile exactly once
        report = _json(s3_client, bucket, layout.tokenized_report_key)
        assert report["status"] == "complete" and report["ids_source"] == {"engine": report["rows_out"]}
        assert report["unverified"] == 0 and report["prompt_template_differs"] == 0
        assert report["rows_out"] + sum(v for k, v in report["dropped_by_reason"].items()) == turns
        assert {k for k in report["dropped_by_reason"] if not k.startswith("quality:")} <= {
            "fewer_than_min_loss_tokens", "no_two_consecutive_loss_tokens"}, report["dropped_by_reason"]
        assert report["gate"]["passed"], report["gate"]
        dag_rows = _table(s3_client, bucket, _keys(s3_client, bucket, layout.key("tokenized/parquet/")))
        assert dag_rows.num_rows == report["rows_out"] > 0

        # every finished turn, checked against the engine
        every, every_report = _all_turns_tokenized(s3_client, bucket, layout)
        assert every.num_rows == turns and every_report["dropped_by_reason"] == {}
        by_key = {(r["id"], r["sample"]): r for r in completions}
        finishes = _engine_check(vllm_server, every, by_key, thinking, newline)
        assert set(finishes) == ({"stop", "length"} if thinking else {"stop"}), finishes
        # the DAG's rows are those same rows (the ones DFlash can train on)
        same = {r["key"]: (r["input_ids"], r["loss_mask"]) for r in every.to_pylist()}
        assert all(same[r["key"]] == (r["input_ids"], r["loss_mask"]) for r in dag_rows.to_pylist())
        noncanonical = sum(1 for r in every.to_pylist()
                           if tok.encode(tok.decode(r["input_ids"][r["loss_mask"].index(1):], skip_special_tokens=False),
                                         add_special_tokens=False).ids != r["input_ids"][r["loss_mask"].index(1):])
        multi = sum(1 for r in every.to_pylist() if r["turn"] > 0)
        checked[name] = {"rows": every.num_rows, "finish": dict(finishes), "noncanonical": noncanonical,
                         "later_turns": multi, "dag_rows": dag_rows.num_rows}

        # speculators' files are not in the default formats: a second, named tokenization of the same dataset
        # (same settings but the formats) writes them beside the DAG's, the same rows
        extra = plan(s3_client, [layout.uri], TokenizeConfig(profiles=("speculators",), tokenization="for-speculators"))
        assert extra["datasets"][0]["tokenization"] == "for-speculators"
        for a in extra["assignments"]:
            run_assignment(s3_client, a)

        # the trainers read what the DAG wrote, with their own code
        root = tmp_path / name
        for key in _keys(s3_client, bucket, layout.root + "/"):
            rel = key[len(layout.root) + 1:]
            if rel.startswith("tokenized/") or rel == "README.md":
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_bytes(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
        (root / "train.jsonl").write_bytes(b"".join(p.read_bytes() for p in sorted((root / "tokenized/specforge").glob("*.jsonl"))))
        ours = [(r["input_ids"], r["loss_mask"]) for r in sorted(dag_rows.to_pylist(), key=lambda r: r["key"])]
        parts = sorted((root / "tokenized/parquet").glob("*.parquet"))
        in_file_order = [(r["input_ids"], r["loss_mask"]) for p in parts for r in pq.read_table(p).to_pylist()]
        (sf, sf_rows), (sp, sp_rows), (hf, hf_rows) = run_loaders([
            ("specforge-tokens", ["--file", str(root / "train.jsonl"), "--max-length", "4096"]),
            ("speculators", ["--data", str(root / "tokenized/for-speculators/speculators"), "--tokenizer", str(vllm_server.tokenizer_dir),
                             "--prepared", str(tmp_path / f"{name}-prepared"), "--max-length", "4096"]),
            ("parquet", ["--root", str(root), "--json-globs", "tokenized/specforge/part-*.jsonl"]),
        ])
        assert [(r["input_ids"], r["loss_mask"]) for r in sf_rows] == in_file_order  # SpecForge kept every row
        assert Counter(json.dumps(v) for v in ((r["input_ids"], r["loss_mask"]) for r in sp_rows)) == \
            Counter(json.dumps(v) for v in ours)
        assert sorted((r["input_ids"], r["loss_mask"]) for r in hf_rows) == sorted(ours)
        assert hf["config_names"] == ["parquet"]
        assert profile_keys("parquet", 0)["rows"].startswith("tokenized/parquet/")
    assert checked["thinking"]["later_turns"] > 0 and checked["thinking"]["noncanonical"] > 0
    # a few hundred training rows, each checked token for token against the engine
    assert sum(c["rows"] for c in checked.values()) >= 250, checked
    print(json.dumps(checked))
