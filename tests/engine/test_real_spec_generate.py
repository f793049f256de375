"""dflash_generate through a real Airflow scheduler against real speculating vLLM servers: per-row statistics.

One run per real vLLM 0.32 server (CPU build, the tiny designed Qwen3; conftest.py): vLLM's n-gram
drafter, the checkpoint as its own draft model (both k = 3, ``--per-request-spec-decode-metrics
summary``) and the plain server; 12 prompts each, 48 tokens, production sampling (temperature 0.6,
thinking on). What it proves (issue 30, "Done when"):

* each row of a speculating server stores its request's figures (per turn and summed per row), and per
  server the rows' sums plus preflight's proof request equal that server's ``/metrics`` delta over the
  run (drafts, draft tokens, accepted tokens, accepted per position), read by the dev stack's own
  ``/metrics`` parser, not the pipeline's;
* the plain server's rows are null, never zero, and its manifest entry says it does not speculate;
* the manifest records each speculating server's draft length and where its figures come from;
* the asset-triggered ``dflash_tokenize`` carries each turn's figures into the training rows.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dev.stack import AirflowStack
from dflash_pipeline.dev.stack.vllm_server import SpecCounters, spec_counters
from dflash_pipeline.serving.specstats import SPEC_COLUMNS, SpecStats, total
from tests.engine.test_real_engine_e2e import _generate, _json, _keys

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
N_PROMPTS = 12


def _prompts(n: int) -> list[dict[str, Any]]:
    return [{"id": f"p{i:03d}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i % 7}?"}]}
            for i in range(n)]


def _stats_counters(stats: SpecStats, k: int) -> SpecCounters:
    hist = list(stats.histogram or ()) + [0] * (k + 1 - len(stats.histogram or ()))
    return SpecCounters(stats.verify_steps, stats.draft_tokens or 0, stats.accepted_tokens,
                        tuple(sum(hist[j:]) for j in range(1, k + 1)))


def test_generate_rows_carry_the_real_servers_figures(
    airflow_stack: AirflowStack, vllm_server: Any, vllm_ngram_server: Any, vllm_draft_model_server: Any,
    s3_client: Any, bucket: str,
) -> None:
    servers = {"ngram": vllm_ngram_server, "draft_model": vllm_draft_model_server, "plain": vllm_server}
    figures = {}
    for name, server in servers.items():  # one run per server: dispatch, not the test, decides who takes a chunk
        before = spec_counters(server.base_url)
        rows_in = _prompts(N_PROMPTS)
        output_uri = _generate(airflow_stack, s3_client, bucket, f"spec-{name}", rows_in, server,
                               max_tokens=MAX_TOKENS, save_every=4, max_truncation_rate=1.0,
                               tokenize_gate_may_fail=True)
        delta = spec_counters(server.base_url) - before

        layout = DatasetLayout.from_uri(output_uri)
        rows = [r for k in _keys(s3_client, bucket, layout.completions_prefix)
                for r in decode_part(s3_client.get_object(Bucket=bucket, Key=k)["Body"].read()).to_pylist()]
        assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in rows_in)
        assert not [r for r in rows if r.get("error_class")]
        assert {r["server"] for r in rows} == {server.base_url}
        [entry] = _json(s3_client, bucket, layout.manifest_key)["servers"]

        if name == "plain":
            # null everywhere, no speculative entry, and its /metrics has no spec counters at all
            assert entry["speculative"] is None
            assert delta == SpecCounters()
            for r in rows:
                assert all(r[c] is None for c in (*SPEC_COLUMNS, "acceptance_length")), r
                assert all(t[c] is None for t in r["turns"] for c in SPEC_COLUMNS)
        else:
            assert entry["speculative"]["stats_source"] == "vllm.metrics.speculative_decoding", entry
            assert entry["speculative"]["num_draft_tokens"] == 3 and entry["speculative"]["engine"] == "vllm"
            per_row = []
            for r in rows:
                row = SpecStats.from_columns(r)
                assert row is not None, r  # a speculating server's row always has figures (zeros: no draft)
                assert row == total([SpecStats.from_columns(t) for t in r["turns"]])
                if row.verify_steps:
                    assert r["acceptance_length"] == pytest.approx(1 + row.accepted_tokens / row.verify_steps)
                per_row.append(row)
            proof = SpecStats.from_columns(entry["proof"]["spec"])  # preflight's request counts on /metrics too
            summed = total([*per_row, *([proof] if proof else [])])
            assert delta.drafts > 0
            assert _stats_counters(summed, 3) == delta, (name, summed, delta)
            figures[name] = {"rows": len(per_row), "verify_steps": summed.verify_steps,
                             "accepted": summed.accepted_tokens, "acceptance_length": summed.acceptance_length}

        # the training rows (asset-triggered dflash_tokenize, parquet profile) carry their turn's figures
        trained = [r for k in _keys(s3_client, bucket, layout.key("tokenized/parquet/"))
                   for r in pq.read_table(io.BytesIO(s3_client.get_object(Bucket=bucket, Key=k)["Body"].read()))
                   .to_pylist()]
        by_id = {(r["id"], r["sample"]): r for r in rows}
        assert trained
        for t in trained:
            turn = by_id[(t["id"], t["sample"])]["turns"][-1]
            assert [t[c] for c in SPEC_COLUMNS] == [turn[c] for c in SPEC_COLUMNS]
            assert (t["acceptance_length"] is None) == (not turn["spec_verify_steps"])  # null: plain, or no draft
    print(json.dumps(figures))
