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


TIMING = ("elapsed_s", "validated_at", "digests")


def _comparable(report: dict[str, Any]) -> dict[str, Any]:
    """A report without what differs between two validations of the same data: timings and how the digests
    were had."""
    out = {k: v for k, v in report.items() if k not in TIMING}
    q = dict(out["quality"])
    q.pop("seconds")
    q["near_duplicates"] = {k: v for k, v in q["near_duplicates"].items() if k not in ("seconds", "computed")}
    out["quality"] = q
    return out


def test_merged_digests_equal_the_batch_pass_after_a_worker_killed_between_part_and_digest(
        s3_client: Any, bucket: str) -> None:
    """Issue 40: the generate worker's hook writes part 0's digest; it is killed before part 1's. Validation
    merges part 0's digest and computes part 1's; the report and signals.parquet equal those of the batch
    pass (every digest and the near-duplicates computed at validation), and a third validation, now merging
    two stored digests, gives them again."""
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.steps.quality.live import limits_from
    from dflash_pipeline.steps.validate.partwatch import PartWatcher
    from dflash_pipeline.steps.validate.run import digest_context, read_manifest

    settings = QualitySettings(languages=("en",))
    rows = dataset_rows()
    planned = [[r["id"] for r in rows[:6]], [r["id"] for r in rows[6:]]]
    uri = write_dataset(s3_client, bucket, "ds/merge", planned, {0: rows[:6], 1: rows[6:]})
    layout = DatasetLayout.from_uri(uri)
    store = Store(s3_client, bucket)
    ctx = digest_context(read_manifest(store, layout), settings, None, None)
    watcher = PartWatcher(store, layout, ctx, run_id="r1", worker="w0000", limits=limits_from(0.1, 0.005, None),
                          fail_fast=False)
    watcher.committed(0, get(s3_client, bucket, layout.part_key(0)))  # part 1: killed before its digest
    watcher.close(60)
    assert watcher.digests_written == 1
    live = json.loads(get(s3_client, bucket, layout.live_quality_key("r1", "w0000-try1")))
    assert sum(g["completions"] for g in live["groups"]) == 6

    merged = run_validation(s3_client, uri, thresholds=LAX, plots=False, quality=settings)
    assert merged["digests"] == {"stored": 1, "computed": 1, "absent_parts": 0, "computed_because": {"no digest": 1}}
    assert merged["quality"]["near_duplicates"]["computed"] == "at validation"
    signals_merged = get(s3_client, bucket, layout.quality_signals_key)

    for obj in s3_client.list_objects_v2(Bucket=bucket, Prefix="ds/merge/digests/").get("Contents", []):
        s3_client.delete_object(Bucket=bucket, Key=obj["Key"])
    for key in (layout.near_duplicates_key, layout.near_duplicates_meta_key, layout.quality_signals_key):
        s3_client.delete_object(Bucket=bucket, Key=key)
    batch = run_validation(s3_client, uri, thresholds=LAX, plots=False, quality=settings)
    assert batch["digests"]["computed"] == 2 and batch["digests"]["stored"] == 0
    assert _comparable(batch) == _comparable(merged)
    assert get(s3_client, bucket, layout.quality_signals_key) == signals_merged

    again = run_validation(s3_client, uri, thresholds=LAX, plots=False, quality=settings)
    assert again["digests"]["stored"] == 2 and again["quality"]["near_duplicates"]["computed"] == "beside generation"
    assert _comparable(again) == _comparable(merged)
    assert get(s3_client, bucket, layout.quality_signals_key) == signals_merged
    # The signals kept as columns: one row per completion, its flags the report's.
    table = pq.read_table(io.BytesIO(signals_merged))
    assert json.loads(table.schema.metadata[b"dflash.quality_settings"])["languages"] == ["en"]
    got = table.to_pylist()
    q = merged["quality"]
    assert len(got) == q["rows"] and len({(r["id"], r["sample"]) for r in got}) == len(got)
    for flag, counted in q["flags"].items():
        assert sum(flag in r["flags"] for r in got) == counted["rows"], flag
    assert [r["id"] for r in got if r["duplicate_of"]] == ["j-copy", "k-copy-refusal"]


def test_a_digest_of_another_part_is_not_used(s3_client: Any, bucket: str) -> None:
    """A part repaired after its digest was written (other bytes): the stale digest is recomputed."""
    rows = dataset_rows()
    planned = [[r["id"] for r in rows[:6]], [r["id"] for r in rows[6:]]]
    uri = write_dataset(s3_client, bucket, "ds/stale", planned, {0: rows[:6], 1: rows[6:]})
    first = run_validation(s3_client, uri, thresholds=LAX, plots=False)
    assert first["digests"]["computed"] == 2
    from dflash_pipeline.dataset.records import encode_part

    repaired = [dict(r, content="A repaired answer that is long enough to be in English, surely.")
                if r["id"] == "f-refusal" else r for r in rows[:6]]
    s3_client.put_object(Bucket=bucket, Key="ds/stale/completions/part-000000.parquet", Body=encode_part(repaired))
    second = run_validation(s3_client, uri, thresholds=LAX, plots=False)
    assert second["digests"] == {"stored": 1, "computed": 1, "absent_parts": 0,
                                 "computed_because": {"digest of another part or settings": 1}}
    assert second["quality"]["flags"]["refusal"]["rows"] == first["quality"]["flags"]["refusal"]["rows"] - 1


def test_a_retried_task_keeps_the_earlier_tries_live_figures(s3_client: Any, bucket: str) -> None:
    """Issue 40: try 1 of a server's task commits part 0 and is killed; try 2 commits part 1. The run's live
    figures cover both parts (each try writes its own figures: a retry starting from zero must not overwrite
    the parts only the earlier try committed)."""
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.monitor.livequality import merge_groups
    from dflash_pipeline.steps.quality.live import limits_from
    from dflash_pipeline.steps.validate.partwatch import PartWatcher
    from dflash_pipeline.steps.validate.run import digest_context, read_manifest

    rows = dataset_rows()
    planned = [[r["id"] for r in rows[:6]], [r["id"] for r in rows[6:]]]
    uri = write_dataset(s3_client, bucket, "ds/retry-live", planned, {0: rows[:6], 1: rows[6:]})
    layout = DatasetLayout.from_uri(uri)
    store = Store(s3_client, bucket)
    ctx = digest_context(read_manifest(store, layout), QualitySettings(languages=("en",)), None, None)
    for try_number, part in ((1, 0), (2, 1)):
        watcher = PartWatcher(store, layout, ctx, run_id="r1", worker="w0000", try_number=try_number,
                              limits=limits_from(0.1, 0.005, None), fail_fast=False)
        watcher.committed(part, get(s3_client, bucket, layout.part_key(part)))
        watcher.close(60)
    docs = PartWatcher(store, layout, ctx, run_id="r1", worker="w0001", limits=[], fail_fast=False).fleet_docs()
    assert sum(g["completions"] for g in merge_groups(docs)) == len(rows)


def test_the_report_table_never_prints_python_none(s3_client: Any, bucket: str) -> None:
    """Issue 41: figures the servers did not report read as words, not `None`."""
    r = validate(s3_client, bucket, "ds/no-none", QualitySettings(languages=("en",)))
    assert r["cached_prompt_tokens"] is None
    md = get(s3_client, bucket, "ds/no-none/report.md").decode()
    assert "| None |" not in md and "| cached_prompt_tokens | not reported by the servers" in md


def test_parts_committed_while_the_digest_queue_is_full_still_reach_the_live_figures(
        s3_client: Any, bucket: str, monkeypatch: Any) -> None:
    """Issue 40: under load the digest thread fell behind, a full queue dropped parts, and the live figures
    covered fewer completions than were committed (747 of 800 in an end-to-end run). A part the queue cannot
    take is now read back from S3 once the queue is empty."""
    import threading

    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.steps.validate import partwatch
    from dflash_pipeline.steps.validate.run import digest_context, read_manifest

    rows = dataset_rows()
    ids = [r["id"] for r in rows]
    cuts = [0, 4, 8, len(rows)]
    planned = [ids[a:b] for a, b in zip(cuts, cuts[1:])]
    uri = write_dataset(s3_client, bucket, "ds/full-queue", planned,
                        {i: rows[a:b] for i, (a, b) in enumerate(zip(cuts, cuts[1:]))})
    layout = DatasetLayout.from_uri(uri)
    store = Store(s3_client, bucket)
    ctx = digest_context(read_manifest(store, layout), QualitySettings(languages=("en",)), None, None)
    release = threading.Event()
    real = partwatch.digest_of_part

    def slow_first(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)  # the digest thread is busy with the first part while the others are committed
        return real(*args, **kwargs)

    monkeypatch.setattr(partwatch, "QUEUE_PARTS", 1)
    monkeypatch.setattr(partwatch, "digest_of_part", slow_first)
    watcher = partwatch.PartWatcher(store, layout, ctx, run_id="r1", worker="w0000", limits=[], fail_fast=False)
    for part in range(3):
        watcher.committed(part, get(s3_client, bucket, layout.part_key(part)))
    assert watcher._pending, "the third part found the queue full"
    release.set()
    watcher.close(60)
    assert watcher.digests_written == 3 and watcher.dropped == 0
    live = json.loads(get(s3_client, bucket, layout.live_quality_key("r1", "w0000-try1")))
    assert sum(g["completions"] for g in live["groups"]) == len(rows)
