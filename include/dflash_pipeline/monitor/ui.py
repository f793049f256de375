"""HTML for the run page of the Airflow UI plugin, from plain data (no Airflow, no I/O here).

Server-rendered on purpose: the page is an iframe inside Airflow's UI, it must work without a
build step, and every figure it shows is computed once, in Python (`fleet.aggregate`). A few
lines of inline JS re-fetch the page's main block while the run is going.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from dflash_pipeline.config import short_server_labels
from dflash_pipeline.monitor.fleet import format_duration

TERMINAL = frozenset({"success", "failed"})
_PALETTE = ("#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#be185d", "#4d7c0f")

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px;color:#1f2937;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 8px}h3{font-size:14px;margin:4px 0 6px}
.muted{color:#6b7280}.mono{font-family:ui-monospace,Menlo,monospace;font-size:12px}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;background:#e5e7eb}
.s-success,.s-passed,.s-done{background:#d1fae5;color:#065f46}.s-failed,.s-stopped,.s-stale{background:#fee2e2;color:#991b1b}
.s-running{background:#dbeafe;color:#1e40af}.s-failing,.s-retrying,.s-up_for_retry{background:#fef3c7;color:#92400e}
.s-queued,.s-scheduled,.s-idle{background:#f3f4f6;color:#374151}
.bar{position:relative;height:18px;background:#f3f4f6;border-radius:4px;overflow:hidden;min-width:160px}
.bar>span{position:absolute;top:0;bottom:0}.bar .earlier{background:#9ca3af}.bar .committed{background:#10b981}
.bar .pending{background:#a7f3d0}.bar .share{background:#3b82f6}
.bar>b{position:absolute;left:6px;top:0;font-size:12px;font-weight:600;line-height:18px;color:#111827}
.runbar{height:26px}.runbar>b{line-height:26px;font-size:13px}
table{border-collapse:collapse;margin:4px 0}td,th{padding:3px 10px 3px 0;text-align:left;vertical-align:middle}
th{font-weight:600;border-bottom:1px solid #e5e7eb}td.n,th.n{text-align:right}
.kpis{display:flex;flex-wrap:wrap;gap:18px;margin:10px 0}.kpi b{display:block;font-size:18px}
.err{color:#991b1b}.plots{display:flex;flex-wrap:wrap;gap:8px;align-items:flex-start}
.plots img{max-width:min(100%,620px);border:1px solid #e5e7eb}
.cols{display:flex;flex-wrap:wrap;gap:28px;align-items:flex-start}
.md table td,.md table th{border-bottom:1px solid #f3f4f6}.md code{font-size:12px}
.legend span{margin-right:12px;font-size:12px}.legend i{display:inline-block;width:10px;height:3px;margin-right:4px;vertical-align:middle}
"""

_JS = """
(function(){
  var every = %d;
  function tick(){
    var main = document.getElementById('dflash-main');
    if(!main || main.getAttribute('data-final') === '1'){ return; }
    var u = new URL(window.location.href); u.searchParams.set('fragment','1');
    fetch(u.toString(), {credentials:'same-origin', headers:{'Accept':'text/html'}})
      .then(function(r){ if(!r.ok){ throw new Error('HTTP '+r.status); } return r.text(); })
      .then(function(t){ main.outerHTML = t; })
      .catch(function(e){ var s=document.getElementById('dflash-refresh'); if(s){ s.textContent='refresh failed: '+e.message; } })
      .finally(function(){ setTimeout(tick, every*1000); });
  }
  setTimeout(tick, every*1000);
})();
"""


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _n(x: Any) -> str:
    """Thousands separators for ints, one decimal for floats, a dash for None."""
    if x is None:
        return "\u2014"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:,.1f}" if abs(x) >= 10 or x == int(x) else f"{x:,.3g}"
    return _e(x)


def _badge(state: Any) -> str:
    s = _e(state or "none")
    return f'<span class="badge s-{s}">{s}</span>'


def _pct(f: float) -> str:
    return f"{100 * f:.1f} %"


def _when(ts: float | None) -> str:
    if ts is None:
        return "\u2014"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def page(title: str, body: str, *, refresh_s: int | None = None) -> str:
    """A whole HTML document around `body`."""
    js = f"<script>{_JS % refresh_s}</script>" if refresh_s else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_CSS}</style></head>'
            f"<body>{body}{js}</body></html>")


def message_page(title: str, text: str, *, link: tuple[str, str] | None = None) -> str:
    extra = f'<p><a href="{_e(link[0])}" target="_top">{_e(link[1])}</a></p>' if link else ""
    return page(title, f"<h1>{_e(title)}</h1><p>{_e(text)}</p>{extra}")


# --------------------------------------------------------------------------------------- pieces


def run_bar(p: Mapping[str, Any]) -> str:
    """The whole run: earlier runs, committed by this run, finished but not yet in a part."""
    total = max(1, int(p["prompts_total"]))
    earlier = int(p.get("prompts_done_earlier_runs", 0))
    committed = max(0, int(p["prompts_committed"]) - earlier)
    pending = int(p["prompts_pending_commit"])
    segs, left = [], 0.0
    for cls, n in (("earlier", earlier), ("committed", committed), ("pending", pending)):
        w = 100.0 * n / total
        if w > 0:
            segs.append(f'<span class="{cls}" style="left:{left:.3f}%;width:{w:.3f}%"></span>')
        left += w
    label = f"{_n(p['prompts_done'])} of {_n(p['prompts_total'])} prompts \u00b7 {_pct(p['fraction_done'])}"
    return (f'<div class="bar runbar" id="run-progress" role="progressbar" aria-valuemin="0" '
            f'aria-valuemax="{total}" aria-valuenow="{p["prompts_done"]}">{"".join(segs)}<b>{label}</b></div>')


def server_bar(s: Mapping[str, Any]) -> str:
    w = 100.0 * float(s.get("share", 0.0))
    return (f'<div class="bar server-progress" role="progressbar" aria-valuenow="{s["rows"]}">'
            f'<span class="share" style="left:0;width:{w:.3f}%"></span><b>{_n(s["rows"])} rows \u00b7 {_pct(s["share"])}'
            f"</b></div>")


_TICK_STEPS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 14400, 21600, 43200, 86400)


def duration_tick(seconds: float) -> str:
    """An axis label in the run's own units: 0, 45s, 2m, 1m 30s, 3h, 1h 30m."""
    s = int(round(seconds))
    if s == 0:
        return "0"
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    if h:
        return f"{h}h {m:02d}m" if m else f"{h}h"
    if m:
        return f"{m}m {sec:02d}s" if sec else f"{m}m"
    return f"{sec}s"


def time_ticks(span_s: float, max_ticks: int = 8) -> list[float]:
    """Tick positions (seconds since the start) at a round step, at most `max_ticks` + 1 of them."""
    if span_s <= 0:
        return [0.0]
    step = next((st for st in _TICK_STEPS_S if span_s / st <= max_ticks), None)
    if step is None:
        step = 86400 * math.ceil(span_s / 86400 / max_ticks)
    return [float(i * step) for i in range(int(span_s // step) + 1)]


def _nice_max(v: float) -> float:
    """The smallest round number (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x 10^k) at or above v: a y-axis top."""
    if v <= 0:
        return 1.0
    base = 10 ** math.floor(math.log10(v))
    return next(m * base for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if m * base >= v - 1e-9)


def _short_duration(seconds: float) -> str:
    """format_duration, but with a decimal below ten seconds (a demo's buckets are sub-second)."""
    return f"{seconds:.2g}s" if seconds < 10 else format_duration(seconds)


def throughput_svg(series: Mapping[str, Any], width: int = 760, height: int = 220) -> str:
    """Output tokens/s over the whole run: the fleet's sum (thick) and each server (thin).

    The x axis is time since the run started, ticked at round steps of its own length (seconds
    for a demo, hours for a long run); a server's line carries its full name as a tooltip.
    """
    t = list(series.get("t") or [])
    span = float(series.get("span_s") or 0.0)
    if len(t) < 2 or span <= 0:
        return '<p class="muted">Throughput appears after the first two progress samples.</p>'
    total = list(series["total"])
    servers: Sequence[Mapping[str, Any]] = series.get("servers") or []
    ymax = _nice_max(max([1.0, *total, *(v for srv in servers for v in srv["values"])]))
    pad_l, pad_r, pad_b, pad_t = 70, 12, 36, 8
    w, h = width - pad_l - pad_r, height - pad_b - pad_t

    def x(sec: float) -> float:
        return pad_l + w * sec / span

    def pts(vals: Sequence[float]) -> str:
        return " ".join(f"{x(ti):.1f},{pad_t + h * (1 - v / ymax):.1f}" for ti, v in zip(t, vals))

    labels = short_server_labels([str(srv["server"]) for srv in servers])
    lines = []
    legend = ['<span title="sum of every server"><i style="background:#111827;height:4px"></i>fleet</span>']
    for i, (srv, label) in enumerate(zip(servers, labels)):
        color = _PALETTE[i % len(_PALETTE)]
        full = f'{srv["server"]} ({srv["worker"]})'
        lines.append(f'<polyline class="server-line" data-server="{_e(srv["server"])}" fill="none" stroke="{color}" '
                     f'stroke-width="1.4" points="{pts(srv["values"])}"><title>{_e(full)}</title></polyline>')
        legend.append(f'<span title="{_e(full)}"><i style="background:{color}"></i>{_e(label)}</span>')
    lines.append(f'<polyline class="fleet-line" fill="none" stroke="#111827" stroke-width="2.4" '
                 f'points="{pts(total)}"><title>fleet</title></polyline>')
    grid = []
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        val = ymax * frac
        y = pad_t + h * (1 - frac)
        grid.append(f'<line x1="{pad_l}" x2="{pad_l + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>'
                    f'<text x="{pad_l - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end" fill="#6b7280">'
                    f"{val:,.0f}</text>")
    for tick in time_ticks(span):
        grid.append(f'<line x1="{x(tick):.1f}" x2="{x(tick):.1f}" y1="{pad_t + h}" y2="{pad_t + h + 4}" '
                    f'stroke="#9ca3af"/><text class="xtick" x="{x(tick):.1f}" y="{pad_t + h + 16}" font-size="11" '
                    f'text-anchor="middle" fill="#6b7280">{_e(duration_tick(tick))}</text>')
    axis = (f'<text x="{pad_l + w / 2}" y="{height - 3}" font-size="11" text-anchor="middle" fill="#374151">'
            f"time since the run started (run: {_e(format_duration(span))}; each point: "
            f'{_e(_short_duration(float(series.get("bucket_s") or 0.0)))} mean)</text>'
            f'<text x="11" y="{pad_t + h / 2}" font-size="11" text-anchor="middle" fill="#374151" '
            f'transform="rotate(-90 11 {pad_t + h / 2})">output tokens/s</text>')
    return (f'<svg id="throughput" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'role="img" aria-label="output tokens per second over time">{"".join(grid)}{"".join(lines)}{axis}</svg>'
            f'<div class="legend">{"".join(legend)}</div>')


def concurrency_svg(servers: Sequence[Mapping[str, Any]], series: Mapping[str, Any], width: int = 760,
                    height: int = 160) -> str:
    """Each server's in-flight limit over the run (steps), on the throughput chart's time axis: how
    the limit discovered from the server's live load moved (flat when concurrency_per_server is set)."""
    t0 = series.get("t0")
    span = float(series.get("span_s") or 0.0)
    drawn = [s for s in servers if len(s.get("limit_series") or []) >= 2]
    if t0 is None or span <= 0 or not drawn:
        return ""
    ymax = _nice_max(max(1.0, *(v for s in drawn for _, v in s["limit_series"])))
    pad_l, pad_r, pad_b, pad_t = 70, 12, 22, 8
    w, h = width - pad_l - pad_r, height - pad_b - pad_t

    def pt(t: float, v: float) -> str:
        sec = min(span, max(0.0, t - float(t0)))
        return f"{pad_l + w * sec / span:.1f},{pad_t + h * (1 - v / ymax):.1f}"

    labels = short_server_labels([str(s["server"]) for s in servers])
    index = {str(s["server"]): i for i, s in enumerate(servers)}
    lines, legend = [], []
    for srv in drawn:
        i = index[str(srv["server"])]
        color = _PALETTE[i % len(_PALETTE)]
        pts, prev = [], None
        for t, v in srv["limit_series"]:
            if prev is not None:
                pts.append(pt(t, prev))  # a step: the limit held until this sample
            pts.append(pt(t, v))
            prev = v
        control = srv.get("concurrency_control") or {}
        tip = (f'{srv["server"]}: limit {control.get("limit", "?")}, slots {control.get("slots", "?")} '
               f'({control.get("reason", "")})')
        lines.append(f'<polyline class="limit-line" data-server="{_e(srv["server"])}" fill="none" stroke="{color}" '
                     f'stroke-width="1.6" points="{" ".join(pts)}"><title>{_e(tip)}</title></polyline>')
        legend.append(f'<span title="{_e(tip)}"><i style="background:{color}"></i>{_e(labels[i])}</span>')
    grid = []
    for frac in (0.0, 0.5, 1.0):
        y = pad_t + h * (1 - frac)
        grid.append(f'<line x1="{pad_l}" x2="{pad_l + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>'
                    f'<text x="{pad_l - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end" fill="#6b7280">'
                    f"{ymax * frac:,.0f}</text>")
    axis = (f'<text x="11" y="{pad_t + h / 2}" font-size="11" text-anchor="middle" fill="#374151" '
            f'transform="rotate(-90 11 {pad_t + h / 2})">in-flight limit</text>')
    return (f'<svg id="concurrency" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="in-flight limit per server over time">{"".join(grid)}{"".join(lines)}{axis}</svg>'
            f'<div class="legend">{"".join(legend)}</div>')


def _limit_cell(s: Mapping[str, Any]) -> str:
    """`in flight / limit`, and under it the slots the limit was discovered from."""
    conc = s.get("concurrency")
    cell = f'{_n(s["in_flight"])} / {_n(conc)}' if conc else _n(s["in_flight"])
    control = s.get("concurrency_control") or {}
    if control.get("mode") in ("load", "latency"):
        cell += (f'<br><span class="muted" title="{_e(control.get("reason"))}">slots {_n(control.get("slots"))} '
                 f'· {_e(control.get("mode"))}</span>')
    elif control.get("mode") == "fixed":
        cell += '<br><span class="muted">fixed</span>'
    return cell


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, cls: str = "", numeric: Sequence[int] = ()) -> str:
    head = "".join(f'<th class="{"n" if i in numeric else ""}">{_e(h)}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{"n" if i in numeric else ""}">{c}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def servers_table(p: Mapping[str, Any]) -> str:
    rows = []
    for s in p["servers"]:
        errs = ", ".join(f"{_e(k)} {_n(v)}" for k, v in sorted((s.get("errors_by_class") or {}).items())) or ""
        rows.append([
            f'<span class="mono">{_e(s["server"])}</span><br><span class="muted">{_e(s["worker"])}</span>',
            _badge(s["state"]) + (f'<br><span class="muted">waiting {_e(format_duration(s["idle_s"]))}</span>'
                                  if s.get("idle_s") else ""),
            server_bar(s),
            _n(s["completions"]),
            f'{_n(s["errors"])}<br><span class="muted">{errs}</span>' if errs else _n(s["errors"]),
            _n(round(s["output_tokens_per_s"])),
            _limit_cell(s),
            _n(s["chunks_committed"]),
            _e(",".join(str(t) for t in s.get("tries") or [] if t is not None)),
            f'{_e(format_duration(s["updated_s_ago"]))} ago',
        ])
    return _table(["server", "state", "share of the run", "completions", "errors", "tok/s", "in flight",
                   "parts", "tries", "updated"], rows, cls="servers", numeric=(3, 5, 6, 7))


def abilities_section(rows: Sequence[Mapping[str, Any]]) -> str:
    """Each server's abilities found at preflight (manifest `servers[].abilities`)."""
    if not rows:
        return ""

    def yes_no(ok: Any, text: Any) -> str:
        cls = "" if ok else ' class="err"'
        return f"<span{cls}>{_e(text)}</span>"

    body = []
    for r in rows:
        ids = r.get("token_ids")
        body.append([
            f'<span class="mono">{_e(r.get("server"))}</span>',
            _e(" ".join(str(x) for x in (r.get("engine"), r.get("version")) if x) or "\u2014"),
            (yes_no(r.get("token_exact"), ids or "\u2014")
             + (f'<br><span class="muted mono">{_e(r["token_ids_via"])}</span>' if r.get("token_ids_via") else "")),
            yes_no(r.get("reasoning") in ("separate", "not checked"), r.get("reasoning") or "\u2014"),
            _e(r.get("speculative") or "no")
            + (f'<br><span class="muted mono">{_e(r["spec_stats"])}</span>' if r.get("spec_stats")
               else ('<br><span class="muted">no per-request figures</span>' if r.get("speculative") else "")),
            _n(r.get("slots")) + (f'<br><span class="muted">{_e(r["slots_source"])}</span>'
                                  if r.get("slots") is None and r.get("slots_source") else ""),
            _e(r.get("note") or ""),
        ])
    return "<h2>Server abilities (preflight)</h2>" + _table(
        ["server", "engine", "token ids", "reasoning", "speculative", "slots", "note"], body,
        cls="abilities", numeric=(5,))


def rate_kpi(p: Mapping[str, Any], run_state: str | None) -> tuple[str, str]:
    """The fleet's recent rate while running; once finished, its mean from first start to last report."""
    mean = (p.get("series") or {}).get("mean_output_tokens_per_s")
    if run_state in TERMINAL and mean is not None:
        return "output tok/s (fleet, mean)", _n(round(mean))
    return f"output tok/s (fleet, last {int(p.get('rate_window_s') or 300) // 60} min)", _n(round(p["output_tokens_per_s"]))


def progress_section(p: Mapping[str, Any], run_state: str | None) -> str:
    kpis = [
        ("done", f'{_n(p["prompts_done"])} / {_n(p["prompts_total"])}'),
        ("remaining", _n(p["prompts_remaining"])),
        ("ETA", format_duration(p["eta_s"]) if run_state not in TERMINAL else "\u2014"),
        rate_kpi(p, run_state),
        ("mean output tokens", _n(p["mean_output_tokens"])),
        ("completions", _n(p["completions"])),
        ("errors", _n(p["errors"])),
        ("in flight", _n(p["in_flight"])),
        ("parts", f'{_n(p["chunks_committed"])} / {_n(p["chunks_total"])}'),
    ]
    kpi_html = "".join(f'<div class="kpi" data-kpi="{_e(k)}"><span class="muted">{_e(k)}</span><b>{v}</b></div>'
                       for k, v in kpis)
    legend = ('<div class="legend"><span><i style="background:#9ca3af;height:8px"></i>earlier runs</span>'
              '<span><i style="background:#10b981;height:8px"></i>committed by this run</span>'
              '<span><i style="background:#a7f3d0;height:8px"></i>finished, part not written yet</span></div>')
    errors = ""
    if p["errors_by_class"]:
        errors = "<h2>Errors by class</h2>" + _table(
            ["error class", "rows"], [[_e(k), _n(v)] for k, v in sorted(p["errors_by_class"].items())],
            cls="errors", numeric=(1,))
    servers = servers_table(p) if p["servers"] else '<p class="muted">No generate task has reported yet.</p>'
    limits = concurrency_svg(p["servers"], p["series"])
    limits = f"<h2>In-flight limit per server</h2>{limits}" if limits else ""
    return (f'<section id="progress"><h2>Progress</h2>{run_bar(p)}{legend}<div class="kpis">{kpi_html}</div>'
            f"<h2>Servers</h2>{servers}{errors}<h2>Throughput</h2>{throughput_svg(p['series'])}{limits}</section>")


_REPORT_SCALARS = (
    "status", "prompts", "completions", "errors", "retryable_errors", "missing", "duplicates", "coverage",
    "error_rate", "truncation_rate", "truncated", "empty_content", "prompt_tokens", "output_tokens",
    "reasoning_tokens", "mean_output_tokens", "training_tokens", "model", "validated_at", "elapsed_s",
)


def report_section(report: Mapping[str, Any] | None, plot_urls: Sequence[tuple[str, str]], md_url: str | None,
                   report_url: str | None = None) -> str:
    if report is None:
        return ('<section id="report"><h2>Report</h2><p class="muted">No report yet: validate_and_count writes it '
                "when every generate task is done.</p></section>")
    status = report.get("status")
    parts = [f'<section id="report"><h2>Report {_badge(status)}</h2>']
    if report.get("problems"):
        parts.append('<ul class="err">' + "".join(f"<li>{_e(x)}</li>" for x in report["problems"]) + "</ul>")
    rows = [[_e(k), _n(report[k])] for k in _REPORT_SCALARS if k in report and not isinstance(report[k], (dict, list))]
    parts.append('<div class="cols"><div>' + _table(["figure", "value"], rows, cls="report-figures", numeric=(1,))
                 + "</div><div>")
    checks = report.get("checks") or []
    if checks:
        parts.append("<h3>Thresholds</h3>" + _table(
            ["check", "figure", "limit", "ok"],
            [[_e(c.get("name")), _e(c.get("figure")), f'{_e(c.get("threshold"))}={_e(c.get("limit"))}',
              _badge("passed" if c.get("ok") else "failed")] for c in checks], cls="report-checks"))
    per_server = report.get("per_server") or {}
    if per_server:
        cols = sorted({k for s in per_server.values() for k, v in s.items() if not isinstance(v, (dict, list))})
        preferred = [c for c in ("rows", "completions", "errors", "truncated", "output_tokens", "mean_latency_s",
                                 "output_tokens_per_request_s") if c in cols]
        parts.append("<h3>Per server</h3>" + _table(
            ["server", *preferred], [[f'<span class="mono">{_e(n)}</span>', *(_n(s.get(c)) for c in preferred)]
                                     for n, s in per_server.items()],
            cls="report-servers", numeric=tuple(range(1, len(preferred) + 1))))
    parts.append("</div></div>")
    if report_url or md_url:
        links = []
        if report_url:
            links.append(f'<a id="report-link" href="{_e(report_url)}">full report</a>')
        if md_url:
            links.append(f'<a href="{_e(md_url)}">report.md (Markdown source)</a>')
        links.append(f'<span class="mono">{_e(report.get("report_key"))}</span>')
        parts.append("<p>" + " \u00b7 ".join(links) + "</p>")
    parts.append(mix_section(report.get("mix")))
    if plot_urls:
        parts.append('<h2>Plots</h2><div class="plots">' + "".join(
            f'<img src="{_e(u)}" alt="{_e(n)}">' for n, u in plot_urls) + "</div>")
    parts.append("</section>")
    return "".join(parts)


LIVE_RATES = (("loop", "loops"), ("truncated_thinking", "thinking cut at max_tokens"), ("truncated", "truncated"),
              ("empty_answer", "empty answer"), ("refusal", "refusals"), ("language_off", "off-language"),
              ("reasoning_missing", "reasoning missing"))


def _rate_cell(r: Mapping[str, Any] | None) -> str:
    """A rate with the rows it is over (a rate over few rows says little)."""
    if not r or r.get("rate") is None:
        return '<span class="muted">-</span>'
    return f'{_pct(r["rate"])} <span class="muted">of {_n(r["rows"])}</span>'


def _acceptance_cell(a: Mapping[str, Any] | None) -> str:
    if not a or a.get("value") is None:
        return '<span class="muted">not speculating</span>'
    return f'{a["value"]:.2f} <span class="muted">over {_n(a["rows"])} rows</span>'


def live_quality_section(live: Mapping[str, Any] | None) -> str:
    """The run's live quality (issue 40): each rate over this run's committed parts, overall, per server and
    per thinking mode, with the rows it is over; acceptance length where servers speculate."""
    if not live:
        return ""
    heads = ["", *(label for _, label in LIVE_RATES), "acceptance length"]
    rows = [["<b>all</b>", *(_rate_cell(live["overall"].get(k)) for k, _ in LIVE_RATES),
             _acceptance_cell(live["overall"].get("acceptance_length"))]]
    for title, key in (("server", "by_server"), ("thinking", "by_thinking")):
        for name, rates in (live.get(key) or {}).items():
            rows.append([f'<span class="muted">{title}</span> <span class="mono">{_e(name)}</span>',
                         *(_rate_cell(rates.get(k)) for k, _ in LIVE_RATES),
                         _acceptance_cell(rates.get("acceptance_length"))])
    return ('<section id="live-quality"><h2>Live quality</h2><p class="muted">Over the '
            f'{_n(live["overall"].get("completions"))} completions of the {_n(live.get("parts"))} parts this run '
            "committed so far (docs/quality.md: fail_fast stops the run when a limit is surely broken).</p>"
            + _table(heads, rows, cls="live-quality") + "</section>")


def quality_section(q: Mapping[str, Any] | None) -> str:
    """The validation report's quality section: each flag's rows and share, by thinking mode."""
    if not q or q.get("disabled") or not q.get("flags"):
        return ""
    rows = []
    for name, f in q["flags"].items():
        by = ", ".join(f'{_e(k)}: {_n(v["rows"])} ({_pct(v["share"])})' for k, v in f["by_thinking"].items()) or "-"
        rows.append([_e(name), _n(f["rows"]), _pct(f["share"]), by])
    return (f'<section id="quality"><h2>Quality signals</h2><p class="muted">{_n(q["rows"])} completions checked; '
            f'{_n(q["rows_flagged"])} ({_pct(q["rows_flagged_share"])}) carry a flag. Tokenize\'s drop_quality '
            "decides what is dropped.</p>" + _table(["flag", "rows", "share", "by thinking"], rows, cls="quality-flags",
                                                     numeric=(1, 2)) + "</section>")


def tokenize_section(entries: Sequence[Mapping[str, Any]]) -> str:
    """A dflash_tokenize run: per dataset, the rows kept and dropped, by reason and thinking mode."""
    if not entries:
        return '<section id="tokenize"><h2>Tokenize</h2><p class="muted">No dataset planned yet.</p></section>'
    out = ['<section id="tokenize"><h2>Tokenize</h2>']
    for e in entries:
        name = f'{e.get("output_uri")}' + (f' ({e["tokenization"]})' if e.get("tokenization") else "")
        out.append(f'<h3 class="mono">{_e(name)}</h3>')
        r = e.get("report")
        if e.get("error"):
            out.append(f'<p class="err">{_e(e["error"])}</p>')
            continue
        if r is None:
            out.append('<p class="muted">No tokenized report yet: the report task writes it when every shard is done.'
                       "</p>")
            continue
        gate = r.get("gate") or {}
        out.append(f'<p>{_badge(r.get("status"))} kept {_n(r.get("rows_out"))} of {_n(r.get("rows_in"))} rows'
                   + (f' (kept share {_pct(gate["kept_share"])}, min_kept_share {gate.get("min_kept_share", "")})'
                      if gate.get("kept_share") is not None else "") + "</p>")
        dropped = r.get("dropped_by_reason") or {}
        by_thinking = r.get("dropped_by_thinking") or {}
        rows = [[_e(reason), _n(n), ", ".join(f"{_e(k)}: {_n(v)}" for k, v in (by_thinking.get(reason) or {}).items())
                 or "-"] for reason, n in sorted(dropped.items(), key=lambda kv: -kv[1])]
        out.append(_table(["dropped for", "rows", "by thinking"], rows, cls="tokenize-drops", numeric=(1,)) if rows
                   else '<p class="muted">Nothing dropped.</p>')
    out.append("</section>")
    return "".join(out)


MIX_INLINE_LABELS = 6


def mix_section(mix: Mapping[str, Any] | None) -> str:
    """The mix of the completions (validation's report `mix`): a table per dimension the target names,
    actual next to target with the gap; the other dimensions on one line each (largest labels first)."""
    if not mix or not mix.get("dimensions"):
        return ""
    out = [f'<section id="mix"><h2>Mix</h2><p class="muted">Shares of the {_e(mix.get("basis"))} '
           f'({_n(mix.get("completions"))})' + ("; target_mix side by side, gap = actual − target."
                                                 if mix.get("target") else "; no target_mix given.") + "</p>"]
    tables, lines = [], []
    for dim, entry in mix["dimensions"].items():
        rows = entry.get("rows") or []
        if "max_abs_gap" in entry:
            body = [[_e(r["label"]), _n(r["count"]), _pct(r["share"]), _pct(r.get("target", 0.0)),
                     f'{100 * r.get("gap", 0.0):+.1f} pp'] for r in rows]
            tables.append(f'<div data-dim="{_e(dim)}"><h3>{_e(dim)} <span class="muted">largest gap '
                          f'{100 * entry["max_abs_gap"]:.1f} pp</span></h3>'
                          + _table(["label", "completions", "share", "target", "gap"], body, cls="mix-target",
                                   numeric=(1, 2, 3, 4)) + "</div>")
        elif rows:
            top = sorted(rows, key=lambda r: -r["count"])[:MIX_INLINE_LABELS]
            more = f" · +{len(rows) - len(top)} more" if len(rows) > len(top) else ""
            lines.append(f'<li data-dim="{_e(dim)}"><b>{_e(dim)}</b>: '
                         + " · ".join(f"{_e(r['label'])} {_pct(r['share'])}" for r in top) + more + "</li>")
    if tables:
        out.append('<div class="cols">' + "".join(tables) + "</div>")
    if lines:
        out.append('<ul class="mix-other">' + "".join(lines) + "</ul>")
    out.append("</section>")
    return "".join(out)


def tasks_line(tasks: Sequence[Mapping[str, Any]]) -> str:
    if not tasks:
        return ""
    items = []
    for t in tasks:
        name = t["task_id"] if int(t.get("map_index", -1)) < 0 else f'{t["task_id"]}[{t["map_index"]}]'
        items.append(f'<span class="task">{_e(name)} {_badge(t.get("state"))}</span>')
    return '<p class="tasks">' + " ".join(items) + "</p>"


def failures_section(failures: Sequence[Mapping[str, Any]]) -> str:
    """Why tasks failed (monitor/failures.py): each task's latest failed try, its message as raised (it says
    what to change), tasks that will be retried marked so."""
    if not failures:
        return ""
    rows = []
    for f in failures:
        index = int(f.get("map_index", -1))
        name = f["task_id"] if index < 0 else f'{f["task_id"]}[{index}]'
        state = "failed" if f.get("state") == "failed" else "will be retried"
        rows.append(f'<tr><td class="mono">{_e(name)}</td><td>try {_e(f.get("try_number"))}, {_e(state)}</td>'
                    f'<td class="mono">{_e(f.get("error_class") or "")}</td><td>{_e(f.get("message"))}</td></tr>')
    return ('<section id="failures"><h2>Why it failed</h2><table><thead><tr><th>task</th><th>try</th>'
            '<th>error</th><th>reason</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table></section>")


def run_main(view: Mapping[str, Any]) -> str:
    """The block the page refreshes: everything below the title (a dflash_eval run's: ui_eval.py)."""
    if view.get("kind") == "eval":
        from dflash_pipeline.monitor.ui_eval import eval_main

        return eval_main(view)
    run_state = view.get("run_state")
    final = run_state in TERMINAL and (view.get("report") is not None or view.get("progress") is None
                                       or view.get("report_missing_final", False))
    parts = [f'<div id="dflash-main" data-final="{1 if final else 0}">']
    parts.append(f'<p>{_badge(run_state)} <span class="mono">{_e(view.get("output_uri"))}</span> '
                 f'<span class="muted">\u00b7 started {_e(_when(view.get("run_started_at")))} \u00b7 page '
                 f'{_e(_when(view.get("now")))}</span> <span class="muted" id="dflash-refresh">'
                 f'{"" if final else "refreshes every %d s" % int(view.get("refresh_s", 10))}</span></p>')
    parts.append(tasks_line(view.get("tasks") or []))
    for msg in view.get("warnings") or []:
        parts.append(f'<p class="err">{_e(msg)}</p>')
    parts.append(failures_section(view.get("failures") or []))
    if view.get("tokenize") is not None:
        parts.append(tokenize_section(view["tokenize"]) + "</div>")
        return "".join(parts)
    if view.get("progress") is not None:
        parts.append(progress_section(view["progress"], run_state))
        parts.append(live_quality_section(view.get("live_quality")))
        parts.append(abilities_section(view.get("abilities") or []))
    elif any(f.get("task_id") == "plan" and f.get("state") == "failed" for f in view.get("failures") or []):
        parts.append('<p class="muted">No plan: the plan task failed (its reason is above); nothing was '
                     'generated.</p>')
    else:
        parts.append('<p class="muted">No plan yet: the manifest appears when the plan task has run.</p>')
    parts.append(report_section(view.get("report"), view.get("plot_urls") or [], view.get("report_md_url"),
                                view.get("report_url")))
    parts.append(quality_section((view.get("report") or {}).get("quality")))
    parts.append("</div>")
    return "".join(parts)


def run_page(view: Mapping[str, Any]) -> str:
    title = f'{view["dag_id"]} \u00b7 {view["run_id"]}'
    links = " \u00b7 ".join(f'<a href="{_e(u)}" target="_top">{_e(t)}</a>' for t, u in view.get("links") or [])
    body = (f'<h1>DFlash run <span class="mono">{_e(view["run_id"])}</span></h1>'
            f'<p class="muted">{links}</p>{run_main(view)}')
    return page(title, body, refresh_s=int(view.get("refresh_s", 10)))


def markdown_html(text: str) -> str:
    """report.md as HTML: CommonMark with tables, raw HTML in the text escaped, never passed through."""
    from markdown_it import MarkdownIt

    return str(MarkdownIt("js-default").render(text))


def report_page(title: str, markdown_text: str, links: Sequence[tuple[str, str]]) -> str:
    """The validation report rendered, with links back to the run page and to the Markdown source."""
    nav = " \u00b7 ".join(f'<a href="{_e(u)}">{_e(t)}</a>' for t, u in links)
    body = f'<p class="muted">{nav}</p><article id="report-md" class="md">{markdown_html(markdown_text)}</article>'
    return page(title, body)


def index_page(dag_id: str, runs: Sequence[Mapping[str, Any]], run_url: Any) -> str:
    """Recent runs, each linking to its page (`run_url(run_id) -> str`)."""
    rows = [[f'<a href="{_e(run_url(r["run_id"]))}">{_e(r["run_id"])}</a>', _badge(r.get("state")),
             _e(_when(r.get("start"))), f'<span class="mono">{_e(r.get("output_uri"))}</span>'] for r in runs]
    table = _table(["run", "state", "started", "output_uri"], rows, cls="runs") if rows else \
        '<p class="muted">No runs yet.</p>'
    return page(f"{dag_id} runs", f"<h1>{_e(dag_id)}: recent runs</h1>{table}")


def quote_id(x: str) -> str:
    return quote(x, safe="")


def to_json(view: Mapping[str, Any]) -> str:
    return json.dumps(view, default=str)
