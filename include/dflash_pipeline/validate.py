"""validate_and_count: is every planned prompt present exactly once, and what did we get?

It streams chunk by chunk (the planned ids of one chunk, then its part), so memory holds one chunk
plus an 8-byte hash per id seen (for duplicates across parts), whatever the dataset's size. The
report is written even when validation fails, so the reason can be read next to the data.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from dflash_pipeline.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.store import Store, with_retries

logger = logging.getLogger(__name__)

REPORT_FORMAT = "dflash-pipeline/report/1"
LIST_LIMIT = 50
PART_READ_COLUMNS = [
    "id",
    "reasoning",
    "content",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "server",
    "latency_s",
    "error_class",
    "retryable",
]


class ValidationFailed(Exception):
    """The dataset is incomplete or has duplicates; the message names the figures."""


@dataclass
class _ServerTally:
    rows: int = 0
    completions: int = 0
    errors: int = 0
    output_tokens: int = 0
    latency_sum: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "completions": self.completions,
            "errors": self.errors,
            "output_tokens": self.output_tokens,
            "mean_latency_s": round(self.latency_sum / self.completions, 3) if self.completions else None,
        }


@dataclass
class Tally:
    prompts: int = 0
    completions: int = 0
    errors: int = 0
    retryable_errors: int = 0
    missing: int = 0
    duplicates: int = 0
    unexpected: int = 0
    truncated: int = 0
    truncated_in_thinking: int = 0
    empty_content: int = 0
    reasoning_missing: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    reasoning_tokens_reported: int = 0
    chunks: int = 0
    parts_present: int = 0
    stray_parts: list[str] = field(default_factory=list)
    missing_ids: list[str] = field(default_factory=list)
    duplicate_ids: list[str] = field(default_factory=list)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    errors_by_class: Counter[str] = field(default_factory=Counter)
    per_server: dict[str, _ServerTally] = field(default_factory=dict)


def _h(pid: str) -> int:
    return int.from_bytes(hashlib.blake2b(pid.encode(), digest_size=8).digest(), "little")


def tally_chunk(t: Tally, planned_ids: list[str], part: dict[str, list[Any]] | None, seen: set[int], thinking: bool) -> None:
    """Fold one chunk into the tally. `part` is column-name -> values (or None when absent)."""
    t.prompts += len(planned_ids)
    if part is None:
        t.missing += len(planned_ids)
        if len(t.missing_ids) < LIST_LIMIT:
            t.missing_ids.extend(planned_ids[: LIST_LIMIT - len(t.missing_ids)])
        return
    t.parts_present += 1
    planned = set(planned_ids)
    present: set[str] = set()
    ids = part["id"]
    for i, pid in enumerate(ids):
        hid = _h(pid)
        if pid in present or hid in seen:
            t.duplicates += 1
            if len(t.duplicate_ids) < LIST_LIMIT:
                t.duplicate_ids.append(pid)
            continue
        seen.add(hid)
        present.add(pid)
        if pid not in planned:
            t.unexpected += 1
            continue
        server = part["server"][i] or "?"
        st = t.per_server.setdefault(server, _ServerTally())
        st.rows += 1
        error_class = part["error_class"][i]
        if error_class:
            t.errors += 1
            st.errors += 1
            t.errors_by_class[error_class] += 1
            if part["retryable"][i]:
                t.retryable_errors += 1
            continue
        t.completions += 1
        st.completions += 1
        finish = part["finish_reason"][i] or "null"
        t.finish_reasons[finish] += 1
        content = part["content"][i] or ""
        reasoning = part["reasoning"][i]
        if not content.strip():
            t.empty_content += 1
        if finish == "length":
            t.truncated += 1
            if not content.strip():
                t.truncated_in_thinking += 1
        if thinking and not reasoning:
            t.reasoning_missing += 1
        ct = int(part["completion_tokens"][i] or 0)
        t.output_tokens += ct
        st.output_tokens += ct
        t.prompt_tokens += int(part["prompt_tokens"][i] or 0)
        rt = part["reasoning_tokens"][i]
        if rt is not None:
            t.reasoning_tokens += int(rt)
            t.reasoning_tokens_reported += 1
        st.latency_sum += float(part["latency_s"][i] or 0.0)
    lacking = [pid for pid in planned_ids if pid not in present]
    t.missing += len(lacking)
    if lacking and len(t.missing_ids) < LIST_LIMIT:
        t.missing_ids.extend(lacking[: LIST_LIMIT - len(t.missing_ids)])


def build_report(t: Tally, manifest: dict[str, Any], layout: DatasetLayout) -> dict[str, Any]:
    return {
        "format": REPORT_FORMAT,
        "output_uri": layout.uri,
        "manifest_key": layout.manifest_key,
        "model": manifest.get("model_resolved") or manifest["pinned"].get("model"),
        "prompts": t.prompts,
        "completions": t.completions,
        "errors": t.errors,
        "retryable_errors": t.retryable_errors,
        "errors_by_class": dict(t.errors_by_class),
        "missing": t.missing,
        "duplicates": t.duplicates,
        "unexpected_ids": t.unexpected,
        "truncated": t.truncated,
        "truncated_in_thinking": t.truncated_in_thinking,
        "empty_content": t.empty_content,
        "reasoning_missing": t.reasoning_missing,
        "finish_reasons": dict(t.finish_reasons),
        "prompt_tokens": t.prompt_tokens,
        "output_tokens": t.output_tokens,
        "reasoning_tokens": t.reasoning_tokens if t.reasoning_tokens_reported else None,
        "mean_output_tokens": round(t.output_tokens / t.completions, 1) if t.completions else None,
        "chunks": t.chunks,
        "parts_present": t.parts_present,
        "stray_parts": t.stray_parts,
        "per_server": {k: v.to_dict() for k, v in sorted(t.per_server.items())},
        "missing_ids_sample": t.missing_ids,
        "duplicate_ids_sample": t.duplicate_ids,
    }


def report_markdown(r: dict[str, Any]) -> str:
    lines = [
        f"# dflash-pipeline report: {r['output_uri']}",
        "",
        f"Model: `{r['model']}`",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    for key in (
        "prompts", "completions", "errors", "retryable_errors", "missing", "duplicates", "truncated",
        "truncated_in_thinking", "empty_content", "reasoning_missing", "prompt_tokens", "output_tokens",
        "reasoning_tokens", "mean_output_tokens",
    ):
        lines.append(f"| {key} | {r[key]} |")
    lines += ["", "## finish_reason", "", "| finish_reason | rows |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(r["finish_reasons"].items())]
    if r["errors_by_class"]:
        lines += ["", "## errors by class", "", "| class | rows |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(r["errors_by_class"].items())]
    lines += ["", "## per server", "", "| server | rows | completions | errors | output tokens | mean latency s |",
              "|---|---|---|---|---|---|"]
    for name, s in r["per_server"].items():
        lines.append(
            f"| {name} | {s['rows']} | {s['completions']} | {s['errors']} | {s['output_tokens']} | {s['mean_latency_s']} |"
        )
    return "\n".join(lines) + "\n"


def _ensure_marker(store: Store, layout: DatasetLayout, c: int, part: dict[str, list[Any]], has: bool) -> None:
    """Re-create the retry flag of a part with error rows if a killed worker never wrote it."""
    if has:
        return
    errs = [bool(r) for e, r in zip(part["error_class"], part["retryable"]) if e]
    if not errs:
        return
    body = {"run_id": "validation", "retryable": sum(errs), "permanent": len(errs) - sum(errs)}
    with_retries(lambda: store.put(layout.retry_key(c), json.dumps(body).encode()), what="marker")
    logger.info("chunk %d has %d error row(s) without a retry flag; flagged for the next run", c, len(errs))


def run_validation(client: Any, output_uri: str) -> dict[str, Any]:
    """Check the dataset under `output_uri` against its plan; write report.json / report.md."""
    layout = DatasetLayout.from_uri(output_uri)
    store = Store(client, layout.bucket)
    got = with_retries(lambda: store.get(layout.manifest_key), what="read manifest")
    if got is None:
        raise ValidationFailed(f"{layout.uri}: manifest.json is missing")
    manifest = json.loads(got[0])
    sizes: list[int] = manifest["chunks"]["sizes"]
    plan_id = manifest["plan_id"]
    thinking = bool(manifest["pinned"]["sampling"]["enable_thinking"])

    parts: dict[int, str] = {}
    t = Tally(chunks=len(sizes))
    for obj in store.list(layout.completions_prefix):
        c = chunk_of_key(obj.key)
        if c is None or c >= len(sizes):
            t.stray_parts.append(obj.key)
        else:
            parts[c] = obj.key
    markers = {chunk_of_key(o.key) for o in store.list(layout.retry_prefix)}
    seen: set[int] = set()
    for c, size in enumerate(sizes):
        data = with_retries(lambda: store.get(layout.input_key(plan_id, c)), what=f"read input {c}")
        if data is None:
            raise ValidationFailed(f"input of chunk {c} is missing; the plan under {layout.uri} is damaged")
        planned_ids = pq.read_table(io.BytesIO(data[0]), columns=["id"]).column("id").to_pylist()
        part_cols: dict[str, list[Any]] | None = None
        if c in parts:
            blob = with_retries(lambda: store.get(parts[c]), what=f"read part {c}")
            if blob is not None:
                table = pq.read_table(io.BytesIO(blob[0]), columns=PART_READ_COLUMNS)
                part_cols = {name: table.column(name).to_pylist() for name in PART_READ_COLUMNS}
                _ensure_marker(store, layout, c, part_cols, c in markers)
        tally_chunk(t, planned_ids, part_cols, seen, thinking)

    report = build_report(t, manifest, layout)
    with_retries(
        lambda: store.put(layout.report_key, json.dumps(report, indent=1).encode(), content_type="application/json"),
        what="write report",
    )
    with_retries(
        lambda: store.put(layout.report_md_key, report_markdown(report).encode(), content_type="text/markdown"),
        what="write report.md",
    )
    logger.info("report for %s:\n%s", layout.uri, report_markdown(report))
    problems = []
    if report["missing"]:
        problems.append(f"{report['missing']} planned prompt(s) missing (first: {report['missing_ids_sample'][:5]})")
    if report["duplicates"]:
        problems.append(f"{report['duplicates']} duplicate row(s) (first: {report['duplicate_ids_sample'][:5]})")
    if report["unexpected_ids"]:
        problems.append(f"{report['unexpected_ids']} row(s) with ids that were never planned")
    if report["stray_parts"]:
        problems.append(f"{len(report['stray_parts'])} part(s) outside the plan: {report['stray_parts'][:3]}")
    if problems:
        raise ValidationFailed(
            f"{layout.uri} is not complete and exact: " + "; ".join(problems)
            + f". Details in s3://{layout.bucket}/{layout.report_key}. Rerun the failed generate tasks "
            "(airflow dags clear dflash_generate --run-id <run> --only-failed -y) or trigger a new run "
            "into the same output_uri: only the missing work is done."
        )
    return report
