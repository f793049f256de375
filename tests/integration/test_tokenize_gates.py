"""Tokenize's gates against a real S3 protocol server (moto over HTTP), through plan → run_assignment → write_report.

A dataset whose every turn disagrees with the engine's counts (issue 32: "keeps 0 of 200 rows and ends
success") now fails with its reasons, its report written and no dataset card; a healthy dataset with a
refusal and a near-duplicate prompt (validation's near_duplicates.parquet) drops exactly those, and the
report and the card say so by thinking mode. A quarter of the rows are thinking-off; in the healthy dataset
every row carries the engine's ids (re-encoding a thinking-off turn with the dataset's pinned thinking-on
template would not match its counts: tokenizing per-row thinking modes is issue 32's item 1, not this test's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.config import TokenizeConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import encode_part
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.dev.sim.rows import engine_row
from dflash_pipeline.dev.sim.tokens import SimTokenModel
from dflash_pipeline.steps.quality.near_dup import write_near_duplicates
from dflash_pipeline.steps.tokenize import TokenizeFailed, plan, run_assignment, write_report

PARTS, ROWS = 2, 100
ANSWER = ("The user wants a short sum; two plus two is four, and I will say it plainly.",
          "Two plus two equals four: adding two units to two units gives four units.")


def _write(client: Any, bucket: str, root: str, tokenizer: Path, *, counts_off: bool,
           answer_of: Any = lambda i: ANSWER) -> DatasetLayout:
    layout = DatasetLayout(bucket, root)
    manifest = {"format": "dflash-pipeline/manifest/1", "plan_id": "p1",
                "pinned": {"sampling": {"enable_thinking": True}}, "chunks": {"sizes": [ROWS] * PARTS}}
    client.put_object(Bucket=bucket, Key=layout.manifest_key, Body=json.dumps(manifest).encode())
    report = {"status": "passed", "completions": PARTS * ROWS, "token_recount": {"tokenizer": str(tokenizer)}}
    client.put_object(Bucket=bucket, Key=layout.report_key, Body=json.dumps(report).encode())
    tm = SimTokenModel(str(tokenizer))
    for c in range(PARTS):
        rows = []
        for i in range(ROWS):
            n = c * ROWS + i
            thinking = n % 4 != 0
            reasoning, answer = answer_of(n)
            r = engine_row(tm, [{"role": "user", "content": f"What is two plus two, case {n}?"}],
                           [(reasoning if thinking else None, answer)], thinking=thinking, ids=not counts_off,
                           row_id=f"p{n}", chunk=c)
            if counts_off:  # an engine whose token counts are not this tokenizer's
                r["completion_tokens"] += 3
                r["turns"] = [dict(t, completion_tokens=t["completion_tokens"] + 3) for t in r["turns"] or []] or None
            r["thinking"], r["domain"] = thinking, ("math" if n % 2 else "chat")
            rows.append(r)
        client.put_object(Bucket=bucket, Key=layout.part_key(c), Body=encode_part(rows))
    return layout


def _tokenize(client: Any, layout: DatasetLayout, cfg: TokenizeConfig) -> dict[str, Any]:
    planned = plan(client, [layout.uri], cfg)
    for a in planned["assignments"]:
        run_assignment(client, a)
    return write_report(client, planned["datasets"][0], cfg.min_kept_share)


def _exists(client: Any, bucket: str, key: str) -> bool:
    return Store(client, bucket).head(key) is not None


def test_a_run_that_keeps_0_of_200_fails_with_its_reasons(s3_client: Any, bucket: str, qwen_tokenizer: Path) -> None:
    layout = _write(s3_client, bucket, "ds/none-kept", qwen_tokenizer, counts_off=True)
    with pytest.raises(TokenizeFailed, match=r"kept 0 of 200 training rows \(0\.0%\), below min_kept_share 0\.7") as exc:
        _tokenize(s3_client, layout, TokenizeConfig(workers=2))
    assert "ids_differ_from_engine_counts 200 (thinking off 50, thinking on 150)" in str(exc.value)
    report = json.loads(s3_client.get_object(Bucket=bucket, Key=layout.tokenized_report_key)["Body"].read())
    assert report["status"] == "kept_too_few" and report["gate"]["passed"] is False
    assert report["dropped_by_thinking"] == {"ids_differ_from_engine_counts": {"off": 50, "on": 150}}
    assert report["dropped_by_domain"] == {"ids_differ_from_engine_counts": {"chat": 100, "math": 100}}
    md = s3_client.get_object(Bucket=bucket, Key=layout.tokenized_report_md_key)["Body"].read().decode()
    assert "**FAILED**" in md and "| dropped: ids_differ_from_engine_counts | 50 (100%) | 150 (100%) |" in md
    assert not _exists(s3_client, bucket, layout.dataset_card_key)  # no card for a dataset that failed its gate


def test_quality_drops_are_reported_and_carded(s3_client: Any, bucket: str, qwen_tokenizer: Path) -> None:
    refusal = ("The user asks for something.", "I'm sorry, but I can't help with that request.")
    layout = _write(s3_client, bucket, "ds/quality", qwen_tokenizer, counts_off=False,
                    answer_of=lambda n: refusal if n in (1, 2) else ANSWER)
    write_near_duplicates(Store(s3_client, bucket), layout, [("p7", "p3", 0.93)])
    report = _tokenize(s3_client, layout, TokenizeConfig(workers=2))
    assert report["status"] == "complete" and report["rows_out"] == 197, report["dropped_by_reason"]
    assert report["dropped_by_reason"] == {"quality:near_duplicate": 1, "quality:refusal": 2}
    assert report["dropped_by_thinking"] == {"quality:near_duplicate": {"on": 1}, "quality:refusal": {"on": 2}}
    assert report["gate"] == {"min_kept_share": 0.7, "kept_share": 0.985, "rows_kept": 197, "rows_counted": 200,
                              "passed": True}
    card = s3_client.get_object(Bucket=bucket, Key=layout.dataset_card_key)["Body"].read().decode()
    assert "| `quality:refusal` | 2 | quality flag `refusal` (drop_quality) |" in card
    assert "| dropped: quality:refusal | 0 (0%) | 2 (1%) |" in card  # by thinking mode: off, on
    settings = json.loads(s3_client.get_object(Bucket=bucket, Key=layout.tokenized_settings_key)["Body"].read())
    assert "refusal" in settings["drop_quality"] and settings["quality"]["loop_ngram"] == 8
