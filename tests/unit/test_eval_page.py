"""The DFlash progress page of a dflash_eval run (monitor/ui_eval.py): the verdict on the page itself
(status, ranking with ties, paired differences, each drafter and condition's status), and none of
dflash_generate's text ("No plan yet", "validate_and_count") anywhere on an eval's pages."""

from __future__ import annotations

from typing import Any

from test_eval_figures import _report, _varied

from dflash_pipeline.monitor import ui

RUN = "manual__2026-12-07T10:00:00+00:00"
BASE = "/dflash/runs/dflash_eval/" + ui.quote_id(RUN)
GENERATE_TEXT = ("No plan yet", "validate_and_count", "No report yet")


def _view(report: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {"dag_id": "dflash_eval", "run_id": RUN, "run_state": "success", "output_uri": "s3://b/ev", "kind": "eval",
            "eval_dataset": None, "run_base": BASE, "progress": None, "report": report,
            "plot_urls": [("report-acceptance.png", f"{BASE}/plots/report-acceptance.png")] if report else [],
            "report_url": f"{BASE}/report" if report else None, "datasets": ["A/greedy_think-on_c1"],
            "tasks": [{"task_id": "prepare", "map_index": -1, "state": "success"},
                      {"task_id": "report", "map_index": -1, "state": "success" if report else "running"}], **extra}


def test_the_eval_page_shows_ranking_paired_differences_and_statuses_directly() -> None:
    rows = {"A": _varied("A", 1.00, noise=0.3), "B": _varied("B", 0.99, noise=0.3), "C": _varied("C", 0.5)}
    report = _report({"A": 0, "B": 0, "C": 0}, n=40, rows_for=lambda g, c: rows.get(g))
    html = ui.run_page(_view(report))
    for text in GENERATE_TEXT:
        assert text not in html, text
    main = html[html.index('id="eval-report"'):]
    assert 'class="eval-ranking"' in main and 'class="eval-paired"' in main and 'class="eval-status"' in main
    ranking = main[main.index('class="eval-ranking"'):main.index("</table>", main.index('class="eval-ranking"'))]
    tied = report["rankings"]["greedy_think-on_c1"][1]["drafter"]
    assert ">=1<" in ranking and f"<b>{tied}</b>" in ranking and "not separable" in ranking
    status = main[main.index('class="eval-status"'):]
    assert status.count('class="badge s-complete"') == 3 * 2 + 2  # every drafter and the baseline, 2 conditions
    assert f'href="{BASE}?dataset=A/greedy_think-on_c1"' in status
    assert 'src="' + BASE + '/plots/report-acceptance.png"' in main and 'data-final="1"' in html


def test_a_failed_eval_says_why_and_an_unfinished_one_says_what_comes() -> None:
    failed = _report({"A": 2.0, "B": 3.0}, n=30,
                     rows_for=lambda g, c: [] if g == "B" else None)
    html = ui.run_page(_view(failed))
    assert 'class="badge s-failed"' in html and "nothing measured" in html
    pending = ui.run_page({**_view(None), "run_state": "running"})
    assert "No eval report yet: the report task writes it" in pending and 'data-final="0"' in pending
    for text in GENERATE_TEXT[:2]:
        assert text not in pending
    dead = ui.run_page({**_view(None), "run_state": "failed", "datasets": [],
                        "tasks": [{"task_id": "prepare", "map_index": -1, "state": "failed"},
                                  {"task_id": "report", "map_index": -1, "state": "failed"}]})
    assert "report task ended failed" in dead and 'data-final="1"' in dead
    for text in GENERATE_TEXT:
        assert text not in dead


def test_a_dataset_of_the_eval_shows_its_progress_without_generates_report_text() -> None:
    html = ui.run_page(_view(None, eval_dataset="A/greedy_think-on_c1", run_state="running"))
    assert "Dataset <b class=\"mono\">A/greedy_think-on_c1</b>" in html and "Not planned yet" in html
    for text in GENERATE_TEXT:
        assert text not in html


def test_the_eval_page_says_where_rows_asked_otherwise_and_how_servers_count() -> None:
    """Issue 37: the rows' own settings (recorded, not sent) and the engine notes are on the page too."""
    report = _report({"A": 0, "B": 0}, n=30)
    report["row_settings"] = {"greedy_think-on_c1": ["30 row(s) asked thinking off; sent on"]}
    report["engine_notes"] = {"A": ["s1: SGLang --speculative-adaptive: the draft depth changes at run time"]}
    main = ui.run_page(_view(report))
    main = main[main.index('id="eval-report"'):]
    assert 'class="eval-notes"' in main
    assert "greedy_think-on_c1: 30 row(s) asked thinking off; sent on" in main
    assert "A: s1: SGLang --speculative-adaptive" in main
