"""The quality signals counted for the validation report: per flag overall, by thinking mode and by domain,
with a few example rows (id + excerpt); the answers' languages; the near-duplicate prompts.

Validation never fails on these: they are facts about the data, and tokenize's gate decides what is
dropped. Owned by validation's one thread: `add` per part, `finish` once (it writes
near_duplicates.parquet and signals.parquet, every completion's signals as columns), then `report` / `markdown`.
Both files are rewritten whole by `finish` only: a validation killed before it leaves the last run's files
(or none), and the next validation rewrites them from the parts. `part_quality` (one part's rows) is a plain function
of its inputs, so with `quality_workers` > 1 it runs in worker processes; their results are merged in the
order the parts were added.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections import Counter, deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_pipeline.config.quality import QualitySettings
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import unit_key
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.steps.quality.near_dup import (
    NearDuplicateFinder,
    Signatures,
    prompt_signatures,
    prompt_text,
    write_near_duplicates,
)
from dflash_pipeline.dataset.store import with_retries
from dflash_pipeline.steps.quality.signals import QUALITY_FLAGS, SIGNAL_COLUMNS, flags_of, is_loop, row_signals, turns_of

logger = logging.getLogger(__name__)

READ_COLUMNS = ("id", "sample", "messages", "reasoning", "content", "finish_reason", "conversation", "turns",
                "thinking", "domain", "error_class")
"""Part columns the signals read (older parts lack some: read when present)."""
EXAMPLES = 5
"""Example rows kept per flag."""
EXCERPT_CHARS = 240
MAX_DOMAINS = 50
"""Domains listed per flag; the rest are summed under "(other)"."""
UNKNOWN = "unknown"
AUTO_WORKERS = 8
AUTO_MIN_ROWS = 20_000
_EMPTY = np.zeros((0, 0), dtype=np.uint32)
SIGNALS_SCHEMA = pa.schema([
    ("id", pa.string()), ("sample", pa.int32()), ("thinking", pa.bool_()), ("domain", pa.string()),
    ("q_loop_reasoning", pa.bool_()), ("q_loop_answer", pa.bool_()), ("q_truncated_thinking", pa.bool_()),
    ("q_empty_answer", pa.bool_()), ("q_refusal", pa.bool_()), ("language", pa.string()),
    ("language_score", pa.float64()), ("duplicate_of", pa.string()), ("flags", pa.list_(pa.string())),
])
"""quality/signals.parquet: one row per completion (error rows are not completions), in part order; `flags`
are `flags_of` with the validation's settings (near_duplicate included), which the file's metadata holds."""


def _label(value: Any, lower: bool = False) -> str:
    if value is None or value == "":
        return UNKNOWN
    return str(value).lower() if lower else str(value)


def _excerpt(text: str, tail: bool = False) -> str:
    text = text[-4 * EXCERPT_CHARS:] if tail else text[:4 * EXCERPT_CHARS]  # whitespace runs may shrink it
    text = " ".join(text.split())
    if len(text) <= EXCERPT_CHARS:
        return text
    return "…" + text[-EXCERPT_CHARS:] if tail else text[:EXCERPT_CHARS] + "…"


def _example_text(flag: str, row: dict[str, Any], signals: dict[str, Any], settings: QualitySettings) -> str:
    """What shows the flag: the end of the looping text (of the turn that loops) or of a cut reasoning, the
    start of a refusal or of a foreign answer."""
    turns = turns_of(row)
    if flag in ("loop_reasoning", "loop_answer"):
        k = 0 if flag == "loop_reasoning" else 1
        return _excerpt(next((t[k] for t in turns if is_loop(t[k], settings)), ""), tail=True)
    if flag in ("refusal", "language"):
        text = "\n".join(a for _, a, _ in turns if a)
        if flag == "language":
            return f"[{signals.get('language')} {signals.get('language_score')}] " + _excerpt(text)
        return _excerpt(text)
    # truncated_thinking, empty_answer: how the reasoning ended
    return _excerpt(turns[-1][0] if turns else "", tail=True)


class FlagCount:
    """One flag's rows: in all, by thinking mode, by domain, and the first few examples."""

    def __init__(self) -> None:
        self.rows = 0
        self.by_thinking: Counter[str] = Counter()
        self.by_domain: Counter[str] = Counter()
        self.examples: list[dict[str, str]] = []

    def add(self, thinking: str, domain: str, key: str, excerpt: str | None, n: int = 1) -> None:
        self.rows += n
        self.by_thinking[thinking] += n
        self.by_domain[domain] += n
        if excerpt is not None and len(self.examples) < EXAMPLES:
            self.examples.append({"id": key, "excerpt": excerpt})

    def to_dict(self, total: int, totals_by_thinking: Counter[str], totals_by_domain: Counter[str]) -> dict[str, Any]:
        def share(k: int, n: int) -> float:
            return round(k / n, 4) if n else 0.0

        ranked = self.by_domain.most_common()
        by_domain = {d: {"rows": k, "share": share(k, totals_by_domain[d])} for d, k in ranked[:MAX_DOMAINS]}
        if ranked[MAX_DOMAINS:]:
            by_domain["(other)"] = {"rows": sum(k for _, k in ranked[MAX_DOMAINS:]), "labels": len(ranked) - MAX_DOMAINS}
        return {
            "rows": self.rows,
            "share": share(self.rows, total),
            "by_thinking": {t: {"rows": k, "share": share(k, totals_by_thinking[t])}
                            for t, k in sorted(self.by_thinking.items())},
            "by_domain": by_domain,
            "examples": self.examples,
        }


@dataclass
class PartQuality:
    """What one part contributes (computed by `part_quality`, in this process or a worker's)."""

    rows: int
    by_thinking: Counter[str]
    by_domain: Counter[str]
    languages: Counter[str]
    flagged: list[tuple[str, str, str, str, list[str], dict[str, str]]]
    """(id, unit key, thinking, domain, flags, excerpt per flag) of each flagged row, in part order."""
    labels: list[tuple[str, str]]
    """(thinking, domain) of each completion row; the signatures' tags index it."""
    signatures: Signatures
    seconds: float
    signals: list[dict[str, Any]] | None = None
    """Each completion's row of signals.parquet (without duplicate_of), in part order."""


def part_quality(part: pa.Table, settings: QualitySettings) -> PartQuality:
    """The signals of one part's completion rows (error and unfinished rows are not completions)."""
    started = time.perf_counter()
    names = part.column_names
    keep = pc.fill_null(pc.is_in(part.column("finish_reason"), pa.array(["stop", "length"])), False)
    if "error_class" in names:
        keep = pc.and_(keep, pc.is_null(part.column("error_class")))
    rows = part.filter(keep).select([c for c in READ_COLUMNS if c in names]).to_pylist()
    out = PartQuality(len(rows), Counter(), Counter(), Counter(), [], [], Signatures([], _EMPTY, [], [], 0, 0.0), 0.0,
                      [])
    ids: list[str] = []
    prompts: list[str] = []
    for row in rows:
        thinking = _label(row.get("thinking"), lower=True)
        domain = _label(row.get("domain"))
        out.by_thinking[thinking] += 1
        out.by_domain[domain] += 1
        sig = row_signals(row, settings)
        out.languages[sig["language"] or "undetermined"] += 1
        flags = flags_of(sig, settings)
        out.signals.append({"id": row["id"], "sample": int(row.get("sample") or 0), "thinking": row.get("thinking"),
                            "domain": row.get("domain"), **{c: sig[c] for c in SIGNAL_COLUMNS},
                            "duplicate_of": None, "flags": flags})
        if flags:
            out.flagged.append((row["id"], unit_key(row), thinking, domain, flags,
                                {f: _example_text(f, row, sig, settings) for f in flags}))
        out.labels.append((thinking, domain))
        ids.append(row["id"])
        prompts.append(prompt_text(row.get("messages") or _context_of(row)))
    out.signatures = prompt_signatures(ids, prompts, range(len(ids)), settings.near_duplicate_num_perm)
    out.seconds = time.perf_counter() - started
    return out


def pool_size(settings: QualitySettings, planned_rows: int) -> int:
    """Worker processes for the row signals: `quality_workers`, or (0) one per core up to AUTO_WORKERS
    when the dataset has at least AUTO_MIN_ROWS rows (a small one is done sooner in-process)."""
    if settings.workers:
        return settings.workers
    if planned_rows < AUTO_MIN_ROWS:
        return 1
    return max(1, min(AUTO_WORKERS, os.cpu_count() or 1))


class QualityTally:
    """Folds completion parts into the quality counts; `finish` runs the near-duplicate search.

    With `workers` > 1 each part's signals are computed in a process pool (spawn) and merged in the order
    the parts were added, so the report is the same as in-process; at most 2 x workers parts are in flight."""

    def __init__(self, settings: QualitySettings, workers: int = 1) -> None:
        self.settings = settings
        self.rows = 0
        self.flags = {f: FlagCount() for f in QUALITY_FLAGS}
        self.by_thinking: Counter[str] = Counter()
        self.by_domain: Counter[str] = Counter()
        self.languages: Counter[str] = Counter()
        self.flagged_per_id: dict[str, int] = {}
        self.rows_per_id_flagged_any = 0
        self.near = NearDuplicateFinder(settings.near_duplicate_threshold, settings.near_duplicate_num_perm)
        self._label_codes: dict[tuple[str, str], int] = {}
        self.near_rows: list[tuple[str, str, float]] = []
        self.near_key: str | None = None
        self.signals_key: str | None = None
        self._signals: list[pa.Table] = []  # one per part, columnar (900k rows of dicts would not be)
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._pending: deque[Future[PartQuality]] = deque()

    def add(self, part: pa.Table) -> None:
        """One part (all its rows; the completions are picked out)."""
        started = time.perf_counter()
        if self.workers > 1 and self._pool is None:  # started on the first part: nothing to leak before
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"))
        if self._pool is None:
            self._merge(part_quality(part, self.settings))
        else:
            self._pending.append(self._pool.submit(part_quality, part, self.settings))
            while len(self._pending) > 2 * self.workers:
                self._merge(self._pending.popleft().result())
        self.seconds += time.perf_counter() - started

    def _merge(self, got: PartQuality) -> None:
        self.rows += got.rows
        self.by_thinking.update(got.by_thinking)
        self.by_domain.update(got.by_domain)
        self.languages.update(got.languages)
        self.cpu_seconds += got.seconds
        self._signals.append(pa.Table.from_pylist(got.signals or [], schema=SIGNALS_SCHEMA))
        for pid, key, thinking, domain, flags, excerpts in got.flagged:
            self.flagged_per_id[pid] = self.flagged_per_id.get(pid, 0) + 1
            for f in flags:
                fc = self.flags[f]
                fc.add(thinking, domain, key, excerpts[f] if len(fc.examples) < EXAMPLES else None)
        codes = [self._label_codes.setdefault(label, len(self._label_codes)) for label in got.labels]
        sigs = got.signatures
        sigs.tags = [codes[i] for i in sigs.tags]
        self.near.add_signatures(sigs)

    def close(self) -> None:
        """Stop the workers (idempotent; `finish` calls it, and validation does on a failure)."""
        if self._pool is not None:
            for fut in self._pending:
                fut.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def finish(self, store: Store, layout: DatasetLayout) -> None:
        """Find the near-duplicate prompts, count them, and write near_duplicates.parquet."""
        started = time.perf_counter()
        try:
            while self._pending:
                self._merge(self._pending.popleft().result())
        finally:
            self.close()
        self.near_rows = self.near.finish()
        self.near_key = write_near_duplicates(store, layout, self.near_rows)
        fc = self.flags["near_duplicate"]
        labels = {code: label for label, code in self._label_codes.items()}
        extra = 0
        for (pid, dup_of, sim), tag, rows in zip(self.near_rows, self.near.tags, self.near.rows):
            thinking, domain = labels.get(tag, (UNKNOWN, UNKNOWN))
            fc.add(thinking, domain, pid, f"duplicate of {dup_of} (similarity {sim})" if len(fc.examples) < EXAMPLES
                   else None, n=rows)
            extra += rows - self.flagged_per_id.get(pid, 0)
        self.rows_per_id_flagged_any = sum(self.flagged_per_id.values()) + extra
        self.signals_key = self._write_signals(store, layout)
        self.seconds += time.perf_counter() - started
        logger.info("quality signals over %d completions in %.1fs; %d near-duplicate prompt(s) written to %s",
                    self.rows, self.seconds, len(self.near_rows), self.near_key)

    def _write_signals(self, store: Store, layout: DatasetLayout) -> str:
        """signals.parquet: the signals kept as columns, for people and tools to query (tokenize recomputes
        them with its own settings, which may differ); same parts and settings, same bytes."""
        dups = {pid: dup for pid, dup, _ in self.near_rows}
        table = pa.concat_tables(self._signals) if self._signals else SIGNALS_SCHEMA.empty_table()
        dup_of = [dups.get(pid) for pid in table.column("id").to_pylist()]
        flags = [f if d is None else [q for q in QUALITY_FLAGS if q in f or q == "near_duplicate"]
                 for f, d in zip(table.column("flags").to_pylist(), dup_of)]
        table = table.set_column(table.schema.get_field_index("duplicate_of"), "duplicate_of",
                                 pa.array(dup_of, pa.string()))
        table = table.set_column(table.schema.get_field_index("flags"), "flags", pa.array(flags, pa.list_(pa.string())))
        table = table.replace_schema_metadata(
            {"dflash.quality_settings": json.dumps(self.settings.to_dict(), sort_keys=True)})
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        key = layout.quality_signals_key
        data = buf.getvalue()
        with_retries(lambda: store.put(key, data, content_type="application/vnd.apache.parquet"), what=f"write {key}")
        self._signals = []
        return key

    def report(self) -> dict[str, Any]:
        """report.json's `quality` section."""
        langs = self.languages.most_common()
        return {
            "settings": self.settings.to_dict(),
            "rows": self.rows,
            "rows_flagged": self.rows_per_id_flagged_any,
            "rows_flagged_share": round(self.rows_per_id_flagged_any / self.rows, 4) if self.rows else 0.0,
            "flags": {f: c.to_dict(self.rows, self.by_thinking, self.by_domain) for f, c in self.flags.items()},
            "languages": dict(langs[:MAX_DOMAINS]) | ({"(other)": sum(k for _, k in langs[MAX_DOMAINS:])}
                                                     if langs[MAX_DOMAINS:] else {}),
            "signals_key": self.signals_key,
            "near_duplicates": {"key": self.near_key, "prompts": self.near.prompts, "duplicates": len(self.near_rows),
                                "empty_prompts": self.near.empty, "seconds": round(self.near.seconds, 2)},
            "seconds": round(self.seconds, 2),
            "cpu_seconds": round(self.cpu_seconds, 2),
            "workers": self.workers,
            "note": "Quality signals never fail validation; tokenize's drop_quality decides what is dropped "
                    "(docs/quality.md). language is flagged only when `languages` is set.",
        }


def _context_of(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation's messages when the part has no `messages` column."""
    return list(row.get("conversation") or [])


def markdown(q: dict[str, Any] | None) -> str:
    """report.md's quality section."""
    if not q:
        return ""
    if q.get("disabled"):
        return "\n## quality signals\n\nNot computed (quality_signals is false).\n"
    lines = ["", "## quality signals", "",
             f"{q['rows']:,} completions checked; {q['rows_flagged']:,} ({q['rows_flagged_share']:.2%}) carry at least "
             "one flag. Flags never fail validation: tokenize's drop_quality decides what is dropped.", "",
             "| flag | rows | share | by thinking | top domains |", "|---|---:|---:|---|---|"]
    for name, f in q["flags"].items():
        thinking = ", ".join(f"{k}: {v['rows']:,} ({v['share']:.1%})" for k, v in f["by_thinking"].items()) or "-"
        domains = ", ".join(f"{k}: {v['rows']:,}" for k, v in list(f["by_domain"].items())[:3]) or "-"
        lines.append(f"| {name} | {f['rows']:,} | {f['share']:.2%} | {thinking} | {domains} |")
    langs = ", ".join(f"{k}: {v:,}" for k, v in list(q["languages"].items())[:10])
    nd = q["near_duplicates"]
    lines += ["", f"Answer languages (py3langid): {langs or '-'}.", "",
              f"Near-duplicate prompts (MinHash, threshold {q['settings']['near_duplicate_threshold']}, "
              f"{q['settings']['near_duplicate_num_perm']} permutations): {nd['duplicates']:,} of {nd['prompts']:,} "
              f"prompts, listed in `{nd['key']}`."]
    examples = [(name, e) for name, f in q["flags"].items() for e in f["examples"][:3]]
    if examples:
        lines += ["", "### examples", ""]
        lines += [f"- {name} `{e['id']}`: {e['excerpt'].replace('|', '¦')}" for name, e in examples]
    return "\n".join(lines) + "\n"


def disabled_report() -> dict[str, Any]:
    return {"disabled": True}


__all__ = ["EXAMPLES", "READ_COLUMNS", "QualityTally", "disabled_report", "markdown"]
