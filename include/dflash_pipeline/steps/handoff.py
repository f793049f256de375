"""The hand-off to downstream DAGs: one Airflow Asset, updated by every validated dataset.

Why: tokenization (or any consumer) should start when a dataset passed validation, not on a clock,
and should learn *which* dataset from the event, not from a guess. `validate_and_count` has the
asset as its outlet and, on success only, attaches `event_extra(report)`; a DAG with
`schedule=[COMPLETIONS_ASSET]` is queued by the scheduler and reads the extra from
`triggering_asset_events`.

The asset is static (one per deployment, not one per output_uri) because schedules are fixed at
parse time; the extra names the dataset. Its URI uses an `x-` scheme: Airflow 3 accepts any scheme
but `airflow`, and leaves `x-` URIs un-normalised.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from dflash_pipeline.config import ConfigError
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store, StoreConfigError, with_retries

logger = logging.getLogger(__name__)

ASSET_NAME = "dflash_completions"
ASSET_URI = "x-dflash://completions"
HANDOFF_FORMAT = "dflash-pipeline/handoff/1"
TOKENIZED_ASSET_NAME = "dflash_tokenized"
TOKENIZED_ASSET_URI = "x-dflash://tokenized"
"""dflash_tokenize's outlet: its event names the tokenized datasets (for a trainer DAG)."""
TOKENIZED_FORMAT = "dflash-pipeline/tokenized-handoff/1"
DRAFTER_ASSET_NAME = "dflash_drafter"
DRAFTER_ASSET_URI = "x-dflash://drafter"
"""dflash_train's outlet: its event names each drafter written and its card."""
DRAFTER_FORMAT = "dflash-pipeline/drafter-handoff/1"
EVAL_ASSET_NAME = "dflash_eval"
EVAL_ASSET_URI = "x-dflash://eval"
"""dflash_eval's outlet: its event names the eval report and each drafter's headline figures."""
EVAL_FORMAT = "dflash-pipeline/eval-handoff/2"
HEADLINE_KEYS = (
    "prompts", "completions", "errors", "missing", "duplicates", "truncated", "prompt_tokens", "output_tokens",
    "reasoning_tokens", "training_tokens",
)


class HandoffError(ConfigError):
    """The asset event does not point at a usable, validated dataset."""


class DatasetGone(HandoffError):
    """The dataset an event names no longer exists (its bucket or its manifest is gone)."""


def event_extra(report: Mapping[str, Any]) -> dict[str, Any]:
    """What the asset event carries: where the dataset is and its headline counts (small, JSON)."""
    layout = DatasetLayout.from_uri(report["output_uri"])
    extra: dict[str, Any] = {
        "format": HANDOFF_FORMAT,
        "output_uri": layout.uri,
        "bucket": layout.bucket,
        "manifest_key": report["manifest_key"],
        "report_key": report["report_key"],
        "completions_prefix": layout.completions_prefix,
        "model": report.get("model"),
        "status": report.get("status"),
    }
    extra.update({k: report.get(k) for k in HEADLINE_KEYS})
    return extra


def extras_from_events(events: Iterable[Any]) -> list[dict[str, Any]]:
    """The extras of the triggering events that came from dflash_generate (others are ignored)."""
    out = []
    for ev in events:
        extra = dict(getattr(ev, "extra", None) or {})
        if extra.get("format") == HANDOFF_FORMAT:
            out.append(extra)
        else:
            logger.warning("ignoring an asset event without a dflash hand-off extra: %s", extra)
    return out


def tokenized_datasets(events: Iterable[Any]) -> list[dict[str, Any]]:
    """The datasets named by dflash_tokenize's events (its report's summary per dataset: output_uri,
    tokenization, ...); events of another format are ignored with a warning."""
    out: list[dict[str, Any]] = []
    for ev in events:
        extra = dict(getattr(ev, "extra", None) or {})
        if extra.get("format") != TOKENIZED_FORMAT:
            logger.warning("ignoring an asset event without a dflash_tokenized extra: %s", extra)
            continue
        out += [d for d in extra.get("datasets") or [] if isinstance(d, Mapping) and d.get("output_uri")]
    return out


def check_events(client: Any, extras: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`check_handoff` for each event of one consumer run. A run may carry several events, some of
    datasets deleted since (a bucket emptied after a trial run): those are skipped with a warning, so
    they do not stop the others being tokenized. Any other problem, or every dataset gone, raises."""
    checked: list[dict[str, Any]] = []
    gone: list[str] = []
    for extra in extras:
        try:
            checked.append(check_handoff(client, extra))
        except DatasetGone as exc:
            logger.warning("skipping an asset event whose dataset is gone: %s", exc)
            gone.append(str(exc))
    if not checked:
        raise DatasetGone(f"every dataset the asset events name is gone: {gone}")
    return checked


def check_handoff(client: Any, extra: Mapping[str, Any]) -> dict[str, Any]:
    """Verify that the dataset an event names is there and validated: manifest, report, counts agree."""
    output_uri = extra.get("output_uri")
    if not output_uri:
        raise HandoffError(f"asset event extra has no output_uri: {dict(extra)}")
    layout = DatasetLayout.from_uri(str(output_uri))
    store = Store(client, layout.bucket)
    manifest_key = str(extra.get("manifest_key") or layout.manifest_key)
    report_key = str(extra.get("report_key") or layout.report_key)
    try:
        got_manifest = with_retries(lambda: store.get(manifest_key), what="read manifest")
    except StoreConfigError as exc:
        if "NoSuchBucket" in str(exc):
            raise DatasetGone(f"s3://{layout.bucket}/ does not exist: {exc}") from exc
        raise
    if got_manifest is None:
        raise DatasetGone(f"s3://{layout.bucket}/{manifest_key} does not exist")
    got_report = with_retries(lambda: store.get(report_key), what="read report")
    if got_report is None:
        raise HandoffError(f"s3://{layout.bucket}/{report_key} does not exist")
    manifest = json.loads(got_manifest[0])
    report = json.loads(got_report[0])
    if report.get("status") != "passed":
        raise HandoffError(f"{layout.uri}: report status is {report.get('status')!r}, not 'passed'")
    differ = {k: (extra.get(k), report.get(k)) for k in HEADLINE_KEYS if k in extra and extra.get(k) != report.get(k)}
    if differ:
        # The dataset was validated again (or changed) after this event: trust the report, say so.
        logger.warning("%s: report differs from the event (event, report): %s", layout.uri, differ)
    parts = sum(1 for _ in store.list(layout.completions_prefix))
    result = {
        "output_uri": layout.uri,
        "manifest_key": manifest_key,
        "report_key": report_key,
        "plan_id": manifest.get("plan_id"),
        "parts": parts,
        "completions": report.get("completions"),
        "training_tokens": report.get("training_tokens"),
        "differs_from_event": sorted(differ),
    }
    logger.info(
        "hand-off ok: %s, %s parts, %s completions, %s output tokens (manifest s3://%s/%s, report s3://%s/%s)",
        layout.uri, parts, report.get("completions"), report.get("output_tokens"), layout.bucket, manifest_key,
        layout.bucket, report_key,
    )
    return result


def eval_event_extra(report: Mapping[str, Any]) -> dict[str, Any]:
    """dflash_eval's asset event (small, JSON): where the report is, the eval's status, and per drafter
    and condition what a consumer acts on. `status` is the report's (complete, partial, untrusted;
    a failed eval emits no event); `conditions[group][condition]` has each one's status, rows with
    statistics over planned rows and the /metrics verdict; `ranking` lists the ranked drafters best
    first and `ranks` their ranks, equal for drafters the paired comparison cannot separate; `paired`
    has the headline condition's paired differences."""
    root = DatasetLayout.from_uri(report["output_uri"])
    headline = report.get("headline_condition") or ""
    ranking = (report.get("rankings") or {}).get(headline, [])
    conditions = {
        g: {c: {"status": f.get("status"), "rows_with_stats": (f.get("acceptance") or {}).get("rows_with_stats"),
                "completions": f.get("completions"), "rows": f.get("rows"), "planned": f.get("planned"),
                "crosscheck": f.get("crosscheck_verdict")} for c, f in conds.items()}
        for g, conds in (report.get("groups") or {}).items()}
    paired = [{k: p.get(k) for k in ("a", "b", "difference", "ci_low", "ci_high", "ci_method", "prompts", "separable")}
              for p in (report.get("paired") or {}).get(headline, [])]
    return {
        "format": EVAL_FORMAT,
        "output_uri": root.uri,
        "bucket": root.bucket,
        "report_key": report["report_key"],
        "report_md_key": root.report_md_key,
        "run_id": report.get("run_id"),
        "status": report.get("status"),
        "status_reasons": list(report.get("status_reasons") or [])[:20],
        "headline_condition": report.get("headline_condition"),
        "drafters": report.get("headline") or {},
        "lineage": report.get("lineage") or {},
        "ranking": [e["drafter"] for e in ranking if e.get("rank") is not None],
        "ranks": {e["drafter"]: e.get("rank") for e in ranking},
        "paired": paired,
        "conditions": conditions,
    }
