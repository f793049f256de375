"""dflash_eval's report: read every (group, condition) dataset and the metrics documents, compute the
figures (figures.py), write report.json + report.md + the plot at the eval root.

The report is written whatever happened (a failed server task included), so people see what was
measured; it then fails (`EvalIncomplete`) when a condition's dataset misses planned rows, and the
asset event is emitted only for a complete eval.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from dflash_pipeline.config.evaluate import EvalConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import read_parquet
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.serving.specstats import SPEC_COLUMNS
from dflash_pipeline.steps.evaluate import figures as F
from dflash_pipeline.steps.evaluate.render import render_markdown

logger = logging.getLogger(__name__)

REPORT_FORMAT = "dflash-pipeline/eval-report/1"
PLOT_NAME = "report-acceptance.png"
ROW_COLUMNS = ("id", "sample", "server", "run_id", "completion_tokens", "latency_s", "error_class", "finish_reason",
               "domain", "source", "thinking", "acceptance_length", *SPEC_COLUMNS)


class EvalIncomplete(Exception):
    """A condition's dataset misses planned rows (a server task failed): rerun to complete it."""


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


def build_report(cfg: EvalConfig, assignments: list[dict[str, Any]], per_group: dict[str, dict[str, Any]],
                 servers: dict[str, Any]) -> dict[str, Any]:
    """The report document from the per (group, condition) figures."""
    conditions = [{k: v for k, v in c.items() if k not in ("root", "server_info")}
                  for c in assignments[0]["conditions"]] if assignments else []
    drafters = [g.name for g in cfg.drafters]
    baseline = cfg.baseline.name if cfg.baseline else None
    headline = F.headline_condition(conditions) if conditions else None
    rankings = {c["name"]: F.rank(per_group, drafters, c["name"], baseline) for c in conditions}
    by_thinking: dict[str, dict[str, Any]] = {}
    incomplete = [f"{g}/{c}: {fig['missing']} of {fig['planned']} planned rows missing"
                  for g, conds in per_group.items() for c, fig in conds.items() if fig.get("missing")]
    mismatches = [f"{g}/{c} {x['server']} (run {x['run_id']}): {x.get('differences')}"
                  for g, conds in per_group.items() for c, fig in conds.items()
                  for x in fig["crosscheck"] if x["status"] == "mismatch"]
    headlines = {}
    for name in drafters:
        fig = per_group.get(name, {}).get(headline) if headline else None
        entry = next((e for e in rankings.get(headline or "", []) if e["drafter"] == name), None)
        headlines[name] = None if fig is None else {
            "acceptance_length": fig["acceptance"]["acceptance_length"], "ci_low": fig["acceptance"]["ci_low"],
            "ci_high": fig["acceptance"]["ci_high"], "rank": entry["rank"] if entry else None,
            "tokens_per_s": fig["throughput"]["tokens_per_s"],
            "speedup_vs_baseline": entry["speedup_vs_baseline"] if entry else None}
    return {
        "format": REPORT_FORMAT,
        "status": "incomplete" if incomplete else "complete",
        "output_uri": cfg.output_uri,
        "source": assignments[0]["source"] if assignments else None,
        "config": cfg.to_dict(),
        "servers": servers,
        "conditions": conditions,
        "headline_condition": headline,
        "headline": headlines,
        "rankings": rankings,
        "groups": per_group,
        "by_thinking": by_thinking,
        "incomplete": incomplete,
        "crosscheck_mismatches": mismatches,
        "definitions": {
            "acceptance_length": "token-weighted over completions: sum(verify_steps + accepted_tokens) / "
            "sum(verify_steps) = 1 + accepted / verify steps (serving/specstats.py); vLLM's mean_acceptance_length "
            "and 1 + d(accepted)/d(drafts) of its /metrics; SGLang's own spec_accept_length also counts the prefill "
            "token and reads higher",
            "ci": f"{cfg.confidence:.0%} bootstrap interval (scipy BCa), requests resampled with their counters paired",
            "per_position": "share of verify steps that accepted draft position i (from the summed histogram)",
            "tokens_per_s": F.__doc__.split("Throughput, exactly:", 1)[1].strip() if F.__doc__ else "",
        },
    }


def run_report(client: Any, cfg: EvalConfig, assignments: list[dict[str, Any]], run_id: str,
               plots: bool = True) -> dict[str, Any]:
    """Compute and write the report; raise EvalIncomplete (after writing it) when rows are missing."""
    root = DatasetLayout.from_uri(cfg.output_uri)
    store = Store(client, root.bucket)
    conditions = assignments[0]["conditions"] if assignments else []
    per_group: dict[str, dict[str, Any]] = {}
    servers: dict[str, Any] = {}
    thinking_rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for group in cfg.groups:
        for cond in conditions:
            layout = DatasetLayout.from_uri(cfg.group_uri(group.name, cond["name"]))
            planned, manifest = planned_rows(store, layout)
            rows = read_rows(store, layout)
            docs = read_metric_docs(store, layout)
            conc = None if cond["concurrency"] == "production" else int(cond["concurrency"])
            fig = F.condition_figures(rows, docs, concurrency=conc, n_servers=len(group.servers),
                                      confidence=cfg.confidence, planned=planned)
            fig["root"] = layout.uri
            per_group.setdefault(group.name, {})[cond["name"]] = fig
            mode = "on" if cond["thinking"] else "off"
            thinking_rows.setdefault(group.name, {}).setdefault(mode, []).extend(F.completions(rows))
            if manifest and group.name not in servers:
                servers[group.name] = [
                    {k: s.get(k) for k in ("name", "engine", "version", "served_model_name", "speculative")}
                    for s in manifest.get("servers") or []]
    report = build_report(cfg, assignments, per_group, servers)
    if cfg.thinking_modes and len(cfg.thinking_modes) > 1:
        report["by_thinking"] = {g: {m: F.acceptance(r, cfg.confidence) for m, r in modes.items()}
                                 for g, modes in thinking_rows.items()}
    report["run_id"] = run_id
    files = {"json": root.report_key, "markdown": root.report_md_key, "plots": []}
    if plots:
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
    logger.info("eval report s3://%s/%s: %s", root.bucket, root.report_key, report["headline"])
    if report["incomplete"]:
        raise EvalIncomplete("; ".join(report["incomplete"]) + f" (report at s3://{root.bucket}/{root.report_key}; "
                             "trigger the same conf again to complete it)")
    return report
