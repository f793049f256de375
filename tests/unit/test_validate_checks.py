"""Every validation check against a dataset built (on moto) to contain exactly that defect.

Datasets are written in the pipeline's own format (manifest, inputs, parts via records.encode_part)
and validated with run_validation(), without Airflow, so each test takes a fraction of a second.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import encode_inputs, encode_part
from dflash_pipeline.steps.validate import LIST_LIMIT, Thresholds, ValidationFailed, run_validation
from dflash_pipeline.steps.validate.histogram import Histogram

LAX = Thresholds(max_error_rate=1.0, max_truncation_rate=1.0, min_coverage=0.0, max_missing_reasoning_rate=1.0)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(pid: str, **kw: Any) -> dict[str, Any]:
    base = {"id": pid, "messages": [{"role": "user", "content": f"question {pid}"}], "reasoning": "let me think",
            "content": "the answer", "finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 5,
            "reasoning_tokens": 3, "server": "gpu0", "latency_s": 0.5, "model": "m", "attempts": 1}
    base.update(kw)
    return base


def error_row(pid: str, cls: str = "ContextLengthExceeded", retryable: bool = False, **kw: Any) -> dict[str, Any]:
    base = {"id": pid, "messages": [{"role": "user", "content": "x"}], "server": "gpu0", "error_class": cls,
            "error_message": "boom", "retryable": retryable, "attempts": 1}
    base.update(kw)
    return base


def write_dataset(
    client: Any, bucket: str, root: str, planned: list[list[str]], parts: dict[int, list[dict[str, Any]]],
    thinking: bool = True, extra_keys: tuple[str, ...] = (),
) -> str:
    """A dataset root: manifest + planned inputs per chunk + the given parts (chunk -> rows)."""
    layout = DatasetLayout(bucket, root)
    plan_id = "p1"
    manifest = {
        "format": "dflash-pipeline/manifest/1", "plan_id": plan_id, "model_resolved": "Qwen/Qwen3-8B",
        "pinned": {"model": None, "sampling": {"enable_thinking": thinking, "max_tokens": 64}},
        "chunks": {"sizes": [len(c) for c in planned]}, "input": {"prompts": sum(map(len, planned))},
    }
    client.put_object(Bucket=bucket, Key=layout.manifest_key, Body=json.dumps(manifest).encode())
    # The plan holds the prompts the parts' rows answer (near-duplicates are found from the plan's prompts).
    asked = {r["id"]: r["messages"] for rows in parts.values() for r in rows if r.get("messages")}
    for c, ids in enumerate(planned):
        body = encode_inputs([{"id": i, "messages": asked.get(i) or [{"role": "user", "content": f"question {i}"}]}
                              for i in ids])
        client.put_object(Bucket=bucket, Key=layout.input_key(plan_id, c), Body=body)
    for c, rows in parts.items():
        client.put_object(Bucket=bucket, Key=layout.part_key(c), Body=encode_part(rows))
    for key in extra_keys:
        client.put_object(Bucket=bucket, Key=f"{root}/{key}", Body=b"x")
    return layout.uri


def get(client: Any, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def lines(client: Any, bucket: str, key: str) -> list[str]:
    return get(client, bucket, key).decode().splitlines()


def test_clean_dataset_report_matches_parts(s3_client: Any, bucket: str) -> None:
    rng = np.random.default_rng(1)
    planned = [[f"c{c}-{i}" for i in range(30)] for c in range(3)]
    parts, cts = {}, []
    for c, ids in enumerate(planned):
        rows = []
        for i, pid in enumerate(ids):
            ct = int(rng.integers(1, 400))
            cts.append(ct)
            rows.append(row(pid, completion_tokens=ct, reasoning_tokens=ct // 2, prompt_tokens=7 + i,
                            server=f"gpu{c % 2}", latency_s=ct / 100))
        parts[c] = rows
    uri = write_dataset(s3_client, bucket, "ds/clean", planned, parts)
    r = run_validation(s3_client, uri)
    assert r["status"] == "passed" and r["problems"] == []
    assert (r["prompts"], r["completions"], r["errors"], r["missing"], r["duplicates"]) == (90, 90, 0, 0, 0)
    assert r["coverage"] == 1.0 and r["error_rate"] == 0.0 and r["truncation_rate"] == 0.0
    assert r["output_tokens"] == sum(cts) and r["reasoning_tokens"] == sum(x // 2 for x in cts)
    st = r["token_stats"]["output_tokens"]
    srt = np.sort(cts)
    for q, key in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        exact = int(srt[int(np.ceil(q * len(srt))) - 1])
        assert abs(st[key] - exact) <= max(1, exact // 200), (key, st[key], exact)
    assert st["max"] == max(cts) and st["total"] == sum(cts) and st["rows"] == 90
    assert r["token_stats"]["prompt_tokens"]["max"] == 7 + 29
    assert set(r["per_server"]) == {"gpu0", "gpu1"}
    g0 = [x for c in (0, 2) for x in parts[c]]
    s0 = r["per_server"]["gpu0"]
    assert (s0["rows"], s0["completions"], s0["errors"]) == (60, 60, 0)
    assert s0["output_tokens"] == sum(x["completion_tokens"] for x in g0)
    assert s0["mean_latency_s"] == pytest.approx(sum(x["latency_s"] for x in g0) / 60, abs=1e-3)
    assert s0["output_tokens_per_request_s"] == pytest.approx(100, abs=0.2)
    # side files exist (empty), plots are valid PNGs, report.json and report.md are written
    for key in ("missing_ids", "duplicate_ids", "unexpected_ids"):
        assert lines(s3_client, bucket, r["files"][key]) == []
    assert len(r["files"]["plots"]) == 4  # lengths, thinking vs answer, throughput, mix
    for key in r["files"]["plots"]:
        assert get(s3_client, bucket, key).startswith(PNG_MAGIC)
    stored = json.loads(get(s3_client, bucket, "ds/clean/report.json"))
    assert stored["output_tokens"] == sum(cts) and stored["status"] == "passed"
    md = get(s3_client, bucket, "ds/clean/report.md").decode()
    assert "| output_tokens |" in md and "PASSED" in md


def test_missing_rows_and_parts_all_listed_in_side_file(s3_client: Any, bucket: str) -> None:
    planned = [[f"a{i}" for i in range(40)], [f"b{i}" for i in range(40)], [f"c{i}" for i in range(40)]]
    parts = {0: [row(p) for p in planned[0][:30]], 2: [row(p) for p in planned[2]]}  # 10 + 40 missing
    uri = write_dataset(s3_client, bucket, "ds/missing", planned, parts)
    with pytest.raises(ValidationFailed) as exc:
        run_validation(s3_client, uri)
    msg = str(exc.value)
    assert "coverage 58.33% (70 of 120 planned prompts have a row) is below min_coverage=100.00%" in msg
    assert "a30" in msg
    r = json.loads(get(s3_client, bucket, "ds/missing/report.json"))
    assert r["missing"] == 50 and r["status"] == "failed" and r["coverage"] == pytest.approx(70 / 120, abs=1e-6)
    assert len(r["missing_ids_sample"]) == LIST_LIMIT
    listed = lines(s3_client, bucket, r["files"]["missing_ids"])
    assert listed == planned[0][30:] + planned[1]
    # the same dataset passes a lower bar
    r2 = run_validation(s3_client, uri, thresholds=Thresholds(min_coverage=0.5))
    assert r2["status"] == "passed" and r2["missing"] == 50


def test_duplicates_unexpected_and_stray_parts_always_fail(s3_client: Any, bucket: str) -> None:
    planned = [["a", "b", "c"], ["d", "e"]]
    parts = {
        0: [row("a"), row("b"), row("b"), row("c"), row("zzz")],  # b twice in its part, zzz never planned
        1: [row("d"), row("e"), row("a")],  # a copy of chunk 0's a
    }
    uri = write_dataset(s3_client, bucket, "ds/dups", planned, parts,
                        extra_keys=("completions/part-000009.parquet", "completions/notes.txt"))
    with pytest.raises(ValidationFailed) as exc:
        run_validation(s3_client, uri, thresholds=LAX)
    msg = str(exc.value)
    assert "2 duplicate row(s)" in msg and "1 row(s) with ids not planned" in msg and "2 part(s) outside the plan" in msg
    r = json.loads(get(s3_client, bucket, "ds/dups/report.json"))
    assert (r["duplicates"], r["unexpected_ids"], r["missing"], r["completions"]) == (2, 1, 0, 5)
    assert sorted(lines(s3_client, bucket, r["files"]["duplicate_ids"])) == ["a", "b"]
    assert lines(s3_client, bucket, r["files"]["unexpected_ids"]) == ["zzz"]
    assert r["stray_parts_count"] == 2


def test_misplaced_row_counts_as_missing_and_unexpected(s3_client: Any, bucket: str) -> None:
    uri = write_dataset(s3_client, bucket, "ds/misplaced", [["a", "b"], ["c"]],
                        {0: [row("a"), row("c")], 1: [row("b")]})
    with pytest.raises(ValidationFailed):
        run_validation(s3_client, uri, thresholds=LAX)
    r = json.loads(get(s3_client, bucket, "ds/misplaced/report.json"))
    assert (r["missing"], r["unexpected_ids"], r["duplicates"]) == (2, 2, 0)


def test_outcome_checks(s3_client: Any, bucket: str) -> None:
    rows = [
        row("ok"),
        row("cut-think", finish_reason="length", content="", reasoning="long long"),
        row("cut-answer", finish_reason="length", content="half an"),
        row("empty", content="  \n "),
        row("tag-content", content="<think>\nthinking leaked</think>\n\nanswer"),
        row("tag-close", content="thinking leaked</think> answer"),
        row("tag-reasoning", reasoning="<think>\nstill tagged"),
        row("no-reasoning", reasoning=None),
        row("no-usage", completion_tokens=None, reasoning_tokens=None),
        row("inline-usage", reasoning_tokens=0),
        error_row("e1"),
        error_row("e2", cls="Timeout", retryable=True),
    ]
    uri = write_dataset(s3_client, bucket, "ds/outcomes", [[r["id"] for r in rows]], {0: rows})
    r = run_validation(s3_client, uri, thresholds=LAX)
    assert r["status"] == "passed"
    assert (r["completions"], r["errors"], r["retryable_errors"]) == (10, 2, 1)
    assert r["errors_by_class"] == {"ContextLengthExceeded": 1, "Timeout": 1}
    assert r["finish_reasons"] == {"stop": 8, "length": 2}
    assert (r["truncated"], r["truncated_in_thinking"], r["truncated_in_answer"]) == (2, 1, 1)
    assert (r["empty_content"], r["empty_content_not_truncated"]) == (2, 1)
    assert r["think_markers_in_content"] == 2 and r["think_markers_in_reasoning"] == 1
    assert r["reasoning_missing"] == 1 and r["reasoning_unexpected"] == 0
    assert r["usage_missing"] == 1
    assert r["reasoning_tokens_unreported"] == 2  # inline-usage (0) and no-usage (null) have reasoning text
    samples = r["defect_ids_sample"]
    assert samples["truncated_in_thinking"] == ["cut-think"]
    assert samples["empty_content_not_truncated"] == ["empty"]
    assert samples["think_markers_in_content"] == ["tag-content", "tag-close"]
    assert samples["think_markers_in_reasoning"] == ["tag-reasoning"]
    assert samples["reasoning_missing"] == ["no-reasoning"]
    assert r["per_server"]["gpu0"]["errors"] == 2 and r["per_server"]["gpu0"]["rows"] == 12


def test_reasoning_unexpected_when_thinking_disabled(s3_client: Any, bucket: str) -> None:
    uri = write_dataset(s3_client, bucket, "ds/nothink", [["a", "b"]], {0: [row("a"), row("b", reasoning=None)]},
                        thinking=False)
    r = run_validation(s3_client, uri, plots=False)
    assert (r["reasoning_unexpected"], r["reasoning_missing"]) == (1, 0)
    assert r["defect_ids_sample"]["reasoning_unexpected"] == ["a"]


@pytest.mark.parametrize(
    ("thresholds", "expected"),
    [
        (Thresholds(max_error_rate=0.01, max_truncation_rate=1.0),
         "error rate 20.00% (2 error rows of 10) is above max_error_rate=1.00%"),
        (Thresholds(max_error_rate=1.0, max_truncation_rate=0.10),
         "truncation rate 37.50% (3 of 8 completions hit max_tokens, 1 of them inside the thinking) "
         "is above max_truncation_rate=10.00%"),
    ],
)
def test_thresholds_fail_with_the_figure(s3_client: Any, bucket: str, thresholds: Thresholds, expected: str) -> None:
    rows = [row(f"r{i}") for i in range(5)] + [row("t1", finish_reason="length", content=""),
                                               row("t2", finish_reason="length"), row("t3", finish_reason="length"),
                                               error_row("e1"), error_row("e2")]
    root = f"ds/thr-{thresholds.max_error_rate}"
    uri = write_dataset(s3_client, bucket, root, [[r["id"] for r in rows]], {0: rows})
    with pytest.raises(ValidationFailed) as exc:
        run_validation(s3_client, uri, thresholds=thresholds, plots=False)
    assert expected in str(exc.value)
    r = json.loads(get(s3_client, bucket, f"{root}/report.json"))
    assert r["status"] == "failed" and expected in r["problems"][0]
    assert [c["ok"] for c in r["checks"]] == [True, thresholds.max_error_rate == 1.0, thresholds.max_error_rate != 1.0,
                                              True]


def test_a_thinking_dataset_without_thinking_fails_naming_the_servers(s3_client: Any, bucket: str) -> None:
    rows = ([row(f"a{i}", server="http://sglang:30000") for i in range(4)]
            + [row(f"b{i}", server="http://vllm-1:8000", reasoning=None) for i in range(3)]
            + [row(f"c{i}", server="http://vllm-2:8000", reasoning=None) for i in range(2)])
    uri = write_dataset(s3_client, bucket, "ds/nothinking", [[r["id"] for r in rows]], {0: rows})
    with pytest.raises(ValidationFailed) as exc:
        run_validation(s3_client, uri, plots=False)
    msg = str(exc.value)
    assert "reasoning missing on 55.56% of completions with thinking enabled (5 of 9" in msg
    assert "http://vllm-1:8000 3, http://vllm-2:8000 2" in msg and "max_missing_reasoning_rate" in msg
    r = json.loads(get(s3_client, bucket, "ds/nothinking/report.json"))
    assert r["per_server"]["http://vllm-1:8000"]["reasoning_missing"] == 3
    assert r["per_server"]["http://sglang:30000"]["reasoning_missing"] == 0
    # Without thinking there is no such check.
    uri = write_dataset(s3_client, bucket, "ds/nothinking-off", [[r["id"] for r in rows]], {0: rows}, thinking=False)
    assert "missing_reasoning_rate" not in [c["name"] for c in run_validation(s3_client, uri, plots=False)["checks"]]


def test_error_rows_without_a_retry_flag_get_one(s3_client: Any, bucket: str) -> None:
    uri = write_dataset(s3_client, bucket, "ds/flag", [["a", "b"]], {0: [row("a"), error_row("b", cls="Timeout", retryable=True)]})
    run_validation(s3_client, uri, thresholds=LAX, plots=False)
    flag = json.loads(get(s3_client, bucket, DatasetLayout(bucket, "ds/flag").retry_key(0)))
    assert (flag["retryable"], flag["permanent"]) == (1, 0)


def test_histogram_is_bounded_and_accurate() -> None:
    rng = np.random.default_rng(7)
    values = rng.lognormal(7.0, 1.2, 300_000).astype(np.int64)
    h = Histogram()
    for chunk in np.array_split(values, 100):
        h.add(chunk)
    assert h.counts.nbytes < 64_000
    srt = np.sort(values)
    for q in (0.5, 0.9, 0.99):
        exact = srt[int(np.ceil(q * len(srt))) - 1]
        assert abs(h.quantile(q) - exact) / exact < 0.005
    assert (h.max, h.total, h.n) == (int(values.max()), int(values.sum()), len(values))
    small = Histogram()
    small.add([3, 1, 2, 2, 200])
    assert (small.quantile(0.5), small.quantile(0.99), small.summary()["mean"]) == (2, 200, 41.6)


def test_rows_with_and_without_engine_ids_and_ids_that_disagree_with_usage(s3_client: Any, bucket: str) -> None:
    turn = {"finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 5, "reasoning_tokens": 3,
            "cached_tokens": None, "latency_s": 0.5}
    rows = [
        row("a", turns=[turn], prompt_token_ids=[list(range(10))], output_token_ids=[list(range(5))]),
        row("b", turns=[turn], prompt_token_ids=[list(range(10))], output_token_ids=[list(range(4))]),  # one short
        row("c", turns=[turn, turn], prompt_token_ids=[None, list(range(10))], output_token_ids=[None, list(range(5))]),
        row("d", turns=[turn]),
        error_row("e"),
    ]
    uri = write_dataset(s3_client, bucket, "ds/ids", [["a", "b", "c", "d", "e"]], {0: rows})
    report = run_validation(s3_client, uri, LAX, plots=False)
    assert report["engine_token_ids"] == {"rows_with": 3, "rows_without": 1, "rows_whose_ids_disagree_with_usage": 1}
    assert report["defect_ids_sample"]["engine_ids_disagree_with_usage"] == ["b"]


def test_validation_after_a_failed_plan_says_plan_did_not_finish(s3_client: Any, bucket: str) -> None:
    """Issue 41: downstream of a failed plan, validation named a missing manifest as if it were the fault."""
    from dflash_pipeline.steps.validate import ValidationFailed

    with pytest.raises(ValidationFailed, match="plan did not finish"):
        run_validation(s3_client, f"s3://{bucket}/ds/never-planned", plots=False)
