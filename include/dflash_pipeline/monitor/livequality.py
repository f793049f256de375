"""The live quality figures of a run, as the progress page shows them (issue 40): the generate tasks' objects
`runs/<run_id>/quality/<worker>-try<N>.json` (written by steps/validate/partwatch.py) summed per (server, thinking
mode), and each rate with the rows it is over. steps/quality/live.py checks the same figures against the
run's limits (fail fast)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

FIGURES = ("completions", "errors", "truncated", "truncated_thinking", "loop", "empty_answer", "refusal",
           "language_off", "language_known", "completions_thinking", "reasoning_missing", "spec_rows",
           "spec_verify_steps", "spec_accepted_tokens")
"""Counts kept per (server, thinking mode)."""


def merge_groups(docs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every task's groups summed per (server, thinking) (a server's task retried writes one doc)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in docs:
        for g in doc.get("groups") or []:
            key = (str(g.get("server")), str(g.get("thinking")))
            acc = out.setdefault(key, {"server": key[0], "thinking": key[1], **dict.fromkeys(FIGURES, 0)})
            for f in FIGURES:
                acc[f] += int(g.get(f) or 0)
    return [out[k] for k in sorted(out)]


RATES = (
    # (name, numerator, denominator)
    ("loop", "loop", "completions"),
    ("truncated", "truncated", "completions"),
    ("truncated_thinking", "truncated_thinking", "completions"),
    ("empty_answer", "empty_answer", "completions"),
    ("refusal", "refusal", "completions"),
    ("language_off", "language_off", "language_known"),
    ("reasoning_missing", "reasoning_missing", "completions_thinking"),
)


def sum_groups(groups: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    acc = dict.fromkeys(FIGURES, 0)
    for g in groups:
        for f in FIGURES:
            acc[f] += int(g.get(f) or 0)
    return acc


def rates_of(g: Mapping[str, Any]) -> dict[str, Any]:
    """Each rate with the rows it is over, and the token-weighted acceptance length where servers speculate."""
    out: dict[str, Any] = {}
    for name, num, den in RATES:
        n = int(g.get(den) or 0)
        out[name] = {"rate": (int(g.get(num) or 0) / n) if n else None, "rows": n, "count": int(g.get(num) or 0)}
    steps = int(g.get("spec_verify_steps") or 0)
    out["acceptance_length"] = {"value": (1 + int(g.get("spec_accepted_tokens") or 0) / steps) if steps else None,
                                "rows": int(g.get("spec_rows") or 0)}
    return out


def live_view(groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the progress page shows: the run's rates overall, per server and per thinking mode."""
    servers = sorted({g["server"] for g in groups})
    modes = sorted({g["thinking"] for g in groups})
    return {
        "overall": rates_of(sum_groups(groups)) | {"completions": sum_groups(groups)["completions"]},
        "by_server": {s: rates_of(sum_groups(g for g in groups if g["server"] == s)) for s in servers},
        "by_thinking": {m: rates_of(sum_groups(g for g in groups if g["thinking"] == m)) for m in modes},
    }
