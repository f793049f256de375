"""The input row's labels on every training row: `source`, `domain`, `metadata`, `thinking`, `sampling`.

Why: every figure about the data (and about a drafter trained on it) must be breakable down by where
a row came from and how it was generated, and a trainer may weight or select by them. The labels ride
on the completion rows (records.ROW_LABEL_COLUMNS + `thinking` + `sampling`); here they are joined onto the
training rows by (id, sample), which is unique within a completions part, so exact.py's row building
stays untouched.

Columns (Parquet profile): `source`, `domain` (string, null when the input row had none), `metadata`
(the row's metadata object JSON-encoded with sorted keys, null if none), `thinking` (bool: the
thinking mode the row was generated with; completion rows from before the column existed take the
dataset's pinned `enable_thinking`), `sampling` (string: the JSON, sorted keys, of the sampling fields the
row's request carried, records.SAMPLING_FIELD; null on parts from before the column: the manifest's pinned
sampling applies).

The JSONL profiles carry the same labels with "" for none, never null: `datasets`' json builder fixes
a column's type from the first file it reads, and a later file with a string where the first had only
nulls then fails the load (tried with datasets 5.1 in .venv-trainers).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from dflash_pipeline.dataset.records import ROW_LABEL_COLUMNS, ROW_LABEL_FIELDS, SAMPLING_FIELD, THINKING_FIELD

LABEL_FIELDS = [*ROW_LABEL_FIELDS, THINKING_FIELD, SAMPLING_FIELD]
LABEL_COLUMNS = tuple(name for name, _ in LABEL_FIELDS)
READ_COLUMNS = LABEL_COLUMNS
"""The completion columns this module reads (a part written before they existed has none of them)."""


def labels_by_unit(table: pa.Table, default_thinking: bool) -> dict[tuple[str, int], dict[str, Any]]:
    """{(id, sample): labels} of a completions part's rows."""
    n = table.num_rows
    ids = table.column("id").to_pylist()
    samples = table.column("sample").to_pylist() if "sample" in table.column_names else [0] * n
    cols = {c: (table.column(c).to_pylist() if c in table.column_names else [None] * n) for c in LABEL_COLUMNS}
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for i in range(n):
        labels = {c: cols[c][i] for c in ROW_LABEL_COLUMNS}
        thinking = cols["thinking"][i]
        labels["thinking"] = default_thinking if thinking is None else bool(thinking)
        labels["sampling"] = cols["sampling"][i]
        out[(ids[i], int(samples[i] or 0))] = labels
    return out


def with_labels(rows: pa.Table, labels: dict[tuple[str, int], dict[str, Any]], default_thinking: bool) -> pa.Table:
    """The training rows with the label columns appended (replaced if present), each row's labels
    those of its completion row."""
    ids = rows.column("id").to_pylist()
    samples = rows.column("sample").to_pylist()
    empty = {c: None for c in ROW_LABEL_COLUMNS} | {"thinking": default_thinking, "sampling": None}
    per_row = [labels.get((i, int(s or 0)), empty) for i, s in zip(ids, samples)]
    for name, typ in LABEL_FIELDS:
        arr = pa.array([r[name] for r in per_row], type=typ)
        if name in rows.column_names:
            rows = rows.set_column(rows.column_names.index(name), name, arr)
        else:
            rows = rows.append_column(pa.field(name, typ), arr)
    return rows


def ensure_label_columns(rows: pa.Table) -> pa.Table:
    """A training-row table with every label column (null where a caller built it without them)."""
    for name, typ in LABEL_FIELDS:
        if name not in rows.column_names:
            rows = rows.append_column(pa.field(name, typ), pa.nulls(rows.num_rows, type=typ))
    return rows


def jsonl_labels(rows: pa.Table, default_thinking: bool) -> list[dict[str, Any]]:
    """Per training row, the labels as the JSONL profiles write them ("" for none, never null)."""
    rows = ensure_label_columns(rows)
    cols = {c: rows.column(c).to_pylist() for c in LABEL_COLUMNS}
    return [{"source": cols["source"][i] or "", "domain": cols["domain"][i] or "",
             "thinking": default_thinking if cols["thinking"][i] is None else bool(cols["thinking"][i]),
             "metadata": cols["metadata"][i] or "", "sampling": cols["sampling"][i] or ""}
            for i in range(rows.num_rows)]
