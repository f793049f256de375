"""The quality signals counted for the validation report: per flag overall, by thinking mode and by domain,
with a few example rows (id + excerpt); the answers' languages; the near-duplicate prompts.

Validation never fails on these: they are facts about the data, and tokenize's gate decides what is
dropped. A part's signals are computed once, into its digest (`signal_columns`, called by
steps/validate/digest.py in the generate worker that committed the part, or at validation for a part
without one). Owned by validation's one thread: `add_digest` per part, `finish` once (it writes
signals.parquet, every completion's signals as columns, streamed from a spool), then `report` / `markdown`.
signals.parquet is rewritten whole by `finish` only: a validation killed before it leaves the last run's
file (or none), and the next validation rewrites it.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_pipeline.config.quality import QualitySettings
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import unit_key
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.steps.quality.signals import QUALITY_FLAGS, SIGNAL_COLUMNS, flags_of, is_loop, turns_of

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


SIGNAL_DIGEST_COLUMNS = ("q_loop_reasoning", "q_loop_answer", "q_truncated_thinking", "q_empty_answer", "q_refusal",
                         "language", "language_score", "q_flags", "q_examples")
"""The quality columns of a part's digest (steps/validate/digest.py): null on rows that are not completions."""


def signal_columns(tbl: pa.Table, completion: np.ndarray, settings: QualitySettings) -> dict[str, pa.Array]:
    """The quality signals of a part's completion rows as digest columns aligned with `tbl` (null on
    other rows): the SIGNAL_COLUMNS, the row's flags without near_duplicate (known by id, from the
    prompts: near_dup.py) and, on flagged rows, one excerpt per flag (JSON)."""
    n = tbl.num_rows
    idx = np.flatnonzero(completion)
    values: dict[str, list[Any]] = {c: [None] * n for c in SIGNAL_DIGEST_COLUMNS}
    if len(idx):
        sub = tbl.take(pa.array(idx, type=pa.int64())).select([c for c in READ_COLUMNS if c in tbl.column_names])
        for i, row, sig in zip(idx.tolist(), sub.to_pylist(), part_signals(sub, settings)):
            flags = flags_of(sig, settings)
            for c in SIGNAL_COLUMNS:
                values[c][i] = sig[c]
            values["q_flags"][i] = flags
            if flags:
                values["q_examples"][i] = json.dumps({f: _example_text(f, row, sig, settings) for f in flags},
                                                     sort_keys=True)
    types = {"language": pa.string(), "language_score": pa.float64(), "q_flags": pa.list_(pa.string()),
             "q_examples": pa.string()}
    return {c: pa.array(values[c], type=types.get(c, pa.bool_())) for c in SIGNAL_DIGEST_COLUMNS}


def part_signals(rows: pa.Table, settings: QualitySettings) -> list[dict[str, Any]]:
    """`row_signals` of every row of a part (completions), with the loop rule run over the whole part at
    once (signals.loop_flags: one vectorised pass instead of one per text) and language ID batched."""
    from dflash_pipeline.steps.quality.signals import part_row_signals

    names = rows.column_names
    columns = ({"reasoning": rows.column("reasoning"), "content": rows.column("content")}
               if "reasoning" in names and "content" in names else None)
    return part_row_signals(rows.to_pylist(), settings, columns)


class QualityTally:
    """Folds part digests into the quality counts and streams signals.parquet (one row per completion, in
    part order), with each row's near_duplicate flag from the prompts' near-duplicates (known before the
    fold: near_dup.py ran beside generation, or validation ran it first)."""

    def __init__(self, settings: QualitySettings, near: Mapping[str, tuple[str, float]] | None = None,
                 near_meta: Mapping[str, Any] | None = None) -> None:
        self.settings = settings
        self.rows = 0
        self.rows_flagged = 0
        self.rows_loop = 0
        self.flags = {f: FlagCount() for f in QUALITY_FLAGS}
        self.by_thinking: Counter[str] = Counter()
        self.by_domain: Counter[str] = Counter()
        self.languages: Counter[str] = Counter()
        self.near = dict(near or {})
        self.near_meta = dict(near_meta or {})
        self.near_key: str | None = None
        self.signals_key: str | None = None
        self.seconds = 0.0
        self._spool = tempfile.TemporaryFile(prefix="dflash-signals-")
        self._writer: pq.ParquetWriter | None = None

    def add_digest(self, table: pa.Table) -> None:
        """One part's digest (its completion rows carry the signal columns)."""
        started = time.perf_counter()
        if "q_flags" not in table.column_names or table.num_rows == 0:
            return
        sub = table.filter(pc.is_valid(table.column("q_flags")))
        if sub.num_rows == 0:
            self.seconds += time.perf_counter() - started
            return
        cols = {c: sub.column(c).to_pylist() if c in sub.column_names else [None] * sub.num_rows
                for c in ("id", "sample", "thinking", "domain", "q_flags", "q_examples", "language")}
        dup_of: list[str | None] = []
        flags_out: list[list[str]] = []
        for i, pid in enumerate(cols["id"]):
            thinking = _label(cols["thinking"][i], lower=True)
            domain = _label(cols["domain"][i])
            self.by_thinking[thinking] += 1
            self.by_domain[domain] += 1
            self.languages[cols["language"][i] or "undetermined"] += 1
            flags = list(cols["q_flags"][i])
            near = self.near.get(pid)
            dup_of.append(near[0] if near else None)
            if near:
                flags = [q for q in QUALITY_FLAGS if q in flags or q == "near_duplicate"]
            flags_out.append(flags)
            if not flags:
                continue
            self.rows_flagged += 1
            self.rows_loop += "loop_reasoning" in flags or "loop_answer" in flags
            excerpts = json.loads(cols["q_examples"][i]) if cols["q_examples"][i] else {}
            key = unit_key({"id": pid, "sample": cols["sample"][i]})
            for f in flags:
                fc = self.flags[f]
                text = (f"duplicate of {near[0]} (similarity {near[1]})" if f == "near_duplicate" and near
                        else excerpts.get(f, ""))
                fc.add(thinking, domain, pid if f == "near_duplicate" else key,
                       text if len(fc.examples) < EXAMPLES else None)
        self.rows += sub.num_rows
        self._write_signals(sub, dup_of, flags_out)
        self.seconds += time.perf_counter() - started

    def _write_signals(self, sub: pa.Table, dup_of: list[str | None], flags: list[list[str]]) -> None:
        n = sub.num_rows

        def col(name: str, typ: pa.DataType) -> pa.Array:
            return (sub.column(name).combine_chunks().cast(typ) if name in sub.column_names
                    else pa.nulls(n, typ))

        sample = pc.fill_null(col("sample", pa.int32()), 0)
        table = pa.table([col("id", pa.string()), sample, col("thinking", pa.bool_()), col("domain", pa.string()),
                          *(col(c, pa.bool_()) for c in SIGNAL_COLUMNS[:5]), col("language", pa.string()),
                          col("language_score", pa.float64()), pa.array(dup_of, pa.string()),
                          pa.array(flags, pa.list_(pa.string()))], schema=SIGNALS_SCHEMA)
        if self._writer is None:
            schema = SIGNALS_SCHEMA.with_metadata(
                {"dflash.quality_settings": json.dumps(self.settings.to_dict(), sort_keys=True)})
            self._writer = pq.ParquetWriter(self._spool, schema, compression="zstd")
        self._writer.write_table(table.replace_schema_metadata(self._writer.schema.metadata))

    def close(self) -> None:
        """Drop the spool (idempotent; validation calls it on a failure too)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._spool.close()

    def finish(self, store: Store, layout: DatasetLayout, near_key: str | None) -> None:
        """Write signals.parquet (streamed from the spool: memory does not grow with the rows)."""
        from dflash_pipeline.dataset.store import upload_file

        started = time.perf_counter()
        if self._writer is None:
            schema = SIGNALS_SCHEMA.with_metadata(
                {"dflash.quality_settings": json.dumps(self.settings.to_dict(), sort_keys=True)})
            self._writer = pq.ParquetWriter(self._spool, schema, compression="zstd")
        self._writer.close()
        self._writer = None
        self.near_key = near_key
        self.signals_key = layout.quality_signals_key
        upload_file(store, self.signals_key, self._spool, "application/vnd.apache.parquet")
        self.seconds += time.perf_counter() - started
        logger.info("quality signals over %d completions merged in %.1fs; %d near-duplicate prompt(s) in %s",
                    self.rows, self.seconds, len(self.near), self.near_key)

    def report(self) -> dict[str, Any]:
        """report.json's `quality` section."""
        langs = self.languages.most_common()
        return {
            "settings": self.settings.to_dict(),
            "rows": self.rows,
            "rows_flagged": self.rows_flagged,
            "rows_flagged_share": round(self.rows_flagged / self.rows, 4) if self.rows else 0.0,
            "flags": {f: c.to_dict(self.rows, self.by_thinking, self.by_domain) for f, c in self.flags.items()},
            "languages": dict(langs[:MAX_DOMAINS]) | ({"(other)": sum(k for _, k in langs[MAX_DOMAINS:])}
                                                     if langs[MAX_DOMAINS:] else {}),
            "signals_key": self.signals_key,
            "near_duplicates": {"key": self.near_key, "prompts": self.near_meta.get("prompts", 0),
                                "duplicates": len(self.near), "empty_prompts": self.near_meta.get("empty_prompts", 0),
                                "computed": self.near_meta.get("computed"),
                                "seconds": self.near_meta.get("seconds", 0.0)},
            "seconds": round(self.seconds, 2),
            "note": "Quality signals never fail validation; tokenize's drop_quality decides what is dropped "
                    "(docs/quality.md). language is flagged only when `languages` is set.",
        }


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


__all__ = ["EXAMPLES", "READ_COLUMNS", "SIGNAL_DIGEST_COLUMNS", "QualityTally", "disabled_report", "markdown", "signal_columns"]
