"""Live quality during generation (issue 40): each generate task folds the digests of the parts it commits
into figures per (server, thinking mode), publishes them under `runs/<run_id>/quality/<worker>-try<N>.json`, and
checks the fleet's figures against the run's limits with a confidence bound (`verdict`), so a run whose
thinking is cut at max_tokens or loops is stopped after a bounded number of rows, not after 26 hours.

Figures count only this run's rows: a run resumed after a fix (a new run into the same output_uri)
starts from zero and continues where the stopped one left off.

The bound. A figure stops the run when the one-sided Wilson lower bound of its rate is above the limit.
The check runs again and again as rows come in; so that noise never stops a healthy run, the error
probability is spent over a geometric grid of row counts (200, 250, 312, ... rows; grid point j gets
alpha * 6 / (pi^2 j^2), which sums to alpha over all j), and the bound at n rows uses the z of the grid
point n has reached. ALPHA = 1e-3 per figure. Rows are not independent draws when the prompt file is
ordered (a block of hard prompts truncates more): MIN_ROWS and the bound's width absorb some of that; a
prompt file sorted by difficulty can still stop a run whose final rate would pass (docs/quality.md).
"""

from __future__ import annotations

import math
from functools import lru_cache
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_pipeline.monitor.livequality import FIGURES, sum_groups

ALPHA = 1e-3
MIN_ROWS = 200
GRID_RATIO = 1.25


def _np(col: Any, fill: Any) -> np.ndarray:
    return pc.fill_null(col, fill).to_numpy(zero_copy_only=False)


def digest_counts(table: pa.Table, thinking_default: bool, languages: Sequence[str] | None) -> dict[tuple[str, str], dict[str, int]]:
    """One part digest's FIGURES per (server, thinking "on"/"off")."""
    n = table.num_rows
    if n == 0:
        return {}
    names = table.column_names
    servers = pc.fill_null(table.column("server"), "?").to_pylist() if "server" in names else ["?"] * n
    thinks = (_np(table.column("thinking"), thinking_default).astype(bool) if "thinking" in names
              else np.full(n, thinking_default, dtype=bool))
    err = (_np(pc.greater(pc.binary_length(table.column("error_class")), 0), False).astype(bool)
           if "error_class" in names else np.zeros(n, bool))
    finish = np.asarray(pc.fill_null(table.column("finish_reason"), "").to_pylist(), dtype=object)
    comp = ~err & ((finish == "stop") | (finish == "length"))

    def q(name: str) -> np.ndarray:
        return _np(table.column(name), False).astype(bool) if name in names else np.zeros(n, bool)

    lang = table.column("language").to_pylist() if "language" in names else [None] * n
    known = np.array([v is not None for v in lang], dtype=bool)
    off = np.array([v is not None and languages is not None and v not in languages for v in lang], dtype=bool)
    verify = (_np(table.column("spec_verify_steps"), -1).astype(np.int64) if "spec_verify_steps" in names
              else np.full(n, -1, np.int64))
    accepted = (_np(table.column("spec_accepted_tokens"), 0).astype(np.int64) if "spec_accepted_tokens" in names
                else np.zeros(n, np.int64))
    per_row = {
        "completions": comp, "errors": err, "truncated": comp & (finish == "length"),
        "truncated_thinking": comp & q("q_truncated_thinking"),
        "loop": comp & (q("q_loop_reasoning") | q("q_loop_answer")), "empty_answer": comp & q("q_empty_answer"),
        "refusal": comp & q("q_refusal"), "language_off": comp & off, "language_known": comp & known,
        "completions_thinking": comp & thinks,
        "reasoning_missing": comp & thinks & ~_np(table.column("d_has_reasoning"), False).astype(bool)
        if "d_has_reasoning" in names else np.zeros(n, bool),
        "spec_rows": comp & (verify > 0),
    }
    out: dict[tuple[str, str], dict[str, int]] = {}
    keys = list(zip(servers, np.where(thinks, "on", "off").tolist()))
    for key in set(keys):
        m = np.array([k == key for k in keys], dtype=bool)
        got = {f: int((v & m).sum()) for f, v in per_row.items()}
        spec = m & comp & (verify > 0)
        got["spec_verify_steps"] = int(verify[spec].sum())
        got["spec_accepted_tokens"] = int(accepted[spec].sum())
        out[(str(key[0]), key[1])] = got
    return out


class LiveTally:
    """One generate task's figures over the parts it committed in this run (its own thread only)."""

    def __init__(self, thinking_default: bool, languages: Sequence[str] | None) -> None:
        self.thinking_default = thinking_default
        self.languages = tuple(languages) if languages is not None else None
        self.groups: dict[tuple[str, str], dict[str, int]] = {}
        self.parts = 0

    def add(self, table: pa.Table) -> None:
        self.parts += 1
        for key, got in digest_counts(table, self.thinking_default, self.languages).items():
            g = self.groups.setdefault(key, dict.fromkeys(FIGURES, 0))
            for f, v in got.items():
                g[f] += v

    def doc(self, run_id: str, worker: str, now: float) -> dict[str, Any]:
        return {"run_id": run_id, "worker": worker, "updated_at": now, "parts": self.parts,
                "groups": [{"server": s, "thinking": t, **g} for (s, t), g in sorted(self.groups.items())]}


# ------------------------------------------------------------------------------------------ fail fast


@dataclass(frozen=True)
class Limit:
    """A user's limit on one live figure, and what to change when a run breaks it."""

    param: str
    figure: str
    numerator: str
    denominator: str
    limit: float
    advice: str


def z_at(n: int, alpha: float = ALPHA, min_rows: int = MIN_ROWS) -> float:
    """The z of the grid point `n` rows have reached (module docstring: alpha spent over the grid)."""
    return _z(1 + int(math.floor(math.log(max(n, min_rows) / min_rows) / math.log(GRID_RATIO))), alpha)


@lru_cache(maxsize=1024)
def _z(j: int, alpha: float) -> float:
    return NormalDist().inv_cdf(1 - alpha * 6 / (math.pi ** 2 * j * j))


def wilson_lower(k: int, n: int, z: float) -> float:
    """One-sided Wilson score lower bound of a binomial rate."""
    if n <= 0:
        return 0.0
    p = k / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n))


def surely_above(k: int, n: int, limit: float, alpha: float = ALPHA, min_rows: int = MIN_ROWS) -> bool:
    return n >= min_rows and wilson_lower(k, n, z_at(n, alpha, min_rows)) > limit


def verdict(groups: Sequence[Mapping[str, Any]], limits: Sequence[Limit], *, alpha: float = ALPHA,
            min_rows: int = MIN_ROWS) -> str | None:
    """None while every figure may still be within its limit; else the message that stops the run: the
    figure, the rows it is over, each server's share (naming one that alone is above the limit) and what
    to change."""
    total = sum_groups(groups)
    servers = sorted({g["server"] for g in groups})
    for lim in limits:
        k, n = total[lim.numerator], total[lim.denominator]
        if not surely_above(k, n, lim.limit, alpha, min_rows):
            continue
        per: list[tuple[str, int, int]] = []
        for s in servers:
            sg = sum_groups(g for g in groups if g["server"] == s)
            per.append((s, sg[lim.numerator], sg[lim.denominator]))
        bad = [s for s, ks, ns in per if ns and surely_above(ks, ns, lim.limit, alpha, min(min_rows, 50))]
        rest_k = sum(ks for s, ks, _ in per if s not in bad)
        rest_n = sum(ns for s, _, ns in per if s not in bad)
        lower = wilson_lower(k, n, z_at(n, alpha, min_rows))
        parts = ", ".join(f"{s}: {ks / ns:.1%} of {ns:,}" if ns else f"{s}: no rows" for s, ks, ns in per)
        msg = (f"stopped early: the {lim.figure} rate is {k / n:.1%} ({k:,} of {n:,} rows; lower confidence bound "
               f"{lower:.1%}), surely above {lim.param}={lim.limit:g}. By server: {parts}.")
        if bad and rest_n and (rest_n < min_rows or not surely_above(rest_k, rest_n, lim.limit, alpha, min_rows)):
            who = ", ".join(bad)
            msg += (f" Server(s) {who} alone are above the limit (the other servers: {rest_k / rest_n:.1%} of "
                    f"{rest_n:,}): check the model, chat template and sampling behind {who}, or remove it from "
                    "`servers`.")
        msg += (f" {lim.advice} Then trigger a new run into the same output_uri: it continues where this one "
                "stopped (the live figures count each run's own rows). `fail_fast: false` turns this check off.")
        return msg
    return None


SERVER_MIN_ROWS = 50
"""Rows of one server before its own figures are judged (the same alpha spending from there)."""


def server_verdict(groups: Sequence[Mapping[str, Any]], limits: Sequence[Limit], server: str, *,
                   alpha: float = ALPHA) -> str | None:
    """A message when `server` alone breaks a limit: its own rate is surely above it while the rest of the fleet's
    is within it (a different model, template or sampling behind that one server). Its task stops; its chunks go
    to the other servers. None otherwise (a fleet-wide problem is `verdict`'s)."""
    return _alone(sum_groups(g for g in groups if g["server"] == server),
                  sum_groups(g for g in groups if g["server"] != server), limits, server, alpha)


def _alone(own: Mapping[str, int], rest: Mapping[str, int], limits: Sequence[Limit], server: str,
           alpha: float) -> str | None:
    for lim in limits:
        k, n = own[lim.numerator], own[lim.denominator]
        rk, rn = rest[lim.numerator], rest[lim.denominator]
        if rn < SERVER_MIN_ROWS or not surely_above(k, n, lim.limit, alpha, SERVER_MIN_ROWS):
            continue
        if rk / rn > lim.limit or surely_above(rk, rn, lim.limit, alpha, MIN_ROWS):
            continue  # the others are no better: the fleet's problem (verdict)
        lower = wilson_lower(k, n, z_at(n, alpha, SERVER_MIN_ROWS))
        return (f"stopped early: server {server} alone breaks {lim.param}={lim.limit:g}: its {lim.figure} rate is "
                f"{k / n:.1%} ({k:,} of {n:,} rows; lower confidence bound {lower:.1%}) while the other servers' is "
                f"{rk / rn:.1%} of {rn:,}. Check the model, chat template and sampling behind {server}. "
                f"{lim.advice} Its chunks go to the other servers; clear this task (or trigger a new run into the same "
                "output_uri) once it is fixed. `fail_fast: false` turns this check off.")
    return None


def verdicts(groups: Sequence[Mapping[str, Any]], limits: Sequence[Limit], *, alpha: float = ALPHA) -> dict[str | None, str]:
    """Who must stop: each server that alone breaks a limit (`server_verdict`: its task stops, the others carry
    on), and under the key None the whole run when the fleet without those servers still surely breaks one
    (`verdict`)."""
    per = {s: sum_groups(g for g in groups if g["server"] == s) for s in sorted({str(g["server"]) for g in groups})}
    out: dict[str | None, str] = {}
    changed = True
    while changed:  # a server already named is not "the others" of the next (two faulty servers, two faults)
        changed = False
        rest_all = sum_groups(v for s, v in per.items() if s not in out)
        for s, own in per.items():
            if s in out:
                continue
            msg = _alone(own, {f: rest_all[f] - own[f] for f in rest_all}, limits, s, alpha)
            if msg is not None:
                out[s] = msg
                changed = True
                break
    fleet = verdict([g for g in groups if g["server"] not in out], limits, alpha=alpha)
    if fleet is not None:
        out[None] = fleet
    return out


def limits_from(max_truncation_rate: float, max_missing_reasoning_rate: float, max_loop_rate: float | None,
                max_empty_answer_rate: float | None = None) -> list[Limit]:
    """The run's limits on live figures (validation fails on the same ones), the most specific cause first: a
    looping model's rows are also cut at max_tokens, and the loop is what to fix."""
    out = []
    if max_loop_rate is not None:
        out.append(Limit("max_loop_rate", "repetition-loop", "loop", "completions", max_loop_rate,
                         "Check temperature/top_p (greedy decoding loops), the model and its chat template."))
    out += [Limit("max_missing_reasoning_rate", "missing-reasoning", "reasoning_missing", "completions_thinking",
                  max_missing_reasoning_rate, "Start the servers with a reasoning parser (SGLang --reasoning-parser "
                  "qwen3) or check the chat template's thinking switch."),
            Limit("max_truncation_rate", "truncation", "truncated", "completions", max_truncation_rate,
                  "Raise max_tokens (thinking is cut at max_tokens), or check the server's context and template.")]
    if max_empty_answer_rate is not None:
        out.append(Limit("max_empty_answer_rate", "empty-answer", "empty_answer", "completions", max_empty_answer_rate,
                         "Check the chat template and the reasoning parser."))
    return out
