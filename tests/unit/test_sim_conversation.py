"""The simulator's multi-turn behaviour over HTTP: radix-cache model and history audit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import requests

from dflash_pipeline.dev.sim import SimConfig, SimServer

LONG = " ".join(f"word{i}" for i in range(2000))  # 2,000 prompt tokens in the sim's count


@pytest.fixture
def server() -> Iterator[Callable[..., SimServer]]:
    started: list[SimServer] = []

    def make(**overrides: Any) -> SimServer:
        s = SimServer(SimConfig(**{"token_time_s": 0.0005, "length_scale": 0.02, **overrides})).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def _chat(url: str, messages: list[dict[str, str]], seed: int | None = None) -> tuple[dict[str, Any], float]:
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 200}
    if seed is not None:
        body["seed"] = seed
    t0 = time.monotonic()
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json(), time.monotonic() - t0


def test_a_cached_prefix_is_not_prefilled_again_and_is_reported(server: Any) -> None:
    s = server(prefill_time_per_token_s=0.0005)  # 2,000 tokens: 1 s of prefill
    first, t_first = _chat(s.url, [{"role": "user", "content": LONG}])
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    answer = first["choices"][0]["message"]["content"]
    follow = [{"role": "user", "content": LONG}, {"role": "assistant", "content": answer},
              {"role": "user", "content": "and then?"}]
    second, t_second = _chat(s.url, follow)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert second["usage"]["prompt_tokens"] - 10 < cached < second["usage"]["prompt_tokens"]
    assert t_second < t_first - 0.5  # the 2,000 cached tokens were not prefilled again


def test_without_the_cache_nothing_is_cached(server: Any) -> None:
    s = server(radix_cache=False)
    _chat(s.url, [{"role": "user", "content": "q"}])
    again, _ = _chat(s.url, [{"role": "user", "content": "q"}])
    assert again["usage"]["prompt_tokens_details"] is None


def test_history_audit_tells_own_answers_from_foreign_ones(server: Any) -> None:
    a, b = server(track_history=True), server(track_history=True)
    q = [{"role": "user", "content": "question one"}]
    ans = _chat(a.url, q)[0]["choices"][0]["message"]["content"]
    nxt = [*q, {"role": "assistant", "content": ans}, {"role": "user", "content": "question two"}]
    _chat(a.url, nxt)  # its own answer
    _chat(b.url, nxt)  # another server's answer: foreign there
    _chat(a.url, [*q, {"role": "assistant", "content": "an original answer"}, {"role": "user", "content": "x"}])
    sa = requests.get(f"{a.url}/sim/stats", timeout=5).json()["conversation"]
    sb = requests.get(f"{b.url}/sim/stats", timeout=5).json()["conversation"]
    assert (sa["own_history_turns"], sa["foreign_history_turns"], sa["requests_with_history"]) == (1, 1, 2)
    assert (sb["own_history_turns"], sb["foreign_history_turns"]) == (0, 1)


def test_the_answer_depends_on_the_whole_conversation_and_the_seed(server: Any) -> None:
    s = server()
    q = [{"role": "user", "content": "same last question"}]
    text = lambda m, seed=None: _chat(s.url, m, seed)[0]["choices"][0]["message"]["content"]  # noqa: E731
    base = text(q)
    assert text([{"role": "system", "content": "a different history"}, *q]) != base
    assert text(q, seed=1) != text(q, seed=2)
    assert text(q, seed=1) == text(q, seed=1)
