"""The eval's arithmetic over rows: acceptance (serving/specstats.py, the one definition), throughput,
the /metrics cross-check, each (group, condition)'s status, the paired comparisons and the ranking.
Pure functions of rows and metrics documents, so the unit tests check them on known rows.

Throughput, exactly:
- at concurrency 1 (one request in flight per server): Σ completion_tokens / Σ latency_s over the
  condition's completions: the decode speed one request sees (what a single user gets);
- at any other concurrency: each server's completion tokens over its own windows (the metrics
  documents' start to end, every run and try of its task), then Σ tokens / Σ seconds over the
  group's servers: tokens/s per server, whenever each server started (a server that starts late is
  not charged for the time before it started).
The ratio to the baseline compares the same figure under the same condition. It is trusted only when
every server of both groups has its generated tokens checked against its /metrics counter: another
client's traffic on a server moves the speed and shows there (`speedup_status`).

Status of a (group, condition), worst first (STATUS_ORDER):
- `failed`: nothing measured: no row with statistics (a drafter), no completion (the baseline);
- `untrusted`: a /metrics cross-check of one of its servers found a mismatch or a restart;
- `partial`: planned rows are missing, or fewer than MIN_STATS_SHARE of the planned rows carry
  statistics (a drafter: rows whose server gave statistics, an answer with 0 verify steps included;
  completions for the baseline);
- `complete`: none of these.
A cross-check that could not run (no /metrics, no counters) leaves the status alone and is reported
as such (`crosscheck_verdict`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dflash_pipeline.serving.specstats import (
    SpecStats,
    breakdown,
    group_figure,
    paired_difference,
    per_position_rates,
    total,
)

UNKNOWN = "unknown"
COMPLETE, PARTIAL, UNTRUSTED, FAILED = "complete", "partial", "untrusted", "failed"
STATUS_ORDER = (COMPLETE, PARTIAL, UNTRUSTED, FAILED)
MIN_STATS_SHARE = 0.95
PAIRWISE_MAX_DRAFTERS = 4
"""Up to this many drafters every pair is compared; above, each drafter against the best."""
MISMATCH_HINT = (
    "the rows' sum differs from the server's /metrics delta: another client's traffic on a shared server, a "
    "request the server ran but we retried or abandoned (timeouts, hand-offs), a server restart, or statistics "
    "the client parsed wrongly"
)
NO_COUNTERS_VLLM = (
    "vLLM's /metrics has none of its engine counters: the server runs with --disable-log-stats (it turns vLLM's "
    "Prometheus stat logger off; the answers' per-request statistics are unaffected), so nothing can be checked"
)


def worst(statuses: Iterable[str]) -> str:
    return max(statuses, key=STATUS_ORDER.index, default=COMPLETE)


def completions(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if not r.get("error_class")]


def domain_of(row: Mapping[str, Any]) -> str:
    d = row.get("domain")
    return str(d) if d not in (None, "") else UNKNOWN


def acceptance(rows: Sequence[Mapping[str, Any]], confidence: float, draft_length: int | None = None
               ) -> dict[str, Any]:
    """Token-weighted acceptance over completions, its CI, per-position rates, the summed histogram.

    `rows_with_stats` counts every row the server gave statistics for, 0 verify steps included (an
    answer ended before any draft: it adds nothing to either sum). `draft_length` (the most drafts a
    step can accept, from the servers' manifest entries) pads the histogram and the per-position rates
    to that length: engines send histograms of different lengths for the same steps (SGLang's of a
    drafter that never accepts is [V], vLLM's [V, 0, ..., 0])."""
    fig = group_figure(rows, confidence=confidence)
    summed = total(SpecStats.from_columns(r) for r in rows)
    out = fig.to_dict()
    out["rows_with_verify_steps"] = fig.rows_with_stats
    out["rows_with_stats"] = sum(1 for r in rows if SpecStats.from_columns(r) is not None)
    out["rows_without_stats"] = fig.rows - out["rows_with_stats"]
    hist = list(summed.histogram) if summed and summed.histogram is not None else None
    if hist is not None and draft_length and len(hist) < draft_length + 1:
        hist += [0] * (draft_length + 1 - len(hist))
        out["per_position"] = per_position_rates(hist)
    out["histogram"] = hist
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
    windows: dict[str, float] = {}
    timed: set[tuple[str, str]] = set()
    for d in docs:
        start, end = d.get("started"), d.get("ended")
        if start is None or end is None:
            continue
        server = str(d.get("server"))
        windows[server] = windows.get(server, 0.0) + max(0.0, float(end) - float(start))
        timed.add((server, str(d.get("run_id"))))
    per_server: dict[str, dict[str, Any]] = {s: {"server": s, "tokens": 0, "seconds": round(w, 6)}
                                            for s, w in sorted(windows.items())}
    untimed = 0
    for r in done:
        key = (str(r.get("server")), str(r.get("run_id")))
        if key in timed:
            per_server[key[0]]["tokens"] += int(r.get("completion_tokens") or 0)
        else:
            untimed += 1
    for s in per_server.values():
        s["tokens_per_s"] = s["tokens"] / s["seconds"] if s["seconds"] > 0 else None
    tokens = sum(s["tokens"] for s in per_server.values())
    seconds = sum(s["seconds"] for s in per_server.values())
    return {"method": "each server's completion tokens over its own windows, summed: tokens per server-second",
            "tokens": tokens, "seconds": round(seconds, 6),
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "servers": list(per_server.values()), "servers_in_group": n_servers, "rows_without_timing": untimed}


def _rows_sums(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    summed = total(SpecStats.from_columns(r) for r in rows)
    out: dict[str, Any] = {"generation_tokens": sum(int(r.get("completion_tokens") or 0) for r in rows)}
    if summed is not None:
        out.update(verify_steps=summed.verify_steps, accepted_tokens=summed.accepted_tokens,
                   draft_tokens=summed.draft_tokens)
    return out


def _family(got: Mapping[str, Any], delta: Mapping[str, Any] | None, keys: Sequence[str], present: bool,
            restarted: bool) -> tuple[str, dict[str, Any]]:
    """One family of counters (speculative, or generated tokens): its verdict and differences."""
    if not present:
        return "no counters", {}
    if restarted or delta is None:
        return UNKNOWN, {}
    diffs = {}
    for k in keys:
        if k not in delta or (k == "draft_tokens" and got.get(k) is None):
            continue
        if int(got.get(k) or 0) != int(delta[k]):
            diffs[k] = {"rows": got.get(k), "metrics": int(delta[k])}
    return ("mismatch" if diffs else "match"), diffs


def crosscheck(rows: Sequence[Mapping[str, Any]], docs: Sequence[Mapping[str, Any]],
               engines: Mapping[str, str | None] | None = None) -> list[dict[str, Any]]:
    """Per (server, run): the rows' summed counters against the sum of that server's /metrics deltas,
    speculative counters and generated tokens each (`checks`); `status` is the worse of the two
    (mismatch, then unknown, then match; "no counters" / "not measured" when neither could run)."""
    engines = engines or {}
    by_key: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for d in docs:
        by_key.setdefault((str(d.get("server")), str(d.get("run_id"))), []).append(d)
    out: list[dict[str, Any]] = []
    for (server, run), ds in sorted(by_key.items()):
        mine = [r for r in rows if r.get("server") == server and r.get("run_id") == run]
        got = _rows_sums(mine)
        entry: dict[str, Any] = {"server": server, "run_id": run, "tries": sorted(int(d.get("try_number") or 0) for d in ds),
                                 "rows": len(mine), "rows_sum": got, "metrics_delta": None}
        if any(d.get("before") is None or d.get("after") is None for d in ds):
            entry.update(status="not measured", checks={}, note="the server's /metrics did not answer (SGLang needs "
                         "--enable-metrics)")
            out.append(entry)
            continue
        afters = [d.get("after") or {} for d in ds]
        restarted = any(d.get("delta") is None and (d.get("before") or d.get("after")) for d in ds)
        delta: dict[str, Any] = {}
        for d in ds:
            for k, v in (d.get("delta") or {}).items():
                if k in ("verify_steps", "accepted_tokens", "draft_tokens", "generation_tokens"):
                    delta[k] = delta.get(k, 0) + int(v)
        entry["metrics_delta"] = delta or None
        spec_present = all("verify_steps" in a for a in afters)
        tokens_present = all("generation_tokens" in a for a in afters)
        spec, spec_diffs = _family(got, delta, ("verify_steps", "accepted_tokens", "draft_tokens"), spec_present,
                                   restarted)
        tokens, token_diffs = _family(got, delta, ("generation_tokens",), tokens_present, restarted)
        entry["checks"] = {"speculative": spec, "generation_tokens": tokens}
        verdicts = {spec, tokens}
        if "mismatch" in verdicts:
            entry["status"] = "mismatch"
            entry["differences"] = {**spec_diffs, **token_diffs}
            retried = " (this task was retried: the traffic of a try that died was not measured)" if len(ds) > 1 \
                or min(entry["tries"] or [1]) > 1 else ""
            entry["note"] = MISMATCH_HINT + retried
        elif UNKNOWN in verdicts:
            entry.update(status=UNKNOWN, note="a counter went down between the scrapes: the server restarted")
        elif "match" in verdicts:
            entry["status"] = "match"
            if spec == "no counters" and got.get("verify_steps") is not None:
                entry["note"] = "generated tokens match; this server's /metrics has no speculative counters"
        else:
            entry["status"] = "no counters"
            entry["note"] = NO_COUNTERS_VLLM if engines.get(server) == "vllm" else \
                "the server's /metrics has neither speculative nor generated-token counters"
        out.append(entry)
    # Rows of a (server, run) with no metrics document: its task died before the second scrape (the
    # rows came from a checkpoint or a hand-off), so nothing measured them.
    unmeasured: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (str(r.get("server")), str(r.get("run_id")))
        if key not in by_key and not r.get("error_class"):
            unmeasured[key] = unmeasured.get(key, 0) + 1
    for (server, run), n in sorted(unmeasured.items()):
        out.append({"server": server, "run_id": run, "tries": [], "rows": n, "rows_sum": None, "metrics_delta": None,
                    "status": "not measured", "checks": {}, "note": "no /metrics document for these rows: the "
                    "server's task ended before its second scrape (its finished rows were saved and committed by the fleet)"})
    return out


def crosscheck_verdict(checks: Sequence[Mapping[str, Any]], family: str | None = None) -> str:
    """One word for a (group, condition)'s cross-checks, or one family's: mismatch > unknown > match
    (every server checked) > "partly checked" > "not checked"."""
    verdicts = [(c.get("checks") or {}).get(family) if family else c.get("status") for c in checks]
    verdicts = [v or "not measured" for v in verdicts]
    if not verdicts:
        return "not checked"
    if "mismatch" in verdicts:
        return "mismatch"
    if UNKNOWN in verdicts:
        return UNKNOWN
    if all(v == "match" for v in verdicts):
        return "match"
    return "partly checked" if "match" in verdicts else "not checked"


def condition_status(fig: Mapping[str, Any], *, baseline: bool) -> tuple[str, list[str]]:
    """The status of one (group, condition) and why (module docstring)."""
    planned = fig.get("planned") or fig["rows"]
    measured = fig["completions"] if baseline else fig.get("stats_reported", fig["acceptance"]["rows_with_stats"])
    what = "completions" if baseline else "rows with statistics"
    if not measured:
        if not fig["completions"]:
            why = "no completion: every request failed, or no server task ran"
        else:
            why = (f"{fig['completions']} completions, none with per-request statistics: the server does not "
                   "speculate or does not say (vLLM needs --per-request-spec-decode-metrics; SGLang < 0.5.13 "
                   "cannot say over the chat API)")
        return FAILED, [f"nothing measured: 0 {what} of {planned} planned rows ({why})"]
    untrusted = [f"/metrics cross-check of {c['server']} (run {c['run_id']}): {c['status']}"
                 + (f" {c.get('differences')}" if c.get("differences") else "")
                 for c in fig["crosscheck"] if c["status"] in ("mismatch", UNKNOWN)]
    partial = []
    if fig.get("missing"):
        partial.append(f"{fig['missing']} of {planned} planned rows missing (trigger the same conf again to complete them)")
    if planned and measured / planned < MIN_STATS_SHARE:
        partial.append(f"{measured} {what} of {planned} planned rows ({measured / planned:.0%}, under "
                       f"{MIN_STATS_SHARE:.0%})")
    status = UNTRUSTED if untrusted else PARTIAL if partial else COMPLETE
    return status, untrusted + partial


def condition_figures(rows: Sequence[Mapping[str, Any]], docs: Sequence[Mapping[str, Any]], *,
                      concurrency: int | None, n_servers: int, confidence: float, planned: int | None,
                      baseline: bool = False, engines: Mapping[str, str | None] | None = None,
                      draft_length: int | None = None) -> dict[str, Any]:
    done = completions(rows)
    figures: dict[str, Any] = {
        "rows": len(rows), "planned": planned, "missing": None if planned is None else max(0, planned - len(rows)),
        "completions": len(done), "errors": len(rows) - len(done),
        "truncated": sum(1 for r in done if r.get("finish_reason") == "length"),
        "output_tokens": sum(int(r.get("completion_tokens") or 0) for r in done),
        "acceptance": acceptance(done, confidence, draft_length),
        # completions whose server gave statistics, 0 verify steps included (an answer the server ended
        # before any draft was measured: nothing to accept); the status's share counts these
        "stats_reported": sum(1 for r in done if SpecStats.from_columns(r) is not None),
        "by_domain": {k: v.to_dict() for k, v in breakdown(done, domain_of, confidence=confidence).items()},
        "throughput": throughput(rows, docs, concurrency, n_servers),
        "crosscheck": crosscheck(rows, docs, engines),
    }
    for domain, fig in figures["by_domain"].items():
        fig["rows_with_verify_steps"] = fig["rows_with_stats"]
        fig["rows_with_stats"] = sum(1 for r in done if domain_of(r) == domain and SpecStats.from_columns(r) is not None)
        fig["rows_without_stats"] = fig["rows"] - fig["rows_with_stats"]
    figures["crosscheck_verdict"] = crosscheck_verdict(figures["crosscheck"])
    figures["status"], figures["status_reasons"] = condition_status(figures, baseline=baseline)
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


def by_acceptance(per_group: Mapping[str, Mapping[str, Any]], drafters: Sequence[str], condition: str) -> list[str]:
    """The drafters measured under `condition` (not failed), best acceptance first."""
    names = [n for n in drafters if condition in per_group.get(n, {})
             and per_group[n][condition]["status"] != FAILED
             and per_group[n][condition]["acceptance"]["acceptance_length"] is not None]
    return sorted(names, key=lambda n: -per_group[n][condition]["acceptance"]["acceptance_length"])


def paired(rows: Mapping[str, Sequence[Mapping[str, Any]]], order: Sequence[str], confidence: float
           ) -> list[dict[str, Any]]:
    """Paired differences under one condition (`order`: the measured drafters, best first): every pair
    with up to PAIRWISE_MAX_DRAFTERS drafters, else each against the best; `a` is the better of the two."""
    if len(order) <= PAIRWISE_MAX_DRAFTERS:
        pairs = [(order[i], order[j]) for i in range(len(order)) for j in range(i + 1, len(order))]
    else:
        pairs = [(order[0], b) for b in order[1:]]
    return [{"a": a, "b": b, **paired_difference(completions(rows[a]), completions(rows[b]), confidence=confidence)}
            for a, b in pairs]


def speedup_status(*figs: Mapping[str, Any] | None) -> str:
    """`checked` when every server of both groups had its generated tokens match its /metrics counter,
    `untrusted` when one mismatched or restarted, else `unchecked`."""
    verdicts = [crosscheck_verdict(f["crosscheck"], "generation_tokens") for f in figs if f is not None]
    if any(v in ("mismatch", UNKNOWN) for v in verdicts):
        return "untrusted"
    return "checked" if verdicts and all(v == "match" for v in verdicts) else "unchecked"


def rank(per_group: Mapping[str, Mapping[str, Any]], drafters: Sequence[str], condition: str,
         baseline: str | None, pairs: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """Drafters under one condition, best acceptance first, with the speed-up. Ties: a drafter whose
    paired difference from the leader of the rank above is not separable (its interval holds 0, or
    too few common prompts for one) shares that rank. A drafter that measured nothing has no rank."""
    base_fig = per_group.get(baseline, {}).get(condition) if baseline is not None else None
    base_tps = base_fig["throughput"]["tokens_per_s"] if base_fig else None
    by_pair = {(p["a"], p["b"]): p for p in pairs}
    order = by_acceptance(per_group, drafters, condition)
    out: list[dict[str, Any]] = []
    leader: dict[str, Any] | None = None
    for name in [*order, *(n for n in drafters if n not in order and condition in per_group.get(n, {}))]:
        fig = per_group[name][condition]
        acc = fig["acceptance"]
        tps = fig["throughput"]["tokens_per_s"]
        e: dict[str, Any] = {
            "drafter": name, "rank": None, "status": fig["status"], "acceptance_length": acc["acceptance_length"],
            "ci_low": acc["ci_low"], "ci_high": acc["ci_high"], "ci_method": acc.get("ci_method"),
            "rows_with_stats": acc["rows_with_stats"], "rows": acc["rows"], "planned": fig.get("planned"),
            "prompts": acc.get("prompts"), "tokens_per_s": tps, "speedup_vs_baseline": ratio(tps, base_tps),
            "speedup_status": speedup_status(fig, base_fig) if base_fig is not None else None,
            "crosscheck": fig.get("crosscheck_verdict"), "vs_above": None, "tied_with": None}
        if name in order:
            if leader is None:
                e["rank"] = 1
            else:
                ref, pair = leader, by_pair.get((leader["drafter"], name))
                if pair is None:  # more drafters than PAIRWISE_MAX_DRAFTERS: compared with the best only
                    ref, pair = out[0], by_pair.get((order[0], name))
                e["vs_above"] = None if pair is None else {
                    k: pair[k] for k in ("a", "difference", "ci_low", "ci_high", "ci_method", "prompts", "separable")}
                if pair is not None and pair["separable"] and (pair["difference"] or 0) > 0:
                    e["rank"] = len(out) + 1
                else:
                    e["rank"] = ref["rank"]
                    e["tied_with"] = ref["drafter"]
            if e["tied_with"] is None:
                leader = e
        out.append(e)
    return out
