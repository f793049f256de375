"""HTML of a dflash_eval run's page, from plain data (no Airflow, no I/O here).

Why its own module: an eval is not a generate run. Its root has no manifest and no validation
report; what a user comes for is the verdict: each drafter and condition's status, the ranking
(with drafters the paired comparison cannot separate sharing a rank) and the paired differences,
on the page itself. Each (drafter, condition) dataset keeps its generate progress view (bars,
throughput) under `?dataset=`, without generate's report text. `ui.run_main` hands eval views here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dflash_pipeline.monitor import ui

EVAL_CSS = (".s-complete{background:#d1fae5;color:#065f46}.s-partial,.s-untrusted{background:#fef3c7;color:#92400e}"
            ".s-unchecked{background:#f3f4f6;color:#374151}td.tie{color:#92400e}")


def _acc(d: Mapping[str, Any], key: str = "acceptance_length", sign: bool = False) -> str:
    v = d.get(key)
    if v is None:
        return "\u2014"
    fmt = "+.3f" if sign else ".3f"
    if d.get("ci_low") is not None and d.get("ci_high") is not None:
        return (f"{v:{fmt}} <span class=\"muted\">[{d['ci_low']:{fmt}}, {d['ci_high']:{fmt}}]</span>"
                + (f'<br><span class="muted">{ui._e(d.get("ci_method"))}</span>' if d.get("ci_method") else ""))
    return f"{v:{fmt}}" + (f'<br><span class="muted">{ui._e(d.get("ci_note"))}</span>' if d.get("ci_note") else "")


def _speedup(e: Mapping[str, Any]) -> str:
    x = e.get("speedup_vs_baseline")
    if x is None:
        return "\u2014"
    status = e.get("speedup_status")
    return f"{x:.2f}" + (f" {ui._badge(status)}" if status and status != "checked" else "")


def _vs_above(e: Mapping[str, Any]) -> str:
    p = e.get("vs_above")
    if not p:
        return ""
    diff = _acc({"d": p.get("difference"), "ci_low": p.get("ci_low"), "ci_high": p.get("ci_high"),
                 "ci_note": None if p.get("ci_low") is not None else f"{p.get('prompts')} common prompts: no interval"},
                "d", sign=True)
    verdict = "separable" if p.get("separable") else "<b>not separable</b>"
    return f"{ui._e(p.get('a'))} {diff} \u00b7 {verdict}"


def ranking_table(report: Mapping[str, Any]) -> str:
    headline = report.get("headline_condition")
    entries: Sequence[Mapping[str, Any]] = (report.get("rankings") or {}).get(headline or "", [])
    if not entries:
        return '<p class="muted">No drafter was ranked.</p>'
    rows = []
    for e in entries:
        rank = "\u2014" if e.get("rank") is None else ("=" if e.get("tied_with") else "") + str(e["rank"])
        rows.append([f'<span class="{"tie" if e.get("tied_with") else ""}">{ui._e(rank)}</span>',
                     f"<b>{ui._e(e['drafter'])}</b>", ui._badge(e.get("status")), _acc(e),
                     f"{ui._n(e.get('rows_with_stats'))} / {ui._n(e.get('planned'))}", ui._n(e.get("tokens_per_s")),
                     _speedup(e), ui._e(e.get("crosscheck")), _vs_above(e)])
    return ui._table(["rank", "drafter", "status", "acceptance length [CI]", "rows with stats / planned", "tok/s",
                      "x baseline", "/metrics", "vs the drafter above (paired)"], rows, cls="eval-ranking",
                     numeric=(4, 5))


def paired_table(report: Mapping[str, Any], condition: str) -> str:
    pairs = (report.get("paired") or {}).get(condition) or []
    if not pairs:
        return ""
    rows = [[f"{ui._e(p['a'])} \u2212 {ui._e(p['b'])}", _acc({**p, "d": p.get("difference")}, "d", sign=True),
             ui._n(p.get("prompts")),
             "yes" if p.get("separable") else ("<b>no</b>" if p.get("separable") is False else "<b>no</b> (no interval)")]
            for p in pairs]
    return (f"<h3>Paired differences <span class=\"muted\">({ui._e(condition)}, on the prompts both measured)</span>"
            "</h3>" + ui._table(["A \u2212 B", "difference [CI]", "common prompts", "separable"], rows,
                                cls="eval-paired", numeric=(2,)))


def status_table(report: Mapping[str, Any], dataset_url: Any) -> str:
    rows = []
    for g, conds in (report.get("groups") or {}).items():
        for c, fig in conds.items():
            acc = fig.get("acceptance") or {}
            rows.append([f"<b>{ui._e(g)}</b>", f'<a href="{ui._e(dataset_url(f"{g}/{c}"))}">{ui._e(c)}</a>',
                         ui._badge(fig.get("status")), _acc(acc),
                         f"{ui._n(acc.get('rows_with_stats'))} / {ui._n(fig.get('planned'))}",
                         f"{ui._n(fig.get('completions'))} / {ui._n(fig.get('planned'))}", ui._n(fig.get("errors")),
                         ui._e(fig.get("crosscheck_verdict")),
                         "<br>".join(ui._e(r) for r in fig.get("status_reasons") or [])])
    return ui._table(["drafter", "condition", "status", "acceptance length [CI]", "rows with stats / planned",
                      "completions / planned", "errors", "/metrics", "why"], rows, cls="eval-status",
                     numeric=(4, 5, 6))


def eval_report_section(view: Mapping[str, Any]) -> str:
    report = view.get("report")
    base = view.get("run_base") or ""

    def dataset_url(d: str) -> str:
        return f"{base}?dataset={d}"

    if report is None:
        datasets = view.get("datasets") or []
        links = "".join(f'<li><a href="{ui._e(dataset_url(d))}">{ui._e(d)}</a></li>' for d in datasets)
        state = next((t.get("state") for t in view.get("tasks") or [] if t.get("task_id") == "report"), None)
        if state in ("failed", "upstream_failed"):
            text = f"The report task ended {ui._e(state)} without writing a report; its log says why."
        elif not datasets:
            text = "Nothing planned yet: prepare plans one dataset per drafter and condition."
        else:
            text = "No eval report yet: the report task writes it when every evaluate task is done."
        return (f'<section id="eval-report"><h2>Eval</h2><p class="muted">{text}</p>'
                + (f"<h3>Drafter \u00d7 condition datasets</h3><ul>{links}</ul>" if links else "") + "</section>")
    headline = report.get("headline_condition")
    parts = [f'<section id="eval-report"><h2>Eval {ui._badge(report.get("status"))}</h2>']
    if report.get("status_reasons"):
        parts.append('<ul class="err">' + "".join(f"<li>{ui._e(r)}</li>" for r in report["status_reasons"]) + "</ul>")
    if headline:
        parts.append(f'<h3>Ranking <span class="muted">({ui._e(headline)})</span></h3>' + ranking_table(report))
        parts.append(paired_table(report, headline))
    if report.get("groups"):
        parts.append("<h3>Each drafter and condition</h3>" + status_table(report, dataset_url))
    notes = [f"{c}: {d}" for c, ds in (report.get("row_settings") or {}).items() for d in ds]
    notes += [f"{g}: {n}" for g, ns in (report.get("engine_notes") or {}).items() for n in ns]
    if notes:
        parts.append('<h3>What was sent and how the servers count</h3><ul class="eval-notes">'
                     + "".join(f"<li>{ui._e(n)}</li>" for n in notes) + "</ul>")
    links = []
    if view.get("report_url"):
        links.append(f'<a id="report-link" href="{ui._e(view["report_url"])}">full report</a>')
    if view.get("report_md_url"):
        links.append(f'<a href="{ui._e(view["report_md_url"])}">report.md (Markdown source)</a>')
    if links:
        parts.append("<p>" + " \u00b7 ".join(links) + "</p>")
    plots = view.get("plot_urls") or []
    if plots:
        parts.append('<div class="plots">' + "".join(f'<img src="{ui._e(u)}" alt="{ui._e(n)}">' for n, u in plots)
                     + "</div>")
    parts.append("</section>")
    return "".join(parts)


def eval_main(view: Mapping[str, Any]) -> str:
    """The refreshed block of an eval run's page: the eval's verdict at its root, or one (drafter,
    condition) dataset's generate progress under `?dataset=`."""
    run_state = view.get("run_state")
    dataset = view.get("eval_dataset")
    if dataset:
        final = run_state in ui.TERMINAL
    else:
        report_state = next((t.get("state") for t in view.get("tasks") or [] if t.get("task_id") == "report"), None)
        final = run_state in ui.TERMINAL and (view.get("report") is not None or report_state != "running")
    parts = [f'<style>{EVAL_CSS}</style><div id="dflash-main" data-final="{1 if final else 0}">']
    parts.append(f'<p>{ui._badge(run_state)} <span class="mono">{ui._e(view.get("output_uri"))}</span> '
                 f'<span class="muted">\u00b7 started {ui._e(ui._when(view.get("run_started_at")))} \u00b7 page '
                 f'{ui._e(ui._when(view.get("now")))}</span> <span class="muted" id="dflash-refresh">'
                 f'{"" if final else "refreshes every %d s" % int(view.get("refresh_s", 10))}</span></p>')
    parts.append(ui.tasks_line(view.get("tasks") or []))
    for msg in view.get("warnings") or []:
        parts.append(f'<p class="err">{ui._e(msg)}</p>')
    if dataset:
        parts.append(f'<p>Dataset <b class="mono">{ui._e(dataset)}</b> of this eval '
                     f'(<a href="{ui._e(view.get("run_base"))}">the eval\'s ranking and statuses</a>).</p>')
        if view.get("progress") is not None:
            parts.append(ui.progress_section(view["progress"], run_state))
            parts.append(ui.abilities_section(view.get("abilities") or []))
        else:
            parts.append('<p class="muted">Not planned yet: prepare plans this dataset.</p>')
    else:
        parts.append(eval_report_section(view))
    parts.append("</div>")
    return "".join(parts)
