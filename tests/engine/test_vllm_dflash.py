"""vLLM 0.32's DFlash path on the CPU build, checked against a drafter whose every draft is known.

The server (``vllm_dflash_server`` in conftest.py) serves the cycle target, whose greedy text is a
fixed cycle of words, with a designed DFlash drafter in SpecForge's format that drafts exactly that
text, except that after any word of the cycle's second half its first draft misses. So each verify
step accepts k drafts or none, and which one is known from the request's first token alone
(``dflash_drafter.oracle_accepts``): each response's ``acceptance_histogram`` must equal it exactly,
alone or batched with others, greedy or sampled (the target's next word is ~1 - 1e-8 likely at
temperature 0.6, so sampling follows the cycle). A drafter whose tokens were drafted at the wrong
offsets, without the bonus token, or against the wrong context positions would not match. The
per-request figures' arithmetic and their sums against ``/metrics`` are checked on this server too,
by test_vllm_spec.py (its ``spec_server`` includes ``dflash``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from dflash_pipeline.dev.engine.dflash_drafter import expected_histogram, oracle_accepts, read_class_target
from dflash_pipeline.dev.stack.vllm_server import settled_spec_counters

pytestmark = pytest.mark.slow

K = 3  # the server's num_speculative_tokens (conftest.ORACLE_K; checked against the endpoint)


def _ask(server: Any, seed: int, thinking: bool, temperature: float, max_tokens: int) -> dict[str, Any]:
    body = {"model": server.model, "messages": [{"role": "user", "content": f"Question {seed}: count for me."}],
            "max_tokens": max_tokens, "temperature": temperature, "top_p": 0.95, "seed": seed,
            "chat_template_kwargs": {"enable_thinking": thinking}, "return_token_ids": True}
    r = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def _expected(server: Any, wrong: tuple[int, ...], answer: dict[str, Any]) -> list[int]:
    """The drafts each verify step of `answer` accepted, as the design says (and its text is the cycle)."""
    assert server.speculative["num_speculative_tokens"] == K
    target = read_class_target(server.checkpoint_dir)
    ids = answer["choices"][0]["token_ids"]
    assert ids == target.chain(ids[0], len(ids) - 1), "the answer left the target's greedy cycle"
    return oracle_accepts(target, ids[0], answer["usage"]["completion_tokens"], K, wrong)


CASES = [  # (thinking, temperature, max_tokens): on starts the cycle at its first word, off at its middle
    (True, 0.0, 64), (False, 0.0, 64), (True, 0.6, 64), (False, 0.6, 40), (True, 0.0, 7), (False, 0.0, 1)]


@pytest.mark.parametrize(("thinking", "temperature", "max_tokens"), CASES)
def test_each_step_accepts_what_the_design_says(vllm_dflash_server: Any, oracle_wrong_tokens: tuple[int, ...],
                                                 thinking: bool, temperature: float, max_tokens: int) -> None:
    before = settled_spec_counters(vllm_dflash_server.base_url)
    answer = _ask(vllm_dflash_server, 7, thinking, temperature, max_tokens)
    delta = settled_spec_counters(vllm_dflash_server.base_url) - before
    spec = answer["metrics"]["speculative_decoding"]
    accepted = _expected(vllm_dflash_server, oracle_wrong_tokens, answer)
    assert spec["acceptance_histogram"] == expected_histogram(accepted, K)
    assert spec["num_spec_steps"] == len(accepted) and spec["num_accepted_draft_tokens"] == sum(accepted)
    assert spec["num_draft_tokens"] == K * len(accepted)  # DFlash always drafts k
    assert (delta.drafts, delta.accepted_tokens, delta.draft_tokens) == (
        len(accepted), sum(accepted), K * len(accepted))


def test_perfect_and_useless_drafts(vllm_dflash_server: Any) -> None:
    """Within the cycle's first half every draft is accepted (acceptance length k + 1); from its middle,
    none (1.0, as an untrained drafter's)."""
    first_half = _ask(vllm_dflash_server, 1, True, 0.0, 21)["metrics"]["speculative_decoding"]
    assert first_half["acceptance_histogram"] == [0, 0, 0, 5] and first_half["mean_acceptance_length"] == 4.0
    second_half = _ask(vllm_dflash_server, 2, False, 0.0, 20)["metrics"]["speculative_decoding"]
    assert second_half["acceptance_histogram"] == [19, 0, 0, 0] and second_half["mean_acceptance_length"] == 1.0
    assert second_half["draft_acceptance_rate"] == 0.0


def test_batched_requests_each_exact(vllm_dflash_server: Any, oracle_wrong_tokens: tuple[int, ...]) -> None:
    """Ten requests at once (different lengths, both halves, greedy and sampled): DFlash's batched
    context and mask slots keep each request's drafts its own."""
    cases = [(i % 2 == 0, 0.6 if i % 3 == 0 else 0.0, 24 + 9 * i) for i in range(10)]
    before = settled_spec_counters(vllm_dflash_server.base_url)
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: _ask(vllm_dflash_server, 100 + c[2], *c), cases))
    delta = settled_spec_counters(vllm_dflash_server.base_url) - before
    expected = [_expected(vllm_dflash_server, oracle_wrong_tokens, a) for a in answers]
    for answer, accepted in zip(answers, expected):
        assert answer["metrics"]["speculative_decoding"]["acceptance_histogram"] == expected_histogram(accepted,
                                                                                                      K)
    assert delta.drafts == sum(len(a) for a in expected) and delta.accepted_tokens == sum(sum(a) for a in expected)
