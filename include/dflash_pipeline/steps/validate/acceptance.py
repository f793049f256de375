"""The validation report's speculative-decoding section: acceptance by domain, thinking mode,
completion length and server, and the prompts the drafter found hardest.

Why here: when the fleet speculates, every completion row carries its request's counters
(serving/specstats.py defines them); the report is where people look, so the figures that say
which data a drafter finds hard are put next to the rest. Acceptance is token-weighted with a
bootstrap confidence interval over rows (specstats), never a mean of per-row ratios.

Intervals resample prompts, not rows: a prompt's samples share its difficulty, so they go together
(serving/specstats.py `ratio_ci`; a row's prompt is its `id`, kept as a 64-bit hash). No interval
under specstats.MIN_PROMPTS_FOR_CI prompts; each interval names its method.

Memory: per row with statistics, three int64 (verify steps, accepted tokens, the prompt's hash) in
its groups, plus a fixed-size heap of the hardest rows: 24 bytes x groups per row, under 100 MB for
a 900k-row run. Rows without statistics (a server that does not speculate or does not say) are only counted.
Nothing is shown (`speculating: false`) when no row has statistics.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_pipeline.serving.specstats import (
    CI_METHODS,
    MIN_PROMPTS_FOR_CI,
    SPEC_COLUMNS,
    no_interval_note,
    per_position_rates,
    ratio_ci,
    token_weighted,
)

READ_COLUMNS = (*SPEC_COLUMNS, "id", "domain", "thinking")  # "id": a prompt's samples are resampled together
# Completion-length buckets (tokens): [lo, hi) and their labels.
LENGTH_BUCKETS = ((0, 512, "<512"), (512, 2048, "512-2k"), (2048, 8192, "2k-8k"), (8192, 32768, "8k-32k"),
                  (32768, 1 << 62, ">=32k"))
HARDEST = 20
# A row is ranked among the hardest only with this many verify steps: below that its ratio is noise.
MIN_STEPS_FOR_HARDEST = 32
DIMENSIONS = ("domain", "thinking", "length", "server")


def prompt_hash(prompt_id: Any, fallback: int) -> int:
    """A stable 64-bit key of a row's prompt (its `id`; rows without one stand alone)."""
    key = f"id:{prompt_id}" if prompt_id not in (None, "") else f"row:{fallback}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


def length_bucket(tokens: int) -> str:
    for lo, hi, label in LENGTH_BUCKETS:
        if lo <= tokens < hi:
            return label
    return "unknown"


class AcceptanceTally:
    """Fed one part at a time (`add`); `report()` gives the section. One owner: validation's main thread."""

    def __init__(self, thinking_default: bool | None = None) -> None:
        self.thinking_default = thinking_default
        self.rows = 0
        self.rows_with_stats = 0
        self._groups: dict[tuple[str, str], dict[str, Any]] = {}
        self._hist: dict[tuple[str, str], list[int]] = {}
        self._hardest: list[tuple[float, int, dict[str, Any]]] = []  # min-heap on -acceptance
        self._seq = 0

    def _group(self, dim: str, value: str) -> dict[str, Any]:
        return self._groups.setdefault((dim, value), {"rows": 0, "verify": array("q"), "accepted": array("q"),
                                                      "prompt": array("q")})

    def add(self, part: pa.Table) -> None:
        names = set(part.column_names)
        if "error_class" in names:
            part = part.filter(pc.is_null(part.column("error_class")))
        n = part.num_rows
        if n == 0:
            return
        col = {c: part.column(c).to_pylist() if c in names else [None] * n
               for c in ("id", "sample", "server", "completion_tokens", "domain", "thinking", *SPEC_COLUMNS)}
        self.rows += n
        default = None if self.thinking_default is None else ("on" if self.thinking_default else "off")
        for i in range(n):
            thinking = col["thinking"][i]
            keys = {
                "domain": col["domain"][i] or "unknown",
                "thinking": ("on" if thinking else "off") if thinking is not None else (default or "unknown"),
                "length": length_bucket(int(col["completion_tokens"][i] or 0)),
                "server": col["server"][i] or "unknown",
            }
            verify, accepted = col["spec_verify_steps"][i], col["spec_accepted_tokens"][i]
            known = verify is not None and accepted is not None and verify > 0
            prompt = prompt_hash(col["id"][i], self.rows - n + i) if known else 0
            for dim, value in keys.items():
                g = self._group(dim, value)
                g["rows"] += 1
                if known:
                    g["verify"].append(int(verify))
                    g["accepted"].append(int(accepted))
                    g["prompt"].append(prompt)
                    hist = col["spec_accept_histogram"][i]
                    if hist is not None:
                        acc = self._hist.setdefault((dim, value), [])
                        if len(acc) < len(hist):
                            acc.extend([0] * (len(hist) - len(acc)))
                        for j, h in enumerate(hist):
                            acc[j] += int(h)
            if not known:
                continue
            self.rows_with_stats += 1
            if verify >= MIN_STEPS_FOR_HARDEST:
                al = 1.0 + accepted / verify
                entry = {"id": col["id"][i], "sample": int(col["sample"][i] or 0), **keys,
                         "acceptance_length": round(al, 4), "verify_steps": int(verify),
                         "completion_tokens": col["completion_tokens"][i]}
                self._seq += 1
                item = (-al, self._seq, entry)
                if len(self._hardest) < HARDEST:
                    heapq.heappush(self._hardest, item)
                elif -al > self._hardest[0][0]:
                    heapq.heapreplace(self._hardest, item)

    @staticmethod
    def _interval(v: np.ndarray, a: np.ndarray, prompts: np.ndarray) -> dict[str, Any]:
        n_prompts = int(len(np.unique(prompts))) if len(prompts) else 0
        ci = ratio_ci(v, a, prompts, n_resamples=1000)
        return {
            "prompts": n_prompts,
            "ci_low": ci.low if ci else None,
            "ci_high": ci.high if ci else None,
            "ci_method": ci.method if ci else None,
            "ci_note": None if ci or not len(v) else no_interval_note(n_prompts),
        }

    def _figure(self, key: tuple[str, str]) -> dict[str, Any]:
        g = self._groups[key]
        v = np.frombuffer(g["verify"], dtype=np.int64)
        a = np.frombuffer(g["accepted"], dtype=np.int64)
        return {
            "rows": g["rows"],
            "rows_with_stats": int(len(v)),
            "verify_steps": int(v.sum()),
            "accepted_tokens": int(a.sum()),
            "acceptance_length": token_weighted(v, a) if len(v) else None,
            **self._interval(v, a, np.frombuffer(g["prompt"], dtype=np.int64)),
            "per_position": per_position_rates(self._hist.get(key)),
        }

    def report(self) -> dict[str, Any]:
        if self.rows_with_stats == 0:
            return {"speculating": False, "rows": self.rows, "rows_with_stats": 0,
                    "note": "no completion row has speculative-decoding statistics (not speculating, or the "
                            "servers do not report them per request)"}
        servers = [self._groups[k] for k in self._groups if k[0] == "server"]  # each row in exactly one
        all_v = np.concatenate([np.frombuffer(g["verify"], dtype=np.int64) for g in servers])
        all_a = np.concatenate([np.frombuffer(g["accepted"], dtype=np.int64) for g in servers])
        all_p = np.concatenate([np.frombuffer(g["prompt"], dtype=np.int64) for g in servers])
        overall_hist: list[int] = []
        for (dim, _), h in self._hist.items():
            if dim == "server":
                overall_hist = [x + y for x, y in zip(overall_hist + [0] * max(0, len(h) - len(overall_hist)),
                                                      h + [0] * max(0, len(overall_hist) - len(h)))]
        by: dict[str, dict[str, Any]] = {d: {} for d in DIMENSIONS}
        for key in sorted(self._groups):
            by[key[0]][key[1]] = self._figure(key)
        return {
            "speculating": True,
            "definition": "token-weighted: 1 + sum(accepted draft tokens) / sum(verify steps) over rows; "
                          f"95% intervals over prompts (a prompt's samples resampled together), none under "
                          f"{MIN_PROMPTS_FOR_CI} prompts",
            "ci_methods": dict(CI_METHODS),
            "rows": self.rows,
            "rows_with_stats": self.rows_with_stats,
            "rows_without_stats": self.rows - self.rows_with_stats,
            "acceptance_length": token_weighted(all_v, all_a),
            **self._interval(all_v, all_a, all_p),
            "histogram": overall_hist or None,
            "per_position": per_position_rates(overall_hist or None),
            "by": by,
            "hardest": [e for _, _, e in sorted(self._hardest, key=lambda t: (-t[0], t[1]))],
            "hardest_min_steps": MIN_STEPS_FOR_HARDEST,
        }


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ci(g: dict[str, Any]) -> str:
    """`low-high (method)`, or why there is none."""
    if g.get("ci_low") is None:
        return g.get("ci_note") or "-"
    return f"{_f(g['ci_low'])}-{_f(g['ci_high'])} ({g.get('ci_method')})"


def markdown(section: dict[str, Any] | None) -> str:
    """The report.md section ("" when the report has no acceptance section)."""
    if not section:
        return ""
    lines = ["", "## speculative decoding acceptance", ""]
    if not section.get("speculating"):
        return "\n".join(lines + ["not speculating: " + section.get("note", ""), ""])
    lines += [
        f"acceptance length {_f(section['acceptance_length'])} (95% CI {_ci(section)}), {section['definition']}; "
        f"{section['rows_with_stats']} rows with statistics from {section.get('prompts')} prompts, "
        f"{section['rows_without_stats']} without (counted apart).",
    ]
    if section.get("per_position"):
        lines += ["", "per-position acceptance: " + ", ".join(_f(x) for x in section["per_position"])]
    for dim in DIMENSIONS:
        groups = section["by"].get(dim) or {}
        if not groups:
            continue
        lines += ["", f"### by {dim}", "",
                  "| " + dim + " | rows | with stats | prompts | acceptance length | 95% CI (method) |",
                  "|---|---|---|---|---|---|"]
        for value, g in groups.items():
            lines.append(f"| {value} | {g['rows']} | {g['rows_with_stats']} | {g.get('prompts')} | "
                         f"{_f(g['acceptance_length'])} | {_ci(g)} |")
    if section.get("ci_methods"):
        lines += ["", "Interval methods: " + "; ".join(f"**{k}**: {v}" for k, v in section["ci_methods"].items())]
    if section.get("hardest"):
        lines += ["", f"### hardest prompts (lowest acceptance, >= {section['hardest_min_steps']} verify steps)", "",
                  "| id | sample | domain | acceptance length | verify steps | completion tokens |",
                  "|---|---|---|---|---|---|"]
        for e in section["hardest"]:
            lines.append(f"| {e['id']} | {e['sample']} | {e['domain']} | {_f(e['acceptance_length'])} | "
                         f"{e['verify_steps']} | {e['completion_tokens']} |")
    return "\n".join(lines) + "\n"
