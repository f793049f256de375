"""The eval's arithmetic over rows: acceptance (serving/specstats.py, the one definition), throughput,
the /metrics cross-check and the ranking. Pure functions of rows and metrics documents, so the
unit tests check them on known rows.

Throughput, exactly:
- at concurrency 1 (one request in flight per server): Σ completion_tokens / Σ latency_s over the
  condition's completions: the decode speed one request sees (what a single user gets);
- at any other concurrency: per run, the fleet's completion tokens of that run / the condition's
  wall time in that run (first server's start to last server's end, from the metrics documents),
  summed over runs (tokens and seconds), divided by the group's servers: tokens/s per server.
The ratio to the baseline compares the same figure under the same condition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dflash_pipeline.serving.specstats import SpecStats, breakdown, group_figure, total

UNKNOWN = "unknown"
MISMATCH_HINT = (
    "the rows' sum differs from the server's /metrics delta: another client's traffic on a shared server, a "
    "request the server ran but we retried or abandoned (timeouts, hand-offs), a server restart, or statistics "
    "the client parsed wrongly"
)


def completions(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if not r.get("error_class")]


def domain_of(row: Mapping[str, Any]) -> str:
    d = row.get("domain")
    return str(d) if d not in (None, "") else UNKNOWN


def acceptance(rows: Sequence[Mapping[str, Any]], confidence: float) -> dict[str, Any]:
    """Token-weighted acceptance over completions, its CI, per-position rates, the summed histogram."""
    fig = group_figure(rows, confidence=confidence)
    summed = total(SpecStats.from_columns(r) for r in rows)
    out = fig.to_dict()
    out["rows_without_stats"] = fig.rows - fig.rows_with_stats
    out["histogram"] = list(summed.histogram) if summed and summed.histogram is not None else None
    out["draft_tokens"] = summed.draft_tokens if summed else None
    out["draft_acceptance_rate"] = summed.draft_acceptance_rate if summed else None
    return out


def throughput(rows: Sequence[Mapping[str, Any]], docs: Sequence[Mapping[str, Any]], concurrency: int | None,
               n_servers: int) -> dict[str, Any]:
    """Output tokens/s of one condition (module docstring)."""
    done = completions(rows)
    if concurrency == 1:
        tokens = sum(int(r.get("completion_tokens") or 0) for r in done)
        seconds = sum(float(r.get("latency_s") or 0.0) for r in done)
        return {"method": "sum of completion tokens / sum of request latencies (one request in flight)",
                "tokens": tokens, "seconds": round(seconds, 6),
                "tokens_per_s": tokens / seconds if seconds > 0 else None}
    walls: dict[str, tuple[float, float]] = {}
    for d in docs:
        run, start, end = d.get("run_id"), d.get("started"), d.get("ended")
        if run is None or start is None or end is None:
            continue
        lo, hi = walls.get(run, (float(start), float(end)))
        walls[run] = (min(lo, float(start)), max(hi, float(end)))
    tokens = sum(int(r.get("completion_tokens") or 0) for r in done if r.get("run_id") in walls)
    untimed = sum(1 for r in done if r.get("run_id") not in walls)
    seconds = sum(hi - lo for lo, hi in walls.values())
    fleet = tokens / seconds if seconds > 0 else None
    return {"method": "fleet completion tokens / condition wall time, per server", "tokens": tokens,
            "seconds": round(seconds, 6), "fleet_tokens_per_s": fleet,
            "tokens_per_s": fleet / max(1, n_servers) if fleet is not None else None,
            "rows_without_timing": untimed}


def crosscheck(rows: Sequence[Mapping[str, Any]], docs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (server, run): the rows' summed counters against the sum of that server's /metrics deltas."""
    by_key: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for d in docs:
        by_key.setdefault((str(d.get("server")), str(d.get("run_id"))), []).append(d)
    out: list[dict[str, Any]] = []
    for (server, run), ds in sorted(by_key.items()):
        mine = [r for r in rows if r.get("server") == server and r.get("run_id") == run]
        summed = total(SpecStats.from_columns(r) for r in mine)
        rows_sum = None if summed is None else {
            "verify_steps": summed.verify_steps, "accepted_tokens": summed.accepted_tokens,
            "draft_tokens": summed.draft_tokens}
        entry: dict[str, Any] = {"server": server, "run_id": run, "tries": sorted(int(d.get("try_number") or 0) for d in ds),
                                 "rows": len(mine), "rows_sum": rows_sum, "metrics_delta": None}
        deltas = [d.get("delta") for d in ds]
        if any(d.get("before") is None or d.get("after") is None for d in ds):
            entry.update(status="not measured", note="the server's /metrics did not answer (SGLang needs "
                         "--enable-metrics)")
        elif any(not (d.get("before") or d.get("after")) for d in ds):
            entry.update(status="no counters", note="the server's /metrics has no speculative counters")
        elif any(x is None for x in deltas):
            entry.update(status="unknown", note="a counter went down between the scrapes: the server restarted")
        else:
            delta: dict[str, Any] = {}
            for x in deltas:
                for k in ("verify_steps", "accepted_tokens", "draft_tokens"):
                    if k in x:
                        delta[k] = delta.get(k, 0) + int(x[k])
            entry["metrics_delta"] = delta
            got = rows_sum or {"verify_steps": 0, "accepted_tokens": 0, "draft_tokens": 0}
            diffs = {k: (got.get(k), v) for k, v in delta.items()
                     if not (k == "draft_tokens" and got.get(k) is None) and int(got.get(k) or 0) != v}
            if not diffs:
                entry["status"] = "match"
            else:
                entry["status"] = "mismatch"
                entry["differences"] = {k: {"rows": a, "metrics": b} for k, (a, b) in diffs.items()}
                retried = " (this task was retried: the traffic of a try that died was not measured)" if len(ds) > 1 \
                    or min(entry["tries"] or [1]) > 1 else ""
                entry["note"] = MISMATCH_HINT + retried
        out.append(entry)
    return out


def condition_figures(rows: Sequence[Mapping[str, Any]], docs: Sequence[Mapping[str, Any]], *,
                      concurrency: int | None, n_servers: int, confidence: float, planned: int | None) -> dict[str, Any]:
    done = completions(rows)
    figures: dict[str, Any] = {
        "rows": len(rows), "planned": planned, "missing": None if planned is None else max(0, planned - len(rows)),
        "completions": len(done), "errors": len(rows) - len(done),
        "truncated": sum(1 for r in done if r.get("finish_reason") == "length"),
        "output_tokens": sum(int(r.get("completion_tokens") or 0) for r in done),
        "acceptance": acceptance(done, confidence),
        "by_domain": {k: v.to_dict() for k, v in breakdown(done, domain_of, confidence=confidence).items()},
        "throughput": throughput(rows, docs, concurrency, n_servers),
        "crosscheck": crosscheck(rows, docs),
    }
    for fig in figures["by_domain"].values():
        fig["rows_without_stats"] = fig["rows"] - fig["rows_with_stats"]
    return figures


def headline_condition(conditions: Sequence[Mapping[str, Any]]) -> str:
    """The condition the ranking uses: greedy before sampled (how DFlash and SpecForge report), the
    lowest concurrency, the first thinking mode listed."""
    def key(c: Mapping[str, Any]) -> tuple[int, int, int]:
        conc = c["concurrency"]
        return (0 if c["sampling"] == "greedy" else 1, 1 << 30 if conc == "production" else int(conc),
                conditions.index(c))
    return min(conditions, key=key)["name"]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def rank(per_group: Mapping[str, Mapping[str, Any]], drafters: Sequence[str], condition: str,
         baseline: str | None) -> list[dict[str, Any]]:
    """Drafters under one condition, best acceptance first (no figure: last), with the speed-up."""
    base_tps = None
    if baseline is not None and condition in per_group.get(baseline, {}):
        base_tps = per_group[baseline][condition]["throughput"]["tokens_per_s"]
    out = []
    for name in drafters:
        fig = per_group.get(name, {}).get(condition)
        if fig is None:
            continue
        acc = fig["acceptance"]
        tps = fig["throughput"]["tokens_per_s"]
        out.append({"drafter": name, "acceptance_length": acc["acceptance_length"], "ci_low": acc["ci_low"],
                    "ci_high": acc["ci_high"], "rows_with_stats": acc["rows_with_stats"], "rows": acc["rows"],
                    "tokens_per_s": tps, "speedup_vs_baseline": ratio(tps, base_tps)})
    out.sort(key=lambda e: (e["acceptance_length"] is None, -(e["acceptance_length"] or 0.0)))
    for i, e in enumerate(out, 1):
        e["rank"] = i
    return out
