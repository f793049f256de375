"""The run-level view of a run's progress: each worker's state, the fleet's throughput series and
the aggregate the progress page shows (done, in flight, ETA), from the documents the generate
tasks publish (monitor/progress.py writes them) plus the manifest and the committed parts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dflash_pipeline.monitor.progress import (
    H_LIMIT,
    H_T,
    H_TOKENS,
    LIVE_STATES,
    RATE_WINDOW_S,
    SERIES_POINTS,
    STALE_INTERVALS,
    add_counts,
    committed_prompts,
    eta_seconds,
    recent_rate,
    round_or_none,
)


def worker_state(doc: Mapping[str, Any], now: float, task_state: str | None = None) -> str:
    """running / failing / done / stale (no news for STALE_INTERVALS intervals) / the task's end state."""
    state = str(doc.get("state") or "running")
    if state in LIVE_STATES:
        if task_state in ("failed", "upstream_failed", "up_for_retry", "success", "skipped"):
            return "stopped" if task_state != "up_for_retry" else "retrying"
        every = float(doc.get("every_s") or 10.0)
        if now - float(doc.get("written_at") or 0.0) > STALE_INTERVALS * every + 5:
            return "stale"
    return state


def _cumulative_at(hist: Sequence[tuple[float, float]], t: float) -> float:
    """Output tokens a worker had produced by time `t`: linear between samples, flat outside them."""
    if t <= hist[0][0]:
        return hist[0][1]
    if t >= hist[-1][0]:
        return hist[-1][1]
    lo, hi = 0, len(hist) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if hist[mid][0] <= t:
            lo = mid
        else:
            hi = mid
    (ta, ca), (tb, cb) = hist[lo], hist[hi]
    return ca + (cb - ca) * (t - ta) / (tb - ta) if tb > ta else cb


def fleet_series(docs: Sequence[Mapping[str, Any]], points: int = SERIES_POINTS,
                 start: float | None = None, live: Iterable[str] = ()) -> dict[str, Any]:
    """Output tokens/s over the whole run, per worker and summed, in at most `points` buckets.

    Rates come from the cumulative output tokens of each worker's history (not from the rate it
    last reported), so a bucket's value is the tokens really produced in it, however sparse or
    downsampled the history. The buckets span `start` (the run's start; else the first sample) to
    the last sample, and are no finer than the histories' sample spacing. `t` holds the buckets'
    middles in seconds since that start. A worker counts zero before its first and after its last
    sample (not started yet, or stopped). While some workers are `live` (their worker names), the
    series ends at the oldest of their latest samples: a live worker's newest tokens are not known
    yet, and counting them as zero would draw a dip at the right edge.
    """
    workers: list[tuple[Mapping[str, Any], list[tuple[float, float]]]] = []
    for d in sorted(docs, key=lambda d: str(d.get("worker"))):
        rows = sorted((float(h[H_T]), float(h[H_TOKENS])) for h in d.get("history") or [] if len(h) > H_TOKENS)
        if rows:
            workers.append((d, rows))
    empty: dict[str, Any] = {"t0": start, "span_s": 0.0, "bucket_s": 0.0, "t": [], "total": [], "servers": [],
                             "mean_output_tokens_per_s": None}
    if not workers:
        return empty
    first = min(rows[0][0] for _, rows in workers)
    t0 = first if start is None else min(start, first)
    t1 = max(rows[-1][0] for _, rows in workers)
    live_names = set(live)
    live_ends = [rows[-1][0] for d, rows in workers if str(d.get("worker")) in live_names]
    if live_ends and min(live_ends) > t0:
        t1 = min(live_ends)
    span = t1 - t0
    active = max(rows[-1][0] for _, rows in workers) - first
    produced = sum(rows[-1][1] - rows[0][1] for _, rows in workers)
    mean = round(produced / active, 1) if active > 0 else None
    if span <= 0:
        return {**empty, "t0": t0, "mean_output_tokens_per_s": mean}
    gaps = sorted(b[0] - a[0] for _, rows in workers for a, b in zip(rows, rows[1:]) if b[0] > a[0])
    spacing = gaps[len(gaps) // 2] if gaps else span
    n = max(1, min(points, math.ceil(span / max(spacing, 1e-9) - 1e-9)))
    width = span / n
    edges = [t0 + width * i for i in range(n + 1)]
    servers = []
    for d, rows in workers:
        cum = [_cumulative_at(rows, e) for e in edges]
        rates = [round(max(0.0, (cum[i + 1] - cum[i]) / width), 1) for i in range(n)]
        servers.append({"worker": str(d.get("worker")), "server": str(d.get("server", d.get("worker"))),
                        "values": rates})
    total = [round(sum(s["values"][i] for s in servers), 1) for i in range(n)]
    return {"t0": t0, "span_s": round(span, 3), "bucket_s": round(width, 3),
            "t": [round(width * (i + 0.5), 3) for i in range(n)], "total": total, "servers": servers,
            "mean_output_tokens_per_s": mean}


def aggregate(
    manifest: Mapping[str, Any],
    committed: Mapping[int, float],
    docs: Sequence[Mapping[str, Any]],
    *,
    now: float,
    run_started_at: float | None = None,
    task_states: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run totals from the manifest, the committed parts and the workers' progress objects.

    `committed` maps each committed chunk to its part's last-modified time (unix): parts older than
    `run_started_at` were committed by earlier runs. `task_states` maps worker names to their
    Airflow task states, so a killed task's last object is not taken for a live one.
    """
    sizes = list(manifest["chunks"]["sizes"])
    total = sum(sizes)
    chunks = {c for c in committed if 0 <= c < len(sizes)}
    done_committed = committed_prompts(sizes, chunks)
    earlier = (committed_prompts(sizes, [c for c in chunks if committed[c] < run_started_at])
               if run_started_at is not None else 0)
    task_states = task_states or {}
    servers: list[dict[str, Any]] = []
    pending = 0
    rate = 0.0
    completions = errors = tokens = in_flight = max_tokens = 0
    errors_by_class: dict[str, int] = {}
    live_workers: list[str] = []
    for doc in sorted(docs, key=lambda d: str(d.get("worker"))):
        worker = str(doc.get("worker"))
        state = worker_state(doc, now, task_states.get(worker))
        live = state in LIVE_STATES
        if live:
            live_workers.append(worker)
        t = doc.get("totals") or {}
        c, e, tok = int(t.get("completions", 0)), int(t.get("errors", 0)), int(t.get("output_tokens", 0))
        completions, errors, tokens = completions + c, errors + e, tokens + tok
        max_tokens = max(max_tokens, int(t.get("max_completion_tokens", 0)))
        errors_by_class = add_counts(errors_by_class, t.get("errors_by_class") or {})
        recent = recent_rate(doc.get("history") or [])
        if recent is None:
            recent = float(doc.get("output_tokens_per_s") or 0.0)
        if live:
            pending += int(doc.get("rows_pending_commit", 0))
            rate += recent
            in_flight += int(doc.get("in_flight", 0))
        servers.append({
            "worker": worker,
            "server": doc.get("server"),
            "state": state,
            "task_state": task_states.get(worker),
            "tries": doc.get("tries") or [doc.get("try_number")],
            "rows": c + e,
            "completions": c,
            "errors": e,
            "errors_by_class": dict(t.get("errors_by_class") or {}),
            "output_tokens": tok,
            "output_tokens_per_s": float(doc.get("output_tokens_per_s") or 0.0) if live else 0.0,
            "in_flight": int(doc.get("in_flight", 0)) if live else 0,
            "concurrency": doc.get("in_flight_limit") or doc.get("concurrency"),
            "concurrency_control": _control_summary(doc.get("concurrency_control")),
            # [unix time, in-flight limit] over the run (the page draws it on the throughput chart's axis)
            "limit_series": [[float(h[H_T]), int(h[H_LIMIT])]
                             for h in doc.get("history") or [] if len(h) > H_LIMIT and h[H_LIMIT]],
            "idle_s": doc.get("idle_s") if state == "idle" else None,
            "chunks_committed": int(doc.get("chunks_committed", 0)),
            "share": round((c + e) / total, 6) if total else 0.0,
            "updated_s_ago": round(now - float(doc.get("written_at") or now), 1),
        })
    done = min(total, done_committed + pending)
    remaining = total - done
    mean = tokens / completions if completions else None
    eta = eta_seconds(remaining, mean, rate, completions, max_completion_tokens=max_tokens, in_flight=in_flight)
    return {
        "prompts_total": total,
        "chunks_total": len(sizes),
        "chunks_committed": len(chunks),
        "prompts_committed": done_committed,
        "prompts_pending_commit": pending,
        "prompts_done": done,
        "prompts_done_earlier_runs": earlier,
        "prompts_remaining": remaining,
        "fraction_done": round(done / total, 6) if total else 1.0,
        "completions": completions,
        "errors": errors,
        "errors_by_class": errors_by_class,
        "in_flight": in_flight,
        "output_tokens": tokens,
        "mean_output_tokens": round_or_none(mean),
        "max_completion_tokens": max_tokens,
        "output_tokens_per_s": round(rate, 1),
        "rate_window_s": RATE_WINDOW_S,
        "eta_s": round_or_none(eta),
        "servers": servers,
        "series": fleet_series(docs, start=run_started_at, live=live_workers),
    }


def _control_summary(control: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What the servers table shows of a worker's concurrency controller (not its change log)."""
    if not control:
        return None
    return {k: control.get(k) for k in ("mode", "start", "slots", "limit", "ceiling", "cap", "reason")}


def format_duration(seconds: float | None) -> str:
    """1h 02m / 3m 10s / 42s; an em dash when unknown."""
    if seconds is None:
        return "\u2014"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"
