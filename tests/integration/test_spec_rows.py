"""Per-row speculative statistics through plan, preflight and the real Worker, against simulated
speculating servers over HTTP and moto S3 (dev/faultlab.run_generation, as the DAG calls them).

What is proved: every row of a speculating server stores its request's figures (per turn, and
summed per row in all_turns mode), their sums plus preflight's proof requests equal what the
server reports server-wide (vLLM `/metrics` counters; SGLang's `avg_spec_accept_length`), the
manifest records each server's speculative config and where its figures come from, and rows of a
server that does not speculate (or an SGLang too old to say) are null, never zero.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dev.faultlab import run_generation
from dflash_pipeline.dev.sim import SimConfig, SimFleet
from dflash_pipeline.serving.specstats import SPEC_COLUMNS, SpecStats, total
from dflash_pipeline.serving.specwire import (
    SOURCE_SGLANG_META,
    SOURCE_SGLANG_SGLEXT,
    SOURCE_VLLM,
    sglang_avg_accept_length,
    vllm_spec_counters,
)

FAST = {"token_time_s": 0.0003, "length_scale": 0.03, "max_running_requests": 6}
DOMAINS = "primes=0.85,poem=0.3"


def _conversations(n: int) -> bytes:
    rows = []
    for i in range(n):
        topic = "primes" if i % 2 else "poem"
        msgs: list[dict[str, str]] = []
        for k in range(1 + i % 2):
            msgs.append({"role": "user", "content": f"Conversation {i} about {topic}, question {k}?"})
            msgs.append({"role": "assistant", "content": f"ORIGINAL answer {i}.{k}."})
        rows.append({"id": f"c{i:04d}", "messages": msgs})
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def _rows(s3: Any, cfg: RunConfig) -> list[dict[str, Any]]:
    layout = DatasetLayout.from_uri(cfg.output_uri)
    out: list[dict[str, Any]] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=layout.bucket, Prefix=layout.completions_prefix):
        for obj in page.get("Contents", []):
            out += decode_part(s3.get_object(Bucket=layout.bucket, Key=obj["Key"])["Body"].read()).to_pylist()
    return out


@pytest.mark.parametrize("regenerate", ["last_turn", "all_turns"])
def test_rows_carry_the_servers_figures_and_they_sum_to_its_counters(s3_client, bucket, regenerate) -> None:
    spec = {"spec_num_draft_tokens": 3, "spec_accept_by_keyword": DOMAINS}
    configs = [
        SimConfig(engine="vllm", spec_algorithm="ngram", **spec, **FAST),
        SimConfig(spec_algorithm="EAGLE3", spec_sglang_version="0.5.21", **spec, **FAST),
        SimConfig(spec_algorithm="EAGLE3", spec_sglang_version="0.5.13", **spec, **FAST),
        SimConfig(spec_algorithm="EAGLE3", spec_sglang_version="0.5.12", **spec, **FAST),  # cannot say
        SimConfig(**FAST),  # does not speculate
        SimConfig(engine="vllm", spec_algorithm="ngram", spec_per_request_metrics="none", **spec, **FAST),
    ]
    n = 120
    with SimFleet(configs).start() as fleet:
        tag = f"spec-{regenerate}"
        s3_client.put_object(Bucket=bucket, Key=f"{tag}/p.jsonl", Body=_conversations(n))
        cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/{tag}/p.jsonl", "output_uri": f"s3://{bucket}/{tag}/ds",
                                     "servers": fleet.urls, "save_every": 5, "regenerate": regenerate})
        outcomes = run_generation(s3_client, cfg, fleet.urls, f"{tag}-run1")
        assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
        metrics = requests.get(fleet.urls[0] + "/metrics", timeout=10).text
        infos = [requests.get(u + "/get_server_info", timeout=10).json() for u in fleet.urls[1:]]
    rows = _rows(s3_client, cfg)
    assert sorted(r["id"] for r in rows) == [f"c{i:04d}" for i in range(n)]
    assert not [r for r in rows if r.get("error_class")]
    layout = DatasetLayout.from_uri(cfg.output_uri)
    manifest = json.loads(s3_client.get_object(Bucket=layout.bucket, Key=layout.manifest_key)["Body"].read())
    entries = {e["name"]: e for e in manifest["servers"]}
    vllm_url, new_url, meta_url, old_url, plain_url, quiet_url = fleet.urls
    assert entries[vllm_url]["speculative"]["stats_source"] == SOURCE_VLLM
    assert entries[vllm_url]["speculative"]["num_draft_tokens"] == 3
    assert entries[new_url]["speculative"]["stats_source"] == SOURCE_SGLANG_SGLEXT
    assert entries[meta_url]["speculative"] == {
        "algorithm": "EAGLE3", "num_draft_tokens": 3, "adaptive": False, "engine": "sglang", "engine_version": "0.5.13",
        "stats_source": SOURCE_SGLANG_META, "engine_args": {
            "speculative_algorithm": "EAGLE3", "speculative_num_draft_tokens": 4, "speculative_num_steps": 3,
            "speculative_eagle_topk": 1, "speculative_draft_model_path": "sim/drafter"}}
    assert entries[old_url]["speculative"]["stats_source"] is None
    assert entries[plain_url]["speculative"] is None
    # vLLM without --per-request-spec-decode-metrics: it speculates (its /metrics says so), no figures.
    assert entries[quiet_url]["speculative"]["stats_source"] is None
    assert entries[quiet_url]["speculative"]["num_draft_tokens"] == 3

    by_server: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_server.setdefault(r["server"], []).append(r)
    assert set(by_server) == set(fleet.urls), "every server generated rows"
    for url in (old_url, plain_url, quiet_url):
        for r in by_server[url]:
            assert all(r[c] is None for c in (*SPEC_COLUMNS, "acceptance_length")), r
            assert all(t[c] is None for t in r["turns"] for c in SPEC_COLUMNS)

    def stats_of(url: str) -> SpecStats:
        per_row = []
        for r in by_server[url]:
            row = SpecStats.from_columns(r)
            assert row is not None and row.verify_steps > 0, r
            turns = [SpecStats.from_columns(t) for t in r["turns"]]
            assert row == total(turns), "the row is the sum of its turns"
            assert r["acceptance_length"] == pytest.approx(1 + row.accepted_tokens / row.verify_steps)
            assert row.draft_tokens == 3 * row.verify_steps
            per_row.append(row)
        proof = SpecStats.from_columns(entries[url]["proof"]["spec"])  # preflight's request counts too
        return total([*per_row, proof])

    vllm_sum = stats_of(vllm_url)
    counters = vllm_spec_counters(metrics)
    assert (counters.drafts, counters.accepted_tokens, counters.draft_tokens) == (
        vllm_sum.verify_steps, vllm_sum.accepted_tokens, vllm_sum.draft_tokens)
    assert list(counters.accepted_per_position) == [sum(vllm_sum.histogram[i + 1:]) for i in range(3)]
    for url, info in zip((new_url, meta_url), infos[:2]):
        s = stats_of(url)
        assert sglang_avg_accept_length(info) == pytest.approx(s.acceptance_length, rel=1e-12)
    if regenerate == "all_turns":
        assert any(len(r["turns"]) == 2 for r in by_server[vllm_url])


def test_validation_report_shows_acceptance_only_when_rows_have_it(s3_client, bucket) -> None:
    """run_validation over a run from one speculating and one plain server: the acceptance section
    counts the plain server's rows apart, its figure is the rows' token-weighted one, the domain the
    drafter finds hard (p = 0.3) has the hardest prompts. A run from plain servers shows nothing."""
    from dflash_pipeline.steps.validate import run_validation

    spec = {"spec_num_draft_tokens": 3, "spec_accept_by_keyword": DOMAINS}
    for tag, configs in (("val-spec", [SimConfig(spec_algorithm="EAGLE3", **spec, **FAST), SimConfig(**FAST)]),
                         ("val-plain", [SimConfig(**FAST)])):
        with SimFleet(configs).start() as fleet:
            s3_client.put_object(Bucket=bucket, Key=f"{tag}/p.jsonl", Body=_conversations(200))
            cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/{tag}/p.jsonl",
                                         "output_uri": f"s3://{bucket}/{tag}/ds", "servers": fleet.urls,
                                         "save_every": 25, "max_tokens": 4096})
            outcomes = run_generation(s3_client, cfg, fleet.urls, f"{tag}-run1")
            assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
        report = run_validation(s3_client, cfg.output_uri, plots=False)
        layout = DatasetLayout.from_uri(cfg.output_uri)
        md = s3_client.get_object(Bucket=layout.bucket, Key=layout.report_md_key)["Body"].read().decode()
        section = report["acceptance"]
        rows = _rows(s3_client, cfg)
        if tag == "val-plain":
            assert section["speculating"] is False and section["rows"] == 200
            assert "not speculating" in md
            continue
        spec_rows = [r for r in rows if r["server"] == fleet.urls[0]]
        assert section["rows"] == 200 and section["rows_with_stats"] == len(spec_rows)
        assert section["rows_without_stats"] == 200 - len(spec_rows)
        v = sum(r["spec_verify_steps"] for r in spec_rows)
        a = sum(r["spec_accepted_tokens"] for r in spec_rows)
        assert section["acceptance_length"] == pytest.approx(1 + a / v)
        assert section["by"]["server"][fleet.urls[1]]["rows_with_stats"] == 0
        # The hardest list ranks every eligible row of the hard domain first (which rows went to the
        # speculating server depends on dispatch timing, so count them).
        poem = {r["id"] for r in spec_rows if "poem" in r["messages"][0]["content"]
                and r["spec_verify_steps"] >= section["hardest_min_steps"]}
        hardest = [e["id"] for e in section["hardest"]]
        n = min(len(poem), len(hardest))
        assert n >= 5 and set(hardest[:n]) <= poem, (len(poem), hardest)
        assert "## speculative decoding acceptance" in md and "### hardest prompts" in md


def test_training_rows_carry_their_turns_figures(s3_client, bucket, tmp_path) -> None:
    """Generate (all_turns) on a speculating server and a plain one serving the sim tokenizer, then
    tokenize: each training row (one regenerated turn) has that turn's statistics in the parquet
    profile and its acceptance length in the speculators metadata and SpecForge's token records;
    the plain server's training rows have null columns and no keys."""
    import io

    import pyarrow.parquet as pq

    from dflash_pipeline.config import TokenizeConfig
    from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer
    from dflash_pipeline.steps.tokenize import plan, run_assignment
    from dflash_pipeline.steps.tokenize.profiles import profile_keys

    tok = build_sim_tokenizer(tmp_path / "tok")
    common = {**FAST, "tokenizer_dir": str(tok)}
    spec = {"spec_num_draft_tokens": 3, "spec_accept_by_keyword": DOMAINS}
    with SimFleet([SimConfig(engine="vllm", spec_algorithm="ngram", **spec, **common),
                   SimConfig(**common)]).start() as fleet:
        s3_client.put_object(Bucket=bucket, Key="tok/p.jsonl", Body=_conversations(60))
        cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/tok/p.jsonl", "output_uri": f"s3://{bucket}/tok/ds",
                                     "servers": fleet.urls, "save_every": 10, "regenerate": "all_turns"})
        outcomes = run_generation(s3_client, cfg, fleet.urls, "tok-run1")
        assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    rows = {(r["id"], r["sample"]): r for r in _rows(s3_client, cfg)}
    planned = plan(s3_client, [cfg.output_uri], TokenizeConfig(tokenizer=str(tok), min_loss_tokens=1, max_length=1 << 16))
    for a in planned["assignments"]:
        run_assignment(s3_client, a)
    layout = DatasetLayout.from_uri(cfg.output_uri)
    n_chunks = 6  # 60 rows, save_every 10
    assert planned["datasets"][0]["parts"] == n_chunks
    seen = {"spec": 0, "plain": 0}
    for c in range(n_chunks):
        keys = {p: profile_keys(p, c) for p in ("parquet", "speculators", "specforge")}
        get = lambda k: s3_client.get_object(Bucket=bucket, Key=layout.key(k))["Body"].read()  # noqa: E731
        table = pq.read_table(io.BytesIO(get(keys["parquet"]["rows"]))).to_pylist()
        spec_lines = [json.loads(x) for x in get(keys["speculators"]["tokens"]).decode().splitlines()]
        sf_lines = [json.loads(x) for x in get(keys["specforge"]["tokens"]).decode().splitlines()]
        for t, sp, sf in zip(table, spec_lines, sf_lines):
            row = rows[(t["id"], t["sample"])]
            turn = row["turns"][t["turn"]]  # all_turns: every assistant turn is regenerated, in order
            assert [t[c] for c in SPEC_COLUMNS] == [turn[c] for c in SPEC_COLUMNS]
            if row["server"] == fleet.urls[0]:
                seen["spec"] += 1
                assert t["acceptance_length"] == pytest.approx(1 + turn["spec_accepted_tokens"] / turn["spec_verify_steps"])
                assert sp["metadata"]["acceptance_length"] == t["acceptance_length"] == sf["acceptance_length"]
                assert sp["metadata"]["spec_verify_steps"] == t["spec_verify_steps"]
            else:
                seen["plain"] += 1
                assert t["acceptance_length"] is None and "acceptance_length" not in sp["metadata"]
                assert "acceptance_length" not in sf
    assert seen["spec"] and seen["plain"], seen  # which server takes which chunk is dispatch's choice


def test_validation_breaks_acceptance_down_by_the_rows_domain_and_covers_the_truth(s3_client, bucket) -> None:
    """Input rows labelled with a `domain` (carried to the completions by the row labels) on two
    servers running the same simulated drafter (per-request draws are seeded, so the figures do not
    depend on dispatch): each domain's reported acceptance has the drafter's known truth,
    1 + sum_{i<=k} p^i, inside its 95% interval, and the thinking mode is the one the rows ran."""
    from dflash_pipeline.dev.sim import spec_drafter
    from dflash_pipeline.steps.validate import run_validation

    rows = []
    for i in range(240):
        topic = ("primes", "poem", "other")[i % 3]
        rows.append({"id": f"d{i:04d}", "domain": topic,
                     "messages": [{"role": "user", "content": f"Question {i} about {topic}?"}]})
    spec = {"spec_algorithm": "EAGLE3", "spec_num_draft_tokens": 3, "spec_accept_by_keyword": DOMAINS,
            "spec_accept_p": 0.6}
    with SimFleet([SimConfig(**spec, **FAST), SimConfig(**spec, **FAST)]).start() as fleet:
        s3_client.put_object(Bucket=bucket, Key="dom/p.jsonl", Body="\n".join(json.dumps(r) for r in rows).encode())
        cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/dom/p.jsonl", "output_uri": f"s3://{bucket}/dom/ds",
                                     "servers": fleet.urls, "save_every": 20, "max_tokens": 4096})
        outcomes = run_generation(s3_client, cfg, fleet.urls, "dom-run1")
        assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    section = run_validation(s3_client, cfg.output_uri, plots=False)["acceptance"]
    by_domain = section["by"]["domain"]
    assert set(by_domain) == {"primes", "poem", "other"}
    for domain, p in (("primes", 0.85), ("poem", 0.3), ("other", 0.6)):
        g = by_domain[domain]
        truth = spec_drafter.true_acceptance_length(p, 3)
        assert g["rows_with_stats"] == 80 and g["ci_low"] <= truth <= g["ci_high"], (domain, g, truth)
    assert set(section["by"]["thinking"]) == {"on"}
    assert by_domain["poem"]["acceptance_length"] < by_domain["other"]["acceptance_length"] < by_domain["primes"]["acceptance_length"]
