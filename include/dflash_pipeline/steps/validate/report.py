"""Thresholds, and the report built from a tally: report.json's dict and report.md's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.steps.validate.tally import Tally

REPORT_FORMAT = "dflash-pipeline/report/1"
VALIDATION_DIR = "validation"
PLOT_FILES = {
    "completion_lengths": "report-completion-lengths.png",
    "thinking_vs_answer": "report-thinking-vs-answer.png",
    "server_throughput": "report-server-throughput.png",
}




@dataclass(frozen=True)
class Thresholds:
    """When a dataset fails validation (see config.PARAM_SCHEMAS for the reasoning behind the defaults)."""

    max_error_rate: float = 0.01
    max_truncation_rate: float = 0.10
    min_coverage: float = 1.0
    max_missing_reasoning_rate: float = 0.005
    max_loop_rate: float | None = None



def rate(num: int, den: int) -> float:
    return num / den if den else 0.0


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def side_file_keys(layout: DatasetLayout) -> dict[str, str]:
    base = f"{layout.root}/{VALIDATION_DIR}"
    return {name: f"{base}/{name}.txt" for name in ("missing_ids", "duplicate_ids", "unexpected_ids")}


def plot_keys(layout: DatasetLayout) -> dict[str, str]:
    return {name: f"{layout.root}/{fname}" for name, fname in PLOT_FILES.items()}


def evaluate(t: Tally, thresholds: Thresholds, thinking: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """The threshold checks (figure, limit, pass) and the problems that fail the dataset."""
    coverage = 1.0 - rate(t.missing, t.prompts) if t.prompts else 1.0
    rows = t.completions + t.errors
    error_rate = rate(t.errors, rows)
    truncation_rate = rate(t.truncated, t.completions)
    checks = [
        {"name": "coverage", "value": round(coverage, 6), "threshold": "min_coverage", "limit": thresholds.min_coverage,
         "ok": coverage >= thresholds.min_coverage,
         "figure": f"coverage {pct(coverage)} ({t.prompts - t.missing} of {t.prompts} planned prompts have a row)"},
        {"name": "error_rate", "value": round(error_rate, 6), "threshold": "max_error_rate",
         "limit": thresholds.max_error_rate, "ok": error_rate <= thresholds.max_error_rate,
         "figure": f"error rate {pct(error_rate)} ({t.errors} error rows of {rows})"},
        {"name": "truncation_rate", "value": round(truncation_rate, 6), "threshold": "max_truncation_rate",
         "limit": thresholds.max_truncation_rate, "ok": truncation_rate <= thresholds.max_truncation_rate,
         "figure": f"truncation rate {pct(truncation_rate)} ({t.truncated} of {t.completions} completions "
         f"hit max_tokens, {t.truncated_in_thinking} of them inside the thinking)"},
    ]
    if thinking:
        missing_rate = rate(t.reasoning_missing, t.completions_thinking or t.completions)
        by_server = sorted(((s.reasoning_missing, n) for n, s in t.per_server.items() if s.reasoning_missing),
                           reverse=True)
        where = ", ".join(f"{n} {k}" for k, n in by_server[:5]) or "none"
        checks.append(
            {"name": "missing_reasoning_rate", "value": round(missing_rate, 6), "threshold": "max_missing_reasoning_rate",
             "limit": thresholds.max_missing_reasoning_rate, "ok": missing_rate <= thresholds.max_missing_reasoning_rate,
             "figure": f"reasoning missing on {pct(missing_rate)} of completions with thinking enabled "
             f"({t.reasoning_missing} of {t.completions_thinking or t.completions}; by server: {where})"})
    problems: list[str] = []
    if t.duplicates:
        problems.append(f"{t.duplicates} duplicate row(s) (first: {t.duplicate_ids[:5]})")
    if t.unexpected:
        problems.append(f"{t.unexpected} row(s) with ids not planned for their chunk (first: {t.unexpected_ids[:5]})")
    if t.stray_parts_count:
        problems.append(f"{t.stray_parts_count} part(s) outside the plan: {t.stray_parts[:3]}")
    for c in checks:
        if not c["ok"]:
            word = "below" if c["threshold"].startswith("min_") else "above"
            extra = f"; first missing: {t.missing_ids[:5]}" if c["name"] == "coverage" and t.missing_ids else ""
            problems.append(f"{c['figure']} is {word} {c['threshold']}={pct(c['limit'])}{extra}")
    return checks, problems


def build_report(
    t: Tally,
    manifest: dict[str, Any],
    layout: DatasetLayout,
    thresholds: Thresholds | None = None,
    files: dict[str, Any] | None = None,
) -> dict[str, Any]:
    thresholds = thresholds or Thresholds()
    mixed_on = int(((manifest.get("input") or {}).get("thinking") or {}).get("conversations_on") or 0)
    checks, problems = evaluate(t, thresholds, thinking=bool(manifest["pinned"]["sampling"]["enable_thinking"])
                                or mixed_on > 0)
    rc = t.recount.to_dict() if t.recount is not None else None
    return {
        "format": REPORT_FORMAT,
        "output_uri": layout.uri,
        "manifest_key": layout.manifest_key,
        "report_key": layout.report_key,
        "report_md_key": layout.report_md_key,
        "validated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "status": "failed" if problems else "passed",
        "problems": problems,
        "model": manifest.get("model_resolved") or manifest["pinned"].get("model"),
        "thinking_enabled": bool(manifest["pinned"]["sampling"]["enable_thinking"]),
        "thinking_share_on": ((manifest.get("input") or {}).get("thinking") or {}).get("share_on"),
        "prompts": t.prompts,
        "completions": t.completions,
        "errors": t.errors,
        "retryable_errors": t.retryable_errors,
        "errors_by_class": dict(t.errors_by_class),
        # Stored as completions by older code although the server never finished them (finish_reason
        # "abort"...): counted above as retryable "Unfinished" errors; the next run redoes them.
        "unfinished_as_completions": t.unfinished_as_completions,
        "missing": t.missing,
        "duplicates": t.duplicates,
        "unexpected_ids": t.unexpected,
        "coverage": checks[0]["value"],
        "error_rate": checks[1]["value"],
        "truncation_rate": checks[2]["value"],
        "thresholds": {"min_coverage": thresholds.min_coverage, "max_error_rate": thresholds.max_error_rate,
                       "max_truncation_rate": thresholds.max_truncation_rate},
        "checks": checks,
        "truncated": t.truncated,
        "truncated_in_thinking": t.truncated_in_thinking,
        "truncated_in_answer": t.truncated_in_answer,
        "empty_content": t.empty_content,
        "empty_content_not_truncated": t.empty_content_not_truncated,
        "reasoning_missing": t.reasoning_missing,
        "reasoning_unexpected": t.reasoning_unexpected,
        "think_markers_in_content": t.think_markers_in_content,
        "think_markers_in_reasoning": t.think_markers_in_reasoning,
        "reasoning_tokens_unreported": t.reasoning_tokens_unreported,
        "usage_missing": t.usage_missing,
        "finish_reasons": dict(t.finish_reasons),
        "prompt_tokens": t.prompt_tokens,
        "output_tokens": t.output_tokens,
        "reasoning_tokens": t.reasoning_tokens if t.reasoning_tokens_reported else None,
        "mean_output_tokens": round(t.output_tokens / t.completions, 1) if t.completions else None,
        "training_tokens": rc["training_tokens"] if rc else None,
        "token_stats": {
            "prompt_tokens": t.prompt_hist.summary(),
            "output_tokens": t.output_hist.summary(),
            "reasoning_tokens": t.reasoning_hist.summary(),
            "output_tokens_by_finish_reason": {k: h.summary() for k, h in sorted(t.by_finish.items())},
        },
        "token_recount": rc,
        "turns_generated": t.turns_generated,
        "multi_turn_rows": t.multi_turn_rows,
        "cut_short": sum(t.cut_short.values()),
        "cut_short_by_reason": dict(t.cut_short),
        "cached_prompt_tokens": t.cached_prompt_tokens if t.cached_tokens_reported else None,
        "cached_tokens_reported_rows": t.cached_tokens_reported,
        "rows_by_sample": {str(k): v for k, v in sorted(t.samples.items())},
        "engine_token_ids": {
            "rows_with": t.rows_with_engine_ids,
            "rows_without": t.rows_without_engine_ids,
            "rows_whose_ids_disagree_with_usage": t.engine_ids_disagree,
        },
        "chunks": t.chunks,
        "parts_present": t.parts_present,
        "stray_parts": t.stray_parts,
        "stray_parts_count": t.stray_parts_count,
        "per_server": {k: v.to_dict() for k, v in sorted(t.per_server.items())},
        "missing_ids_sample": t.missing_ids,
        "duplicate_ids_sample": t.duplicate_ids,
        "unexpected_ids_sample": t.unexpected_ids,
        "defect_ids_sample": {k: v for k, v in sorted(t.defect_ids.items())},
        "files": files or {},
    }


_MD_FIGURES = (
    "prompts", "completions", "errors", "retryable_errors", "unfinished_as_completions", "missing", "duplicates", "unexpected_ids", "coverage",
    "error_rate", "truncation_rate", "truncated", "truncated_in_thinking", "truncated_in_answer", "empty_content",
    "empty_content_not_truncated", "reasoning_missing", "reasoning_unexpected", "think_markers_in_content",
    "think_markers_in_reasoning", "reasoning_tokens_unreported", "usage_missing", "prompt_tokens", "output_tokens",
    "reasoning_tokens", "mean_output_tokens", "training_tokens", "turns_generated", "multi_turn_rows", "cut_short",
    "cut_short_by_reason", "cached_prompt_tokens", "rows_by_sample", "engine_token_ids",
)


_NOT_GIVEN = {"cached_prompt_tokens": "not reported by the servers (no prompt-cache usage in their answers)"}
"""What the report table says where a figure is None, instead of Python's `None`."""


def thinking_words(r: dict[str, Any]) -> str:
    """The run's thinking mode as planned: on, off, or the share of conversations on in a mixed run."""
    share = r.get("thinking_share_on")
    if share is not None and 0 < share < 1:
        return f"thinking mixed ({share:.0%} of conversations on)"
    if share is not None:
        return "thinking on" if share == 1 else "thinking off"
    return "thinking on" if r.get("thinking_enabled") else "thinking off"


def report_markdown(r: dict[str, Any]) -> str:
    lines = [
        f"# dflash-pipeline report: {r['output_uri']}",
        "",
        f"Model: `{r['model']}` · {thinking_words(r)} · "
        f"validated {r.get('validated_at')} · **{r.get('status', '?').upper()}**",
        "",
    ]
    if r.get("problems"):
        lines += ["## problems", ""] + [f"- {p}" for p in r["problems"]] + [""]
    lines += ["| figure | value |", "|---|---|"]
    for key in _MD_FIGURES:
        if key in r:
            lines.append(f"| {key} | {_NOT_GIVEN.get(key, 'n/a') if r[key] is None else r[key]} |")
    if r.get("checks"):
        lines += ["", "## thresholds", "", "| check | figure | limit | ok |", "|---|---|---|---|"]
        lines += [f"| {c['name']} | {c['figure']} | {c['threshold']}={c['limit']} | {'yes' if c['ok'] else '**NO**'} |"
                  for c in r["checks"]]
    stats = r.get("token_stats") or {}
    if stats:
        lines += ["", "## token counts (server usage)", "", "| | rows | total | mean | p50 | p90 | p99 | max |",
                  "|---|---|---|---|---|---|---|---|"]
        rows = [(k, stats[k]) for k in ("prompt_tokens", "output_tokens", "reasoning_tokens")]
        rows += [(f"output, finish={k}", v) for k, v in stats.get("output_tokens_by_finish_reason", {}).items()]
        if r.get("token_recount"):
            rows.append(("training (recount)", r["token_recount"]["training_tokens_stats"]))
        for name, s in rows:
            lines.append(f"| {name} | {s['rows']} | {s['total']} | {s['mean']} | {s['p50']} | {s['p90']} | {s['p99']} | {s['max']} |")
    rc = r.get("token_recount")
    if rc:
        lines += ["", "## recount with the training tokenizer", "",
                  f"Tokenizer `{rc['tokenizer']}`, chat template from {rc['chat_template']}.", "",
                  "| figure | value |", "|---|---|"]
        for key in ("rows", "compared", "output_tokens", "output_tokens_server", "reasoning_tokens", "answer_tokens",
                    "mismatches", "max_abs_delta", "training_tokens", "tokens_per_s"):
            lines.append(f"| {key} | {rc[key]} |")
        if rc["mismatch_ids_sample"]:
            lines += ["", f"First mismatching ids: {', '.join(map(str, rc['mismatch_ids_sample']))}"]
    lines += ["", "## finish_reason", "", "| finish_reason | rows |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(r["finish_reasons"].items())]
    if r["errors_by_class"]:
        lines += ["", "## errors by class", "", "| class | rows |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(r["errors_by_class"].items())]
    lines += ["", "## per server", "",
              "| server | rows | completions | errors | truncated | output tokens | mean latency s | tokens/request-s |",
              "|---|---|---|---|---|---|---|---|"]
    for name, s in r["per_server"].items():
        lines.append(
            f"| {name} | {s['rows']} | {s['completions']} | {s['errors']} | {s.get('truncated')} | {s['output_tokens']} "
            f"| {s['mean_latency_s']} | {s.get('output_tokens_per_request_s')} |"
        )
    defects = r.get("defect_ids_sample") or {}
    if any(defects.values()) or r.get("missing_ids_sample") or r.get("duplicate_ids_sample"):
        lines += ["", "## example ids", ""]
        for key in ("missing_ids_sample", "duplicate_ids_sample", "unexpected_ids_sample"):
            if r.get(key):
                lines.append(f"- {key.removesuffix('_sample')}: {', '.join(map(str, r[key][:10]))}")
        for check, ids in defects.items():
            lines.append(f"- {check}: {', '.join(map(str, ids))}")
    files = r.get("files") or {}
    if files:
        lines += ["", "## files", ""]
        for k, val in files.items():
            lines += [f"- {k}: " + ", ".join(f"`{x}`" for x in (val if isinstance(val, list) else [val]))] if val else []
    return "\n".join(lines) + "\n"


