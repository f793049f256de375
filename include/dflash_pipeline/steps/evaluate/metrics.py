"""The servers' own counters, scraped from `/metrics` around each condition: speculative decoding's
and generated tokens.

Why: the per-row statistics and token counts are what the report is built from; the engine's
server-wide counters are an independent witness. The eval scrapes each server before and after each
condition and keeps the delta; the report compares it with the sum of that server's rows of that
run. The generation-token counter is the one every server has (baselines included): another
client's traffic on a server shows there, and so does it in the speed it was measured at.

What each engine publishes (Prometheus text; serving/specwire.py `spec_counters` parses it):
- vLLM 0.32 (`vllm/v1/spec_decode/metrics.py`): counters `vllm:spec_decode_num_drafts_total`
  (verify steps), `..._num_draft_tokens_total`, `..._num_accepted_tokens_total` and
  `..._num_accepted_tokens_per_pos_total{position}`; summed over engines (`engine` label).
- SGLang (with `--enable-metrics`): counter `sglang:spec_verify_calls_total`, incremented by each
  finished request's `spec_verify_ct` (`metrics_collector.observe_one_finished_request`, 0.5.21), so
  only verify steps can be checked; its acceptance gauges are running averages, not counters.

Generated tokens (`GENERATION_TOKENS`; parsed here with prometheus_client, summed over labels):
- vLLM 0.32 (`vllm/v1/metrics/loggers.py` `PrometheusStatLogger`): counter `vllm:generation_tokens`
  ("Number of generation tokens processed."), increased by every engine step's new tokens, the
  prefill's first token included: a request's `usage.completion_tokens` in all. vLLM publishes it,
  and every other `vllm:` series, only with stat logging on: `--disable-log-stats` turns the
  Prometheus stat logger off (`v1/engine/async_llm.py`: no StatLoggerManager), so /metrics answers
  without them while the answers' per-request statistics are unaffected.
- SGLang (with `--enable-metrics`): counter `sglang:generation_tokens_total`, increased by each finished
  request's completion tokens (`observe_one_finished_request`, beside `spec_verify_calls_total`).

A counter that goes down between two scrapes means the server restarted: the delta is unknown. A
labelled counter appears at its first increment, so a counter absent before and present after a
condition started from 0.
"""

from __future__ import annotations

import logging
from typing import Any

from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.serving.specwire import SglangSpecCounters, VllmSpecCounters, spec_counters

logger = logging.getLogger(__name__)

GENERATION_TOKENS = {"vllm": "vllm:generation_tokens", "sglang": "sglang:generation_tokens"}
"""Each engine's generated-tokens counter (the family name; samples end in `_total`)."""
SPEC_KEYS = ("verify_steps", "accepted_tokens", "draft_tokens")
COUNTER_KEYS = (*SPEC_KEYS, "generation_tokens")


def generation_tokens(text: str) -> tuple[str, int] | None:
    """(engine, generated tokens) from a /metrics text, summed over labels; None without the counter."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for engine, name in GENERATION_TOKENS.items():
                if family.name == name:
                    found[engine] = found.get(engine, 0.0) + sum(
                        s.value for s in family.samples if s.name == f"{name}_total")
    except ValueError as exc:
        logger.warning("unparseable /metrics text: %s", exc)
        return None
    return next(((e, int(v)) for e, v in found.items()), None)


def parse_spec_counters(text: str) -> dict[str, Any]:
    """The counters in a /metrics text (serving/specwire.py parses the speculative ones):
    {"engine", "verify_steps", "accepted_tokens", "draft_tokens", "per_position": [..]} (vLLM) or
    {"engine", "verify_steps"} (SGLang), each with "generation_tokens" when published; {} when the
    server publishes none of them."""
    counters = spec_counters(text)
    out: dict[str, Any] = {}
    if isinstance(counters, VllmSpecCounters):
        out = {"engine": "vllm", "verify_steps": counters.drafts, "accepted_tokens": counters.accepted_tokens,
               "draft_tokens": counters.draft_tokens}
        if counters.accepted_per_position:
            out["per_position"] = list(counters.accepted_per_position)
    elif isinstance(counters, SglangSpecCounters):
        out = {"engine": "sglang", "verify_steps": counters.verify_steps}
    gen = generation_tokens(text)
    if gen is not None and out.get("engine", gen[0]) == gen[0]:
        out.update(engine=gen[0], generation_tokens=gen[1])
    return out


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
    """after - before, counter by counter (a counter absent before started from 0); None when either
    scrape is missing or a counter went down (a restart between the scrapes)."""
    if not before or not after or before.get("engine") != after.get("engine"):
        if before == {} and after:  # the first increments of labelled counters came in the window
            before = {"engine": after.get("engine")}
        else:
            return None
    out: dict[str, Any] = {"engine": after["engine"]}
    for key in COUNTER_KEYS:
        if key in after:
            d = int(after[key]) - int(before.get(key) or 0)
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
