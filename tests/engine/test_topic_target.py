"""The learnable tiny target (dev/engine/topic_qwen.py) on a real vLLM 0.32 (CPU build), qwen3 reasoning parser.

Served with itself as its draft model (k 3): a perfect drafter, which vLLM drafts greedily, so its
acceptance is what a drafter that learned the target exactly could reach. Checked: the greedy text is the
design's for the prompt's topic, thinking on (reasoning, then the answer) and off; sampled answers at
temperature 0.6 think, answer and end, and differ from one another; acceptance is 4 (k + 1) at
temperature 0 and about 1 + 0.9 + 0.9^2 + 0.9^3 = 3.44 at 0.6 (0.9: the greedy word's probability).
An untrained DFlash drafter accepts about 1.0 on it (docs/trainers.md, measured with dflash_measure).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from dflash_pipeline.dev.engine import topic_qwen

pytestmark = pytest.mark.slow


def _ask(server: Any, text: str, thinking: bool, temperature: float, seed: int = 0) -> dict[str, Any]:
    body = {"model": server.model, "messages": [{"role": "user", "content": text}], "max_tokens": 96,
            "temperature": temperature, "top_p": 0.95, "seed": seed,
            "chat_template_kwargs": {"enable_thinking": thinking}}
    r = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


@pytest.mark.parametrize("topic", list(topic_qwen.TOPICS))
def test_greedy_answer_follows_the_topic(vllm_topic_self_server: Any, topic: str) -> None:
    on = _ask(vllm_topic_self_server, f"Question 1: Tell me about {topic}.", True, 0.0)
    choice = on["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning"].strip() == "".join(topic_qwen.THINKING) + "."
    assert choice["message"]["content"].strip() == topic_qwen.answer_text(topic)
    assert on["metrics"]["speculative_decoding"]["mean_acceptance_length"] == 4.0
    off = _ask(vllm_topic_self_server, f"Question 2: What {topic} do you know?", False, 0.0)
    assert off["choices"][0]["message"]["content"].strip() == topic_qwen.answer_text(topic)
    assert not off["choices"][0]["message"].get("reasoning")


def test_sampled_rows_think_answer_end_and_vary(vllm_topic_self_server: Any) -> None:
    prompts = [r["messages"][0]["content"] for r in topic_qwen.prompt_rows(16, seed=5)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: _ask(vllm_topic_self_server, prompts[i], True, 0.6, seed=i), range(16)))
    texts = set()
    steps = accepted = 0
    for prompt, answer in zip(prompts, answers):
        choice = answer["choices"][0]
        topic = next(t for t in topic_qwen.TOPICS if t in prompt)
        assert choice["finish_reason"] == "stop"
        words = choice["message"]["content"].strip()
        assert words.split()[0] == topic_qwen.TOPICS[topic][0] and words.endswith(".")
        assert len(choice["message"]["reasoning"].split()) >= 6
        texts.add((choice["message"]["reasoning"], words))
        spec = answer["metrics"]["speculative_decoding"]
        steps, accepted = steps + spec["num_spec_steps"], accepted + spec["num_accepted_draft_tokens"]
    assert len(texts) >= 8, "temperature 0.6 is peaked, not deterministic"
    assert 3.0 < 1 + accepted / steps < 3.8
