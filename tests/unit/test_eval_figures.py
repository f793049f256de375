"""steps/evaluate: the report's arithmetic on known rows, the /metrics parsing and delta, the
cross-check's verdicts (speculative counters and generated tokens), each (group, condition)'s status,
the paired ranking, the asset event, and the report's rendering."""

from __future__ import annotations

from typing import Any

import pytest

from dflash_pipeline.config import EvalConfig
from dflash_pipeline.steps.evaluate import figures as F
from dflash_pipeline.steps.evaluate.metrics import delta, parse_spec_counters
from dflash_pipeline.steps.evaluate.report import NOTHING_PLANNED, build_report
from dflash_pipeline.steps.evaluate.render import render_markdown
from dflash_pipeline.steps.handoff import eval_event_extra


def row(server: str = "s0", run: str = "r1", verify: int | None = 10, accepted: int | None = 20,
        hist: list[int] | None = None, tokens: int = 30, latency: float = 1.0, domain: str | None = "math",
        error: str | None = None, id: str | None = None) -> dict[str, Any]:
    return {"id": id or f"{server}-{verify}-{accepted}-{tokens}", "server": server, "run_id": run, "completion_tokens": tokens,
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
    # 3 rows: no interval holds on so few prompts, and the figure says so instead of printing one
    assert acc["ci_low"] is None and acc["ci_note"].startswith("no interval: 2 prompt(s)")


def test_throughput_at_concurrency_one_is_tokens_over_request_latencies() -> None:
    rows = [row(tokens=100, latency=2.0), row(tokens=50, latency=3.0), row(tokens=999, latency=9.0, error="Timeout")]
    tp = F.throughput(rows, [], concurrency=1, n_servers=3)
    assert tp["tokens_per_s"] == pytest.approx(150 / 5.0)


def test_throughput_at_production_is_each_servers_tokens_over_its_own_windows() -> None:
    rows = [row(server="s0", run="r1", tokens=600), row(server="s1", run="r1", tokens=400),
            row(server="s0", run="r2", tokens=300), row(server="s0", run="r0", tokens=7)]
    docs = [{"run_id": "r1", "server": "s0", "started": 100.0, "ended": 108.0},
            {"run_id": "r1", "server": "s1", "started": 101.0, "ended": 110.0},
            {"run_id": "r2", "server": "s0", "started": 500.0, "ended": 505.0}]
    tp = F.throughput(rows, docs, concurrency=None, n_servers=2)
    # s0: 900 tokens in 8 + 5 s; s1: 400 in 9 s; r0 has no window (not counted)
    assert tp["tokens_per_s"] == pytest.approx(1300 / 22)
    assert {s["server"]: s["tokens_per_s"] for s in tp["servers"]} == pytest.approx({"s0": 900 / 13, "s1": 400 / 9})
    assert tp["rows_without_timing"] == 1


def test_a_server_that_starts_late_is_as_fast_as_an_equal_speed_baseline() -> None:
    """Issue 37: a group whose second server started 50 s late read 0.75 of an equal-speed baseline
    (the fleet's tokens over the fleet's window, divided by the servers). Every server runs 100 tokens/s."""
    drafter = [row(server="d0", tokens=10_000, id="a"), row(server="d1", tokens=5_000, id="b")]
    docs = [{"run_id": "r1", "server": "d0", "started": 0.0, "ended": 100.0},
            {"run_id": "r1", "server": "d1", "started": 50.0, "ended": 100.0}]
    base = F.throughput([row(server="b0", tokens=10_000)], [{"run_id": "r1", "server": "b0", "started": 0.0,
                                                              "ended": 100.0}], concurrency=None, n_servers=1)
    tp = F.throughput(drafter, docs, concurrency=None, n_servers=2)
    assert F.ratio(tp["tokens_per_s"], base["tokens_per_s"]) == pytest.approx(1.0)


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


def test_rows_without_a_metrics_document_are_listed_as_not_measured() -> None:
    rows = [row(server="a", run="r1"), row(server="a", run="r0"), row(server="a", run="r0", verify=None, accepted=None)]
    out = F.crosscheck(rows, [_doc("a", "r1", {"engine": "vllm", "verify_steps": 10, "accepted_tokens": 20,
                                                 "draft_tokens": 30})])
    # the completions of r0 (with statistics or not: their tokens are checked too) were never measured
    assert [(x["run_id"], x["status"], x["rows"]) for x in out] == [("r1", "match", 1), ("r0", "not measured", 2)]
    assert "second scrape" in out[1]["note"]


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


def _cfg(drafters: tuple[str, ...] = ("A", "B")) -> EvalConfig:
    return EvalConfig.from_params({
        "prompts_uri": "s3://bk1/p.jsonl", "output_uri": "s3://bk1/ev", "concurrency": [1], "greedy": True,
        "drafters": [{"name": d, "servers": [f"http://{d.lower()}:1"]} for d in drafters],
        "baseline": {"name": "base", "servers": ["http://base:1"]}})


def _report(greedy_values: dict[str, float], n: int = 4, rows_for: Any = None, docs_for: Any = None
            ) -> dict[str, Any]:
    """A report of drafters with the given acceptance on every row (n rows, 4 domains cycling) and a
    baseline; rows_for(group, condition) / docs_for(group, condition) replace the generated ones."""
    cfg = _cfg(tuple(greedy_values))
    conds = [dict(c.to_dict(), root="x", server_info={}) for c in cfg.conditions()]
    per_group: dict[str, Any] = {}
    rows_by: dict[str, Any] = {}
    for g, value in {**greedy_values, "base": None}.items():
        for c in conds:
            if rows_for is not None and rows_for(g, c["name"]) is not None:
                rows = rows_for(g, c["name"])
            elif value is None:
                rows = [row(server=g, verify=None, accepted=None, tokens=10, latency=1.0, id=f"q{i}") for i in range(n)]
            else:
                rows = [row(server=g, verify=10, accepted=int(10 * (value - 1)), tokens=40, latency=1.0,
                            domain=("math", "code", "math", "chat")[i % 4], id=f"q{i}") for i in range(n)]
            docs = docs_for(g, c["name"]) if docs_for is not None else []
            per_group.setdefault(g, {})[c["name"]] = F.condition_figures(
                rows, docs, concurrency=1, n_servers=1, confidence=0.95, planned=n, baseline=g == "base")
            rows_by.setdefault(g, {})[c["name"]] = rows
    assignments = [{"conditions": conds, "source": {"prompts_uri": "s3://bk1/p.jsonl"}}]
    report = build_report(cfg, assignments, per_group, {}, rows_by)
    report["report_key"] = "ev/report.json"
    return report


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
    assert "## Ranking (greedy_think-on_c1)" in md and "| 1 | B | complete | 3.500" in md
    assert "By domain" in md and "How the figures are computed" in md
    from dflash_pipeline.steps.evaluate.plots import acceptance_plot

    png = acceptance_plot(report)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


# ---------------------------------------------------------------------------------- statuses


def _fig(rows: list[dict[str, Any]], planned: int, docs: list[dict[str, Any]] | None = None,
         baseline: bool = False) -> dict[str, Any]:
    return F.condition_figures(rows, docs or [], concurrency=1, n_servers=1, confidence=0.95, planned=planned,
                               baseline=baseline)


def test_status_follows_what_was_measured() -> None:
    full = [row(id=f"q{i}") for i in range(100)]
    assert _fig(full, 100)["status"] == "complete"
    # issue 37: a drafter whose server stopped speculating, 4 of 100 rows with statistics, read "complete"
    few = [row(id=f"q{i}", verify=10 if i < 4 else None, accepted=20 if i < 4 else None) for i in range(100)]
    fig = _fig(few, 100)
    assert fig["status"] == "partial" and "4 rows with statistics of 100 planned rows (4%" in fig["status_reasons"][0]
    none = [row(id=f"q{i}", verify=None, accepted=None) for i in range(100)]
    fig = _fig(none, 100)
    assert fig["status"] == "failed" and "nothing measured" in fig["status_reasons"][0]
    assert "--per-request-spec-decode-metrics" in fig["status_reasons"][0]
    assert _fig([], 100)["status"] == "failed"
    fig = _fig(full[:90], 100)
    assert fig["status"] == "partial" and "10 of 100 planned rows missing" in fig["status_reasons"][0]
    # the baseline is measured by its completions (it has no statistics)
    assert _fig(none, 100, baseline=True)["status"] == "complete"
    assert _fig([row(error="Timeout", id=f"q{i}") for i in range(100)], 100, baseline=True)["status"] == "failed"
    # a /metrics mismatch makes the figures untrusted (and says which server)
    mismatch = [_doc("s0", "r1", {"engine": "vllm", "verify_steps": 999, "accepted_tokens": 2000, "draft_tokens": 3000})]
    fig = _fig(full, 100, mismatch)
    assert fig["status"] == "untrusted" and fig["crosscheck_verdict"] == "mismatch"
    assert "s0 (run r1): mismatch" in fig["status_reasons"][0]
    assert F.worst(["complete", "partial", "untrusted"]) == "untrusted" and F.worst(["partial", "failed"]) == "failed"


def test_a_report_without_conditions_is_failed_never_complete_with_an_empty_ranking() -> None:
    """Issue 37: prepare failed, evaluate upstream-failed, and the report said "complete" with an
    empty ranking and "prompts: None"."""
    report = build_report(_cfg(), [], {}, {})
    assert report["status"] == "failed" and report["status_reasons"] == [NOTHING_PLANNED]
    assert report["rankings"] == {} and all(h is None for h in report["headline"].values())
    md = render_markdown({**report, "report_key": "x"})
    assert "status: **failed**" in md and "prompts: None" not in md and "prepare did not complete" in md


def test_a_drafter_that_measured_nothing_fails_the_eval_and_has_no_rank() -> None:
    def rows_for(g: str, c: str) -> list[dict[str, Any]] | None:
        return [row(server=g, verify=None, accepted=None, id=f"q{i}") for i in range(30)] if g == "B" else None

    report = _report({"A": 2.0, "B": 3.5}, n=30, rows_for=rows_for)
    assert report["status"] == "failed"
    ranking = report["rankings"]["greedy_think-on_c1"]
    assert [(e["drafter"], e["rank"], e["status"]) for e in ranking] == [("A", 1, "complete"), ("B", None, "failed")]
    assert any("B/greedy_think-on_c1: nothing measured" in r for r in report["status_reasons"])


def _varied(g: str, base: float, n: int = 40, noise: float = 0.0, domains: tuple[str, ...] = ("math", "code")
            ) -> list[dict[str, Any]]:
    """n prompts whose acceptance varies a lot from prompt to prompt (shared across drafters), the
    drafter adding `base` and its own noise (uniform within +-noise) to each."""
    import numpy as np

    rng = np.random.default_rng(0)
    own = np.random.default_rng(sum(map(ord, g)))
    out = []
    for i in range(n):
        steps = int(rng.integers(20, 200))
        per_step = (i * 7) % 10 / 5 + base + float(own.uniform(-noise, noise))
        out.append(row(server=g, verify=steps, accepted=int(steps * per_step), id=f"q{i}",
                       tokens=steps * 3, domain=domains[i % len(domains)]))
    return out


def test_ranking_ties_drafters_the_paired_difference_cannot_separate() -> None:
    rows = {"A": _varied("A", 1.00, noise=0.3), "B": _varied("B", 0.99, noise=0.3), "C": _varied("C", 0.5)}
    report = _report({"A": 0, "B": 0, "C": 0}, n=40, rows_for=lambda g, c: rows.get(g))
    ranking = report["rankings"]["greedy_think-on_c1"]
    first, second, third = ranking
    assert {first["drafter"], second["drafter"]} == {"A", "B"} and third["drafter"] == "C"
    assert [(e["rank"], e["tied_with"]) for e in ranking] == [(1, None), (1, first["drafter"]), (3, None)]
    assert second["vs_above"]["separable"] is False and second["vs_above"]["ci_low"] <= 0 <= second["vs_above"]["ci_high"]
    assert third["vs_above"]["a"] == first["drafter"] and third["vs_above"]["separable"] is True
    pairs = {(p["a"], p["b"]): p for p in report["paired"]["greedy_think-on_c1"]}
    assert set(pairs) == {(first["drafter"], second["drafter"]), (first["drafter"], "C"), (second["drafter"], "C")}
    assert pairs[(first["drafter"], "C")]["prompts"] == 40
    md = render_markdown(report)
    assert f"| =1 | {second['drafter']} |" in md and "not separable" in md
    assert "Paired differences (greedy_think-on_c1" in md
    extra = eval_event_extra(report)
    assert extra["ranking"] == [first["drafter"], second["drafter"], "C"]
    assert extra["ranks"] == {"A": 1, "B": 1, "C": 3}
    assert {(p["b"], p["separable"]) for p in extra["paired"]} == {(second["drafter"], False), ("C", True)}


def test_too_few_common_prompts_rank_as_not_separable() -> None:
    """A drafter with 4 rows with statistics (of 100) cannot be ranked above another (issue 37)."""
    def rows_for(g: str, c: str) -> list[dict[str, Any]] | None:
        if g == "A":
            return [row(server=g, verify=10 if i < 4 else None, accepted=30 if i < 4 else None, id=f"q{i}")
                    for i in range(100)]
        return [row(server=g, verify=10, accepted=12 + i % 5, id=f"q{i}") for i in range(100)]

    report = _report({"A": 0, "B": 0}, n=100, rows_for=rows_for)
    [a, b] = report["rankings"]["greedy_think-on_c1"]
    assert (a["drafter"], a["status"], a["rank"]) == ("A", "partial", 1)
    assert (b["drafter"], b["rank"], b["tied_with"]) == ("B", 1, "A") and b["vs_above"]["prompts"] == 4
    assert report["status"] == "partial"
    extra = eval_event_extra(report)
    assert extra["status"] == "partial" and extra["drafters"]["A"]["status"] == "partial"
    assert extra["conditions"]["A"]["greedy_think-on_c1"]["rows_with_stats"] == 4


def test_a_metrics_mismatch_changes_the_event() -> None:
    """Issue 37: a /metrics mismatch left the asset event byte-identical to a clean run's."""
    def docs_for(mismatch: bool) -> Any:
        def docs(g: str, c: str) -> list[dict[str, Any]]:
            rows_sum = 30 * 10
            return [_doc(g, "r1", {"engine": "vllm", "generation_tokens": 40 * 30 + (500 if mismatch and g == "A" else 0),
                                   **({} if g == "base" else {"verify_steps": rows_sum,
                                                               "accepted_tokens": (rows_sum if g == "A" else 2 * rows_sum),
                                                               "draft_tokens": 3 * rows_sum})},
                         before={"engine": "vllm", "generation_tokens": 0,
                                 **({} if g == "base" else {"verify_steps": 0})})]
        return docs

    def rows_for(g: str, c: str) -> list[dict[str, Any]] | None:
        return [row(server=g, verify=None, accepted=None, tokens=40, id=f"q{i}") for i in range(30)] if g == "base" \
            else None

    clean = _report({"A": 2.0, "B": 3.0}, n=30, docs_for=docs_for(False), rows_for=rows_for)
    dirty = _report({"A": 2.0, "B": 3.0}, n=30, docs_for=docs_for(True), rows_for=rows_for)
    assert clean["status"] == "complete", clean["status_reasons"]
    assert dirty["status"] == "untrusted"
    e_clean, e_dirty = eval_event_extra(clean), eval_event_extra(dirty)
    assert e_clean != e_dirty and e_dirty["status"] == "untrusted"
    assert e_dirty["conditions"]["A"]["greedy_think-on_c1"] == {
        "status": "untrusted", "rows_with_stats": 30, "completions": 30, "rows": 30, "planned": 30,
        "crosscheck": "mismatch"}
    assert e_clean["drafters"]["A"]["speedup_status"] == "checked"
    assert e_dirty["drafters"]["A"]["speedup_status"] == "untrusted"
    assert e_dirty["drafters"]["B"]["speedup_status"] == "checked"


def test_another_clients_traffic_on_the_baseline_marks_every_speedup_untrusted() -> None:
    """Issue 37: another client on the baseline server moved "x baseline" from 0.94 to 1.95 unflagged."""
    def docs(g: str, c: str) -> list[dict[str, Any]]:
        extra = 5_000 if g == "base" else 0
        spec = {} if g == "base" else {"verify_steps": 100, "accepted_tokens": 100 * (1 if g == "A" else 2),
                                        "draft_tokens": 300}
        return [_doc(g, "r1", {"engine": "vllm", "generation_tokens": 10 * 40 + extra, **spec},
                     before={"engine": "vllm", "generation_tokens": 0, **({"verify_steps": 0} if spec else {})})]

    def rows_for(g: str, c: str) -> list[dict[str, Any]] | None:
        return [row(server=g, verify=None, accepted=None, tokens=40, id=f"q{i}") for i in range(10)] if g == "base" \
            else None

    report = _report({"A": 2.0, "B": 3.0}, n=10, rows_for=rows_for, docs_for=docs)
    assert report["statuses"]["base"]["greedy_think-on_c1"] == "untrusted"
    base_check = report["groups"]["base"]["greedy_think-on_c1"]["crosscheck"][0]
    assert base_check["checks"] == {"speculative": "no counters", "generation_tokens": "mismatch"}
    assert base_check["differences"] == {"generation_tokens": {"rows": 400, "metrics": 5_400}}
    for e in report["rankings"]["greedy_think-on_c1"]:
        assert e["speedup_status"] == "untrusted" and e["speedup_vs_baseline"] is not None
    assert "(untrusted)" in render_markdown(report)


def test_generated_tokens_are_parsed_and_checked_for_both_engines() -> None:
    vllm_text = VLLM_METRICS + (
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 700.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 50.0\n'
        "# HELP vllm:generation_tokens_created Number of generation tokens processed.\n"
        "# TYPE vllm:generation_tokens_created gauge\n"
        'vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9\n')
    assert parse_spec_counters(vllm_text)["generation_tokens"] == 750
    base_text = ('# TYPE vllm:generation_tokens_total counter\n'
                 'vllm:generation_tokens_total{engine="0",model_name="m"} 12.0\n')
    assert parse_spec_counters(base_text) == {"engine": "vllm", "generation_tokens": 12}
    sgl = ("# TYPE sglang:generation_tokens_total counter\n"
           'sglang:generation_tokens_total{model_name="m"} 90.0\n'
           "# TYPE sglang:spec_verify_calls_total counter\n"
           'sglang:spec_verify_calls_total{model_name="m",tp_rank="0"} 12.0\n')
    assert parse_spec_counters(sgl) == {"engine": "sglang", "verify_steps": 12, "generation_tokens": 90}
    # a labelled counter appears at its first increment: absent before the window, it started from 0
    assert delta({}, {"engine": "sglang", "generation_tokens": 90}) == {"engine": "sglang", "generation_tokens": 90}
    rows = [row(server="a", tokens=60), row(server="a", tokens=30, id="b")]
    checks = F.crosscheck(rows, [_doc("a", "r1", {"engine": "sglang", "verify_steps": 20, "generation_tokens": 90},
                                      before={"engine": "sglang", "verify_steps": 0, "generation_tokens": 0})])
    assert checks[0]["status"] == "match" and checks[0]["checks"] == {"speculative": "match", "generation_tokens": "match"}


def test_vllm_without_engine_counters_says_disable_log_stats() -> None:
    """vLLM started with --disable-log-stats answers /metrics without any vllm: series: the cross-check
    cannot run, and the report says why instead of a bare "no counters"."""
    doc = {"server": "a", "run_id": "r1", "try_number": 1, "before": {}, "after": {}, "delta": None}
    [x] = F.crosscheck([row(server="a")], [doc], engines={"a": "vllm"})
    assert x["status"] == "no counters" and "--disable-log-stats" in x["note"]
    assert F.crosscheck_verdict([x]) == "not checked"
    assert _fig([row(server="a", id=f"q{i}") for i in range(10)], 10, [doc])["status"] == "complete"


def test_markdown_names_each_intervals_method_and_never_claims_bca() -> None:
    domains = ("math", "code", "chat", "poem")
    rows = {"A": _varied("A", 1.0, n=30, domains=domains), "B": _varied("B", 0.6, n=30, domains=domains)}
    report = _report({"A": 0, "B": 0}, n=30, rows_for=lambda g, c: rows.get(g))
    md = render_markdown(report)
    assert "BCa" not in md and "expanded percentile bootstrap" in md
    # per domain: 30 prompts over 4 domains, each under the floor: points without an interval, and why
    assert "no interval: " in md and "prompts" in md
    dom = report["groups"]["A"]["greedy_think-on_c1"]["by_domain"]["math"]
    assert dom["ci_low"] is None and dom["prompts"] == 8 and dom["ci_note"].startswith("no interval: 8 prompt(s)")


def test_answers_the_server_ended_before_any_draft_count_as_measured() -> None:
    """vLLM answers a request that never had a draft with 0 steps: the server said so; the row has no
    acceptance to weigh but the drafter was measured on it (the status's share counts it)."""
    rows = [row(id=f"q{i}", verify=0 if i < 10 else 10, accepted=0 if i < 10 else 20) for i in range(40)]
    fig = _fig(rows, 40)
    assert fig["stats_reported"] == 40 and fig["status"] == "complete"
    assert fig["acceptance"]["acceptance_length"] == pytest.approx(3.0)


def test_the_report_carries_each_carded_drafters_lineage() -> None:
    from dflash_pipeline.steps.handoff import eval_event_extra

    cfg = _cfg(("A", "B"))
    conds = [dict(c.to_dict(), root="x", server_info={}) for c in cfg.conditions()]
    lin = {"card": "s3://bk1/drafters/a/card.json", "dataset": "s3://bk1/ds", "tokenization": "original",
           "answers": "original", "defect": None, "trainer": "specforge", "trainer_version": "0.2.0", "steps": 400,
           "seed": 0, "final_loss": 1.23456, "heldout_of_training_data": True}
    per_group: dict[str, Any] = {}
    for g in ("A", "B", "base"):
        for c in conds:
            rows = [row(server=g, verify=None if g == "base" else 10, accepted=None if g == "base" else 10,
                        tokens=40, latency=1.0, id=f"q{i}") for i in range(4)]
            per_group.setdefault(g, {})[c["name"]] = F.condition_figures(
                rows, [], concurrency=1, n_servers=1, confidence=0.95, planned=4, baseline=g == "base")
    assignments = [{"group": "A", "conditions": conds, "source": {}, "lineage": lin},
                   {"group": "B", "conditions": conds, "source": {}, "lineage": None}]
    report = build_report(cfg, assignments, per_group, {})
    report["report_key"] = "ev/report.json"
    assert report["lineage"] == {"A": lin}
    md = render_markdown(report)
    assert "## Drafters' lineage (from their cards)" in md
    assert ("| A | `s3://bk1/ds` | `original` | original | - | specforge 0.2.0 | 400 | 0 | 1.2346 | yes | "
            "`s3://bk1/drafters/a/card.json` |") in md
    ranking = md.split("## Ranking")[1].split("\n\n")[1]
    assert "trained on" in ranking and "`original` (original answers), specforge 0.2.0, 400 steps" in ranking
    assert eval_event_extra(report)["lineage"] == {"A": lin}
