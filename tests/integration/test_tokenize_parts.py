"""The tokenize step against a real S3 protocol server (moto over HTTP): parts, resume, racing workers.

The dataset mixes parts of the oldest shape (messages + the answer + usage, re-encoded and checked)
and all_turns parts with the generate step's newer columns (`sample`, `conversation`, `turns`, the
engine's token ids for sample 0, none for sample 1), and includes error rows, which are always dropped.
"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.config import ConfigError, TokenizeConfig
from dflash_pipeline.dataset.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.dataset.records import PART_SCHEMA, encode_part
from dflash_pipeline.dev.sim.rows import engine_row
from dflash_pipeline.dev.sim.tokens import SimTokenModel
from dflash_pipeline.steps.tokenize import TokenizeFailed, plan, run_assignment, write_report
from dflash_pipeline.steps.tokenize.profiles import profile_keys

OLD_ABSENT = ("sample", "conversation", "original_messages", "turns", "cut_short", "cached_tokens", "prompt_token_ids",
              "output_token_ids")
"""Columns a part written before multi-turn regeneration and engine ids does not have."""

PARTS = 5
ROWS = 12


def _old_rows(tm: SimTokenModel, c: int) -> list[dict[str, Any]]:
    """Parts written before conversation/turns/ids existed: messages + the answer + usage."""
    rows = []
    for i in range(ROWS):
        pid = f"p{c}-{i}"
        if i == 5:
            rows.append({"id": pid, "messages": [{"role": "user", "content": "x"}], "error_class": "ContextLength",
                         "error_message": "too long", "chunk": c})
            continue
        r = engine_row(tm, [{"role": "user", "content": f"Explain item {i} of part {c}, please."}],
                       [(f"The user wants item {i}.\nI should be brief.", f"Item {i}: done.")], thinking=True,
                       max_tokens=8 if i == 7 else None, ids=False, row_id=pid, chunk=c)
        rows.append({k: r[k] for k in ("id", "messages", "reasoning", "content", "finish_reason", "prompt_tokens",
                                       "completion_tokens", "chunk")})
    return rows


def _new_rows(tm: SimTokenModel, c: int) -> list[dict[str, Any]]:
    """regenerate=all_turns rows, two samples each: sample 0 from an engine that returns ids, 1 without."""
    rows = []
    for i in range(ROWS // 2):
        for sample in (0, 1):
            messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": f"First question {i}?"},
                        {"role": "assistant", "content": "old"}, {"role": "user", "content": "And then?"}]
            answers = [(f"think {i} a", f"First answer {i}/{sample}."), (f"think {i} b", f"Second answer {i}/{sample}.")]
            rows.append(engine_row(tm, messages, answers, thinking=True, ids=sample == 0, row_id=f"p{c}-{i}",
                                   sample=sample, chunk=c))
    return rows


def _write_dataset(client: Any, bucket: str, root: str, tokenizer: str) -> DatasetLayout:
    layout = DatasetLayout(bucket, root)
    manifest = {"format": "dflash-pipeline/manifest/1", "plan_id": "p1",
                "pinned": {"sampling": {"enable_thinking": True}}, "chunks": {"sizes": [ROWS] * PARTS}}
    client.put_object(Bucket=bucket, Key=layout.manifest_key, Body=json.dumps(manifest).encode())
    report = {"status": "passed", "completions": 1, "token_recount": {"tokenizer": tokenizer}}
    client.put_object(Bucket=bucket, Key=layout.report_key, Body=json.dumps(report).encode())
    tm = SimTokenModel(tokenizer)
    for c in range(PARTS):
        if c % 2 == 0:
            old_schema = pa.schema([f for f in PART_SCHEMA if f.name not in OLD_ABSENT])
            table = pa.Table.from_pylist([{k: r.get(k) for k in old_schema.names} for r in _old_rows(tm, c)],
                                         schema=old_schema)
            buf = io.BytesIO()
            pq.write_table(table, buf)
            body = buf.getvalue()
        else:
            body = encode_part(_new_rows(tm, c))
        client.put_object(Bucket=bucket, Key=layout.part_key(c), Body=body)
    return layout


def _objects(client: Any, bucket: str, prefix: str) -> dict[str, tuple[str, Any]]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = (o["ETag"], o["LastModified"])
    return out


def _outputs(client: Any, bucket: str, layout: DatasetLayout) -> dict[str, tuple[str, Any]]:
    return {**_objects(client, bucket, layout.tokenized_prefix),
            **_objects(client, bucket, layout.dataset_card_key)}


def _read_tokenized(client: Any, bucket: str, layout: DatasetLayout) -> pa.Table:
    tables = []
    for c in range(PARTS):
        body = client.get_object(Bucket=bucket, Key=layout.key(profile_keys("parquet", c)["rows"]))["Body"].read()
        tables.append(pq.read_table(io.BytesIO(body)))
    return pa.concat_tables(tables)


@pytest.fixture
def dataset(s3_client: Any, bucket: str, qwen_tokenizer: Path) -> DatasetLayout:
    return _write_dataset(s3_client, bucket, "ds/tok", str(qwen_tokenizer))


def test_parts_report_and_export(s3_client: Any, bucket: str, dataset: DatasetLayout, qwen_tokenizer: Path) -> None:
    from tokenizers import Tokenizer

    cfg = TokenizeConfig(min_loss_tokens=1, workers=3)
    planned = plan(s3_client, [dataset.uri], cfg)
    assert [sorted(j["parts"]) for a in planned["assignments"] for j in a["jobs"]] == [[0, 3], [1, 4], [2]]
    assert planned["datasets"][0]["settings"]["tokenizer"] == str(qwen_tokenizer)  # validation's tokenizer
    for a in planned["assignments"]:
        assert run_assignment(s3_client, a)["written"] == len(a["jobs"][0]["parts"])
    report = write_report(s3_client, planned["datasets"][0])

    table = _read_tokenized(s3_client, bucket, dataset)
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("loss_mask").type == pa.list_(pa.int8())
    old_rows, new_rows = 3 * (ROWS - 2), 2 * ROWS
    # one training row per regenerated turn: old rows 1, all_turns rows 2 (the "old" answer is replaced); an old
    # part's row 7, cut at max_tokens 8 inside its thinking, is dropped by the default drop_quality
    assert table.num_rows == old_rows + 2 * new_rows == report["rows_out"]
    assert report["rows_in"] == PARTS * ROWS
    assert report["dropped_by_reason"] == {"error_row": 3, "quality:truncated_thinking": 3}
    assert report["ids_source"] == {"engine": new_rows, "retokenized": old_rows + new_rows}
    assert report["rows_with_engine_ids"] == new_rows // 2 and report["unverified"] == 0
    assert report["tokens"] == sum(table.column("num_tokens").to_pylist())
    assert report["loss_tokens"] == sum(table.column("num_loss_tokens").to_pylist())
    # every conversation with a regenerated turn, the dropped ones too
    assert report["turns"]["conversations_by_assistant_turns"] == {"1": 3 * (ROWS - 1), "2": new_rows}
    assert report["turns"]["trained_turns"] == old_rows + 2 * new_rows and report["status"] == "complete"
    keys = table.column("key").to_pylist()
    assert len(set(keys)) == table.num_rows and "p1-0#sample=1#turn=1" in keys  # exactly once per (id, sample, turn)
    tok = Tokenizer.from_file(str(qwen_tokenizer / "tokenizer.json"))
    for ids, mask, n, k, fr in zip(*(table.column(c).to_pylist()
                                     for c in ("input_ids", "loss_mask", "num_tokens", "num_loss_tokens", "finish_reason"))):
        assert len(ids) == len(mask) == n and sum(mask) == k
        first = mask.index(1)
        assert all(mask[first:])  # one trained run: the generated turn, at the end
        trained = tok.decode(ids[first:], skip_special_tokens=False)
        assert trained.startswith("<think>\n") and "<|im_start|>" not in trained
        assert trained.endswith("<|im_end|>\n") == (fr == "stop")

    conv_key = dataset.key(profile_keys("specforge", 1)["conversations"])
    body = s3_client.get_object(Bucket=bucket, Key=conv_key)["Body"].read().decode()
    recs = [json.loads(line) for line in body.splitlines()]
    assert [r["id"] for r in recs[:2]] == ["p1-0#turn=0", "p1-0#turn=1"]
    assert all(r["status"] == "success" for r in recs)
    last = recs[0]["conversations"][-1]  # texts as the engine's parser returned them (vLLM keeps the newlines)
    assert (last["role"], last["content"].strip(), last["reasoning_content"].strip()) == (
        "assistant", "First answer 0/0.", "think 0 a")
    assert recs[1]["conversations"][2] == {"role": "assistant", "content": last["content"]}  # as the request carried it
    assert {p: v["rows"] for p, v in report["profiles"].items()} == {p: report["rows_out"] for p in
                                                                     ("parquet", "specforge", "speculators")}
    conv = report["profiles"]["specforge"]["specforge_conversations"]
    assert conv["rows"] + sum(conv["skipped"].values()) == report["rows_out"]
    for files in report["files"].values():  # every profile's files, one per part
        for glob in files.values():
            folder = glob.rsplit("/", 1)[0] + "/"
            assert len([k for k in _objects(s3_client, bucket, folder) if chunk_of_key(k, folder) is not None]) == PARTS
    card = s3_client.get_object(Bucket=bucket, Key=dataset.dataset_card_key)["Body"].read().decode()
    assert card.startswith("---\nconfigs:") and "tokenizer.json sha256" in card
    settings = json.loads(s3_client.get_object(Bucket=bucket, Key=dataset.tokenized_settings_key)["Body"].read())
    assert settings["provenance"]["tokenizer"]["tokenizer_json_sha256"] and settings["specforge_template"] == "qwen3-thinking"
    # a mixed run's thinking-off rows take SpecForge's thinking-off template (docs/tokenize.md)
    assert settings["specforge_templates"] == report["specforge_templates"] == {"on": "qwen3-thinking",
                                                                                "off": "qwen3-instruct"}
    assert report["provenance"] == settings["provenance"] and settings["provenance"]["tokenizer"]["tokenizer_json_sha256"] in card
    md = s3_client.get_object(Bucket=bucket, Key=dataset.tokenized_report_md_key)["Body"].read().decode()
    assert f"| total tokens | {report['tokens']:,} |" in md


def test_rerun_writes_nothing_and_settings_are_pinned(s3_client: Any, bucket: str, dataset: DatasetLayout) -> None:
    cfg = TokenizeConfig(min_loss_tokens=1, workers=2)
    first = plan(s3_client, [dataset.uri], cfg)
    for a in first["assignments"]:
        run_assignment(s3_client, a)
    before = _outputs(s3_client, bucket, dataset)
    again = plan(s3_client, [dataset.uri], cfg)
    assert all(a["jobs"] == [] for a in again["assignments"]) and again["datasets"][0]["already_done"] == PARTS
    # even told to do every part again, a worker finds them on S3 and writes nothing
    forced = {"worker": 0, "jobs": [dict(first["assignments"][0]["jobs"][0], parts=list(range(PARTS)))]}
    summary = run_assignment(s3_client, forced)
    assert (summary["written"], summary["present"], summary["lost_race"]) == (0, PARTS, 0)
    assert _outputs(s3_client, bucket, dataset) == before
    with pytest.raises(ConfigError, match=r"tokenization 'default' .* other settings.*max_length.*Its files stay as "
                                          r"they are.*tokenization='s-[0-9a-f]{8}' \(free: tokenized/s-[0-9a-f]{8}/\)"):
        plan(s3_client, [dataset.uri], TokenizeConfig(min_loss_tokens=1, workers=2, max_length=8192,
                                                      tokenization="default"))
    assert _outputs(s3_client, bucket, dataset) == before


def test_other_settings_make_a_named_tokenization_beside_the_first(s3_client: Any, bucket: str,
                                                                   dataset: DatasetLayout) -> None:
    """Tokenizing again with other settings never touches the first tokenization: a name asked for (or, with
    none, one derived from the settings) gets its own folder; the same name and settings resume; the card
    lists both and says which one its configs are."""
    def run(cfg: TokenizeConfig) -> dict[str, Any]:
        planned = plan(s3_client, [dataset.uri], cfg)
        for a in planned["assignments"]:
            run_assignment(s3_client, a)
        return write_report(s3_client, planned["datasets"][0])

    # drop_quality=(): this test is about the folders and row counts of two tokenizations, not quality drops.
    first = run(TokenizeConfig(min_loss_tokens=1, workers=2, drop_quality=()))
    assert first["tokenization"] == "default" and first["tokenized_prefix"] == dataset.tokenized_prefix
    default_files = _objects(s3_client, bucket, dataset.tokenized_prefix)

    last = run(TokenizeConfig(min_loss_tokens=1, workers=2, drop_quality=(), train_turns="last", tokenization="last"))
    named = dataset.tokenized_as("last")
    assert last["tokenization"] == "last" and last["tokenized_prefix"] == f"{dataset.root}/tokenized/last/"
    old_rows, new_rows = 3 * (ROWS - 1), 2 * ROWS
    assert (first["rows_out"], last["rows_out"]) == (old_rows + 2 * new_rows, old_rows + new_rows)
    assert _objects(s3_client, bucket, dataset.tokenized_prefix + "parquet/") == {
        k: v for k, v in default_files.items() if k.startswith(dataset.tokenized_prefix + "parquet/")}  # untouched
    rows = pa.concat_tables(pq.read_table(io.BytesIO(s3_client.get_object(
        Bucket=bucket, Key=named.key(profile_keys("parquet", c)["rows"]))["Body"].read())) for c in range(PARTS))
    assert set(rows.column("turn").to_pylist()) == {0, 1} and rows.num_rows == last["rows_out"]
    settings = json.loads(s3_client.get_object(Bucket=bucket, Key=named.tokenized_settings_key)["Body"].read())
    assert (settings["tokenization"], settings["tokenized_dir"], settings["train_turns"]) == ("last", "tokenized/last", "last")
    card = s3_client.get_object(Bucket=bucket, Key=dataset.dataset_card_key)["Body"].read().decode()
    assert "path: tokenized/last/parquet/part-*.parquet" in card and "## Tokenizations" in card
    assert "| `default` | `tokenized/` |" in card and "| `last` | `tokenized/last/` |" in card
    assert "This card's configs and paths are tokenization `last`" in card

    # the same name and settings resume (nothing to do); other settings under that name are refused
    again = plan(s3_client, [dataset.uri], TokenizeConfig(min_loss_tokens=1, workers=2, drop_quality=(), train_turns="last", tokenization="last"))
    assert again["datasets"][0]["already_done"] == PARTS and all(a["jobs"] == [] for a in again["assignments"])
    with pytest.raises(ConfigError, match=r"tokenization 'last' .*other settings.*max_length.*tokenization='s-"):
        plan(s3_client, [dataset.uri], TokenizeConfig(min_loss_tokens=1, workers=2, drop_quality=(), train_turns="last", max_length=128,
                                                      tokenization="last"))
    # no name: the tokenization made with these settings is found and resumed; new settings get a new name
    found = plan(s3_client, [dataset.uri], TokenizeConfig(min_loss_tokens=1, workers=2, drop_quality=(), train_turns="last"))
    assert found["datasets"][0]["tokenization"] == "last" and found["datasets"][0]["already_done"] == PARTS
    third = run(TokenizeConfig(min_loss_tokens=1, workers=2, drop_quality=(), max_length=128))
    assert third["tokenization"].startswith("s-") and third["status"] == "complete"
    listed = _objects(s3_client, bucket, dataset.tokenized_prefix)
    assert len([k for k in listed if k.endswith("settings.json")]) == 3
    with pytest.raises(ConfigError, match="name of a folder of the default tokenization"):
        TokenizeConfig.from_params({"tokenization": "parquet"})


def test_two_workers_racing_on_the_same_parts_write_each_once(s3_client: Any, bucket: str, dataset: DatasetLayout) -> None:
    planned = plan(s3_client, [dataset.uri], TokenizeConfig(min_loss_tokens=1, workers=1))
    (assignment,) = planned["assignments"]
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work() -> None:
        try:
            barrier.wait()
            results.append(run_assignment(s3_client, assignment))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sum(r["written"] for r in results) == PARTS, results
    assert sum(r["written"] + r["present"] + r["lost_race"] for r in results) == 2 * PARTS
    parts = [k for k in _objects(s3_client, bucket, dataset.tokenized_prefix) if k.endswith(".parquet")]
    assert len(parts) == PARTS
    assert len(list(_objects(s3_client, bucket, dataset.tokenized_stats_prefix))) == PARTS
    report = write_report(s3_client, planned["datasets"][0])
    table = _read_tokenized(s3_client, bucket, dataset)
    assert report["rows_out"] == table.num_rows == 3 * (ROWS - 2) + 4 * ROWS  # error rows and truncated thinking out


def test_a_missing_part_fails_the_report(s3_client: Any, bucket: str, dataset: DatasetLayout) -> None:
    planned = plan(s3_client, [dataset.uri], TokenizeConfig(min_loss_tokens=1, workers=2))
    run_assignment(s3_client, planned["assignments"][0])  # worker 1 never ran
    with pytest.raises(TokenizeFailed, match="not tokenized"):
        write_report(s3_client, planned["datasets"][0])
    report = json.loads(s3_client.get_object(Bucket=bucket, Key=dataset.tokenized_report_key)["Body"].read())
    assert report["status"] == "incomplete" and report["missing_parts"] == [1, 3]


def test_tokenizer_from_s3_gives_the_same_shards(s3_client: Any, bucket: str, dataset: DatasetLayout,
                                                 qwen_tokenizer: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        s3_client.put_object(Bucket=bucket, Key=f"models/qwen/{name}", Body=(qwen_tokenizer / name).read_bytes())
    other = _write_dataset(s3_client, bucket, "ds/tok-s3", str(qwen_tokenizer))
    for layout, spec in ((dataset, None), (other, f"s3://{bucket}/models/qwen")):
        planned = plan(s3_client, [layout.uri], TokenizeConfig(min_loss_tokens=1, workers=1, tokenizer=spec))
        run_assignment(s3_client, planned["assignments"][0])
        write_report(s3_client, planned["datasets"][0])
    local, remote = (_read_tokenized(s3_client, bucket, lay) for lay in (dataset, other))
    assert local.equals(remote)
    settings = json.loads(s3_client.get_object(Bucket=bucket, Key=other.tokenized_settings_key)["Body"].read())
    assert settings["tokenizer"] == f"s3://{bucket}/models/qwen"


def test_the_generate_runs_tokenizer_from_the_manifest_and_an_explicit_one_wins(
        s3_client: Any, bucket: str, qwen_tokenizer: Path, tmp_path: Path) -> None:
    """Without the tokenizer param, tokenize takes the one plan checked and recorded in the manifest (not the
    report's); an explicit param wins and is what the settings record; a tokenizer file replaced since plan is
    refused."""
    from dflash_pipeline.dataset.tokenizer_source import check_tokenizer_spec

    for name in ("tokenizer.json", "tokenizer_config.json"):
        s3_client.put_object(Bucket=bucket, Key=f"models/gen/{name}", Body=(qwen_tokenizer / name).read_bytes())
    layout = _write_dataset(s3_client, bucket, "ds/tok-manifest", str(qwen_tokenizer))
    report = {"status": "passed", "completions": 1, "token_recount": {"tokenizer": "/nonexistent/report-tokenizer"}}
    s3_client.put_object(Bucket=bucket, Key=layout.report_key, Body=json.dumps(report).encode())
    manifest = json.loads(s3_client.get_object(Bucket=bucket, Key=layout.manifest_key)["Body"].read())
    manifest["tokenizer"] = check_tokenizer_spec(f"s3://{bucket}/models/gen", s3_client)
    s3_client.put_object(Bucket=bucket, Key=layout.manifest_key, Body=json.dumps(manifest).encode())

    planned = plan(s3_client, [layout.uri], TokenizeConfig(min_loss_tokens=1, workers=1))
    assert planned["datasets"][0]["settings"]["tokenizer"] == f"s3://{bucket}/models/gen"
    explicit = plan(s3_client, [layout.uri], TokenizeConfig(min_loss_tokens=1, workers=1, tokenizer=str(qwen_tokenizer),
                                                            tokenization="explicit"))
    assert explicit["datasets"][0]["settings"]["tokenizer"] == str(qwen_tokenizer)
    doc = json.loads(s3_client.get_object(Bucket=bucket, Key=layout.tokenized_as("explicit").tokenized_settings_key)
                     ["Body"].read())
    assert doc["tokenizer"] == str(qwen_tokenizer) and doc["provenance"]["tokenizer"]["source"] == str(qwen_tokenizer)

    other = json.loads((qwen_tokenizer / "tokenizer.json").read_text())
    other["added_tokens"] = other["added_tokens"][:-1]
    s3_client.put_object(Bucket=bucket, Key="models/gen/tokenizer.json", Body=json.dumps(other).encode())
    with pytest.raises(ConfigError, match=rf"tokenizer 's3://{bucket}/models/gen' changed since the generate run was "
                                          r"planned.*give the tokenizer param"):
        plan(s3_client, [layout.uri], TokenizeConfig(min_loss_tokens=1, workers=1, tokenization="again"))
