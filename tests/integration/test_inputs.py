"""The inputs users have (issue 32), planned against a real S3 protocol server (moto): a prefix of
ShareGPT / OpenAI-with-developer-and-tools / list-content files in JSONL, .jsonl.gz and Parquet, globs,
weighted and labelled lists, every file pinned; the reject budget and the rejects counted by reason.

The fixtures are generated (dflash_pipeline/dev/input_formats.py), a few thousand rows, none committed.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_inputs
from dflash_pipeline.dataset.sources import copies
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.dev.input_formats import jsonl, parquet, rows
from dflash_pipeline.steps.plan import PlanError, load_manifest, run_plan

N = 1200  # rows per file: 4 files, 4,800 conversations


def _conf(bucket: str, prompts_uri: Any, root: str, **extra: Any) -> RunConfig:
    return RunConfig.from_params({"prompts_uri": prompts_uri, "output_uri": f"s3://{bucket}/{root}",
                                  "servers": ["http://127.0.0.1:9"], **extra})


def _upload_formats(s3: Any, bucket: str, prefix: str = "in/") -> dict[str, list[dict[str, Any]]]:
    made = {
        "sharegpt.jsonl": rows("sharegpt", N),
        "openai_tools.jsonl.gz": rows("openai_tools", N),
        "list_content.jsonl": rows("list_content", N),
        "sharegpt.parquet": rows("sharegpt", N, start=N),
    }
    for name, rs in made.items():
        body = parquet(rs) if name.endswith(".parquet") else jsonl(rs, gz=name.endswith(".gz"))
        s3.put_object(Bucket=bucket, Key=prefix + name, Body=body)
    return made


def _planned(s3: Any, bucket: str, root: str) -> list[dict[str, Any]]:
    store = Store(s3, bucket)
    layout = DatasetLayout(bucket, root)
    manifest = load_manifest(store, layout)[0]  # type: ignore[index]
    out = []
    for obj in store.list(manifest["chunks"]["inputs_prefix"]):
        out.extend(decode_inputs(store.get(obj.key)[0]))  # type: ignore[index]
    return out


def test_a_prefix_of_every_format_plans_without_a_reject(s3_client: Any, bucket: str) -> None:
    _upload_formats(s3_client, bucket)
    s3_client.put_object(Bucket=bucket, Key="in/README.md", Body=b"# not prompts")
    s3_client.put_object(Bucket=bucket, Key="in/_SUCCESS", Body=b"")
    strict = {"max_rejects": 0, "max_reject_share": 0.0}
    summary = run_plan(s3_client, _conf(bucket, f"s3://{bucket}/in/", "ds", **strict), "r1")
    assert summary["rejects"] == 0 and summary["rejects_by_reason"] == {}
    assert summary["prompts"] == 4 * N and summary["files"] == 4
    manifest = load_manifest(Store(s3_client, bucket), DatasetLayout(bucket, "ds"))[0]  # type: ignore[index]
    pinned = manifest["pinned"]["input"]["files"]
    assert [f["uri"].rsplit("/", 1)[1] for f in pinned] == [
        "list_content.jsonl", "openai_tools.jsonl.gz", "sharegpt.jsonl", "sharegpt.parquet"]
    heads = {f["uri"]: s3_client.head_object(Bucket=bucket, Key=f["uri"].split("/", 3)[3]) for f in pinned}
    assert all(f["etag"] == heads[f["uri"]]["ETag"] and f["size"] == heads[f["uri"]]["ContentLength"]
               and f["weight"] == 1.0 for f in pinned)
    assert [f["prompts"] for f in manifest["input"]["files"]] == [N] * 4
    assert all(f["sha256"] for f in manifest["input"]["files"])

    planned = _planned(s3_client, bucket, "ds")
    assert len(planned) == 4 * N
    roles = Counter(m["role"] for r in planned for m in r["messages"])
    assert set(roles) == {"system", "user", "assistant", "tool"} and roles["tool"] > 0
    assert not any(m["role"] == "developer" for r in planned for m in r["messages"])
    assert all(r["messages"][-1]["role"] in ("user", "tool") for r in planned)
    calls = [m["content"] for r in planned for m in r["messages"] if "<tool_call>" in m["content"]]
    assert calls and all(c.count("<tool_call>\n{\"name\": \"") == c.count("</tool_call>") for c in calls)
    assert Counter(r["source"] for r in planned)["openai-tools"] == N
    with_tools = [r for r in planned if r["metadata"] and "tools" in json.loads(r["metadata"])]
    assert with_tools, "an extra column (tools) is kept as row metadata"

    # The same conf resumes; a file added under the prefix changes the input: refused.
    again = run_plan(s3_client, _conf(bucket, f"s3://{bucket}/in/", "ds", **strict), "r2")
    assert again["resumed"] and again["plan_id"] == summary["plan_id"]
    s3_client.put_object(Bucket=bucket, Key="in/more.jsonl", Body=b'{"prompt": "late"}\n')
    with pytest.raises(PlanError, match=r"input.files: the input files differ: 1 added \(s3://.*/in/more.jsonl\)"):
        run_plan(s3_client, _conf(bucket, f"s3://{bucket}/in/", "ds", **strict, accept_pin_changes=True), "r3")
    s3_client.put_object(Bucket=bucket, Key="in/sharegpt.jsonl", Body=jsonl(rows("sharegpt", 10)))
    s3_client.delete_object(Bucket=bucket, Key="in/more.jsonl")
    with pytest.raises(PlanError, match=r"1 changed \(s3://.*/in/sharegpt.jsonl\)"):
        run_plan(s3_client, _conf(bucket, f"s3://{bucket}/in/", "ds", **strict), "r4")


def test_globs_and_a_weighted_labelled_list(s3_client: Any, bucket: str) -> None:
    made = _upload_formats(s3_client, bucket)
    s3_client.put_object(Bucket=bucket, Key="in/deeper/extra.jsonl", Body=jsonl(rows("list_content", 50, start=9000)))
    b = f"s3://{bucket}"
    # `*` stays within a segment: in/*.jsonl is the two top-level .jsonl files, not .jsonl.gz or deeper/.
    got = run_plan(s3_client, _conf(bucket, f"{b}/in/*.jsonl", "glob1"), "r1")
    assert got["files"] == 2 and got["prompts"] == 2 * N
    got = run_plan(s3_client, _conf(bucket, f"{b}/in/**.jsonl", "glob2"), "r1")
    assert got["files"] == 3 and got["prompts"] == 2 * N + 50
    with pytest.raises(PlanError, match="no object matches"):
        run_plan(s3_client, _conf(bucket, f"{b}/in/*.csv", "glob3"), "r1")
    with pytest.raises(PlanError, match="is named by both"):
        run_plan(s3_client, _conf(bucket, [f"{b}/in/*.jsonl", f"{b}/in/sharegpt.jsonl"], "glob4"), "r1")

    spec = [{"uri": f"{b}/in/sharegpt.jsonl", "weight": 0.5, "source": "chat"},
            {"uri": f"{b}/in/openai_tools.jsonl.gz", "weight": 1, "source": "ignored-when-row-has-one"},
            {"uri": f"{b}/in/sharegpt.parquet", "weight": 2.5, "source": "pq"}]
    summary = run_plan(s3_client, _conf(bucket, spec, "weighted"), "r1")
    planned = _planned(s3_client, bucket, "weighted")
    by_source = Counter(r["source"] for r in planned if r["sample"] == 0)
    kept_half = [r["id"] for r in made["sharegpt.jsonl"] if copies(r["id"], 0.5) == 1]
    assert by_source["chat"] == len(kept_half) and 0.45 * N < len(kept_half) < 0.55 * N
    assert {r["id"] for r in planned if r["source"] == "chat"} == set(kept_half)
    assert by_source["openai-tools"] == N and "ignored-when-row-has-one" not in by_source
    pq_units = Counter(r["id"] for r in planned if r["source"] == "pq")
    assert set(pq_units.values()) <= {2, 3} and sum(pq_units.values()) == sum(
        copies(r["id"], 2.5) for r in made["sharegpt.parquet"])
    assert 0.4 * N < sum(1 for n in pq_units.values() if n == 3) < 0.6 * N
    assert summary["prompts"] == len(kept_half) + 2 * N
    manifest = load_manifest(Store(s3_client, bucket), DatasetLayout(bucket, "weighted"))[0]  # type: ignore[index]
    assert [(f["weight"], f["source"]) for f in manifest["pinned"]["input"]["files"]] == [
        (0.5, "chat"), (1.0, "ignored-when-row-has-one"), (2.5, "pq")]
    assert manifest["input"]["weighted_out"] == N - len(kept_half)
    # Deterministic: another root plans the very same units; another weight under this root is refused.
    run_plan(s3_client, _conf(bucket, spec, "weighted-again"), "r1")
    key = lambda r: (r["id"], r["sample"])  # noqa: E731
    assert sorted(map(key, _planned(s3_client, bucket, "weighted-again"))) == sorted(map(key, planned))
    with pytest.raises(PlanError, match="input.files"):
        run_plan(s3_client, _conf(bucket, [{**spec[0], "weight": 0.6}, *spec[1:]], "weighted"), "r2")


def test_reject_budget_is_a_share_and_rejects_are_counted_by_reason(s3_client: Any, bucket: str) -> None:
    good = [json.dumps({"prompt": f"question {i}"}) for i in range(1000)]
    bad = ['{"broken', json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
           json.dumps({"messages": [{"role": "narrator", "content": "x"}]}), json.dumps({"text": "?"}),
           json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).replace("}]}]", "}]}], \"id\": 2")]
    s3_client.put_object(Bucket=bucket, Key="p.jsonl", Body="\n".join(good[:500] + bad + good[500:]).encode())
    summary = run_plan(s3_client, _conf(bucket, f"s3://{bucket}/p.jsonl", "ok"), "r1")
    assert summary["prompts"] == 1000 and summary["rejects"] == 5
    assert summary["rejects_by_reason"] == {"malformed_json": 1, "non_text_content": 2, "unknown_role": 1,
                                            "no_conversation": 1}
    manifest = load_manifest(Store(s3_client, bucket), DatasetLayout(bucket, "ok"))[0]  # type: ignore[index]
    assert manifest["input"]["rejects_by_reason"] == summary["rejects_by_reason"]
    assert manifest["input"]["reject_budget"] == 10  # 1% of 1,005 rows read
    assert set(manifest["pinned"]["input"]) == {"uri", "etag", "size", "limit"}, "one key keeps the old pin form"
    lines = [json.loads(x) for x in s3_client.get_object(Bucket=bucket, Key="ok/rejects/rejects.jsonl")["Body"].read().splitlines()]
    assert [(r["line"], r["code"]) for r in lines] == [(501, "malformed_json"), (502, "non_text_content"),
                                                      (503, "unknown_role"), (504, "no_conversation"),
                                                      (505, "non_text_content")]
    with pytest.raises(PlanError, match=r"5 bad row\(s\) of 1005 \(non_text_content 2, .*the budget is 0"):
        run_plan(s3_client, _conf(bucket, f"s3://{bucket}/p.jsonl", "strict", max_reject_share=0.0), "r1")
    assert run_plan(s3_client, _conf(bucket, f"s3://{bucket}/p.jsonl", "abs", max_reject_share=0.0,
                                     max_rejects=5), "r1")["rejects"] == 5


def test_rejects_of_several_files_name_their_file(s3_client: Any, bucket: str) -> None:
    s3_client.put_object(Bucket=bucket, Key="d/a.jsonl", Body=b'{"prompt": "a"}\n{"prompt": 3}\n')
    s3_client.put_object(Bucket=bucket, Key="d/b.jsonl", Body=b'{"prompt": "b"}\n{"messages": []}\n')
    summary = run_plan(s3_client, _conf(bucket, f"s3://{bucket}/d", "ds", max_rejects=2), "r1")
    assert summary["prompts"] == 2 and summary["files"] == 2, "a key that is a folder reads as its prefix"
    lines = [json.loads(x) for x in s3_client.get_object(Bucket=bucket, Key="ds/rejects/rejects.jsonl")["Body"].read().splitlines()]
    assert [(r["file"].rsplit("/", 1)[1], r["line"], r["code"]) for r in lines] == [
        ("a.jsonl", 2, "bad_prompt"), ("b.jsonl", 2, "bad_messages")]


def test_every_format_generates_and_validates_through_the_simulated_fleet(s3_client: Any, bucket: str,
                                                                          sim_fleet: Any) -> None:
    """Tool turns, folded tool calls and former developer turns reach a server over HTTP and come back
    as completion rows carrying their labels; validation finds every planned unit."""
    from dflash_pipeline.dataset.records import decode_part
    from dflash_pipeline.dev.faultlab import run_generation
    from dflash_pipeline.steps.validate import Thresholds, run_validation

    fleet = sim_fleet(2, token_time_s=0.0002, length_scale=0.02)
    for fmt, name in (("sharegpt", "a.jsonl"), ("openai_tools", "b.jsonl.gz"), ("list_content", "c.jsonl")):
        s3_client.put_object(Bucket=bucket, Key=f"in/{name}", Body=jsonl(rows(fmt, 60), gz=name.endswith(".gz")))
    spec = [{"uri": f"s3://{bucket}/in/*.jsonl", "source": "plain"},
            {"uri": f"s3://{bucket}/in/b.jsonl.gz", "weight": 1.5}]
    cfg = RunConfig.from_params({"prompts_uri": spec, "output_uri": f"s3://{bucket}/gen", "servers": fleet.urls,
                                 "max_tokens": 64, "save_every": 20, "max_rejects": 0, "max_reject_share": 0.0})
    outcomes = run_generation(s3_client, cfg, fleet.urls, "run1")
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    planned = _planned(s3_client, bucket, "gen")
    report = run_validation(s3_client, cfg.output_uri, thresholds=Thresholds(max_truncation_rate=1.0))
    assert report["missing"] == 0 and report["errors"] == 0 and report["completions"] == len(planned)
    store = Store(s3_client, bucket)
    done = [r for obj in store.list("gen/completions/")
            for r in decode_part(store.get(obj.key)[0]).to_pylist()]  # type: ignore[index]
    assert len(done) == len(planned) and all(r["error_class"] is None and r["content"] is not None for r in done)
    assert any(m["role"] == "tool" for r in done for m in r["messages"])
    assert Counter(r["source"] for r in done if r["sample"] == 0)["plain"] == 120
    tool_ids = {p["id"] for p in planned if p["source"] == "openai-tools"}
    assert len(tool_ids) == 60
    assert sum(1 for r in done if r["source"] == "openai-tools") == sum(copies(i, 1.5) for i in tool_ids)
