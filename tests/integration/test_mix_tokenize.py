"""A mixed-thinking run from the fleet to the training rows: simulated vLLM (engine ids) and SGLang (no ids)
servers serving Qwen's BPE and a Qwen3-style template render each request in its row's mode; validation's
recount and the tokenize step render each row in its own mode too, so no row is dropped as unverified and a
thinking-off row's prompt ends in the empty think block its request had (a thinking-on dataset's template
would not write it)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from test_mix_fleet import RUN_ID, _rows, _run_workers
from tokenizers import Tokenizer

from dflash_pipeline.config import RunConfig, TokenizeConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import run_preflight
from dflash_pipeline.steps.tokenize import plan, run_assignment, write_report
from dflash_pipeline.steps.tokenize.profiles import profile_keys
from dflash_pipeline.steps.validate import run_validation

SIM = {"token_time_s": 0.0005, "length_scale": 0.01, "max_running_requests": 32}
EMPTY_BLOCK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.timeout(300)
def test_a_mixed_run_tokenizes_every_row_in_its_own_mode(s3_client: Any, bucket: str, sim_fleet: Any,
                                                         qwen_tokenizer: Path) -> None:
    n = 200
    fleet = sim_fleet(engines=["vllm", "sglang"], tokenizer_dir=str(qwen_tokenizer), **SIM)
    fleet.servers[1].update_config(token_ids_supported=False)  # an SGLang that returns no ids: re-encoded rows
    s3_client.put_object(Bucket=bucket, Key="in/mixtok.jsonl", Body=_rows(n))
    cfg = RunConfig.from_params({
        "prompts_uri": f"s3://{bucket}/in/mixtok.jsonl", "output_uri": f"s3://{bucket}/mixtok", "servers": fleet.urls,
        "save_every": 50, "seed": 7, "thinking_fraction": 0.5, "max_tokens": 512, "enable_thinking": True,
    })
    run_plan(s3_client, cfg, RUN_ID)
    infos = run_preflight(s3_client, cfg, [ServerSpec(u, u) for u in fleet.urls], RUN_ID)
    _run_workers(s3_client, bucket, cfg, infos)
    layout = DatasetLayout.from_uri(cfg.output_uri)
    store = Store(s3_client, bucket)
    rows = [r for o in store.list(layout.completions_prefix) for r in decode_part(store.get(o.key)[0]).to_pylist()]
    modes = {r["thinking"] for r in rows}
    assert modes == {True, False} and all(r["error_class"] is None for r in rows)
    with_ids = {r["id"] for r in rows if r["output_token_ids"] is not None}
    assert 0 < len(with_ids) < len(rows), "both engines served"

    validation = run_validation(s3_client, cfg.output_uri, tokenizer=str(qwen_tokenizer), plots=False)
    assert validation["token_recount"]["mismatches"] == 0 and validation["token_recount"]["compared"] == n

    planned = plan(s3_client, [cfg.output_uri], TokenizeConfig(tokenizer=str(qwen_tokenizer), workers=1,
                                                               min_loss_tokens=1, drop_quality=()))
    for a in planned["assignments"]:
        run_assignment(s3_client, a)
    report = write_report(s3_client, planned["datasets"][0])
    assert report["dropped_by_reason"] == {} and report["unverified"] == 0, report["unverified_examples"][:3]
    assert report["prompt_template_differs"] == 0 and report["rows_out"] == n

    tok = Tokenizer.from_file(str(qwen_tokenizer / "tokenizer.json"))
    src = {r["id"]: r for r in rows}
    seen = {"engine": 0, "retokenized": 0}
    for c in range(len(json.loads(store.get(layout.manifest_key)[0])["chunks"]["sizes"])):
        part = pq.read_table(io.BytesIO(store.get(layout.key(profile_keys("parquet", c)["rows"]))[0])).to_pylist()
        for row in part:
            r = src[row["id"]]
            assert row["thinking"] is r["thinking"] and row["sampling"] == r["sampling"]
            prompt = tok.decode(row["input_ids"][: row["loss_mask"].index(1)], skip_special_tokens=False)
            assert prompt.endswith(EMPTY_BLOCK) is (not r["thinking"]), (row["key"], r["thinking"])
            if r["output_token_ids"] is not None:
                assert row["input_ids"][: len(r["prompt_token_ids"][0])] == r["prompt_token_ids"][0]
            seen[row["ids_source"]] += 1
    assert seen["engine"] and seen["retokenized"] and sum(seen.values()) == n
