"""The validation report as plain-text tables for a terminal (the demo prints it).

Numbers are right-aligned so their digits line up; everything else is left-aligned. A value is
a number by its whole text, not by its first character: `2026-12-04T03:38:31+00:00` starts with
a digit but is a timestamp, and right-aligning it pushed it out of its column.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

#: Report keys printed as their own tables (or not at all), not as one value cell.
NESTED = ("per_server", "checks", "token_stats", "token_recount", "files", "defect_ids_sample", "thresholds")
_NUMBER = re.compile(r"^[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?%?$")


MAX_CELL = 80
"""A cell longer than this is cut with "...": a nested section printed whole (the report's mix, quality...)
widened its column to thousands of characters and pushed every right-aligned number off the screen; the
report.md and report.json hold it whole."""


def format_value(value: Any) -> str:
    """One cell (at most MAX_CELL characters): thousands separators, two decimals, `k=v` pairs, at most five
    list items, `-` for none."""
    text = _format(value)
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 4] + " ..."


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
    if isinstance(value, list):
        return ", ".join(map(str, value[:5])) + (" ..." if len(value) > 5 else "") if value else "-"
    return "-" if value is None else str(value)


def is_number(cell: str) -> bool:
    """True for `2,000`, `0.40`, `-3`, `12.5%`; false for dates, versions, host:ports."""
    return bool(_NUMBER.match(cell))


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A header, a rule and the rows, columns two spaces apart, without trailing blanks."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str], numeric: Sequence[bool]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)).rstrip()

    out = [line(headers, [False] * len(headers)), "  ".join("-" * w for w in widths)]
    out += [line(r, [is_number(c) for c in r]) for r in rows]
    return out


def report_lines(report: Mapping[str, Any]) -> list[str]:
    """The report's scalar figures, then one row per server."""
    scalars = [[k, format_value(v)] for k, v in report.items() if k not in NESTED]
    out = table_lines(["figure", "value"], scalars)
    per_server = report.get("per_server") or {}
    if per_server:
        cols = sorted({k for s in per_server.values() for k in s})
        out.append("")
        out += table_lines(["server", *cols],
                           [[name, *(format_value(s.get(c)) for c in cols)] for name, s in per_server.items()])
    return out
