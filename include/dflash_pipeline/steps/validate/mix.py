"""The mix report: shares of the completions by source, domain, thinking mode, language, prompt and
completion length and turns, against the target mix the user gave (`target_mix`).

Why: a drafter serves its target's traffic, and its acceptance follows the data's mix as much as the
data's exactness (a drafter trained on thinking-on rows only collapses with thinking off). The report
says what the mix is, before filters (validation: every completion) and after them (tokenize: the
completions that kept at least one training row), side by side with the target and the gap.

Counting is per completion (error rows are left out: they train nothing). A row without a label, or
a part written before the column existed, counts as "unknown" (`language` comes from the quality
signals when the rows carry it). `MixTally` is owned by one thread (validation's loop, or one
tokenize part); its counts are plain JSON ({dimension: {label: count}}) so parts' counts add up.
"""

from __future__ import annotations

import io
import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_pipeline.config.mix import BUCKET_EDGES, FIXED_LABELS, MIX_DIMENSIONS, UNKNOWN, bucket_labels

__all__ = ["OTHER", "PLOT_FILE", "READ_COLUMNS", "UNKNOWN", "MixTally", "kept_counts", "markdown", "mix_report", "plot",
           "plot_key", "render"]

logger = logging.getLogger(__name__)

READ_COLUMNS = ("source", "domain", "thinking", "language", "prompt_tokens", "completion_tokens", "messages",
                "error_class")
"""Completion columns read (each is optional: a part without one counts its rows as "unknown")."""
MAX_LABELS = 50
"""Labels listed per free-text dimension; the rest are summed under OTHER (target labels always listed)."""
OTHER = "(other)"
PLOT_LABELS = 8
"""Bars per dimension in the plot (the largest, plus any target label)."""

PLOT_FILE = "report-mix.png"
"""Next to the report's other plots (report.PLOT_FILES): the progress page lists it with them."""

_LENGTH_COLUMNS = {"prompt_length": "prompt_tokens", "completion_length": "completion_tokens"}


def _completions(table: pa.Table) -> pa.Table:
    """The completion rows of a part (error rows carry a non-empty error_class)."""
    if "error_class" not in table.column_names:
        return table
    ok = pc.fill_null(pc.equal(pc.utf8_length(table.column("error_class")), 0), True)
    return table.filter(ok)


def _text_labels(table: pa.Table, name: str) -> list[str]:
    if name not in table.column_names:
        return [UNKNOWN] * table.num_rows
    return [UNKNOWN if v is None or v == "" else str(v) for v in table.column(name).to_pylist()]


def _thinking_labels(table: pa.Table, default: bool | None) -> list[str]:
    """"true"/"false": the mode the row was generated with (rows from before the column: the run's mode)."""
    values = table.column("thinking").to_pylist() if "thinking" in table.column_names else [None] * table.num_rows
    fallback = UNKNOWN if default is None else str(bool(default)).lower()
    return [fallback if v is None else str(bool(v)).lower() for v in values]


def bucket_counts(values: np.ndarray, edges: Sequence[int]) -> Counter[str]:
    """Counts of `values` (negative = unknown) in the half-open buckets of `edges`."""
    labels = bucket_labels(tuple(edges))
    known = values >= edges[0]
    idx = np.searchsorted(np.asarray(edges), values[known], side="right") - 1
    out: Counter[str] = Counter()
    for i, n in enumerate(np.bincount(idx, minlength=len(labels))):
        if n:
            out[labels[i]] += int(n)
    unknown = int((~known).sum())
    if unknown:
        out[UNKNOWN] += unknown
    return out


def _int_values(table: pa.Table, name: str) -> np.ndarray:
    if name not in table.column_names:
        return np.full(table.num_rows, -1, dtype=np.int64)
    return np.asarray(pc.fill_null(table.column(name).cast(pa.int64()), -1).to_numpy(), dtype=np.int64)


def to_int64(col: Any) -> np.ndarray:
    return np.asarray(pc.fill_null(col, -1).to_numpy(zero_copy_only=False), dtype=np.int64)


def user_turns(table: pa.Table) -> np.ndarray:
    """User messages per row's conversation (at least 1; -1 when the row has no messages column)."""
    n = table.num_rows
    if "d_user_turns" in table.column_names:  # a part's digest carries them (digest.py)
        return to_int64(table.column("d_user_turns"))
    if "messages" not in table.column_names or n == 0:
        return np.full(n, -1, dtype=np.int64)
    msgs = table.column("messages").combine_chunks()
    flat = pc.list_flatten(msgs)
    if len(flat) == 0:
        return np.ones(n, dtype=np.int64)
    parents = np.asarray(pc.list_parent_indices(msgs).to_numpy(), dtype=np.int64)
    is_user = np.asarray(pc.fill_null(pc.equal(pc.struct_field(flat, "role"), "user"), False).to_numpy(
        zero_copy_only=False), dtype=bool)
    counts = np.bincount(parents[is_user], minlength=n)
    return np.maximum(counts, 1).astype(np.int64)


class MixTally:
    """Completions counted per label of each mix dimension."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter[str]] = {dim: Counter() for dim in MIX_DIMENSIONS}
        self.completions = 0

    def add(self, part: pa.Table, default_thinking: bool | None = None,
            language: Sequence[str | None] | None = None) -> None:
        """Count the completion rows of one part (error rows skipped). `language`: one value per row of
        the part (the quality signals' `language`, when computed outside the part), used when the part
        has no `language` column."""
        if language is not None and "language" not in part.column_names:
            part = part.append_column("language", pa.array(list(language), type=pa.string()))
        t = _completions(part)
        if t.num_rows == 0:
            return
        self.completions += t.num_rows
        for dim in ("source", "domain", "language"):
            self.counts[dim].update(_text_labels(t, dim))
        self.counts["thinking"].update(_thinking_labels(t, default_thinking))
        for dim, col in _LENGTH_COLUMNS.items():
            self.counts[dim].update(bucket_counts(_int_values(t, col), BUCKET_EDGES[dim]))
        self.counts["turns"].update(bucket_counts(user_turns(t), BUCKET_EDGES["turns"]))

    def use_languages(self, languages: Mapping[str, int]) -> None:
        """Take the language counts the quality signals made over the same completions (validation computes
        them once, in steps/quality), when no part carried a language column. Completions they did not
        count stay "unknown", so the shares still sum to 1."""
        if set(self.counts["language"]) - {UNKNOWN} or not languages:
            return
        counted = Counter({str(k): int(v) for k, v in languages.items() if v})
        rest = self.completions - sum(counted.values())
        if rest > 0:
            counted[UNKNOWN] += rest
        self.counts["language"] = counted

    def add_counts(self, counts: Mapping[str, Any]) -> None:
        """Add counts as `to_counts` wrote them (another part's)."""
        self.completions += int(counts.get("completions", 0))
        for dim, labels in (counts.get("by") or {}).items():
            if dim in self.counts:
                for label, n in labels.items():
                    self.counts[dim][label] += int(n)

    def to_counts(self) -> dict[str, Any]:
        """{"completions": n, "by": {dimension: {label: count}}}: JSON, additive over parts."""
        return {"completions": self.completions, "by": {d: dict(c) for d, c in self.counts.items()}}


def kept_counts(part: pa.Table, training_rows: pa.Table, default_thinking: bool | None) -> dict[str, Any]:
    """Tokenize's after-filter counts for one part: its completions that kept at least one training row
    (joined on (id, sample), unique within a part). The language is the part's column, else the training
    rows' (the quality signals tokenize's filters computed)."""
    from dflash_pipeline.dataset.records import unit_keys

    def keys(t: pa.Table) -> list[str]:
        samples = t.column("sample").to_pylist() if "sample" in t.column_names else None
        return unit_keys(t.column("id").to_pylist(), samples)

    train_keys = keys(training_rows) if training_rows.num_rows else []
    kept = set(train_keys)
    part_keys = keys(part)
    mask = [k in kept for k in part_keys]
    language = None
    if "language" in training_rows.column_names and "language" not in part.column_names:
        # the quality signals tokenize computed for its filters ride on the training rows
        by_key = dict(zip(train_keys, training_rows.column("language").to_pylist()))
        language = [by_key.get(k) for k, m in zip(part_keys, mask) if m]
    tally = MixTally()
    tally.add(part.filter(pa.array(mask, type=pa.bool_())), default_thinking, language=language)
    return tally.to_counts()


def _ordered(dim: str, counts: Mapping[str, int], target: Mapping[str, float]) -> list[tuple[str, int]]:
    """Labels in a stable order: fixed dimensions in their own order, free text by count; long free-text
    tails summed under OTHER (target labels always kept)."""
    fixed = FIXED_LABELS.get(dim)
    if fixed is not None:
        order = [lab for lab in fixed if lab in counts or lab in target]
        order += sorted(lab for lab in {*counts, *target} if lab not in fixed)
        return [(lab, int(counts.get(lab, 0))) for lab in order]
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = ranked[:MAX_LABELS]
    names = {k for k, _ in kept}
    rest = [(k, v) for k, v in ranked[MAX_LABELS:] if k not in target]
    kept += [(k, v) for k, v in ranked[MAX_LABELS:] if k in target]
    kept += [(lab, 0) for lab in target if lab not in counts and lab not in names]
    if rest:
        kept.append((OTHER, sum(v for _, v in rest)))
    return kept


def _share(n: int, total: int) -> float:
    return round(n / total, 4) if total else 0.0


def mix_report(counts: Mapping[str, Any], target: Mapping[str, Mapping[str, float]] | None = None,
               before: Mapping[str, Any] | None = None, basis: str = "completions") -> dict[str, Any]:
    """The report's `mix` section from `to_counts` output: per dimension, each label's count and share,
    the target share and the gap (actual - target) when the dimension has a target, and the share
    before filters when `before` (validation's counts) is given."""
    target = dict(target or {})
    total = int(counts.get("completions", 0))
    by = counts.get("by") or {}
    before_by = (before or {}).get("by") or {}
    before_total = int((before or {}).get("completions", 0))
    dims: dict[str, Any] = {}
    for dim in MIX_DIMENSIONS:
        tgt = target.get(dim) or {}
        rows = []
        for label, n in _ordered(dim, by.get(dim) or {}, tgt):
            row: dict[str, Any] = {"label": label, "count": n, "share": _share(n, total)}
            if before is not None:
                b = int((before_by.get(dim) or {}).get(label, 0))
                row["before_count"] = b
                row["before_share"] = _share(b, before_total)
            if tgt:
                row["target"] = round(float(tgt.get(label, 0.0)), 4)
                row["gap"] = round(row["share"] - row["target"], 4)
            rows.append(row)
        entry: dict[str, Any] = {"rows": rows, "labels": len(by.get(dim) or {})}
        if tgt:
            entry["max_abs_gap"] = round(max((abs(r["gap"]) for r in rows), default=0.0), 4)
        dims[dim] = entry
    return {"basis": basis, "completions": total, "before_completions": before_total if before is not None else None,
            "target": target or None, "counts": {"completions": total, "by": by}, "dimensions": dims}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _pp(x: float) -> str:
    return f"{100 * x:+.1f} pp"


def markdown(mix: Mapping[str, Any] | None, title: str = "mix", plot_key: str | None = None) -> str:
    """The report.md section: per dimension, label | count | share (| before) (| target | gap)."""
    if not mix:
        return ""
    before = mix.get("before_completions") is not None
    lines = ["", f"## {title}", "",
             f"Shares of the {mix['basis']} ({mix['completions']:,})"
             + (f", next to the shares before filters ({mix['before_completions']:,} completions)" if before else "")
             + ("; the target mix side by side, gap = actual - target in percentage points."
                if mix.get("target") else "; no target_mix given.")]
    if plot_key:
        lines += ["", f"Plot: `{plot_key}`"]
    for dim, entry in mix["dimensions"].items():
        rows = entry["rows"]
        if not rows:
            continue
        has_target = "max_abs_gap" in entry
        head = ["label", *(["before"] if before else []), "completions", *(["share before"] if before else []), "share"]
        if has_target:
            head += ["target", "gap"]
        note = f" (largest gap {_pp(entry['max_abs_gap']).lstrip('+')})" if has_target else ""
        lines += ["", f"### {dim}{note}", ""]
        if entry.get("note"):
            lines += [f"({entry['note']}.)", ""]
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for r in rows:
            cells = [str(r["label"])]
            if before:
                cells.append(f"{r['before_count']:,}")
            cells.append(f"{r['count']:,}")
            if before:
                cells.append(_pct(r["before_share"]))
            cells.append(_pct(r["share"]))
            if has_target:
                cells += [_pct(r["target"]), _pp(r["gap"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot_rows(entry: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    rows = list(entry["rows"])
    if len(rows) <= PLOT_LABELS:
        return rows
    chosen = [r for r in rows if r.get("target")]
    chosen += sorted((r for r in rows if not r.get("target")), key=lambda r: -r["count"])
    return chosen[:PLOT_LABELS]


def plot(mix: Mapping[str, Any], title: str) -> bytes:
    """Horizontal bars per dimension: the actual share of each label, and the target next to it."""
    from matplotlib.ticker import PercentFormatter

    from dflash_pipeline.steps.validate.plots import _figure, _png

    dims = [(d, e) for d, e in mix["dimensions"].items() if e["rows"]]
    cols = 2
    nrows = max(1, math.ceil(len(dims) / cols))
    fig, _ = _figure(9.0, min(10.0, 0.6 + 2.0 * nrows))
    axes = fig.subplots(nrows, cols, squeeze=False)
    legend = False
    for i, ax in enumerate(axes.flat):
        if i >= len(dims):
            ax.set_visible(False)
            continue
        dim, entry = dims[i]
        rows = _plot_rows(entry)
        y = np.arange(len(rows))
        has_target = "max_abs_gap" in entry
        h = 0.4 if has_target else 0.7
        actual = [r["share"] for r in rows]
        bars = ax.barh(y - (h / 2 if has_target else 0), actual, height=h, color="tab:blue", label="actual")
        ax.bar_label(bars, [_pct(v) for v in actual], padding=2, fontsize=7)
        if has_target:
            tb = ax.barh(y + h / 2, [r.get("target", 0.0) for r in rows], height=h, color="tab:orange",
                         label="target")
            ax.bar_label(tb, [_pct(r.get("target", 0.0)) for r in rows], padding=2, fontsize=7)
        ax.set_yticks(y, [str(r["label"])[:24] for r in rows], fontsize=8)
        ax.set_ylim(max(len(rows), 3) - 0.5, -0.5)  # first label on top; a lone bar stays a bar
        ax.set_xlim(0, min(1.0, max([*actual, *(r.get("target", 0.0) for r in rows), 0.05])) * 1.25)
        ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.tick_params(axis="x", labelsize=7)
        gap = f" (largest gap {100 * entry['max_abs_gap']:.1f} pp)" if has_target else ""
        ax.set_title(f"{dim}{gap}", fontsize=9)
        if has_target and not legend:
            ax.legend(fontsize=7, loc="lower right")
            legend = True
    fig.suptitle(title, fontsize=10)
    return _png(fig)


def plot_key(files: Mapping[str, Any]) -> str | None:
    """The mix plot's key among a report's files, if it was written."""
    return next((k for k in files.get("plots") or [] if k.endswith("/" + PLOT_FILE)), None)


def render(mix: Mapping[str, Any], title: str) -> bytes | None:
    """The plot, or None (logged) if it fails: a plot must never cost the report."""
    try:
        return plot(mix, title)
    except Exception:  # noqa: BLE001
        logger.exception("mix plot failed; the report is written without it")
        return None
