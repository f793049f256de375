"""The servers' own speculative counters, scraped from `/metrics` around each condition.

Why: the per-row statistics are what the report is built from; the engine's server-wide counters
are an independent witness. The eval scrapes each server before and after each condition and keeps
the delta; the report compares it with the sum of that server's rows of that run.

What each engine publishes (Prometheus text; serving/specwire.py `spec_counters` parses it):
- vLLM 0.32 (`vllm/v1/spec_decode/metrics.py`): counters `vllm:spec_decode_num_drafts_total`
  (verify steps), `..._num_draft_tokens_total`, `..._num_accepted_tokens_total` and
  `..._num_accepted_tokens_per_pos_total{position}`; summed over engines (`engine` label).
- SGLang (with `--enable-metrics`): counter `sglang:spec_verify_calls_total`, incremented by each
  finished request's `spec_verify_ct` (`metrics_collector.observe_one_finished_request`, 0.5.21), so
  only verify steps can be checked; its acceptance gauges are running averages, not counters.

A counter that goes down between two scrapes means the server restarted: the delta is unknown.
"""

from __future__ import annotations

import logging
from typing import Any

from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.serving.specwire import SglangSpecCounters, VllmSpecCounters, spec_counters

logger = logging.getLogger(__name__)

def parse_spec_counters(text: str) -> dict[str, Any]:
    """The speculative counters in a /metrics text (serving/specwire.py parses them):
    {"verify_steps", "accepted_tokens", "draft_tokens", "per_position": [..]} (vLLM) or
    {"verify_steps"} (SGLang); {} when the server publishes none."""
    counters = spec_counters(text)
    if isinstance(counters, VllmSpecCounters):
        out: dict[str, Any] = {"engine": "vllm", "verify_steps": counters.drafts,
                               "accepted_tokens": counters.accepted_tokens,
                               "draft_tokens": counters.draft_tokens}
        if counters.accepted_per_position:
            out["per_position"] = list(counters.accepted_per_position)
        return out
    if isinstance(counters, SglangSpecCounters):
        return {"engine": "sglang", "verify_steps": counters.verify_steps}
    return {}


def scrape(session: Any, spec: ServerSpec, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The server's counters now; None when /metrics does not answer (SGLang without --enable-metrics,
    a generic server), {} when it answers without speculative counters."""
    import requests

    try:
        resp = session.get(f"{spec.base_url}/metrics", headers=spec.headers(), timeout=timeout_s)
    except requests.RequestException as exc:
        logger.info("server %s: /metrics not reachable (%s)", spec.name, exc)
        return None
    if resp.status_code != 200:
        logger.info("server %s: /metrics answered %s", spec.name, resp.status_code)
        return None
    return parse_spec_counters(resp.text)


def delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """after - before, counter by counter; None when either is missing or a counter went down
    (a restart between the scrapes)."""
    if not before or not after or before.get("engine") != after.get("engine"):
        return None
    out: dict[str, Any] = {"engine": after["engine"]}
    for key in ("verify_steps", "accepted_tokens", "draft_tokens"):
        if key in after and key in before:
            d = int(after[key]) - int(before[key])
            if d < 0:
                return None
            out[key] = d
    if "per_position" in after:
        b = list(before.get("per_position") or [])
        a = list(after["per_position"])
        b += [0] * (len(a) - len(b))
        diffs = [x - y for x, y in zip(a, b)]
        if any(d < 0 for d in diffs):
            return None
        out["per_position"] = diffs
    return out
