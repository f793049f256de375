"""The quality signals in the validation report: every flag counted (overall, by thinking mode and domain) with
examples, on a dataset (moto) whose rows carry known defects; validation passes whatever they count."""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow.parquet as pq
import quality_texts as qt
from test_validate_checks import LAX, get, row, write_dataset

from dflash_pipeline.config.quality import QualitySettings
from dflash_pipeline.steps.validate import run_validation

PROMPT = ("A farmer has 17 sheep and all but 9 run away. How many sheep does the farmer have left? Explain the trick "
          "in the wording, then give the number.")


def msg(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def dataset_rows() -> list[dict[str, Any]]:
    """Chunk 0 then chunk 1; the defect of each row is in its id."""
    good = dict(reasoning=qt.PROBABILITY_THINKING, content=qt.ENGLISH_ANSWER)
    rows = [
        row("a-good", **good, thinking=True, domain="math"),
        row("b-loop", reasoning=qt.LOOP_THINKING, content="", finish_reason="length", thinking=True, domain="math"),
        row("c-loop-answer", reasoning=qt.MATH_THINKING, content=qt.LOOP_ANSWER, thinking=True, domain="math"),
        row("d-cut", reasoning=qt.MATH_THINKING[:2000], content="", finish_reason="length", thinking=True, domain="code"),
        row("e-empty", reasoning=qt.MATH_THINKING, content="", thinking=True, domain="code"),
        row("f-refusal", reasoning="", content=qt.REFUSALS[0], thinking=False, domain="chat"),
        row("g-french", reasoning="", content=qt.FRENCH_ANSWER, thinking=False, domain="chat"),
        row("h-cannot", reasoning="", content=qt.ANSWER_SAYING_CANNOT, thinking=False, domain="chat"),
        row("i-original", **good, thinking=True, domain="math", messages=msg(PROMPT)),
        row("j-copy", **good, thinking=False, domain="math", messages=msg(PROMPT.upper())),
        row("k-copy-refusal", reasoning="", content=qt.REFUSALS[1], thinking=False, domain="chat",
            messages=msg(PROMPT.replace(".", "!"))),
    ]
    return rows


def validate(s3_client: Any, bucket: str, root: str, quality: QualitySettings | None = None) -> dict[str, Any]:
    rows = dataset_rows()
    planned = [[r["id"] for r in rows[:6]], [r["id"] for r in rows[6:]]]
    uri = write_dataset(s3_client, bucket, root, planned, {0: rows[:6], 1: rows[6:]})
    return run_validation(s3_client, uri, thresholds=LAX, plots=False, quality=quality)


def test_each_signal_is_counted_with_examples_and_never_fails_validation(s3_client: Any, bucket: str) -> None:
    r = validate(s3_client, bucket, "ds/quality", QualitySettings(languages=("en",)))
    assert r["status"] == "passed" and r["problems"] == []
    q = r["quality"]
    assert q["rows"] == 11
    flagged = {name: [e["id"] for e in f["examples"]] for name, f in q["flags"].items()}
    assert flagged == {
        "loop_reasoning": ["b-loop"],
        "loop_answer": ["c-loop-answer"],
        "truncated_thinking": ["b-loop", "d-cut"],
        "empty_answer": ["e-empty"],
        "refusal": ["f-refusal", "k-copy-refusal"],
        "near_duplicate": ["j-copy", "k-copy-refusal"],
        "language": ["g-french"],
    }
    assert {name: f["rows"] for name, f in q["flags"].items()} == {k: len(v) for k, v in flagged.items()}
    # union: b, c, d, e, f, g, j, k
    assert q["rows_flagged"] == 8 and q["rows_flagged_share"] == round(8 / 11, 4)
    ref = q["flags"]["refusal"]
    assert ref["by_thinking"] == {"false": {"rows": 2, "share": 0.4}}  # f, g, h, j, k are thinking-off
    assert ref["by_domain"] == {"chat": {"rows": 2, "share": round(2 / 4, 4)}}
    assert q["flags"]["truncated_thinking"]["by_domain"] == {"math": {"rows": 1, "share": 0.2},
                                                            "code": {"rows": 1, "share": 0.5}}
    nd = q["flags"]["near_duplicate"]
    assert nd["by_thinking"] == {"false": {"rows": 2, "share": 0.4}}
    assert nd["by_domain"] == {"math": {"rows": 1, "share": 0.2}, "chat": {"rows": 1, "share": 0.25}}
    assert nd["examples"][0]["excerpt"] == "duplicate of i-original (similarity 1.0)"
    assert "Wait, maybe I made a mistake" in q["flags"]["loop_reasoning"]["examples"][0]["excerpt"]
    assert q["flags"]["refusal"]["examples"][0]["excerpt"].startswith("I'm sorry, but I can't")
    assert q["flags"]["language"]["examples"][0]["excerpt"].startswith("[fr ")
    assert q["languages"]["en"] >= 5 and q["languages"]["fr"] == 1
    assert q["settings"]["languages"] == ["en"]
    # the near-duplicates file: in id order, read by tokenize
    key = r["files"]["near_duplicates"]
    assert key == "ds/quality/quality/near_duplicates.parquet" and q["near_duplicates"]["key"] == key
    table = pq.read_table(io.BytesIO(get(s3_client, bucket, key)))
    assert table.column("id").to_pylist() == ["j-copy", "k-copy-refusal"]
    assert table.column("duplicate_of").to_pylist() == ["i-original", "i-original"]
    md = get(s3_client, bucket, "ds/quality/report.md").decode()
    assert "## quality signals" in md and "| refusal | 2 |" in md and "f-refusal" in md
    stored = json.loads(get(s3_client, bucket, "ds/quality/report.json"))
    assert stored["quality"]["flags"]["loop_answer"]["rows"] == 1


def test_languages_null_counts_languages_but_flags_none(s3_client: Any, bucket: str) -> None:
    q = validate(s3_client, bucket, "ds/quality-default")["quality"]
    assert q["flags"]["language"]["rows"] == 0 and q["languages"]["fr"] == 1
    assert q["flags"]["refusal"]["rows"] == 2  # the answer that says "cannot" is not one


def test_quality_signals_off(s3_client: Any, bucket: str) -> None:
    r = validate(s3_client, bucket, "ds/quality-off", QualitySettings(enabled=False))
    assert r["quality"] == {"disabled": True} and "near_duplicates" not in r["files"]
    assert "Not computed" in get(s3_client, bucket, "ds/quality-off/report.md").decode()


def test_worker_processes_give_the_same_report(s3_client: Any, bucket: str) -> None:
    """quality_workers > 1: each part's signals in a spawned process, merged in part order."""
    settings = QualitySettings(languages=("en",))
    serial = validate(s3_client, bucket, "ds/quality-serial", QualitySettings(languages=("en",), workers=1))["quality"]
    pooled = validate(s3_client, bucket, "ds/quality-pool", QualitySettings(languages=("en",), workers=2))["quality"]
    assert pooled["workers"] == 2 and serial["workers"] == 1 and settings.workers == 1
    for q in (serial, pooled):
        for k in ("seconds", "cpu_seconds", "workers"):
            q.pop(k)
        q["near_duplicates"].pop("seconds")
        q["near_duplicates"].pop("key")
        q["settings"].pop("quality_workers")
    keys = [q.pop("signals_key") for q in (serial, pooled)]
    assert pooled == serial
    # The signals kept as columns: the same table either way, one row per completion, its flags the report's.
    tables = [pq.read_table(io.BytesIO(get(s3_client, bucket, k))) for k in keys]
    assert json.loads(tables[0].schema.metadata[b"dflash.quality_settings"])["languages"] == ["en"]
    assert tables[0].replace_schema_metadata(None).equals(tables[1].replace_schema_metadata(None))
    rows = tables[0].to_pylist()
    assert len(rows) == serial["rows"] and len({(r["id"], r["sample"]) for r in rows}) == len(rows)
    for flag, counted in serial["flags"].items():
        assert sum(flag in r["flags"] for r in rows) == counted["rows"], flag
    assert any(r["duplicate_of"] for r in rows) == (serial["flags"]["near_duplicate"]["rows"] > 0)
