"""The client and the simulator against what a real vLLM 0.32 server answered with speculative decoding.

`data/vllm_0.32_spec_wire.json`: responses and `/metrics` deltas a real vLLM 0.32.0 CPU server (ngram and
draft_model, k = 3, and a plain server) gave, one request at a time (captured by i30-engine's
dev/engine/spec_wire.py; trimmed to the fields the client reads). The live check is tests/engine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from dflash_pipeline.dev.sim import SimServer
from dflash_pipeline.serving.sglang import parse_chat_response
from dflash_pipeline.serving.specstats import per_position_rates
from dflash_pipeline.serving.specwire import vllm_spec_counters

WIRE = json.loads((Path(__file__).with_name("data") / "vllm_0.32_spec_wire.json").read_text())
CASES = [(kind, r) for kind, v in WIRE["servers"].items() for r in v["requests"]]


@pytest.mark.parametrize("kind,case", CASES, ids=[f"{k}-{r['name']}" for k, r in CASES])
def test_per_request_figures_equal_the_servers_metrics_delta(kind, case):
    spec = parse_chat_response(case["response"]).spec
    delta = case["metrics_delta"]
    if kind == "plain" or case["request_n"] > 1:
        assert spec is None  # not speculating, or n > 1 (vLLM suppresses the figures)
        return
    assert (spec.verify_steps, spec.accepted_tokens, spec.draft_tokens) == (
        delta["drafts"], delta["accepted_tokens"], delta["draft_tokens"])
    tails = [sum(spec.histogram[i + 1:]) for i in range(len(spec.histogram) - 1)]
    assert tails == delta["accepted_per_pos"]
    if spec.verify_steps:
        assert spec.acceptance_length == pytest.approx(
            case["response"]["metrics"]["speculative_decoding"]["mean_acceptance_length"])
        assert per_position_rates(spec.histogram) == pytest.approx([t / spec.verify_steps for t in tails])
    else:
        assert spec.acceptance_length is None  # 0 steps: vLLM's 1.0 is a convention, not a figure


def test_real_metrics_lines_parse():
    c = vllm_spec_counters("\n".join(WIRE["servers"]["ngram"]["metrics_text_spec_lines"]) + "\n")
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position) == (588, 1708, 790, (293, 249, 248))
    assert vllm_spec_counters("\n".join(WIRE["servers"]["plain"]["metrics_text_spec_lines"] or []) + "\n") is None


def _shape(line: str) -> str:
    """A sample line without its model name and value."""
    return re.sub(r'model_name="[^"]*"', 'model_name="M"', line.rsplit(" ", 1)[0])


def test_the_simulators_vllm_dialect_has_the_real_shape():
    real = next(r for r in WIRE["servers"]["ngram"]["requests"] if r["name"] == "thinking_on_t0")["response"]
    with SimServer(token_time_s=0.0002, length_scale=0.05, engine="vllm", spec_algorithm="ngram",
                   spec_num_draft_tokens=3) as s:
        body = requests.post(s.url + "/v1/chat/completions", timeout=30,
                             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}).json()
        lines = [x for x in requests.get(s.url + "/metrics", timeout=10).text.splitlines()
                 if x.startswith("vllm:spec_decode")]
    assert set(body["metrics"]) == set(real["metrics"])
    assert set(body["metrics"]["speculative_decoding"]) == set(real["metrics"]["speculative_decoding"])
    assert len(body["metrics"]["speculative_decoding"]["acceptance_histogram"]) == 4
    assert sorted(map(_shape, lines)) == sorted(map(_shape, WIRE["servers"]["ngram"]["metrics_text_spec_lines"]))
