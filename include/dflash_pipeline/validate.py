"""validate_and_count: is every planned prompt present exactly once, and what did we get?

It streams chunk by chunk (the planned ids of one chunk, then its part, fetched a few chunks
ahead), and every per-row check is vectorised over the part with pyarrow/numpy. Memory holds a
few chunks, fixed-size histograms and an 8-byte hash per row (to tell a duplicate in another part
from an id that was never planned), whatever the dataset's size; the id lists (missing,
duplicate, unexpected) go to temporary files and then to S3 in full, the report keeps the first
few. The report is written even when validation fails, so the reason can be read next to the data.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_pipeline.histogram import Histogram, Histogram2D
from dflash_pipeline.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.records import read_parquet
from dflash_pipeline.store import Store, with_retries

logger = logging.getLogger(__name__)

REPORT_FORMAT = "dflash-pipeline/report/1"
LIST_LIMIT = 50
"""Ids of missing/duplicate/unexpected rows kept in report.json (all of them go to side files)."""
SAMPLE_LIMIT = 10
"""Ids kept per row-level defect (markers, empty answers, token mismatches...)."""
MAX_FINISH_KEYS = 8
PREFETCH = 4
"""Chunks fetched ahead (input + part): S3 latency overlaps with the checks; bounds memory."""
SMALL_UPLOAD = 32 << 20
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
THINK_MARKER_RE = "</?think>"
VALIDATION_DIR = "validation"
PLOT_FILES = {
    "completion_lengths": "report-completion-lengths.png",
    "thinking_vs_answer": "report-thinking-vs-answer.png",
    "server_throughput": "report-server-throughput.png",
}


class ValidationFailed(Exception):
    """The dataset is incomplete, has duplicates or breaks a threshold; the message names the figures."""


@dataclass(frozen=True)
class Thresholds:
    """When a dataset fails validation (see config.PARAM_SCHEMAS for the reasoning behind the defaults)."""

    max_error_rate: float = 0.01
    max_truncation_rate: float = 0.10
    min_coverage: float = 1.0


@dataclass
class _ServerTally:
    rows: int = 0
    completions: int = 0
    errors: int = 0
    truncated: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    latency_sum: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "completions": self.completions,
            "errors": self.errors,
            "truncated": self.truncated,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "mean_latency_s": round(self.latency_sum / self.completions, 3) if self.completions else None,
            "output_tokens_per_request_s": round(self.output_tokens / self.latency_sum, 1) if self.latency_sum > 0 else None,
        }


@dataclass
class RecountTally:
    """The training tokenizer's view of the completions (see tokencount.py)."""

    tokenizer: str = ""
    chat_template: str = ""
    rows: int = 0
    compared: int = 0
    output_tokens: int = 0
    output_tokens_server: int = 0
    reasoning_tokens: int = 0
    content_tokens: int = 0
    mismatches: int = 0
    max_abs_delta: int = 0
    mismatch_ids: list[str] = field(default_factory=list)
    training: Histogram = field(default_factory=Histogram)
    rows_encoded_alone: int = 0
    seconds: float = 0.0

    def _per_s(self, tokens: int) -> int | None:
        return round(tokens / self.seconds) if self.seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokenizer": self.tokenizer,
            "chat_template": self.chat_template,
            "rows": self.rows,
            "compared": self.compared,
            "output_tokens": self.output_tokens,
            "output_tokens_server": self.output_tokens_server,
            "reasoning_tokens": self.reasoning_tokens,
            "answer_tokens": self.content_tokens,
            "mismatches": self.mismatches,
            "mismatch_ids_sample": self.mismatch_ids,
            "max_abs_delta": self.max_abs_delta,
            "rule": "a row matches when 0 <= server completion_tokens - (tokens(reasoning) + tokens(answer)) "
            "<= tokens('<think>\\n') + tokens('\\n</think>\\n\\n') (rows with reasoning) + 1 (stop token)",
            "training_tokens": self.training.total,
            "training_tokens_stats": self.training.summary(),
            "rows_encoded_alone": self.rows_encoded_alone,
            # each conversation is encoded once: tokens encoded per second = training tokens per second
            "tokens_per_s": self._per_s(self.training.total),
            "output_tokens_per_s": self._per_s(self.output_tokens),
            "training_tokens_per_s": self._per_s(self.training.total),
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
    truncated_in_answer: int = 0
    empty_content: int = 0
    empty_content_not_truncated: int = 0
    reasoning_missing: int = 0
    reasoning_unexpected: int = 0
    think_markers_in_content: int = 0
    think_markers_in_reasoning: int = 0
    reasoning_tokens_unreported: int = 0
    usage_missing: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    reasoning_tokens_reported: int = 0
    chunks: int = 0
    parts_present: int = 0
    stray_parts: list[str] = field(default_factory=list)
    stray_parts_count: int = 0
    missing_ids: list[str] = field(default_factory=list)
    duplicate_ids: list[str] = field(default_factory=list)
    unexpected_ids: list[str] = field(default_factory=list)
    defect_ids: dict[str, list[str]] = field(default_factory=dict)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    errors_by_class: Counter[str] = field(default_factory=Counter)
    per_server: dict[str, _ServerTally] = field(default_factory=dict)
    prompt_hist: Histogram = field(default_factory=Histogram)
    output_hist: Histogram = field(default_factory=Histogram)
    reasoning_hist: Histogram = field(default_factory=Histogram)
    by_finish: dict[str, Histogram] = field(default_factory=dict)
    think_vs_answer: Histogram2D = field(default_factory=Histogram2D)
    think_vs_answer_unit: str = "tokens (server usage)"
    think_vs_answer_skipped: int = 0
    recount: RecountTally | None = None

    def sample(self, check: str, ids: Iterable[str]) -> None:
        kept = self.defect_ids.setdefault(check, [])
        for pid in ids:
            if len(kept) >= SAMPLE_LIMIT:
                return
            kept.append(pid)


class _IdSpool:
    """Ids written one per line to a temporary file (all of them) with the first few kept in memory."""

    def __init__(self, keep: list[str]) -> None:
        self.keep = keep
        self.count = 0
        self._fh: IO[bytes] = tempfile.TemporaryFile(prefix="dflash-ids-")

    def add(self, ids: Iterable[str]) -> None:
        lines = []
        for pid in ids:
            self.count += 1
            if len(self.keep) < LIST_LIMIT:
                self.keep.append(pid)
            # One id per line; an id holding a line break is written JSON-quoted.
            lines.append(json.dumps(pid) if ("\n" in pid or "\r" in pid) else pid)
        if lines:
            self._fh.write(("\n".join(lines) + "\n").encode())

    def lines(self) -> Iterator[str]:
        self._fh.flush()
        self._fh.seek(0)
        for raw in self._fh:
            line = raw.decode().rstrip("\n")
            yield json.loads(line) if line.startswith('"') else line

    def file(self) -> IO[bytes]:
        self._fh.flush()
        self._fh.seek(0)
        return self._fh

    def close(self) -> None:
        self._fh.close()


def _np(arr: pa.ChunkedArray | pa.Array, fill: Any) -> np.ndarray:
    return pc.fill_null(arr, fill).to_numpy(zero_copy_only=False)


def _has_markers(col: pa.ChunkedArray) -> np.ndarray:
    """Rows whose text holds `<think>` or `</think>`: one RE2 pass (its literal-prefix scan runs at
    memchr speed, ~40x the plain substring kernel on long texts)."""
    return np.array(_np(pc.match_substring_regex(col, THINK_MARKER_RE), False), dtype=bool)


class Validator:
    """Folds chunks (planned ids + the part's rows) into a Tally; `finish()` resolves cross-part ids."""

    def __init__(self, thinking: bool, recounter: Any = None) -> None:
        self.t = Tally()
        self.thinking = thinking
        self.recounter = recounter
        if recounter is not None:
            self.t.recount = RecountTally(
                tokenizer=recounter.files.spec, chat_template=recounter.template_source
            )
            self.t.think_vs_answer_unit = "tokens (training tokenizer)"
        self.missing = _IdSpool(self.t.missing_ids)
        self.duplicates = _IdSpool(self.t.duplicate_ids)
        self.unexpected = _IdSpool(self.t.unexpected_ids)
        self._foreign = _IdSpool([])
        self._valid_hashes: list[np.ndarray] = []

    def close(self) -> None:
        for spool in (self.missing, self.duplicates, self.unexpected, self._foreign):
            spool.close()

    # -- coverage ------------------------------------------------------------------------------
    def add_chunk(self, planned_ids: list[str], part: pa.Table | None) -> None:
        """One planned chunk and its part (None when the part is absent)."""
        t = self.t
        t.prompts += len(planned_ids)
        if part is None:
            t.missing += len(planned_ids)
            self.missing.add(planned_ids)
            return
        t.parts_present += 1
        planned = set(planned_ids)
        present: set[str] = set()
        keep: list[int] = []
        dups: list[str] = []
        foreign: list[str] = []
        ids = part.column("id").to_pylist()
        for i, pid in enumerate(ids):
            pid = "<null>" if pid is None else pid
            if pid in present:
                dups.append(pid)
                continue
            present.add(pid)
            if pid not in planned:
                foreign.append(pid)
                continue
            keep.append(i)
        if dups:
            t.duplicates += len(dups)
            self.duplicates.add(dups)
        if foreign:
            self._foreign.add(foreign)
        lacking = [pid for pid in planned_ids if pid not in present]
        if lacking:
            t.missing += len(lacking)
            self.missing.add(lacking)
        valid = part if len(keep) == len(ids) else part.take(pa.array(keep, type=pa.int64()))
        self._valid_hashes.append(np.fromiter((hash(ids[i]) for i in keep), dtype=np.int64, count=len(keep)))
        if valid.num_rows:
            self._tally_rows(valid)

    def finish(self) -> Tally:
        """Sort rows whose id was not planned in their part's chunk: a copy of a row kept elsewhere is
        a duplicate, anything else is unexpected (never planned, or misplaced and missing at home)."""
        if self._foreign.count:
            valid = np.sort(np.concatenate(self._valid_hashes)) if self._valid_hashes else np.zeros(0, np.int64)
            batch: list[str] = []

            def flush() -> None:
                h = np.fromiter((hash(p) for p in batch), dtype=np.int64, count=len(batch))
                pos = np.minimum(np.searchsorted(valid, h), max(len(valid) - 1, 0))
                is_dup = (valid[pos] == h) if len(valid) else np.zeros(len(batch), dtype=bool)
                dup_ids = [p for p, d in zip(batch, is_dup) if d]
                other = [p for p, d in zip(batch, is_dup) if not d]
                self.t.duplicates += len(dup_ids)
                self.duplicates.add(dup_ids)
                self.t.unexpected += len(other)
                self.unexpected.add(other)
                batch.clear()

            for pid in self._foreign.lines():
                batch.append(pid)
                if len(batch) >= 100_000:
                    flush()
            if batch:
                flush()
        self._valid_hashes = []
        return self.t

    # -- per-row checks (vectorised) -------------------------------------------------------------
    def _tally_rows(self, tbl: pa.Table) -> None:
        t = self.t
        servers = np.asarray(pc.fill_null(tbl.column("server"), "?").to_pylist(), dtype=object)
        is_err = _np(pc.greater(pc.binary_length(tbl.column("error_class")), 0), False)
        for name in set(servers.tolist()):
            st = t.per_server.setdefault(name, _ServerTally())
            mask = servers == name
            st.rows += int(mask.sum())
            st.errors += int((mask & is_err).sum())
        n_err = int(is_err.sum())
        if n_err:
            errs = tbl.filter(pa.array(is_err))
            t.errors += n_err
            for cls, cnt in zip(*_value_counts(errs.column("error_class"))):
                t.errors_by_class[cls] += cnt
            t.retryable_errors += int(_np(errs.column("retryable"), False).sum())
            tbl = tbl.filter(pa.array(~is_err))
            servers = servers[~is_err]
        m = tbl.num_rows
        if m == 0:
            return
        t.completions += m
        ids: list[str] | None = None

        def id_list() -> list[str]:
            nonlocal ids
            if ids is None:
                ids = tbl.column("id").to_pylist()
            return ids

        def flag(check: str, mask: np.ndarray) -> int:
            k = int(mask.sum())
            if k and len(t.defect_ids.get(check, [])) < SAMPLE_LIMIT:
                pids = id_list()
                t.sample(check, (pids[i] for i in np.flatnonzero(mask)[:SAMPLE_LIMIT]))
            return k

        finish = np.asarray(pc.fill_null(tbl.column("finish_reason"), "null").to_pylist(), dtype=object)
        content = pc.fill_null(tbl.column("content"), "")
        reasoning = pc.fill_null(tbl.column("reasoning"), "")
        empty = _np(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(content)), 0), True)
        has_reasoning = _np(pc.greater(pc.binary_length(reasoning), 0), False)
        truncated = finish == "length"

        t.truncated += int(truncated.sum())
        t.truncated_in_thinking += flag("truncated_in_thinking", truncated & empty)
        t.truncated_in_answer += int((truncated & ~empty).sum())
        t.empty_content += int(empty.sum())
        t.empty_content_not_truncated += flag("empty_content_not_truncated", empty & ~truncated)
        if self.thinking:
            t.reasoning_missing += flag("reasoning_missing", ~has_reasoning)
        else:
            t.reasoning_unexpected += flag("reasoning_unexpected", has_reasoning)
        t.think_markers_in_content += flag("think_markers_in_content", _has_markers(content))
        if has_reasoning.any():
            t.think_markers_in_reasoning += flag("think_markers_in_reasoning", _has_markers(reasoning))

        pt_col, ct_col, rt_col = (tbl.column(c) for c in ("prompt_tokens", "completion_tokens", "reasoning_tokens"))
        pt, ct, rt = _np(pt_col, 0).astype(np.int64), _np(ct_col, 0).astype(np.int64), _np(rt_col, 0).astype(np.int64)
        ct_ok = _np(pc.is_valid(ct_col), False)
        rt_ok = _np(pc.is_valid(rt_col), False)
        t.usage_missing += flag("usage_missing", ~ct_ok)
        t.prompt_tokens += int(pt.sum())
        t.output_tokens += int(ct.sum())
        t.reasoning_tokens += int(rt[rt_ok].sum())
        t.reasoning_tokens_reported += int(rt_ok.sum())
        t.reasoning_tokens_unreported += int((has_reasoning & (~rt_ok | (rt == 0))).sum())
        t.prompt_hist.add(pt[_np(pc.is_valid(pt_col), False)])
        t.output_hist.add(ct[ct_ok])
        t.reasoning_hist.add(rt[rt_ok])
        for name, cnt in Counter(finish.tolist()).items():
            t.finish_reasons[name] += cnt
            key = name if name in t.by_finish or len(t.by_finish) < MAX_FINISH_KEYS else "other"
            t.by_finish.setdefault(key, Histogram()).add(ct[(finish == name) & ct_ok])

        latency = _np(tbl.column("latency_s"), 0.0).astype(np.float64)
        for name in set(servers.tolist()):
            mask = servers == name
            st = t.per_server[name]
            st.completions += int(mask.sum())
            st.truncated += int((mask & truncated).sum())
            st.prompt_tokens += int(pt[mask].sum())
            st.output_tokens += int(ct[mask].sum())
            st.latency_sum += float(latency[mask].sum())

        if self.recounter is not None:
            thinking_n, answer_n = self._recount(tbl, ct, ct_ok, has_reasoning, id_list)
            t.think_vs_answer.add(thinking_n, answer_n)
        else:
            split = rt_ok & ct_ok & ((rt > 0) | ~has_reasoning)
            t.think_vs_answer_skipped += int((~split).sum())
            t.think_vs_answer.add(rt[split], (ct - rt)[split])

    def _recount(
        self, tbl: pa.Table, ct: np.ndarray, ct_ok: np.ndarray, has_reasoning: np.ndarray, id_list: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        rc = self.t.recount
        assert rc is not None
        started = time.perf_counter()
        res = self.recounter.recount(
            tbl.column("messages").to_pylist(), tbl.column("reasoning").to_pylist(), tbl.column("content").to_pylist()
        )
        rc.seconds += time.perf_counter() - started
        out = res.output
        rc.rows += len(out)
        rc.compared += int(ct_ok.sum())
        rc.output_tokens += int(out.sum())
        rc.output_tokens_server += int(ct[ct_ok].sum())
        rc.reasoning_tokens += int(res.reasoning.sum())
        rc.content_tokens += int(res.content.sum())
        rc.training.add(res.training)
        rc.rows_encoded_alone += res.rows_encoded_alone
        delta = ct - out
        bad = ct_ok & ((delta < 0) | (delta > self.recounter.allowed_overhead(has_reasoning)))
        k = int(bad.sum())
        if k:
            rc.mismatches += k
            rc.max_abs_delta = max(rc.max_abs_delta, int(np.abs(delta[bad]).max()))
            if len(rc.mismatch_ids) < SAMPLE_LIMIT:
                pids = id_list()
                rc.mismatch_ids.extend(pids[i] for i in np.flatnonzero(bad)[: SAMPLE_LIMIT - len(rc.mismatch_ids)])
        return res.reasoning, res.content


def _value_counts(col: pa.ChunkedArray) -> tuple[list[str], list[int]]:
    vc = pc.value_counts(col)
    return vc.field("values").to_pylist(), vc.field("counts").to_pylist()


def _rate(num: int, den: int) -> float:
    return num / den if den else 0.0


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def side_file_keys(layout: DatasetLayout) -> dict[str, str]:
    base = f"{layout.root}/{VALIDATION_DIR}"
    return {name: f"{base}/{name}.txt" for name in ("missing_ids", "duplicate_ids", "unexpected_ids")}


def plot_keys(layout: DatasetLayout) -> dict[str, str]:
    return {name: f"{layout.root}/{fname}" for name, fname in PLOT_FILES.items()}


def evaluate(t: Tally, thresholds: Thresholds) -> tuple[list[dict[str, Any]], list[str]]:
    """The threshold checks (figure, limit, pass) and the problems that fail the dataset."""
    coverage = 1.0 - _rate(t.missing, t.prompts) if t.prompts else 1.0
    rows = t.completions + t.errors
    error_rate = _rate(t.errors, rows)
    truncation_rate = _rate(t.truncated, t.completions)
    checks = [
        {"name": "coverage", "value": round(coverage, 6), "threshold": "min_coverage", "limit": thresholds.min_coverage,
         "ok": coverage >= thresholds.min_coverage,
         "figure": f"coverage {_pct(coverage)} ({t.prompts - t.missing} of {t.prompts} planned prompts have a row)"},
        {"name": "error_rate", "value": round(error_rate, 6), "threshold": "max_error_rate",
         "limit": thresholds.max_error_rate, "ok": error_rate <= thresholds.max_error_rate,
         "figure": f"error rate {_pct(error_rate)} ({t.errors} error rows of {rows})"},
        {"name": "truncation_rate", "value": round(truncation_rate, 6), "threshold": "max_truncation_rate",
         "limit": thresholds.max_truncation_rate, "ok": truncation_rate <= thresholds.max_truncation_rate,
         "figure": f"truncation rate {_pct(truncation_rate)} ({t.truncated} of {t.completions} completions "
         f"hit max_tokens, {t.truncated_in_thinking} of them inside the thinking)"},
    ]
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
            problems.append(f"{c['figure']} is {word} {c['threshold']}={_pct(c['limit'])}{extra}")
    return checks, problems


def build_report(
    t: Tally,
    manifest: dict[str, Any],
    layout: DatasetLayout,
    thresholds: Thresholds | None = None,
    files: dict[str, Any] | None = None,
) -> dict[str, Any]:
    thresholds = thresholds or Thresholds()
    checks, problems = evaluate(t, thresholds)
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
        "prompts": t.prompts,
        "completions": t.completions,
        "errors": t.errors,
        "retryable_errors": t.retryable_errors,
        "errors_by_class": dict(t.errors_by_class),
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
    "prompts", "completions", "errors", "retryable_errors", "missing", "duplicates", "unexpected_ids", "coverage",
    "error_rate", "truncation_rate", "truncated", "truncated_in_thinking", "truncated_in_answer", "empty_content",
    "empty_content_not_truncated", "reasoning_missing", "reasoning_unexpected", "think_markers_in_content",
    "think_markers_in_reasoning", "reasoning_tokens_unreported", "usage_missing", "prompt_tokens", "output_tokens",
    "reasoning_tokens", "mean_output_tokens", "training_tokens",
)


def report_markdown(r: dict[str, Any]) -> str:
    lines = [
        f"# dflash-pipeline report: {r['output_uri']}",
        "",
        f"Model: `{r['model']}` · thinking {'on' if r.get('thinking_enabled') else 'off'} · "
        f"validated {r.get('validated_at')} · **{r.get('status', '?').upper()}**",
        "",
    ]
    if r.get("problems"):
        lines += ["## problems", ""] + [f"- {p}" for p in r["problems"]] + [""]
    lines += ["| figure | value |", "|---|---|"]
    for key in _MD_FIGURES:
        if key in r:
            lines.append(f"| {key} | {r[key]} |")
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


def _ensure_marker(store: Store, layout: DatasetLayout, c: int, part: pa.Table, has: bool) -> None:
    """Re-create the retry flag of a part with error rows if a killed worker never wrote it."""
    if has:
        return
    is_err = _np(pc.greater(pc.binary_length(part.column("error_class")), 0), False)
    if not is_err.any():
        return
    retryable = int(_np(part.filter(pa.array(is_err)).column("retryable"), False).sum())
    n = int(is_err.sum())
    body = {"run_id": "validation", "retryable": retryable, "permanent": n - retryable}
    with_retries(lambda: store.put(layout.retry_key(c), json.dumps(body).encode()), what="marker")
    logger.info("chunk %d has %d error row(s) without a retry flag; flagged for the next run", c, n)


def _upload(store: Store, key: str, fh: IO[bytes], content_type: str) -> None:
    """Small files in one PUT (with our retries), large ones as a streamed multipart upload."""
    size = fh.seek(0, 2)
    fh.seek(0)
    if size <= SMALL_UPLOAD:
        data = fh.read()
        with_retries(lambda: store.put(key, data, content_type=content_type), what=f"write {key}")
    else:
        store.client.upload_fileobj(fh, store.bucket, key, ExtraArgs={"ContentType": content_type})


def run_validation(
    client: Any,
    output_uri: str,
    thresholds: Thresholds | None = None,
    tokenizer: str | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Check the dataset under `output_uri` against its plan; write the report, side files and plots.

    Raises ValidationFailed (after writing everything) when the dataset is not complete and exact
    or breaks a threshold.
    """
    started = time.monotonic()
    thresholds = thresholds or Thresholds()
    layout = DatasetLayout.from_uri(output_uri)
    store = Store(client, layout.bucket)
    got = with_retries(lambda: store.get(layout.manifest_key), what="read manifest")
    if got is None:
        raise ValidationFailed(f"{layout.uri}: manifest.json is missing")
    manifest = json.loads(got[0])
    sizes: list[int] = manifest["chunks"]["sizes"]
    plan_id = manifest["plan_id"]
    thinking = bool(manifest["pinned"]["sampling"]["enable_thinking"])

    recounter = None
    columns = list(PART_READ_COLUMNS)
    if tokenizer:
        from dflash_pipeline.tokencount import load_recounter

        def s3_get(bucket: str, key: str) -> bytes | None:
            res = with_retries(lambda: Store(client, bucket).get(key), what=f"read tokenizer {key}")
            return None if res is None else res[0]

        recounter = load_recounter(tokenizer, s3_get, enable_thinking=thinking)
        columns.append("messages")

    v = Validator(thinking, recounter)
    t = v.t
    t.chunks = len(sizes)
    parts: dict[int, str] = {}
    for obj in store.list(layout.completions_prefix):
        c = chunk_of_key(obj.key)
        if c is None or c >= len(sizes):
            t.stray_parts_count += 1
            if len(t.stray_parts) < LIST_LIMIT:
                t.stray_parts.append(obj.key)
        else:
            parts[c] = obj.key
    markers = {chunk_of_key(o.key) for o in store.list(layout.retry_prefix)}

    def fetch(c: int) -> tuple[int, list[str], pa.Table | None]:
        data = with_retries(lambda: store.get(layout.input_key(plan_id, c)), what=f"read input {c}")
        if data is None:
            raise ValidationFailed(f"input of chunk {c} is missing; the plan under {layout.uri} is damaged")
        planned_ids = read_parquet(data[0], ["id"]).column("id").to_pylist()
        table = None
        if c in parts:
            blob = with_retries(lambda: store.get(parts[c]), what=f"read part {c}")
            if blob is not None:
                table = read_parquet(blob[0], columns)
        return c, planned_ids, table

    try:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="validate-fetch") as pool:
            pending: deque[Future[tuple[int, list[str], pa.Table | None]]] = deque()
            chunk_iter = iter(range(len(sizes)))
            for c in chunk_iter:
                pending.append(pool.submit(fetch, c))
                if len(pending) >= PREFETCH:
                    break
            while pending:
                c, planned_ids, table = pending.popleft().result()
                nxt = next(chunk_iter, None)
                if nxt is not None:
                    pending.append(pool.submit(fetch, nxt))
                if table is not None:
                    _ensure_marker(store, layout, c, table, c in markers)
                v.add_chunk(planned_ids, table)
                if c and c % 500 == 0:
                    logger.info("validated %d of %d chunks (%d rows) in %.0fs", c, len(sizes), t.completions + t.errors,
                                time.monotonic() - started)
        v.finish()

        files: dict[str, Any] = {}
        keys = side_file_keys(layout)
        for name, spool in (("missing_ids", v.missing), ("duplicate_ids", v.duplicates), ("unexpected_ids", v.unexpected)):
            _upload(store, keys[name], spool.file(), "text/plain")
            files[name] = keys[name]
    finally:
        v.close()

    files["report_md"] = layout.report_md_key
    if plots:
        from dflash_pipeline.plots import render_all

        pre = build_report(t, manifest, layout, thresholds)
        pngs = render_all(t.by_finish, t.think_vs_answer, t.think_vs_answer_unit, t.think_vs_answer_skipped,
                          pre["per_server"], f"completion length by finish_reason: {layout.uri}")
        pkeys = plot_keys(layout)
        for name, png in pngs.items():
            with_retries(lambda: store.put(pkeys[name], png, content_type="image/png"), what=f"write {pkeys[name]}")
        files["plots"] = [pkeys[n] for n in pngs]

    report = build_report(t, manifest, layout, thresholds, files)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    with_retries(
        lambda: store.put(layout.report_key, json.dumps(report, indent=1).encode(), content_type="application/json"),
        what="write report",
    )
    md = report_markdown(report)
    with_retries(lambda: store.put(layout.report_md_key, md.encode(), content_type="text/markdown"), what="write report.md")
    logger.info("report for %s:\n%s", layout.uri, md)
    logger.info(
        "written: s3://%s/%s, s3://%s/%s, side files %s, plots %s",
        layout.bucket, layout.report_key, layout.bucket, layout.report_md_key,
        [files.get(k) for k in ("missing_ids", "duplicate_ids", "unexpected_ids")], files.get("plots", []),
    )
    if report["problems"]:
        raise ValidationFailed(
            f"{layout.uri} failed validation: " + "; ".join(report["problems"])
            + f". Details in s3://{layout.bucket}/{layout.report_key} (all ids under "
            f"s3://{layout.bucket}/{layout.root}/{VALIDATION_DIR}/). Missing rows or error rows: rerun the failed "
            "generate tasks (airflow dags clear dflash_generate --run-id <run> --only-failed -y) or trigger a new run "
            "into the same output_uri (only the missing work is done; retry_failed_rows='all' retries permanent errors). "
            "Truncation: raise max_tokens (into a new output_uri) or max_truncation_rate if truncated rows are acceptable."
        )
    return report
