"""dflash_eval through a real Airflow scheduler against real vLLM servers: two drafters side by side.

The two real speculative configurations of the engine tier (conftest.py: vLLM's n-gram drafter, and the
tiny checkpoint as its own draft model; k = 3, ``--per-request-spec-decode-metrics summary``) are the
eval's two "drafters", the plain server its no-speculation baseline. The prompts carry a ``domain``
column (two domains). Conditions: production sampling (temperature 0.6) and greedy, thinking on and off
(issue 37: none refused by preflight), 4 requests in flight per server. Small on purpose (CI, 2 cores): 12 prompts, 40 tokens.

What it proves (issue 30, "Done when"): the report has both drafters side by side for every condition,
ranks them in each condition as the ``/metrics`` counters of that condition's window rank them, its
cross-check finds no mismatch, every drafter shows per-domain figures (the baseline none), and each
server's ``/metrics`` delta over the whole eval, read here with the dev stack's own parser, is exactly
the eval's windows plus preflight's proof requests.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dev.stack import AirflowStack
from dflash_pipeline.dev.stack.vllm_server import spec_counters
from dflash_pipeline.serving.specstats import SpecStats

pytestmark = pytest.mark.slow

DOMAINS = ("arith", "chat")
N_PROMPTS = 12
MAX_TOKENS = 40


def _prompts() -> list[dict[str, Any]]:
    rows = []
    for i in range(N_PROMPTS):
        domain = DOMAINS[i % 2]
        text = f"What is {i} + {i * 3}?" if domain == "arith" else f"Say hello to friend number {i}."
        rows.append({"id": f"q{i:02d}", "domain": domain, "source": "engine-tier",
                     "messages": [{"role": "user", "content": text}]})
    return rows


def _manifest(s3: Any, uri: str) -> dict[str, Any]:
    layout = DatasetLayout.from_uri(uri)
    doc: dict[str, Any] = json.loads(s3.get_object(Bucket=layout.bucket, Key=layout.manifest_key)["Body"].read())
    return doc


def test_eval_ranks_two_real_drafters_as_their_metrics_do(
    airflow_stack: AirflowStack, vllm_server: Any, vllm_ngram_server: Any, vllm_draft_model_server: Any,
    s3_client: Any, bucket: str,
) -> None:
    drafters = {"ngram": vllm_ngram_server, "draft_model": vllm_draft_model_server}
    key = "eval-bench/prompts.jsonl"
    s3_client.put_object(Bucket=bucket, Key=key, Body="".join(json.dumps(r) + "\n" for r in _prompts()).encode())
    output_uri = f"s3://{bucket}/evals/real"
    conf = {
        "prompts_uri": f"s3://{bucket}/{key}", "output_uri": output_uri,
        "drafters": [{"name": name, "servers": [s.base_url]} for name, s in drafters.items()],
        "baseline": {"name": "no-spec", "servers": [vllm_server.base_url]},
        "model": vllm_server.model, "max_tokens": MAX_TOKENS, "temperature": 0.6, "top_p": 0.95, "greedy": True,
        "thinking_modes": ["on", "off"], "concurrency": [4], "save_every": 6,
    }
    before = {name: spec_counters(s.base_url) for name, s in drafters.items()}
    run_id = airflow_stack.trigger("dflash_eval", conf)
    state = airflow_stack.wait_run("dflash_eval", run_id, timeout_s=1200)
    assert state == "success", airflow_stack.task_instances("dflash_eval", run_id)
    delta = {name: spec_counters(s.base_url) - before[name] for name, s in drafters.items()}
    report = json.loads(s3_client.get_object(Bucket=bucket, Key="evals/real/report.json")["Body"].read())

    assert report["status"] == "complete" and report["crosscheck_mismatches"] == []
    conditions = [c["name"] for c in report["conditions"]]
    assert conditions == ["sampled_think-on_c4", "sampled_think-off_c4", "greedy_think-on_c4", "greedy_think-off_c4"]
    figures: dict[str, Any] = {}
    for cond in conditions:
        # side by side: both drafters ranked, each with its figures; per condition, the ranking is the one
        # of the /metrics windows the eval scraped around it on each server
        ranking = report["rankings"][cond]
        assert sorted(e["drafter"] for e in ranking) == sorted(drafters)
        by_metrics = {}
        for name in drafters:
            fig = report["groups"][name][cond]
            assert fig["rows"] == fig["planned"] == N_PROMPTS and fig["missing"] == 0
            acc = fig["acceptance"]
            assert acc["rows_with_stats"] == fig["completions"] == N_PROMPTS
            assert len(acc["histogram"]) == 4 and len(acc["per_position"]) == 3
            [x] = fig["crosscheck"]
            assert x["status"] == "match" and x["server"] in (drafters[name].base_url, {"name": drafters[name].base_url})
            assert x["metrics_delta"]["verify_steps"] > 0
            by_metrics[name] = 1 + x["metrics_delta"]["accepted_tokens"] / x["metrics_delta"]["verify_steps"]
            assert acc["acceptance_length"] == pytest.approx(
                1 + x["rows_sum"]["accepted_tokens"] / x["rows_sum"]["verify_steps"])
            # per-domain figures, both domains, each with its interval
            assert set(fig["by_domain"]) == set(DOMAINS), fig["by_domain"]
            for d in fig["by_domain"].values():
                assert d["rows"] == N_PROMPTS // 2 and d["acceptance_length"] is not None
            figures.setdefault(name, {})[cond] = {
                "acceptance_length": acc["acceptance_length"], "ci": [acc["ci_low"], acc["ci_high"]],
                "by_domain": {k: v["acceptance_length"] for k, v in fig["by_domain"].items()},
                "tokens_per_s": fig["throughput"]["tokens_per_s"]}
        order = [e["drafter"] for e in ranking]
        assert order == sorted(drafters, key=lambda n: -by_metrics[n]), (cond, order, by_metrics)
        assert len(set(by_metrics.values())) == 2, "a tie ranks nothing"
        base = report["groups"]["no-spec"][cond]
        assert base["acceptance"]["acceptance_length"] is None and base["rows"] == N_PROMPTS
        assert all(e["speedup_vs_baseline"] is not None for e in ranking)

    # read independently of the eval: each server's /metrics delta over the whole eval is exactly what the
    # eval's per-condition windows saw plus preflight's proof request of each condition (sent in prepare,
    # outside the windows). (A ranking by the whole-run delta would mix conditions in each drafter's own
    # proportions, so rankings are compared per condition, above.)
    for name in drafters:
        windows = [report["groups"][name][c]["crosscheck"][0]["metrics_delta"] for c in conditions]
        proofs = []
        for c in conditions:
            proof = _manifest(s3_client, f"{output_uri}/{name}/{c}")["servers"][0]["proof"]
            proofs.append(SpecStats.from_columns(proof["spec"]))
            # answers preflight asked to settle a first answer without thinking (the first is `proof`)
            settled = (proof.get("reasoning_settled") or {}).get("answers") or []
            proofs += [SpecStats.from_columns(a["spec"]) for a in settled[1:] if a.get("spec")]
        steps = sum(w["verify_steps"] for w in windows) + sum(p.verify_steps for p in proofs if p)
        accepted = sum(w["accepted_tokens"] for w in windows) + sum(p.accepted_tokens for p in proofs if p)
        assert (delta[name].drafts, delta[name].accepted_tokens) == (steps, accepted), (name, delta[name], windows)
    print(json.dumps({"figures": figures, "metrics_delta": {n: vars(d) for n, d in delta.items()}}))
