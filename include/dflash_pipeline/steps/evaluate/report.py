"""dflash_eval's report: read every (group, condition) dataset and the metrics documents, compute the
figures (figures.py), write report.json + report.md + the plot at the eval root.

The report is written whatever happened (a failed server task, a failed prepare), so people see what
was measured. Each (group, condition) has a status (figures.py: complete, partial, untrusted,
failed) and the eval's is the worst of them. After writing, the report fails the task with
`EvalFailed` when a condition measured nothing or nothing was planned (prepare failed), and with
`EvalIncomplete` when planned rows are missing (a rerun completes them); otherwise the asset event
carries the status, so an untrusted or partial eval is never mistaken for a complete one.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from dflash_pipeline.config.evaluate import EvalConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import read_parquet
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.serving.specstats import BOOTSTRAP_MAX_PROMPTS, CI_METHODS, MIN_PROMPTS_FOR_CI, SPEC_COLUMNS
from dflash_pipeline.steps.evaluate import figures as F
from dflash_pipeline.steps.evaluate.render import render_markdown

logger = logging.getLogger(__name__)

REPORT_FORMAT = "dflash-pipeline/eval-report/2"
PLOT_NAME = "report-acceptance.png"
ROW_COLUMNS = ("id", "sample", "server", "run_id", "completion_tokens", "latency_s", "error_class", "finish_reason",
               "domain", "source", "thinking", "acceptance_length", *SPEC_COLUMNS)
NOTHING_PLANNED = ("nothing was planned: prepare did not complete (its log says why), so no condition was measured; "
                   "fix the cause and trigger the same conf again")


class EvalIncomplete(Exception):
    """A condition's dataset misses planned rows (a server task failed): rerun to complete it."""


class EvalFailed(Exception):
    """A condition measured nothing, or nothing was planned (prepare failed)."""


def read_rows(store: Store, layout: DatasetLayout) -> list[dict[str, Any]]:
    """Every row of a condition's committed parts (the columns the report needs, those the part has)."""
    import io

    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for obj in with_retries(lambda: list(store.list(layout.completions_prefix)), what="list parts"):
        if not obj.key.endswith(".parquet"):
            continue
        got = with_retries(lambda: store.get(obj.key), what=f"read {obj.key}")
        if got is None:
            continue
        names = set(pq.read_schema(io.BytesIO(got[0])).names)
        rows.extend(read_parquet(got[0], [c for c in ROW_COLUMNS if c in names]).to_pylist())
    return rows


def read_metric_docs(store: Store, layout: DatasetLayout) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for obj in with_retries(lambda: list(store.list(layout.key("runs/"))), what="list metrics"):
        if "/metrics/" not in obj.key or not obj.key.endswith(".json"):
            continue
        got = with_retries(lambda: store.get(obj.key), what=f"read {obj.key}")
        if got is not None:
            docs.append(json.loads(got[0]))
    return docs


def planned_rows(store: Store, layout: DatasetLayout) -> tuple[int | None, dict[str, Any] | None]:
    got = with_retries(lambda: store.get(layout.manifest_key), what="manifest")
    if got is None:
        return None, None
    manifest = json.loads(got[0])
    return sum(manifest["chunks"]["sizes"]), manifest


def _headline(per_group: dict[str, dict[str, Any]], rankings: dict[str, list[dict[str, Any]]], name: str,
              headline: str | None) -> dict[str, Any] | None:
    """A drafter's figures under the headline condition (what the event carries)."""
    fig = per_group.get(name, {}).get(headline) if headline else None
    if fig is None:
        return None
    entry = next((e for e in rankings.get(headline or "", []) if e["drafter"] == name), {})
    acc = fig["acceptance"]
    return {
        "status": fig["status"], "acceptance_length": acc["acceptance_length"], "ci_low": acc["ci_low"],
        "ci_high": acc["ci_high"], "ci_method": acc.get("ci_method"), "rank": entry.get("rank"),
        "tied_with": entry.get("tied_with"), "rows_with_stats": acc["rows_with_stats"], "rows": fig["rows"],
        "planned": fig.get("planned"), "prompts": acc.get("prompts"), "crosscheck": fig.get("crosscheck_verdict"),
        "tokens_per_s": fig["throughput"]["tokens_per_s"], "speedup_vs_baseline": entry.get("speedup_vs_baseline"),
        "speedup_status": entry.get("speedup_status")}


def definitions(cfg: EvalConfig) -> dict[str, str]:
    """How every figure and status is computed (report.json and report.md carry them)."""
    return {
        "acceptance_length": "token-weighted over completions: sum(verify_steps + accepted_tokens) / "
        "sum(verify_steps) = 1 + accepted / verify steps (serving/specstats.py); vLLM's mean_acceptance_length "
        "and 1 + d(accepted)/d(drafts) of its /metrics. SGLang's own spec_accept_length (completion tokens / "
        "verify steps) differs from ours by (1 - O) / V for a request of V verify steps, O being the drafts "
        "counted as accepted in its last step but dropped past the answer's end: higher by 1/V where the server "
        "counts only the drafts it kept, lower where it counts drafts past the end and O > 1 (long DFlash blocks "
        "on short answers)",
        "ci": f"{cfg.confidence:.0%} interval over prompts (a prompt's rows resampled together); none under "
              f"{MIN_PROMPTS_FOR_CI} prompts; each interval names its method: "
              + "; ".join(f"{k}: {v}" for k, v in CI_METHODS.items()),
        "paired_difference": "A minus B on the prompts both measured (rows paired by prompt id), with the "
        "interval of that difference (prompts resampled together for both): 'separable' when it excludes 0. "
        "A drafter not separable from the one ranked above it shares its rank",
        "status": f"per drafter and condition: failed = nothing measured (no row with statistics; the baseline: no "
                  f"completion); untrusted = a /metrics cross-check found a mismatch or a restart; partial = "
                  f"planned rows missing, or under {F.MIN_STATS_SHARE:.0%} of the planned rows with statistics (the "
                  f"baseline: completions); complete = none of these. The eval's status is the worst of them",
        "per_position": "share of verify steps that accepted draft position i (from the summed histogram)",
        "tokens_per_s": F.__doc__.split("Throughput, exactly:", 1)[1].split("Status of a", 1)[0].strip()
        if F.__doc__ else "",
        "crosscheck": "per server and run: the rows' summed counters against the server's /metrics delta over "
                      "the same window, speculative counters (vLLM: verify steps, accepted and draft tokens; "
                      "SGLang: verify steps) and generated tokens (every server, the baseline's included)",
    }


def build_report(cfg: EvalConfig, assignments: list[dict[str, Any]] | None, per_group: dict[str, dict[str, Any]],
                 servers: dict[str, Any], rows: dict[str, dict[str, list[dict[str, Any]]]] | None = None
                 ) -> dict[str, Any]:
    """The report document from the per (group, condition) figures (and rows, for the paired comparisons)."""
    conditions = [{k: v for k, v in c.items() if k not in ("root", "server_info")}
                  for c in assignments[0]["conditions"]] if assignments else []
    drafters = [g.name for g in cfg.drafters]
    baseline = cfg.baseline.name if cfg.baseline else None
    headline = F.headline_condition(conditions) if conditions else None
    paired: dict[str, list[dict[str, Any]]] = {}
    rankings: dict[str, list[dict[str, Any]]] = {}
    for c in conditions:
        order = F.by_acceptance(per_group, drafters, c["name"])
        by_drafter = {d: (rows or {}).get(d, {}).get(c["name"], []) for d in order}
        paired[c["name"]] = F.paired(by_drafter, order, cfg.confidence) if rows is not None else []
        rankings[c["name"]] = F.rank(per_group, drafters, c["name"], baseline, paired[c["name"]])
    incomplete = [f"{g}/{c}: {fig['missing']} of {fig['planned']} planned rows missing"
                  for g, conds in per_group.items() for c, fig in conds.items() if fig.get("missing")]
    mismatches = [f"{g}/{c} {x['server']} (run {x['run_id']}): {x.get('differences')}"
                  for g, conds in per_group.items() for c, fig in conds.items()
                  for x in fig["crosscheck"] if x["status"] == "mismatch"]
    statuses = {g: {c: fig["status"] for c, fig in conds.items()} for g, conds in per_group.items()}
    reasons = [f"{g}/{c}: {r}" for g, conds in per_group.items() for c, fig in conds.items()
               for r in fig.get("status_reasons") or []]
    status = F.worst(s for conds in statuses.values() for s in conds.values())
    if not conditions or not per_group:
        status, reasons = F.FAILED, [NOTHING_PLANNED]
    elif status != F.FAILED and not rankings.get(headline or "") or all(
            e["rank"] is None for e in rankings.get(headline or "", [])):
        status = F.FAILED
        reasons.append("no drafter was measured under the headline condition")
    return {
        "format": REPORT_FORMAT,
        "status": status,
        "status_reasons": reasons,
        "statuses": statuses,
        "output_uri": cfg.output_uri,
        "source": assignments[0]["source"] if assignments else None,
        "lineage": {a["group"]: a["lineage"] for a in assignments or [] if a.get("lineage")},
        "config": cfg.to_dict(),
        "servers": servers,
        "conditions": conditions,
        "headline_condition": headline,
        "headline": {name: _headline(per_group, rankings, name, headline) for name in drafters},
        "rankings": rankings,
        "paired": paired,
        "groups": per_group,
        "by_thinking": {},
        "incomplete": incomplete,
        "crosscheck_mismatches": mismatches,
        "definitions": definitions(cfg),
        "interval_rule": {"min_prompts": MIN_PROMPTS_FOR_CI, "bootstrap_max_prompts": BOOTSTRAP_MAX_PROMPTS,
                          "confidence": cfg.confidence},
    }


def _read_condition(store: Store, cfg: EvalConfig, group: Any, cond: dict[str, Any]
                    ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """One (group, condition): its figures, its rows and its manifest."""
    layout = DatasetLayout.from_uri(cfg.group_uri(group.name, cond["name"]))
    planned, manifest = planned_rows(store, layout)
    rows = read_rows(store, layout)
    docs = read_metric_docs(store, layout)
    engines = {str(s.get("name")): s.get("engine") for s in (manifest or {}).get("servers") or []}
    conc = None if cond["concurrency"] == "production" else int(cond["concurrency"])
    fig = F.condition_figures(rows, docs, concurrency=conc, n_servers=len(group.servers), confidence=cfg.confidence,
                              planned=planned, baseline=group.baseline, engines=engines)
    fig["root"] = layout.uri
    return fig, rows, manifest


def run_report(client: Any, cfg: EvalConfig, assignments: list[dict[str, Any]] | None, run_id: str,
               plots: bool = True) -> dict[str, Any]:
    """Compute and write the report; then raise EvalFailed / EvalIncomplete (module docstring)."""
    root = DatasetLayout.from_uri(cfg.output_uri)
    store = Store(client, root.bucket)
    conditions = assignments[0]["conditions"] if assignments else []
    per_group: dict[str, dict[str, Any]] = {}
    rows_by: dict[str, dict[str, list[dict[str, Any]]]] = {}
    servers: dict[str, Any] = {}
    thinking_rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for group in cfg.groups:
        for cond in conditions:
            fig, rows, manifest = _read_condition(store, cfg, group, cond)
            per_group.setdefault(group.name, {})[cond["name"]] = fig
            rows_by.setdefault(group.name, {})[cond["name"]] = rows
            mode = "on" if cond["thinking"] else "off"
            thinking_rows.setdefault(group.name, {}).setdefault(mode, []).extend(F.completions(rows))
            if manifest and group.name not in servers:
                servers[group.name] = [
                    {k: s.get(k) for k in ("name", "engine", "version", "served_model_name", "speculative")}
                    for s in manifest.get("servers") or []]
    report = build_report(cfg, assignments, per_group, servers, rows_by)
    if cfg.thinking_modes and len(cfg.thinking_modes) > 1:
        # each mode pools its conditions: the same prompts several times, resampled together (by id)
        report["by_thinking"] = {g: {m: F.acceptance(r, cfg.confidence) for m, r in modes.items()}
                                 for g, modes in thinking_rows.items()}
    report["run_id"] = run_id
    files = {"json": root.report_key, "markdown": root.report_md_key, "plots": []}
    if plots and conditions:
        try:
            from dflash_pipeline.steps.evaluate.plots import acceptance_plot

            png = acceptance_plot(report)
            key = root.key(PLOT_NAME)
            with_retries(lambda: store.put(key, png, content_type="image/png"), what="write plot")
            files["plots"].append(key)
        except Exception as exc:  # noqa: BLE001 - a plot never fails the report
            logger.warning("could not draw the eval plot: %s", exc)
    report["files"] = files
    report["report_key"] = root.report_key
    md = render_markdown(report)
    with_retries(lambda: store.put(root.report_md_key, md.encode(), content_type="text/markdown"), what="report.md")
    body = json.dumps(report, indent=1, default=str).encode()
    with_retries(lambda: store.put(root.report_key, body, content_type="application/json"), what="report.json")
    logger.info("eval report s3://%s/%s: %s %s", root.bucket, root.report_key, report["status"], report["headline"])
    where = f"report at s3://{root.bucket}/{root.report_key}"
    if report["status"] == F.FAILED:
        raise EvalFailed("; ".join(report["status_reasons"]) + f" ({where})")
    if report["incomplete"]:
        raise EvalIncomplete("; ".join(report["incomplete"]) + f" ({where}; trigger the same conf again to complete it)")
    return report
