"""report.md of dflash_eval: the status of every (group, condition), the ranking with its paired
differences, each condition side by side, domains, histograms, the /metrics cross-check, and how
every figure is computed. Every interval says its method and the prompts it stands on; where there
is none, why."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _ci(d: Mapping[str, Any], key: str = "acceptance_length", sign: bool = False) -> str:
    """`value [low, high]`; `value (no interval: ...)` where none could hold."""
    v = d.get(key)
    if v is None:
        return "-"
    fmt = "+.3f" if sign else ".3f"
    lo, hi = d.get("ci_low"), d.get("ci_high")
    if lo is not None and hi is not None:
        return f"{v:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"
    return f"{v:{fmt}}" + (f" ({d['ci_note']})" if d.get("ci_note") else "")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _speedup(e: Mapping[str, Any]) -> str:
    s = _f(e.get("speedup_vs_baseline"), 2)
    status = e.get("speedup_status")
    return s if s == "-" or status in (None, "checked") else f"{s} ({status})"


def _vs_above(e: Mapping[str, Any]) -> str:
    p = e.get("vs_above")
    if not p:
        return "-"
    verdict = "separable" if p.get("separable") else "**not separable**"
    diff = _ci({"d": p.get("difference"), "ci_low": p.get("ci_low"), "ci_high": p.get("ci_high"),
                "ci_note": None if p.get("ci_low") is not None else f"{p.get('prompts')} common prompts, no interval"},
               "d", sign=True)
    return f"{p.get('a')} {diff}: {verdict}"


def header_lines(report: Mapping[str, Any]) -> list[str]:
    src = report.get("source") or {}
    cfg = report.get("config") or {}
    planned = sorted({f.get("planned") for conds in (report.get("groups") or {}).values() for f in conds.values()
                      if f.get("planned") is not None})
    prompts = "no prompts were planned" if not planned else f"{', '.join(map(str, planned))} planned rows per condition"
    source = (f"`{src.get('prompts_uri')}`" + (f" (held-out split of `{src['dataset_uri']}`)" if src.get("dataset_uri")
                                               else "")) if src else "not resolved (prepare did not complete)"
    lines = [f"- status: **{report['status']}**", f"- eval root: `{report['output_uri']}`",
             f"- prompts: {source}; {prompts}",
             f"- max_tokens {cfg.get('max_tokens')}, max_prompts {cfg.get('max_prompts')}, "
             f"conditions: {', '.join(c['name'] for c in report.get('conditions') or []) or 'none'}", ""]
    lines += [f"- **{report['status']}**: {r}" for r in report.get("status_reasons") or []]
    return lines


def _trained_on(lin: Mapping[str, Any] | None) -> str:
    """One cell: what the drafter was trained on, from its card."""
    if not lin:
        return "-"
    defect = f", defect `{lin['defect']}`" if lin.get("defect") else ""
    return (f"`{lin.get('tokenization')}` ({lin.get('answers') or 'regenerated'} answers{defect}), "
            f"{lin.get('trainer')} {lin.get('trainer_version') or ''}, {_f(lin.get('steps'))} steps".replace(" ,", ","))


def lineage_lines(report: Mapping[str, Any]) -> list[str]:
    """Each carded drafter's lineage: the data it learned from and how (its card, dflash_train)."""
    lineage = report.get("lineage") or {}
    if not lineage:
        return []
    rows = [[g, f"`{lin.get('dataset')}`", f"`{lin.get('tokenization')}`", lin.get("answers") or "regenerated",
             lin.get("defect") or "-", f"{lin.get('trainer')} {lin.get('trainer_version') or ''}".strip(),
             _f(lin.get("steps")), _f(lin.get("seed")), _f(lin.get("final_loss"), 4),
             "yes" if lin.get("heldout_of_training_data") else "**no**", f"`{lin.get('card')}`"]
            for g, lin in lineage.items()]
    return ["", "## Drafters' lineage (from their cards)", ""] + _table(
        ["drafter", "dataset", "tokenization", "answers", "defect", "trainer", "steps", "seed", "final loss",
         "prompts held out of its training data", "card"], rows)


def status_lines(report: Mapping[str, Any]) -> list[str]:
    """Per group and condition: status, what it stands on, the /metrics verdict."""
    rows = []
    for g, conds in (report.get("groups") or {}).items():
        for c, fig in conds.items():
            acc = fig["acceptance"]
            rows.append([g, c, f"**{fig.get('status')}**", f"{acc['rows_with_stats']}/{fig.get('planned')}",
                         f"{fig['completions']}/{fig.get('planned')}", fig["errors"], acc.get("prompts"),
                         fig.get("crosscheck_verdict", "-")])
    if not rows:
        return []
    return ["", "## Status per drafter and condition", ""] + _table(
        ["group", "condition", "status", "rows with stats / planned", "completions / planned", "errors", "prompts",
         "/metrics check"], rows)


def ranking_lines(report: Mapping[str, Any], condition: str) -> list[str]:
    entries = report["rankings"].get(condition, [])
    lineage = report.get("lineage") or {}
    lines = _table(["rank", "drafter", "status", "acceptance length [CI]", "CI method", "rows with stats / planned",
                    "tokens/s", "x baseline", "vs the drafter above (paired)"] + (["trained on"] if lineage else []),
                   [[("=" if e.get("tied_with") else "") + _f(e["rank"]) if e["rank"] is not None else "-",
                     e["drafter"], e.get("status"), _ci(e), e.get("ci_method") or "-",
                     f"{e['rows_with_stats']}/{e.get('planned')}", _f(e["tokens_per_s"], 1), _speedup(e),
                     _vs_above(e)] + ([_trained_on(lineage.get(e["drafter"]))] if lineage else [])
                    for e in entries])
    ties = [e for e in entries if e.get("tied_with")]
    if ties:
        lines += ["", "Not separable (shared rank): " + "; ".join(
            f"{e['drafter']} from {e['tied_with']}" for e in ties)
            + ": the paired difference's interval holds 0, or too few common prompts for an interval."]
    return lines


def paired_lines(report: Mapping[str, Any], condition: str) -> list[str]:
    pairs = (report.get("paired") or {}).get(condition) or []
    if not pairs:
        return []
    rows = [[f"{p['a']} - {p['b']}", _ci({**p, "d": p["difference"]}, "d", sign=True), p.get("ci_method") or "-",
             p["prompts"], "yes" if p["separable"] else ("no" if p["separable"] is False else "no (no interval)"),
             _f(p.get("a_on_common")), _f(p.get("b_on_common"))] for p in pairs]
    return ["", f"Paired differences ({condition}; on the prompts both measured):", ""] + _table(
        ["A - B", "difference [CI]", "CI method", "common prompts", "separable", "A on them", "B on them"], rows)


def condition_lines(report: Mapping[str, Any], cond: Mapping[str, Any]) -> list[str]:
    groups = report.get("groups") or {}
    name = cond["name"]
    lines = ["", f"## {name}", "",
             f"temperature {cond['temperature']}, top_p {cond['top_p']}, thinking "
             f"{'on' if cond['thinking'] else 'off'}, concurrency {cond['concurrency']}", ""]
    rows = []
    for g, conds in groups.items():
        fig = conds.get(name)
        if fig is None:
            continue
        acc, tp = fig["acceptance"], fig["throughput"]
        pp = acc.get("per_position")
        rank = next((e for e in report["rankings"].get(name, []) if e["drafter"] == g), None)
        rows.append([g, fig.get("status"), _ci(acc), acc.get("ci_method") or "-",
                     f"{acc['rows_with_stats']}/{acc['rows']} ({acc.get('prompts')} prompts)",
                     ", ".join(f"{p:.2f}" for p in pp[:8]) if pp else "-", _f(tp.get("tokens_per_s"), 1),
                     _speedup(rank) if rank else "-", f"{fig['errors']}/{fig['rows']}",
                     fig.get("crosscheck_verdict", "-")])
    lines += _table(["group", "status", "acceptance length [CI]", "CI method", "rows with stats", "per-position acceptance",
                     "tokens/s", "x baseline", "errors", "/metrics check"], rows)
    lines += paired_lines(report, name)
    domains = sorted({d for conds in groups.values() for d in (conds.get(name) or {}).get("by_domain", {})})
    spec_groups = [g for g, conds in groups.items() if (conds.get(name) or {}).get("acceptance", {}).get(
        "rows_with_stats")]
    if domains and spec_groups:
        lines += ["", "By domain (acceptance length [CI]; rows with stats / rows, prompts):", ""]
        lines += _table(["domain", *spec_groups],
                        [[d, *[(lambda x: f"{_ci(x)}; {x['rows_with_stats']}/{x['rows']}, {x.get('prompts')} prompts"
                                if x else "-")(groups[g][name]["by_domain"].get(d)) for g in spec_groups]]
                         for d in domains])
    return lines


def crosscheck_lines(report: Mapping[str, Any]) -> list[str]:
    groups = report.get("groups") or {}
    lines = ["", "## /metrics cross-check", ""]
    checks = [[g, c, x["server"], x["run_id"], x["status"],
               ", ".join(f"{k} {v}" for k, v in (x.get("checks") or {}).items()) or "-",
               x.get("rows_sum"), x.get("metrics_delta"), x.get("note", "")]
              for g, conds in groups.items() for c, fig in conds.items() for x in fig["crosscheck"]]
    lines += _table(["group", "condition", "server", "run", "status", "checks", "rows' sum", "/metrics delta", "note"],
                    checks) if checks else ["no /metrics scraped in any run"]
    return lines


def render_markdown(report: Mapping[str, Any]) -> str:
    lines: list[str] = ["# dflash_eval report", ""]
    lines += header_lines(report)
    lines += lineage_lines(report)
    lines += status_lines(report)
    headline = report.get("headline_condition")
    if headline:
        lines += ["", f"## Ranking ({headline})", ""]
        lines += ranking_lines(report, headline)
    for cond in report.get("conditions") or []:
        lines += condition_lines(report, cond)
    if report.get("by_thinking"):
        lines += ["", "## By thinking mode (each mode's conditions pooled; a prompt's rows resampled together)", ""]
        lines += _table(["group", "thinking on", "thinking off"],
                        [[g, _ci(m.get("on") or {}), _ci(m.get("off") or {})] for g, m in report["by_thinking"].items()])
    if headline:
        lines += ["", f"## Accepted drafts per verify step ({headline})", "",
                  "histogram[k] = verify steps that accepted exactly k draft tokens", ""]
        for g, conds in (report.get("groups") or {}).items():
            hist = (conds.get(headline) or {}).get("acceptance", {}).get("histogram")
            if hist:
                lines.append(f"- {g}: {hist}")
    lines += crosscheck_lines(report)
    lines += ["", "## How the figures are computed", ""]
    lines += [f"- **{k}**: {v}" for k, v in (report.get("definitions") or {}).items()]
    return "\n".join(lines) + "\n"
