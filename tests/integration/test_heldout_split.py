"""The held-out split and the input's labels, through plan, generate (simulated fleet over HTTP), validation
and tokenize, against a real S3 protocol server (moto).

What is proved: plan keeps held-out conversations out of every chunk input and writes them, readable
back as a prompts_uri, to the key the manifest names; a rerun with another split is refused; no
held-out conversation reaches any shard of any profile, even when one is slipped into the completions
after generation (tokenize's own guard, counted as `heldout`), or named only at tokenize time; every
training row carries its input row's source, domain, metadata and thinking mode.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.config import RunConfig, TokenizeConfig
from dflash_pipeline.dataset.heldout import HeldoutSplit
from dflash_pipeline.dataset.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.dataset.prompts import Prompt, iter_prompt_file
from dflash_pipeline.dataset.records import decode_inputs, decode_part, encode_part
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.dev.faultlab import run_generation
from dflash_pipeline.steps.plan import PlanError, run_plan
from dflash_pipeline.steps.tokenize import plan as tokenize_plan
from dflash_pipeline.steps.tokenize import run_assignment, write_report
from dflash_pipeline.steps.tokenize.profiles import PROFILES, profile_keys
from dflash_pipeline.steps.validate import run_validation

SIM = {"token_time_s": 0.0005, "length_scale": 0.02, "max_running_requests": 8}
DOMAINS = ("math", "code", "chat")


def _row(i: int) -> dict[str, Any]:
    row: dict[str, Any] = {"id": f"p{i:04d}", "prompt": f"Question {i}: what is {i} plus {i + 1}?"}
    if i % 4 != 3:  # every fourth row has no labels at all
        row |= {"source": f"set{i % 2}", "domain": DOMAINS[i % 3], "metadata": {"n": i}, "difficulty": i % 5}
    return row


def _put_prompts(s3: Any, bucket: str, n: int, key: str = "in/prompts.jsonl") -> dict[str, dict[str, Any]]:
    rows = [_row(i) for i in range(n)]
    s3.put_object(Bucket=bucket, Key=key, Body=("\n".join(json.dumps(r) for r in rows) + "\n").encode())
    return {r["id"]: r for r in rows}


def _expected_labels(row: dict[str, Any]) -> tuple[Any, Any, Any]:
    if "domain" not in row:
        return None, None, None
    metadata = {"difficulty": row["difficulty"], **row["metadata"]}  # extra keys join the metadata object
    return row["source"], row["domain"], json.dumps(metadata, sort_keys=True, separators=(",", ":"))


def _get(s3: Any, bucket: str, key: str) -> bytes:
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def _units_planned(s3: Any, bucket: str, layout: DatasetLayout, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for c in range(len(manifest["chunks"]["sizes"])):
        out += decode_inputs(_get(s3, bucket, layout.input_key(manifest["plan_id"], c)))
    return out


def test_plan_writes_the_heldout_prompts_and_pins_the_split(s3_client: Any, bucket: str) -> None:
    rows = _put_prompts(s3_client, bucket, 400)
    s3_client.put_object(Bucket=bucket, Key="in/bench.txt", Body=b"p0005\np0010\nnot-in-the-input\n")
    params = {"prompts_uri": f"s3://{bucket}/in/prompts.jsonl", "output_uri": f"s3://{bucket}/ds",
              "servers": ["http://127.0.0.1:9"], "save_every": 40, "samples_per_prompt": 2,
              "heldout_fraction": 0.1, "heldout_uri": f"s3://{bucket}/in/bench.txt"}
    cfg = RunConfig.from_params(params)
    summary = run_plan(s3_client, cfg, "r1")
    layout = DatasetLayout.from_uri(cfg.output_uri)
    manifest = json.loads(_get(s3_client, bucket, layout.manifest_key))

    split = HeldoutSplit(0.1, ids=frozenset({"p0005", "p0010"}))
    held = {pid for pid in rows if split.holds(pid)}
    assert {"p0005", "p0010"} <= held and 20 < len(held) < 70, len(held)
    entry = manifest["heldout"]
    assert entry["fraction"] == 0.1 and entry["salt"] == "dflash-heldout" and entry["count"] == len(held)
    assert entry["key"] == layout.heldout_prompts_key == "ds/heldout/prompts.jsonl.gz"
    assert entry["heldout_uri"] == f"s3://{bucket}/in/bench.txt"
    assert entry["named_ids"] == 3 and entry["named_not_found"] == 1
    assert summary["heldout"] == len(held) and summary["prompts"] == 400 - len(held)

    units = _units_planned(s3_client, bucket, layout, manifest)
    per_id = Counter(u["id"] for u in units)
    assert not set(per_id) & held, "a held-out prompt was planned for generation"
    assert set(per_id) == set(rows) - held and set(per_id.values()) == {2}, "every sample of an id goes one way"
    for u in units:  # the labels are in the chunk inputs
        assert (u["source"], u["domain"], u["metadata"]) == _expected_labels(rows[u["id"]])

    # The held-out file is a prompts_uri: the prompt reader gives back the held-out prompts with their labels.
    back = [p for p in iter_prompt_file(io.BytesIO(_get(s3_client, bucket, entry["key"])), entry["key"])]
    assert all(isinstance(p, Prompt) for p in back)
    assert {p.id for p in back} == held  # type: ignore[union-attr]
    for p in back:
        assert (p.source, p.domain) == _expected_labels(rows[p.id])[:2]  # type: ignore[union-attr]

    # The same split resumes; another one is refused, even with accept_pin_changes.
    assert run_plan(s3_client, cfg, "r2")["resumed"] is True
    for change in ({"heldout_fraction": 0.2}, {"heldout_salt": "other"}, {"heldout_fraction": 0.0, "heldout_uri": None},
                   {"heldout_uri": None}):
        with pytest.raises(PlanError, match="input.heldout"):
            run_plan(s3_client, RunConfig.from_params({**params, **change, "accept_pin_changes": True}), "r3")
    s3_client.put_object(Bucket=bucket, Key="in/bench.txt", Body=b"p0005\n")  # the named file replaced
    with pytest.raises(PlanError, match="input.heldout.etag"):
        run_plan(s3_client, cfg, "r4")

    # A plan of another split that finds this root's held-out file (its manifest not yet written: a race,
    # or a plan that stopped before its manifest) refuses to replace it.
    s3_client.delete_object(Bucket=bucket, Key=layout.manifest_key)
    with pytest.raises(PlanError, match="already holds other held-out prompts"):
        run_plan(s3_client, RunConfig.from_params({**params, "heldout_fraction": 0.3, "heldout_uri": None}), "r6")
    assert [p.id for p in iter_prompt_file(io.BytesIO(_get(s3_client, bucket, entry["key"])), entry["key"])] == \
        [p.id for p in back]  # type: ignore[union-attr]

    # A root planned before the split existed keeps matching a run without one (the pin is left out).
    plain = RunConfig.from_params({**params, "output_uri": f"s3://{bucket}/plain", "heldout_fraction": 0.0,
                                   "heldout_uri": None})
    run_plan(s3_client, plain, "r5")
    m2 = json.loads(_get(s3_client, bucket, "plain/manifest.json"))
    assert m2["heldout"] is None and "heldout" not in m2["pinned"]["input"]
    assert sum(m2["chunks"]["sizes"]) == 800


def _shard_units(s3: Any, bucket: str, layout: DatasetLayout) -> dict[str, set[str]]:
    """The conversation (id) of every row of every shard, per profile file kind."""
    seen: dict[str, set[str]] = {}
    store = Store(s3, bucket)
    for obj in store.list(layout.tokenized_prefix):
        if obj.key.startswith(layout.tokenized_stats_prefix) or not obj.key.split("/")[-1].startswith("part-"):
            continue
        folder = obj.key[len(layout.tokenized_prefix):].split("/")[0]
        body = store.get(obj.key)[0]
        if obj.key.endswith(".parquet"):
            ids = set(pq.read_table(io.BytesIO(body)).column("id").to_pylist())
        else:
            recs = [json.loads(x) for x in body.splitlines()]
            field = {"specforge": "id", "specforge-conversations": "source_id", "speculators": "primary_id"}[folder]
            ids = {r[field].split("#")[0] for r in recs}
        seen.setdefault(folder, set()).update(ids)
    return seen


@pytest.mark.timeout(180)
def test_no_heldout_conversation_reaches_any_shard(s3_client: Any, bucket: str, sim_fleet: Any,
                                                   qwen_tokenizer: Path) -> None:
    rows = _put_prompts(s3_client, bucket, 120)
    fleet = sim_fleet(engines=["vllm", "sglang"], tokenizer_dir=str(qwen_tokenizer), **SIM)
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/in/prompts.jsonl", "output_uri": f"s3://{bucket}/ds",
                                 "servers": fleet.urls, "save_every": 16, "samples_per_prompt": 2, "max_tokens": 256,
                                 "heldout_fraction": 0.25, "seed": 3})
    out = run_generation(s3_client, cfg, fleet.urls, "run1")
    assert not any(isinstance(o, BaseException) for o in out), out
    layout = DatasetLayout.from_uri(cfg.output_uri)
    manifest = json.loads(_get(s3_client, bucket, layout.manifest_key))
    held = {pid for pid in rows if HeldoutSplit(0.25).holds(pid)}
    assert manifest["heldout"]["count"] == len(held) > 10

    # Completions carry the labels and the thinking mode; validation counts rows by them and names the split.
    store = Store(s3_client, bucket)
    parts = [o.key for o in store.list(layout.completions_prefix) if chunk_of_key(o.key, layout.completions_prefix) is not None]
    completions = [r for k in parts for r in decode_part(store.get(k)[0]).to_pylist()]
    assert len(completions) == 2 * (120 - len(held)) and not {r["id"] for r in completions} & held
    for r in completions:
        assert (r["source"], r["domain"], r["metadata"]) == _expected_labels(rows[r["id"]])
        assert r["thinking"] is True
    report = run_validation(s3_client, cfg.output_uri, plots=False)
    want_domains = Counter(rows[r["id"]].get("domain", "unknown") for r in completions)
    assert {k: v["rows"] for k, v in report["rows_by_label"]["by_domain"].items()} == dict(want_domains)
    assert report["heldout"]["count"] == len(held)
    md = _get(s3_client, bucket, layout.report_md_key).decode()
    assert "## rows by domain" in md and f"{len(held):,} prompts held out" in md

    # Defence in depth: a held-out conversation slipped into a completions part after generation (a part
    # copied from another root, a dataset planned before its split) is refused by tokenize all the same.
    victim = parts[0]
    part_rows = decode_part(store.get(victim)[0]).to_pylist()
    intruders = sorted(held)[:3]
    slipped = [dict(part_rows[0], id=pid) for pid in intruders]
    store.put(victim, encode_part(part_rows + slipped))

    planned = tokenize_plan(s3_client, [cfg.output_uri], TokenizeConfig(tokenizer=str(qwen_tokenizer), workers=2,
                                                                        min_loss_tokens=1))
    for a in planned["assignments"]:
        run_assignment(s3_client, a)
    tok = write_report(s3_client, planned["datasets"][0])
    assert tok["dropped_by_reason"].get("heldout") == len(slipped), tok["dropped_by_reason"]
    assert tok["heldout"]["count"] == len(held) and tok["rows_out"] > 0

    shards = _shard_units(s3_client, bucket, layout)
    assert set(shards) == {"parquet", "specforge", "specforge-conversations", "speculators"}, shards.keys()
    for folder, ids in shards.items():
        assert ids, folder
        assert not ids & held, f"held-out conversations in {folder}: {sorted(ids & held)[:5]}"

    # Every training row carries its input row's labels, in every profile.
    for c in range(len(manifest["chunks"]["sizes"])):
        for r in pq.read_table(io.BytesIO(store.get(layout.key(profile_keys("parquet", c)["rows"]))[0])).to_pylist():
            assert (r["source"], r["domain"], r["metadata"]) == _expected_labels(rows[r["id"]])
            assert r["thinking"] is True
        sp = [json.loads(x) for x in store.get(layout.key(profile_keys("speculators", c)["tokens"]))[0].splitlines()]
        for r in sp:
            src = _expected_labels(rows[r["primary_id"].split("#")[0]])
            assert (r["metadata"]["source"], r["metadata"]["domain"], r["metadata"]["metadata"]) == tuple(
                x or "" for x in src)
    card = _get(s3_client, bucket, layout.dataset_card_key).decode()
    assert "## Held-out split" in card and "| fraction | 0.25 |" in card and "`dflash-heldout`" in card
    assert f"{len(held):,} in `s3://{bucket}/ds/heldout/prompts.jsonl.gz`" in card
    assert PROFILES


@pytest.mark.timeout(120)
def test_tokenize_heldout_uri_guards_a_dataset_planned_without_a_split(s3_client: Any, bucket: str, sim_fleet: Any,
                                                                       qwen_tokenizer: Path) -> None:
    rows = _put_prompts(s3_client, bucket, 40)
    fleet = sim_fleet(engines=["vllm"], tokenizer_dir=str(qwen_tokenizer), **SIM)
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/in/prompts.jsonl", "output_uri": f"s3://{bucket}/old",
                                 "servers": fleet.urls, "save_every": 10, "max_tokens": 256})
    assert not any(isinstance(o, BaseException) for o in run_generation(s3_client, cfg, fleet.urls, "run1"))
    named = ["p0001", "p0007", "p0030"]
    s3_client.put_object(Bucket=bucket, Key="bench/prompts.jsonl",
                         Body="".join(json.dumps(rows[i]) + "\n" for i in named).encode())
    tcfg = TokenizeConfig(tokenizer=str(qwen_tokenizer), workers=1, min_loss_tokens=1,
                          heldout_uri=f"s3://{bucket}/bench/prompts.jsonl")
    planned = tokenize_plan(s3_client, [cfg.output_uri], tcfg)
    for a in planned["assignments"]:
        run_assignment(s3_client, a)
    tok = write_report(s3_client, planned["datasets"][0])
    assert tok["dropped_by_reason"].get("heldout") == len(named)
    layout = DatasetLayout.from_uri(cfg.output_uri)
    for folder, ids in _shard_units(s3_client, bucket, layout).items():
        assert ids and not ids & set(named), folder
    # The tokenize split is pinned with the settings: another heldout_uri is refused under the same tokenization
    # (without a name, it would be a new tokenization beside this one, never a rewrite of its shards).
    from dflash_pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="heldout_uri"):
        tokenize_plan(s3_client, [cfg.output_uri], TokenizeConfig(tokenizer=str(qwen_tokenizer), min_loss_tokens=1,
                                                                  tokenization="default"))
    other = tokenize_plan(s3_client, [cfg.output_uri], TokenizeConfig(tokenizer=str(qwen_tokenizer), min_loss_tokens=1))
    assert other["datasets"][0]["tokenization"].startswith("s-")
