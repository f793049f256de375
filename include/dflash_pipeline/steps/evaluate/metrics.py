"""The servers' own speculative counters, scraped from `/metrics` around each condition.

Why: the per-row statistics are what the report is built from; the engine's server-wide counters
are an independent witness. The eval scrapes each server before and after each condition and keeps
the delta; the report compares it with the sum of that server's rows of that run.

What each engine publishes (Prometheus text, parsed with prometheus_client's parser):
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

logger = logging.getLogger(__name__)

VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SGLANG_VERIFY = "sglang:spec_verify_calls"


def parse_spec_counters(text: str) -> dict[str, Any]:
    """The speculative counters in a /metrics text: {"verify_steps", "accepted_tokens", "draft_tokens",
    "per_position": [..]} (vLLM) or {"verify_steps"} (SGLang); {} when the server publishes none."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name[:-len("_total")] if sample.name.endswith("_total") else sample.name
                if sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                    continue
                if name == VLLM_PER_POS:
                    pos = int(sample.labels.get("position", "0"))
                    per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
                elif name in (VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED, SGLANG_VERIFY):
                    sums[name] = sums.get(name, 0.0) + sample.value
    except ValueError as exc:
        logger.warning("unparseable /metrics text: %s", exc)
        return {}
    if VLLM_DRAFTS in sums:
        out: dict[str, Any] = {"engine": "vllm", "verify_steps": int(sums[VLLM_DRAFTS]),
                               "accepted_tokens": int(sums.get(VLLM_ACCEPTED, 0)),
                               "draft_tokens": int(sums.get(VLLM_DRAFT_TOKENS, 0))}
        if per_pos:
            out["per_position"] = [int(per_pos[k]) for k in sorted(per_pos)]
        return out
    if SGLANG_VERIFY in sums:
        return {"engine": "sglang", "verify_steps": int(sums[SGLANG_VERIFY])}
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
