"""Tokenize's gates: every drop counted by reason, thinking mode and domain; a run that keeps too little fails.

Why: a tokenize run that keeps 0 of 200 rows (every re-encoded turn disagreeing with the engine's counts, a
wrong tokenizer, a filter that flags everything) used to end "success" with an empty dataset, and a filter
that drops by length (``min_loss_tokens``) or by a quality flag can skew the mix towards one thinking mode
or domain without anyone seeing it. So:

* every dropped training row is counted under its reason and under the thinking mode (``on`` / ``off``)
  and the domain (the input row's ``domain``, ``(none)`` without one) of the row it came from, next to the
  rows kept per mode and domain, so the report and the card show what each filter cost each part of the mix;
* the report fails the run (TokenizeFailed, after writing report.json / report.md; no dataset card, no
  asset event) when the rows kept are fewer than ``min_kept_share`` of the rows counted. Rows counted =
  rows kept + rows dropped for any reason but ``heldout`` (a held-out conversation is kept out on purpose,
  not lost) and ``original_answer_of_another_sample`` (answers 'original': a prompt's original answers are
  trained once, from sample 0). An error or held-out completion row counts once (its turns are never built); a row dropped
  for a quality flag counts once per turn it would have trained.

Units: training rows (one per regenerated assistant turn), as everywhere in the tokenize stats.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.steps.tokenize.heldout import DROP_HELDOUT
from dflash_pipeline.steps.tokenize.turns import DROP_OTHER_SAMPLE

THINKING_ON, THINKING_OFF = "on", "off"
NO_DOMAIN = "(none)"
NOT_LOST = frozenset({DROP_HELDOUT, DROP_OTHER_SAMPLE})
"""Drop reasons that do not count against the kept share."""
DOMAINS_SHOWN = 20
"""Domains named in the markdown tables (the most frequent; the rest summed as "other"); the JSON has all."""


def mode_of(thinking: bool | None, default: bool) -> str:
    return THINKING_ON if (default if thinking is None else bool(thinking)) else THINKING_OFF


def domain_of(domain: Any) -> str:
    return str(domain) if domain not in (None, "") else NO_DOMAIN


@dataclass
class DropTally:
    """Training rows kept and dropped, by reason × thinking mode and reason × domain (one part's share)."""

    kept_by_thinking: Counter[str] = field(default_factory=Counter)
    kept_by_domain: Counter[str] = field(default_factory=Counter)
    dropped_by_thinking: dict[str, Counter[str]] = field(default_factory=dict)
    dropped_by_domain: dict[str, Counter[str]] = field(default_factory=dict)

    def keep(self, mode: str, domain: str, n: int = 1) -> None:
        self.kept_by_thinking[mode] += n
        self.kept_by_domain[domain] += n

    def drop(self, reason: str, mode: str, domain: str, n: int = 1) -> None:
        self.dropped_by_thinking.setdefault(reason, Counter())[mode] += n
        self.dropped_by_domain.setdefault(reason, Counter())[domain] += n

    def to_dict(self) -> dict[str, Any]:
        """The PartStats fields (plain, sorted dicts)."""
        return {
            "kept_by_thinking": dict(sorted(self.kept_by_thinking.items())),
            "kept_by_domain": dict(sorted(self.kept_by_domain.items())),
            "dropped_by_thinking": {r: dict(sorted(c.items())) for r, c in sorted(self.dropped_by_thinking.items())},
            "dropped_by_domain": {r: dict(sorted(c.items())) for r, c in sorted(self.dropped_by_domain.items())},
        }


BREAKDOWN_KEYS = ("kept_by_thinking", "kept_by_domain", "dropped_by_thinking", "dropped_by_domain")


def add_breakdown(total: dict[str, Any], part: Mapping[str, Any]) -> None:
    """Sum one part's breakdown (DropTally.to_dict keys) into `total` (same keys)."""
    for name in ("kept_by_thinking", "kept_by_domain"):
        target = total.setdefault(name, {})
        for k, v in (part.get(name) or {}).items():
            target[k] = target.get(k, 0) + int(v)
    for name in ("dropped_by_thinking", "dropped_by_domain"):
        target = total.setdefault(name, {})
        for reason, per in (part.get(name) or {}).items():
            row = target.setdefault(reason, {})
            for k, v in per.items():
                row[k] = row.get(k, 0) + int(v)


def sorted_breakdown(total: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "kept_by_thinking": dict(sorted((total.get("kept_by_thinking") or {}).items())),
        "kept_by_domain": dict(sorted((total.get("kept_by_domain") or {}).items())),
        "dropped_by_thinking": {r: dict(sorted(v.items())) for r, v in sorted((total.get("dropped_by_thinking") or {}).items())},
        "dropped_by_domain": {r: dict(sorted(v.items())) for r, v in sorted((total.get("dropped_by_domain") or {}).items())},
    }


# -- the gate ----------------------------------------------------------------------------------------


def kept_share(report: Mapping[str, Any]) -> tuple[float, int]:
    """(rows kept / rows counted, rows counted): counted = kept + dropped for a reason other than NOT_LOST."""
    dropped = report.get("dropped_by_reason") or {}
    kept = int(report.get("rows_out", 0))
    counted = kept + sum(int(v) for k, v in dropped.items() if k not in NOT_LOST)
    return (kept / counted if counted else 0.0), counted


def gate(report: Mapping[str, Any], min_kept_share: float) -> dict[str, Any]:
    """The report's `gate` entry: passed when some row is kept and the kept share is at least `min_kept_share`."""
    share, counted = kept_share(report)
    kept = int(report.get("rows_out", 0))
    passed = kept > 0 and share >= min_kept_share
    return {"min_kept_share": min_kept_share, "kept_share": round(share, 4), "rows_kept": kept,
            "rows_counted": counted, "passed": passed}


def failure_message(report: Mapping[str, Any]) -> str:
    """Why the gate failed, with the reasons and their counts by thinking mode (largest first)."""
    g = report["gate"]
    dropped = report.get("dropped_by_reason") or {}
    by_mode = report.get("dropped_by_thinking") or {}
    reasons = "; ".join(
        f"{reason} {n:,}" + (" (" + ", ".join(f"thinking {m} {c:,}" for m, c in sorted(by_mode.get(reason, {}).items()))
                             + ")" if by_mode.get(reason) else "")
        for reason, n in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0])))
    examples = report.get("unverified_examples") or []
    hint = f"; first unverified turns: {examples[:3]}" if examples else ""
    return (f"{report['output_uri']}: kept {g['rows_kept']:,} of {g['rows_counted']:,} training rows "
            f"({g['kept_share']:.1%}), below min_kept_share {g['min_kept_share']}. Dropped: {reasons or 'nothing'}"
            f"{hint}. See {report.get('report_key', 'tokenized/report.json')}. Fix the cause (another tokenizer or "
            "drop_quality: tokenizing with other settings writes a new tokenization beside this one, tokenized/<name>/), "
            "or accept these rows by triggering dflash_tokenize again with a lower min_kept_share (done parts are "
            "skipped)")


# -- tables for the report and the card ----------------------------------------------------------------


def _pct(n: int, d: int) -> str:
    return f"{n:,} ({n / d:.0%})" if d else f"{n:,}"


def _table(title: str, kept: Mapping[str, int], dropped: Mapping[str, Mapping[str, int]],
           columns: list[str]) -> list[str]:
    counted = {c: kept.get(c, 0) + sum(v.get(c, 0) for v in dropped.values()) for c in columns}
    lines = [f"| {title} | " + " | ".join(f"`{c}`" for c in columns) + " |",
             "|---|" + "---:|" * len(columns),
             "| rows in | " + " | ".join(f"{counted[c]:,}" for c in columns) + " |",
             "| kept | " + " | ".join(_pct(kept.get(c, 0), counted[c]) for c in columns) + " |"]
    for reason in sorted(dropped):
        lines.append(f"| dropped: {reason} | " + " | ".join(_pct(dropped[reason].get(c, 0), counted[c])
                                                           for c in columns) + " |")
    return lines


def _top_domains(breakdown: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, dict[str, int]], list[str]]:
    """Domains folded to the DOMAINS_SHOWN most frequent (by rows in) plus "other"."""
    kept = dict(breakdown.get("kept_by_domain") or {})
    dropped = {r: dict(v) for r, v in (breakdown.get("dropped_by_domain") or {}).items()}
    size: Counter[str] = Counter(kept)
    for v in dropped.values():
        size.update(v)
    top = [d for d, _ in sorted(size.items(), key=lambda kv: (-kv[1], kv[0]))[:DOMAINS_SHOWN]]
    if len(size) <= DOMAINS_SHOWN:
        return kept, dropped, top

    def fold(c: Mapping[str, int]) -> dict[str, int]:
        out = {d: c[d] for d in top if d in c}
        rest = sum(v for d, v in c.items() if d not in out)
        if rest:
            out["other"] = rest
        return out

    return fold(kept), {r: fold(v) for r, v in dropped.items()}, [*top, "other"]


def breakdown_lines(breakdown: Mapping[str, Any]) -> list[str]:
    """Markdown: rows in / kept / dropped by reason, per thinking mode and per domain (share of that column)."""
    kept_t = breakdown.get("kept_by_thinking") or {}
    drop_t = breakdown.get("dropped_by_thinking") or {}
    modes = sorted(set(kept_t) | {m for v in drop_t.values() for m in v})
    if not modes:
        return []
    lines = ["Training rows by thinking mode (share of that mode's rows):", "",
             *_table("thinking", kept_t, drop_t, modes), ""]
    kept_d, drop_d, domains = _top_domains(breakdown)
    if domains and domains != [NO_DOMAIN]:
        lines += ["Training rows by domain (share of that domain's rows):", "",
                  *_table("domain", kept_d, drop_d, domains), ""]
    return lines


REASONS_EXPLAINED: dict[str, str] = {
    "error_row": "the request failed (a failed request is a row, never a completion)",
    "heldout": "the conversation is in the held-out split (kept out for the eval; not counted against the gate)",
    "no_regenerated_turn": "the row has no regenerated assistant turn",
    "finish_reason_length": "the turn stopped at max_tokens and drop_truncated is on",
    "turn_not_found_in_rendered_text": "the chat template's rendering of the turn does not contain its text",
    "ids_differ_from_engine_counts": "re-encoded ids disagree with the engine's token counts (keep_unverified off)",
    "no_loss_tokens_within_max_length": "no generated token left within max_length",
    "fewer_than_min_loss_tokens": "fewer trained tokens than min_loss_tokens",
    "no_two_consecutive_loss_tokens": "no two adjacent trained tokens (DFlash cannot anchor a block)",
}
QUALITY_PREFIX = "quality:"


def explain(reason: str) -> str:
    if reason.startswith(QUALITY_PREFIX):
        return f"quality flag `{reason[len(QUALITY_PREFIX):]}` (drop_quality)"
    return REASONS_EXPLAINED.get(reason, "")


def card_lines(report: Mapping[str, Any]) -> list[str]:
    """The dataset card's "What was dropped and why" section."""
    dropped = report.get("dropped_by_reason") or {}
    lines = ["## What was dropped and why", ""]
    if not dropped:
        return lines + ["Nothing: every regenerated turn is a training row.", ""]
    lines += ["| reason | rows | why |", "|---|---:|---|",
              *(f"| `{k}` | {v:,} | {explain(k)} |" for k, v in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0]))),
              ""]
    g = report.get("gate")
    if g:
        lines += [f"Kept {g['rows_kept']:,} of {g['rows_counted']:,} training rows ({g['kept_share']:.1%}); the run "
                  f"fails below min_kept_share {g['min_kept_share']}.", ""]
    return lines + breakdown_lines(report)
