"""report.md of dflash_eval: the ranking, each condition side by side, domains, histograms, the
/metrics cross-check, and how every figure is computed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _ci(d: Mapping[str, Any]) -> str:
    if d.get("acceptance_length") is None:
        return "-"
    lo, hi = d.get("ci_low"), d.get("ci_high")
    ci = f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else ""
    return f"{d['acceptance_length']:.3f}{ci}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def render_markdown(report: Mapping[str, Any]) -> str:
    lines: list[str] = ["# dflash_eval report", ""]
    src = report.get("source") or {}
    cfg = report.get("config") or {}
    lines += [f"- status: **{report['status']}**", f"- eval root: `{report['output_uri']}`",
              f"- prompts: `{src.get('prompts_uri')}`" + (f" (held-out split of `{src['dataset_uri']}`)"
                                                         if src.get("dataset_uri") else ""),
              f"- max_tokens {cfg.get('max_tokens')}, max_prompts {cfg.get('max_prompts')}, "
              f"conditions: {', '.join(c['name'] for c in report.get('conditions') or [])}", ""]
    for problem in report.get("incomplete") or []:
        lines.append(f"- **incomplete**: {problem}")
    headline = report.get("headline_condition")
    if headline:
        lines += ["", f"## Ranking ({headline})", ""]
        lines += _table(["rank", "drafter", "acceptance length [CI]", "rows with stats / rows", "tokens/s",
                         "x baseline"],
                        [[e["rank"], e["drafter"], _ci(e), f"{e['rows_with_stats']}/{e['rows']}",
                          _f(e["tokens_per_s"], 1), _f(e["speedup_vs_baseline"], 2)]
                         for e in report["rankings"].get(headline, [])])
    groups = report.get("groups") or {}
    for cond in report.get("conditions") or []:
        name = cond["name"]
        lines += ["", f"## {name}", "",
                  f"temperature {cond['temperature']}, top_p {cond['top_p']}, thinking "
                  f"{'on' if cond['thinking'] else 'off'}, concurrency {cond['concurrency']}", ""]
        rows = []
        for g, conds in groups.items():
            fig = conds.get(name)
            if fig is None:
                continue
            acc, tp = fig["acceptance"], fig["throughput"]
            pp = acc.get("per_position")
            checks = sorted({x["status"] for x in fig["crosscheck"]}) or ["-"]
            rank = next((e for e in report["rankings"].get(name, []) if e["drafter"] == g), None)
            rows.append([g, _ci(acc), f"{acc['rows_with_stats']}/{acc['rows']}",
                         ", ".join(f"{p:.2f}" for p in pp[:8]) if pp else "-", _f(tp.get("tokens_per_s"), 1),
                         _f(rank["speedup_vs_baseline"], 2) if rank else "-",
                         f"{fig['errors']}/{fig['rows']}", ", ".join(checks)])
        lines += _table(["group", "acceptance length [CI]", "rows with stats", "per-position acceptance",
                         "tokens/s", "x baseline", "errors", "/metrics check"], rows)
        domains = sorted({d for conds in groups.values() for d in (conds.get(name) or {}).get("by_domain", {})})
        spec_groups = [g for g, conds in groups.items() if (conds.get(name) or {}).get("acceptance", {}).get(
            "rows_with_stats")]
        if domains and spec_groups:
            lines += ["", "By domain (acceptance length [CI], rows):", ""]
            lines += _table(["domain", *spec_groups],
                            [[d, *[(lambda x: f"{_ci(x)} ({x['rows']})" if x else "-")(
                                groups[g][name]["by_domain"].get(d)) for g in spec_groups]] for d in domains])
    if report.get("by_thinking"):
        lines += ["", "## By thinking mode (all conditions pooled)", ""]
        lines += _table(["group", "thinking on", "thinking off"],
                        [[g, _ci(m.get("on") or {}), _ci(m.get("off") or {})] for g, m in report["by_thinking"].items()])
    if headline:
        lines += ["", f"## Accepted drafts per verify step ({headline})", "",
                  "histogram[k] = verify steps that accepted exactly k draft tokens", ""]
        for g, conds in groups.items():
            hist = (conds.get(headline) or {}).get("acceptance", {}).get("histogram")
            if hist:
                lines.append(f"- {g}: {hist}")
    lines += ["", "## /metrics cross-check", ""]
    checks = [[g, c, x["server"], x["run_id"], x["status"], x.get("rows_sum"), x.get("metrics_delta"), x.get("note", "")]
              for g, conds in groups.items() for c, fig in conds.items() for x in fig["crosscheck"]]
    lines += _table(["group", "condition", "server", "run", "status", "rows' sum", "/metrics delta", "note"], checks) \
        if checks else ["no /metrics scraped in any run"]
    lines += ["", "## How the figures are computed", ""]
    lines += [f"- **{k}**: {v}" for k, v in (report.get("definitions") or {}).items()]
    return "\n".join(lines) + "\n"
