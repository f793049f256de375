"""steps/evaluate: the report's arithmetic on known rows, the /metrics parsing and delta, the
cross-check's verdicts, the ranking, and the report's rendering."""

from __future__ import annotations

from typing import Any

import pytest

from dflash_pipeline.config import EvalConfig
from dflash_pipeline.steps.evaluate import figures as F
from dflash_pipeline.steps.evaluate.metrics import delta, parse_spec_counters
from dflash_pipeline.steps.evaluate.report import build_report
from dflash_pipeline.steps.evaluate.render import render_markdown


def row(server: str = "s0", run: str = "r1", verify: int | None = 10, accepted: int | None = 20,
        hist: list[int] | None = None, tokens: int = 30, latency: float = 1.0, domain: str | None = "math",
        error: str | None = None) -> dict[str, Any]:
    return {"id": f"{server}-{verify}-{accepted}-{tokens}", "server": server, "run_id": run, "completion_tokens": tokens,
            "latency_s": latency, "error_class": error, "finish_reason": None if error else "stop", "domain": domain,
            "spec_verify_steps": verify, "spec_accepted_tokens": accepted,
            "spec_draft_tokens": None if verify is None else verify * 3, "spec_accept_histogram": hist}


def test_acceptance_is_token_weighted_and_rows_without_stats_are_counted() -> None:
    rows = [row(verify=100, accepted=300, hist=[0, 0, 0, 100]), row(verify=1, accepted=0, hist=[1, 0, 0, 0]),
            row(verify=None, accepted=None)]
    acc = F.acceptance(rows, 0.95)
    assert acc["acceptance_length"] == pytest.approx(1 + 300 / 101)  # not the mean of rows (2.5)
    assert (acc["rows"], acc["rows_with_stats"], acc["rows_without_stats"]) == (3, 2, 1)
    assert acc["histogram"] == [1, 0, 0, 100]
    assert acc["per_position"] == pytest.approx([100 / 101] * 3)
    assert acc["draft_tokens"] == 303 and acc["draft_acceptance_rate"] == pytest.approx(300 / 303)
    assert acc["ci_low"] <= acc["acceptance_length"] <= acc["ci_high"]


def test_throughput_at_concurrency_one_is_tokens_over_request_latencies() -> None:
    rows = [row(tokens=100, latency=2.0), row(tokens=50, latency=3.0), row(tokens=999, latency=9.0, error="Timeout")]
    tp = F.throughput(rows, [], concurrency=1, n_servers=3)
    assert tp["tokens_per_s"] == pytest.approx(150 / 5.0)


def test_throughput_at_production_is_fleet_tokens_over_wall_time_per_server() -> None:
    rows = [row(server="s0", run="r1", tokens=600), row(server="s1", run="r1", tokens=400),
            row(server="s0", run="r2", tokens=300), row(server="s0", run="r0", tokens=7)]
    docs = [{"run_id": "r1", "server": "s0", "started": 100.0, "ended": 108.0},
            {"run_id": "r1", "server": "s1", "started": 101.0, "ended": 110.0},
            {"run_id": "r2", "server": "s0", "started": 500.0, "ended": 505.0}]
    tp = F.throughput(rows, docs, concurrency=None, n_servers=2)
    # run r1: 1000 tokens in 10 s (100 -> 110); r2: 300 in 5 s; r0 has no timing (not counted)
    assert tp["fleet_tokens_per_s"] == pytest.approx(1300 / 15)
    assert tp["tokens_per_s"] == pytest.approx(1300 / 15 / 2)
    assert tp["rows_without_timing"] == 1


def _doc(server: str, run: str, d: dict[str, Any] | None, before: Any = True, try_number: int = 1) -> dict[str, Any]:
    b = {"engine": "vllm", "verify_steps": 0} if before is True else before
    return {"server": server, "run_id": run, "try_number": try_number, "before": b, "after": b, "delta": d}


def test_crosscheck_match_mismatch_and_unmeasured() -> None:
    rows = [row(server="a", verify=10, accepted=20), row(server="a", verify=5, accepted=1),
            row(server="b", verify=10, accepted=20), row(server="c", verify=3, accepted=3)]
    docs = [_doc("a", "r1", {"engine": "vllm", "verify_steps": 15, "accepted_tokens": 21, "draft_tokens": 45}),
            _doc("b", "r1", {"engine": "vllm", "verify_steps": 12, "accepted_tokens": 20, "draft_tokens": 36}),
            _doc("c", "r1", None, before=None),
            _doc("d", "r1", None)]
    out = {x["server"]: x for x in F.crosscheck(rows, docs)}
    assert out["a"]["status"] == "match"
    assert out["b"]["status"] == "mismatch"
    assert out["b"]["differences"] == {"verify_steps": {"rows": 10, "metrics": 12}, "draft_tokens": {"rows": 30, "metrics": 36}}
    assert "another client's traffic on a shared server" in out["b"]["note"]
    assert out["c"]["status"] == "not measured"
    assert out["d"]["status"] == "unknown" and "restarted" in out["d"]["note"]


def test_crosscheck_sums_the_tries_of_a_run_and_says_when_one_died() -> None:
    rows = [row(server="a", verify=10, accepted=20)]
    d = {"engine": "sglang", "verify_steps": 4}
    docs = [_doc("a", "r1", d, try_number=1), _doc("a", "r1", dict(d, verify_steps=7), try_number=2)]
    [x] = F.crosscheck(rows, docs)
    assert x["metrics_delta"] == {"verify_steps": 11} and x["status"] == "mismatch" and "retried" in x["note"]
    docs[1]["delta"] = dict(d, verify_steps=6)
    assert F.crosscheck(rows, docs)[0]["status"] == "match"  # SGLang: verify steps only


VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 10.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 150.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 90.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 20.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_parse_vllm_and_sglang_counters_and_their_delta() -> None:
    got = parse_spec_counters(VLLM_METRICS)
    assert got == {"engine": "vllm", "verify_steps": 50, "accepted_tokens": 90, "draft_tokens": 150,
                   "per_position": [40, 30, 20]}
    assert parse_spec_counters('vllm:num_requests_running{engine="0"} 1.0\n') == {}
    sgl = ("# TYPE sglang:spec_verify_calls_total counter\n"
           'sglang:spec_verify_calls_total{model_name="m",tp_rank="0"} 12.0\n')
    assert parse_spec_counters(sgl) == {"engine": "sglang", "verify_steps": 12}
    later = dict(got, verify_steps=60, accepted_tokens=100, per_position=[45, 33, 22])
    assert delta(got, later) == {"engine": "vllm", "verify_steps": 10, "accepted_tokens": 10, "draft_tokens": 0,
                                 "per_position": [5, 3, 2]}
    assert delta(later, got) is None  # a counter went down: the server restarted
    assert delta(None, got) is None


def _report(greedy_values: dict[str, float]) -> dict[str, Any]:
    cfg = EvalConfig.from_params({
        "prompts_uri": "s3://bk1/p.jsonl", "output_uri": "s3://bk1/ev", "concurrency": [1], "greedy": True,
        "drafters": [{"name": "A", "servers": ["http://a:1"]}, {"name": "B", "servers": ["http://b:1"]}],
        "baseline": {"name": "base", "servers": ["http://c:1"]}})
    conds = [dict(c.to_dict(), root="x", server_info={}) for c in cfg.conditions()]
    per_group: dict[str, Any] = {}
    for g, value in {**greedy_values, "base": None}.items():
        for c in conds:
            if value is None:
                rows = [row(server=g, verify=None, accepted=None, tokens=10, latency=1.0) for _ in range(4)]
            else:
                rows = [row(server=g, verify=10, accepted=int(10 * (value - 1)), tokens=40, latency=1.0,
                            domain=d) for d in ("math", "code", "math", "chat")]
            per_group.setdefault(g, {})[c["name"]] = F.condition_figures(rows, [], concurrency=1, n_servers=1,
                                                                         confidence=0.95, planned=4)
    assignments = [{"conditions": conds, "source": {"prompts_uri": "s3://bk1/p.jsonl"}}]
    return build_report(cfg, assignments, per_group, {})


def test_ranking_speedup_and_headline() -> None:
    report = _report({"A": 2.0, "B": 3.5})
    assert report["headline_condition"] == "greedy_think-on_c1"
    ranking = report["rankings"]["greedy_think-on_c1"]
    assert [e["drafter"] for e in ranking] == ["B", "A"]
    assert ranking[0]["speedup_vs_baseline"] == pytest.approx(4.0)  # 40 tok/s vs 10 tok/s
    assert report["headline"]["B"]["acceptance_length"] == pytest.approx(3.5)
    assert report["headline"]["B"]["rank"] == 1
    base = report["groups"]["base"]["greedy_think-on_c1"]["acceptance"]
    assert base["acceptance_length"] is None and base["rows_without_stats"] == 4
    assert set(report["groups"]["A"]["sampled_think-on_c1"]["by_domain"]) == {"math", "code", "chat"}
    assert report["status"] == "complete"


def test_report_renders_markdown_and_a_plot() -> None:
    report = _report({"A": 2.0, "B": 3.5})
    md = render_markdown(report)
    assert "## Ranking (greedy_think-on_c1)" in md and "| 1 | B | 3.500" in md
    assert "By domain" in md and "How the figures are computed" in md
    from dflash_pipeline.steps.evaluate.plots import acceptance_plot

    png = acceptance_plot(report)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
