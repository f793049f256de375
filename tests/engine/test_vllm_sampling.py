"""Sampling fields reach a real vLLM 0.32 server as the pipeline sends them (build_chat_body with the
run's `sampling_extra`, a ladder entry and a row's overrides), seen by their effect on the answer:
a `stop` string ends the answer there (vLLM names it in `stop_reason`), `top_k` 1 makes every seed
answer alike, `min_tokens` / `ignore_eos` keep the model from stopping early. Out-of-range values are
refused by vLLM with a 400, and by the simulator's vLLM flavour with the same message.

Uses the session's shared real server (conftest.py `vllm_server`); no server configuration of its own.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.serving.sglang import build_chat_body, parse_chat_response, sent_sampling

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-thinking"
BASE = {"prompts_uri": "s3://in/p.jsonl", "output_uri": "s3://out/ds", "servers": ["http://x:1"], "seed": 3}


def _body(params: dict[str, Any], prompt_id: str, *, sample: int = 0, thinking: bool = False,
          overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = RunConfig.from_params({**BASE, **params})
    return build_chat_body([{"role": "user", "content": f"Question {prompt_id}: what is 2 + 2?"}], MODEL,
                           cfg.sampling, prompt_id, "vllm", sample=sample, thinking=thinking, overrides=overrides)


def _post(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda b: requests.post(f"{url}/v1/chat/completions", json=b, timeout=300), bodies))
    assert all(r.status_code == 200 for r in got), [r.text[:300] for r in got if r.status_code != 200]
    return [r.json() for r in got]


def test_stop_top_k_min_tokens_reach_vllm(vllm_server: Any) -> None:
    url = vllm_server.base_url
    ids = [f"q{i}" for i in range(8)]
    base = {"max_tokens": 64, "temperature": 1.0}
    free = _post(url, [_body(base, i) for i in ids])
    contents = [parse_chat_response(r).content for r in free]
    assert all(contents), "thinking off: every answer has content"

    # `stop` from the run's extras: the same seed stops at the string (cut before it) and says so.
    picks = {i: c[len(c) // 2: len(c) // 2 + 4] for i, c in zip(ids, contents) if len(c) >= 12}
    assert len(picks) >= 3, contents
    for pid, stop in picks.items():
        body = _body({**base, "sampling_extra": {"stop": [stop]}}, pid)
        assert body["stop"] == [stop] and sent_sampling(body)["stop"] == [stop]
        raw = _post(url, [body])[0]
        choice = raw["choices"][0]
        full = contents[ids.index(pid)]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop, (stop, choice)
        assert full.startswith(choice["message"]["content"]) and stop not in choice["message"]["content"]
        assert len(choice["message"]["content"]) < len(full)

    # `top_k` 1 from a ladder entry: greedy, so eight seeds give one answer (they gave several without it).
    assert len(set(contents)) >= 3
    greedy = _post(url, [_body({**base, "samples_per_prompt": 2, "sampling_ladder": [{}, {"top_k": 1}]},
                               "same", sample=1 + 2 * k) for k in range(8)])
    assert len({json.dumps(r["choices"][0]["message"]) for r in greedy}) == 1
    assert len({b["seed"] for b in (_body({**base, "samples_per_prompt": 2}, "same", sample=1 + 2 * k)
                                    for k in range(8))}) == 8, "the seeds did differ"

    # `min_tokens` as a row's override and `ignore_eos` from the extras: nobody stops before the budget.
    early = [r for r in free if r["usage"]["completion_tokens"] < 64]
    assert early, "some answers end before 64 tokens without min_tokens"
    held = _post(url, [_body(base, i, overrides={"min_tokens": 64}) for i in ids])
    assert all(r["usage"]["completion_tokens"] == 64 for r in held)
    no_eos = _post(url, [_body({**base, "sampling_extra": {"ignore_eos": True}}, i) for i in ids])
    assert all(r["usage"]["completion_tokens"] == 64 and r["choices"][0]["finish_reason"] == "length" for r in no_eos)


def test_out_of_range_refused_alike_by_vllm_and_the_simulator(vllm_server: Any, tiny_qwen_checkpoint: Any) -> None:
    sim = SimServer(SimConfig(engine="vllm", model_path="/models/tiny-qwen3", served_model_name=MODEL,
                              context_length=vllm_server.max_model_len, token_time_s=0.001,
                              tokenizer_dir=str(tiny_qwen_checkpoint))).start()
    try:
        for bad in ({"min_p": 1.5}, {"top_k": -3}, {"presence_penalty": 3.0}, {"min_tokens": 80}):
            body = {**_body({"max_tokens": 64}, "bad"), **bad}  # past our config check, straight to the servers
            real = requests.post(f"{vllm_server.base_url}/v1/chat/completions", json=body, timeout=120)
            simulated = requests.post(f"{sim.url}/v1/chat/completions", json=body, timeout=30)
            assert real.status_code == simulated.status_code == 400, (bad, real.text, simulated.text)
            assert real.json()["error"]["message"] == simulated.json()["error"]["message"], (real.text, simulated.text)
            assert simulated.json()["error"]["param"] == real.json()["error"]["param"]
    finally:
        sim.stop()
