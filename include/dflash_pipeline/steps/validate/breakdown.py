"""Rows by the input's labels (domain, source, thinking) and the held-out split, for the validation report.

Why: every later figure (truncation, acceptance, drops) is read against the mix it came from; a
report that counts rows by domain and source first says what that mix is. Rows without a label count
under "unknown". Owned by validation's one thread: `add` per part, `to_dict` once at the end.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa

UNKNOWN = "unknown"
READ_COLUMNS = ("source", "domain", "thinking")
"""Completion columns read (parts written before they existed have none: every row is "unknown")."""
MAX_KEYS = 200
"""Labels listed per table; the rest are summed under "(other)" so a free-text domain cannot bloat the report."""


class LabelTally:
    """Rows, completions and errors per domain, per source, per thinking mode."""

    def __init__(self) -> None:
        self.rows: dict[str, Counter[str]] = {"domain": Counter(), "source": Counter(), "thinking": Counter()}
        self.errors: dict[str, Counter[str]] = {"domain": Counter(), "source": Counter(), "thinking": Counter()}

    def add(self, part: pa.Table) -> None:
        n = part.num_rows
        errs = (part.column("error_class").to_pylist() if "error_class" in part.column_names else [None] * n)
        for name in self.rows:
            values = part.column(name).to_pylist() if name in part.column_names else [None] * n
            for value, err in zip(values, errs):
                key = UNKNOWN if value is None or value == "" else (str(value).lower() if name == "thinking" else value)
                self.rows[name][key] += 1
                if err:
                    self.errors[name][key] += 1

    def _table(self, name: str) -> dict[str, dict[str, Any]]:
        total = sum(self.rows[name].values())
        ranked = self.rows[name].most_common()
        out: dict[str, dict[str, Any]] = {}
        for key, rows in ranked[:MAX_KEYS]:
            errors = self.errors[name][key]
            out[key] = {"rows": rows, "completions": rows - errors, "errors": errors,
                        "share": round(rows / total, 4) if total else 0.0}
        rest = ranked[MAX_KEYS:]
        if rest:
            rows = sum(v for _, v in rest)
            errors = sum(self.errors[name][k] for k, _ in rest)
            out["(other)"] = {"rows": rows, "completions": rows - errors, "errors": errors,
                              "share": round(rows / total, 4) if total else 0.0, "labels": len(rest)}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"by_domain": self._table("domain"), "by_source": self._table("source"),
                "by_thinking": self._table("thinking")}


def report_fields(labels: LabelTally, manifest: dict[str, Any]) -> dict[str, Any]:
    """What validation adds to report.json: `rows_by_label` and the manifest's `heldout` split."""
    return {"rows_by_label": labels.to_dict(), "heldout": manifest.get("heldout")}


def markdown(report: dict[str, Any]) -> str:
    """The report.md sections: the held-out split, then rows by domain and by source."""
    lines: list[str] = []
    split = report.get("heldout")
    lines += ["", "## held-out split", ""]
    if split:
        lines += [f"Fraction {split.get('fraction')}, salt `{split.get('salt')}`, {split.get('count', 0):,} prompts "
                  f"held out (not generated) in `{split.get('key')}`; named by heldout_uri: "
                  f"`{split.get('heldout_uri') or 'none'}`; ids sha256 `{split.get('ids_sha256')}`."]
    else:
        lines += ["None: no prompt of the input was held out."]
    by = report.get("rows_by_label") or {}
    for name in ("domain", "source", "thinking"):
        table = by.get(f"by_{name}") or {}
        if not table:
            continue
        lines += ["", f"## rows by {name}", "", f"| {name} | rows | completions | errors | share |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {k} | {v['rows']:,} | {v['completions']:,} | {v['errors']:,} | {v['share']:.1%} |"
                  for k, v in table.items()]
    return "\n".join(lines) + "\n"
