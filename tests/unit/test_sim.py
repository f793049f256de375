"""Tests of the simulated SGLang server (real sockets on 127.0.0.1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import requests

from dflash_pipeline.dev.sim import (
    CONTEXT_TOO_LONG_MSG,
    QUEUE_FULL_MSG,
    TOTAL_TOO_LONG_MSG,
    SimConfig,
    SimFleet,
    SimServer,
    count_prompt_tokens,
    plan_lengths,
)
from dflash_pipeline.dev.sim.lengths import IM_END_TOKEN_ID

FAST = {"token_time_s": 0.0005, "length_scale": 0.02}


def _msgs(text: str = "what is two plus two") -> list[dict[str, Any]]:
    return [{"role": "system", "content": "you are helpful"}, {"role": "user", "content": text}]


def _chat(url: str, messages: list[dict[str, Any]] | None = None, *,
          session: requests.Session | None = None, headers: dict[str, str] | None = None,
          timeout: float = 10.0, **body: Any) -> requests.Response:
    payload = {"model": "Qwen/Qwen3-8B", "messages": messages or _msgs(), **body}
    poster = session.post if session is not None else requests.post
    return poster(url + "/v1/chat/completions", json=payload, headers=headers, timeout=timeout)


def _wait_for(predicate: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def make_server() -> Iterator[Callable[..., SimServer]]:
    servers: list[SimServer] = []

    def factory(**overrides: Any) -> SimServer:
        server = SimServer(SimConfig(**{**FAST, **overrides})).start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop()


# -- endpoint shapes ------------------------------------------------------------------------


def test_endpoint_shapes(make_server: Callable[..., SimServer]) -> None:
    server = make_server(model_path="Qwen/Qwen3-8B", served_model_name="qwen3",
                         max_running_requests=8, context_length=4096)
    url = server.url
    assert server.port > 0 and url == f"http://127.0.0.1:{server.port}"

    health = requests.get(url + "/health", timeout=5)
    assert health.status_code == 200 and health.content == b""
    assert requests.get(url + "/health_generate", timeout=5).status_code == 200

    for path in ("/get_server_info", "/server_info"):
        info = requests.get(url + path, timeout=5).json()
        assert info["model_path"] == "Qwen/Qwen3-8B"
        assert info["served_model_name"] == "qwen3"
        assert info["max_running_requests"] == 8
        assert info["max_total_num_tokens"] == 200000
        assert info["context_length"] == 4096
        assert info["tp_size"] == 1
        assert info["reasoning_parser"] == "qwen3"
        assert info["version"].endswith("-sim")
        assert "api_key" not in info
        state = info["internal_states"][0]
        assert state["max_total_num_tokens"] == 200000 and "last_gen_throughput" in state

    load = requests.get(url + "/get_load", timeout=5).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]

    model_info = requests.get(url + "/get_model_info", timeout=5).json()
    assert model_info == {"model_path": "Qwen/Qwen3-8B", "tokenizer_path": "Qwen/Qwen3-8B",
                          "is_generation": True, "preferred_sampling_params": None}

    models = requests.get(url + "/v1/models", timeout=5).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "qwen3" and card["object"] == "model" and card["owned_by"] == "sglang"
    assert card["root"] == "Qwen/Qwen3-8B" and card["max_model_len"] == 4096
    assert isinstance(card["created"], int)

    missing = requests.get(url + "/no/such/path", timeout=5)
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    assert requests.get(url + "/v1/chat/completions", timeout=5).status_code == 405

    resp = _chat(url, max_tokens=1000)
    assert resp.status_code == 200
    data = resp.json()
    assert set(data) == {"id", "object", "created", "model", "choices", "usage"}
    assert data["object"] == "chat.completion" and int(data["id"], 16) >= 0
    assert data["model"] == "Qwen/Qwen3-8B" and isinstance(data["created"], int)
    choice = data["choices"][0]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert set(choice["message"]) == {"role", "content", "reasoning_content", "tool_calls"}
    assert choice["message"]["role"] == "assistant" and choice["message"]["tool_calls"] is None
    usage = data["usage"]
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens",
                          "prompt_tokens_details", "reasoning_tokens"}
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert _chat(url, model=None).json()["model"] == "qwen3"  # no model -> served name

    stats = requests.get(url + "/sim/stats", timeout=5).json()
    for key in ("requests_total", "generation_requests", "completed", "errors_by_code",
                "output_tokens", "busy_slot_seconds", "running", "waiting", "first_admit_t",
                "last_finish_t", "started_t", "capacity_slots", "token_time_s", "slow_factor",
                "ids"):
        assert key in stats
    assert stats["capacity_slots"] == 8 and stats["completed"] == 2
    assert stats["generation_requests"] == 2 and stats["errors_by_code"] == {"404": 1, "405": 1}
    assert sum(stats["ids"].values()) == 2 and len(stats["ids"]) == 1


# -- reasoning split, truncation, determinism -----------------------------------------------


def test_parser_mode_splits_reasoning_and_counts_words(make_server: Callable[..., SimServer]
                                                       ) -> None:
    server = make_server()
    messages = _msgs("explain the parser mode")
    data = _chat(server.url, messages).json()
    message, usage = data["choices"][0]["message"], data["usage"]
    assert message["reasoning_content"] and message["content"]
    assert "<think>" not in message["content"] + message["reasoning_content"]
    assert "</think>" not in message["content"] + message["reasoning_content"]
    thinking = len(message["reasoning_content"].split())
    answer = len(message["content"].split())
    assert usage["completion_tokens"] == thinking + answer
    assert usage["reasoning_tokens"] == thinking
    assert usage["prompt_tokens"] == count_prompt_tokens(messages) == 3 + 4 + 2 * 3 + 3
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["choices"][0]["matched_stop"] == IM_END_TOKEN_ID
    plan = plan_lengths(messages, seed=0, mean_tokens=1800, length_scale=FAST["length_scale"])
    assert (thinking, answer) == (plan.thinking_tokens, plan.answer_tokens)
    assert 0.7 <= thinking / (thinking + answer) <= 0.95 or thinking + answer < 12


def test_inline_mode_without_parser(make_server: Callable[..., SimServer]) -> None:
    server = make_server(reasoning_parser=None)
    data = _chat(server.url).json()
    message = data["choices"][0]["message"]
    assert message["reasoning_content"] is None
    content = message["content"]
    assert content.startswith("<think>\n") and "\n</think>\n\n" in content
    assert data["usage"]["completion_tokens"] == len(content.split())  # markers = 1 token each
    assert data["usage"]["reasoning_tokens"] == 0
    assert data["choices"][0]["finish_reason"] == "stop"

    parsed = make_server()  # same seed: separate_reasoning=false gives the same inline text
    assert _chat(parsed.url, separate_reasoning=False).json()["choices"][0]["message"] \
        ["content"] == content


def test_enable_thinking_false_gives_only_an_answer(make_server: Callable[..., SimServer]
                                                    ) -> None:
    for parser in ("qwen3", None):
        server = make_server(reasoning_parser=parser)
        data = _chat(server.url, chat_template_kwargs={"enable_thinking": False}).json()
        message = data["choices"][0]["message"]
        assert message["reasoning_content"] is None
        assert "<think>" not in message["content"] and message["content"]
        assert data["usage"]["completion_tokens"] == len(message["content"].split())
        assert data["usage"]["reasoning_tokens"] == 0


def test_truncation_inside_thinking_and_inside_answer(make_server: Callable[..., SimServer]
                                                      ) -> None:
    messages = _msgs("a prompt whose thinking gets cut")
    plan = plan_lengths(messages, seed=0, length_scale=0.05)
    assert plan.thinking_tokens >= 4 and plan.answer_tokens >= 2
    cut = plan.thinking_tokens // 2

    server = make_server(length_scale=0.05)
    data = _chat(server.url, messages, max_tokens=cut).json()
    choice = data["choices"][0]
    assert choice["message"]["content"] == ""
    assert len(choice["message"]["reasoning_content"].split()) == cut
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None
    assert data["usage"]["completion_tokens"] == cut

    full = _chat(server.url, messages).json()["choices"][0]["message"]
    assert full["reasoning_content"].startswith(choice["message"]["reasoning_content"])

    in_answer = plan.thinking_tokens + 1
    choice = _chat(server.url, messages, max_completion_tokens=in_answer).json()["choices"][0]
    assert choice["message"]["reasoning_content"] == full["reasoning_content"]
    assert len(choice["message"]["content"].split()) == 1
    assert full["content"].startswith(choice["message"]["content"])
    assert choice["finish_reason"] == "length"

    inline = make_server(length_scale=0.05, reasoning_parser=None)
    choice = _chat(inline.url, messages, max_tokens=cut).json()["choices"][0]
    content = choice["message"]["content"]
    assert content.startswith("<think>\n") and "</think>" not in content
    assert len(content.split()) == cut and choice["finish_reason"] == "length"


def test_deterministic_per_prompt(make_server: Callable[..., SimServer]) -> None:
    a, b = make_server(), make_server()
    first = _chat(a.url).json()["choices"][0]["message"]
    again = _chat(a.url).json()["choices"][0]["message"]
    other_server = _chat(b.url).json()["choices"][0]["message"]
    assert first == again == other_server
    different = _chat(a.url, _msgs("a different question")).json()["choices"][0]["message"]
    assert different != first
    reseeded = make_server(seed=7)
    assert _chat(reseeded.url).json()["choices"][0]["message"] != first


def test_length_distribution_is_heavy_tailed() -> None:
    totals = [plan_lengths([{"role": "user", "content": f"q{i}"}]).total_tokens
              for i in range(2000)]
    mean = sum(totals) / len(totals)
    assert 1400 < mean < 2200
    assert sum(t > 4096 for t in totals) > 40
    assert min(totals) >= 2


# -- errors -----------------------------------------------------------------------------------


def test_context_length_400s_and_bad_requests(make_server: Callable[..., SimServer]) -> None:
    server = make_server(context_length=40)
    long_prompt = [{"role": "user", "content": " ".join(["word"] * 40)}]  # 40 + 3 + 3 tokens
    resp = _chat(server.url, long_prompt)
    assert resp.status_code == 400
    assert resp.json() == {
        "object": "error", "type": "BadRequestError", "param": None, "code": 400,
        "message": CONTEXT_TOO_LONG_MSG.format(input_tokens=46, context_length=40)}
    assert resp.json()["message"] == ("The input (46 tokens) is longer than the model's "
                                      "context length (40 tokens).")

    short = [{"role": "user", "content": "hi there"}]  # 2 + 3 + 3 = 8 tokens
    resp = _chat(server.url, short, max_tokens=33)
    assert resp.status_code == 400
    assert resp.json()["message"] == TOTAL_TOO_LONG_MSG.format(
        context_length=40, total_tokens=41, input_tokens=8, max_tokens=33)
    assert resp.json()["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 40 tokens.")
    assert _chat(server.url, short, max_tokens=32).status_code == 200  # exactly at the limit

    bad_json = requests.post(server.url + "/v1/chat/completions", data=b"{not json",
                             headers={"Content-Type": "application/json"}, timeout=5)
    assert bad_json.status_code == 400 and bad_json.json()["object"] == "error"
    no_messages = requests.post(server.url + "/v1/chat/completions", json={"model": "m"},
                                timeout=5)
    assert no_messages.status_code == 400 and "messages" in no_messages.json()["message"]
    assert _chat(server.url, short, stream=True).status_code == 400
    assert _chat(server.url, short, max_tokens=-1).status_code == 400
    assert server.stats()["errors_by_code"]["400"] == 6


def test_api_key(make_server: Callable[..., SimServer]) -> None:
    server = make_server(api_key="secret")
    url = server.url
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
        resp = _chat(url, headers=headers)
        assert resp.status_code == 401 and resp.json() == {"error": "Unauthorized"}
    assert requests.get(url + "/v1/models", timeout=5).status_code == 401
    assert requests.get(url + "/get_server_info", timeout=5).status_code == 401
    assert requests.get(url + "/health", timeout=5).status_code == 200
    assert requests.get(url + "/health_generate", timeout=5).status_code == 200
    good = {"Authorization": "Bearer secret"}
    assert _chat(url, headers=good).status_code == 200
    assert requests.get(url + "/v1/models", headers=good, timeout=5).status_code == 200
    info = requests.get(url + "/get_server_info", headers=good, timeout=5).json()
    assert "api_key" not in info and "secret" not in str(info)


def test_queue_full_503(make_server: Callable[..., SimServer]) -> None:
    messages = _msgs("occupy the only slot")
    tokens = plan_lengths(messages, length_scale=0.05).total_tokens
    server = make_server(max_running_requests=1, max_queued_requests=0,
                         token_time_s=0.5 / tokens, length_scale=0.05)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_chat, server.url, messages)
        assert _wait_for(lambda: server.stats()["running"] == 1)
        resp = _chat(server.url)
        assert resp.status_code == 503
        assert resp.json() == {"object": "error", "message": QUEUE_FULL_MSG,
                               "type": "ServiceUnavailableError", "param": None, "code": 503}
        assert first.result().status_code == 200
    stats = server.stats()
    assert stats["rejected_queue_full"] == 1 and stats["errors_by_code"] == {"503": 1}


def test_injected_faults_are_reproducible(make_server: Callable[..., SimServer]) -> None:
    server = make_server(error_rate=1.0)
    resp = _chat(server.url)
    assert resp.status_code == 500
    body = resp.json()
    assert body["object"] == "error" and body["code"] == 500
    assert body["type"] == "InternalServerError"

    server.update_config(error_rate=0.0, unavailable_rate=1.0)
    assert _chat(server.url).status_code == 503
    server.update_config(unavailable_rate=0.0, reset_rate=1.0)
    with pytest.raises(requests.ConnectionError):
        _chat(server.url)
    server.update_config(reset_rate=0.0, hang_rate=1.0, hang_s=0.3)
    started = time.monotonic()
    with pytest.raises(requests.ConnectionError):
        _chat(server.url)
    assert time.monotonic() - started >= 0.25
    server.update_config(hang_rate=0.0, abort_rate=1.0)
    resp = _chat(server.url)
    # SGLang's abort shape: HTTP 200, finish_reason "abort", the partial text so far.
    assert resp.status_code == 200
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["matched_stop"] is None
    assert server.stats()["faults"] == {"error": 1, "unavailable": 1, "hang": 1, "reset": 1, "abort": 1}
    server.update_config(abort_rate=0.0)

    def codes(target: SimServer) -> list[int]:
        return [_chat(target.url).status_code for _ in range(16)]

    one, two = make_server(error_rate=0.5, seed=3), make_server(error_rate=0.5, seed=3)
    sequence = codes(one)
    assert sequence == codes(two) and {200, 500} == set(sequence)


def test_hang_does_not_hold_a_slot(make_server: Callable[..., SimServer]) -> None:
    server = make_server(max_running_requests=1, hang_rate=1.0, hang_s=30.0)
    with ThreadPoolExecutor(1) as pool:
        hung = pool.submit(_chat, server.url)
        assert _wait_for(lambda: server.stats()["faults"]["hang"] == 1)
        server.update_config(hang_rate=0.0)
        assert _chat(server.url).status_code == 200
        assert server.stats()["running"] == 0
        server.stop()  # wakes the hung request: it sees a reset
        with pytest.raises(requests.ConnectionError):
            hung.result(timeout=5)


# -- batching and accounting --------------------------------------------------------------------


def test_continuous_batching_two_slots_four_requests(make_server: Callable[..., SimServer]
                                                     ) -> None:
    messages = _msgs("four identical requests")
    tokens = plan_lengths(messages, length_scale=0.05).total_tokens
    service = 0.4
    server = make_server(max_running_requests=2, length_scale=0.05,
                         token_time_s=service / tokens)
    done: list[float] = []
    lock = threading.Lock()

    def one() -> int:
        resp = _chat(server.url, messages)
        with lock:
            done.append(time.monotonic())
        return resp.status_code

    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: one(), range(4)))
    assert codes == [200] * 4
    finish = sorted(t - started for t in done)
    assert finish[1] < 1.5 * service + 0.2           # two finish at ~T
    assert finish[2] > 1.5 * service                 # two more at ~2T
    assert finish[2] - finish[1] > 0.5 * service
    assert finish[3] < 2 * service + 1.0
    stats = server.stats()
    assert stats["completed"] == 4 and stats["output_tokens"] == 4 * tokens
    assert stats["max_running_seen"] == 2 and stats["max_waiting_seen"] == 2
    assert stats["busy_slot_seconds"] == pytest.approx(4 * service, rel=0.05)
    span = stats["last_finish_t"] - stats["first_admit_t"]
    assert span == pytest.approx(2 * service, rel=0.25)


def test_busy_slot_seconds_matches_service_times(make_server: Callable[..., SimServer]) -> None:
    server = make_server(max_running_requests=4, token_time_s=0.002, length_scale=0.05)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: _chat(server.url, _msgs(f"question {i}")).json(),
                                range(12)))
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    stats = server.stats()
    assert stats["output_tokens"] == tokens and stats["completed"] == 12
    assert stats["busy_slot_seconds"] == pytest.approx(tokens * 0.002, rel=0.05)

    server.reset_stats()
    assert server.stats()["completed"] == 0
    requests.post(server.url + "/sim/config", json={"slow_factor": 3.0}, timeout=5) \
        .raise_for_status()
    data = _chat(server.url).json()
    stats = server.stats()
    assert stats["slow_factor"] == 3.0
    assert stats["busy_slot_seconds"] == pytest.approx(
        data["usage"]["completion_tokens"] * 0.002 * 3.0, rel=0.05)
    bad = requests.post(server.url + "/sim/config", json={"nope": 1}, timeout=5)
    assert bad.status_code == 400
    assert requests.post(server.url + "/sim/config", json={"port": 1}, timeout=5) \
        .status_code == 400
    assert requests.post(server.url + "/sim/reset_stats", timeout=5).json() == {"ok": True}
    assert server.stats()["completed"] == 0


def test_many_keepalive_clients_and_no_spinning(make_server: Callable[..., SimServer]) -> None:
    server = make_server(max_running_requests=16, token_time_s=0.001, length_scale=0.02)
    idle_cpu = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - idle_cpu < 0.05  # idle servers cost nothing
    wakeups_before = server.stats()["scheduler_wakeups"]

    def client(i: int) -> list[int]:
        with requests.Session() as session:
            return [_chat(server.url, _msgs(f"client {i} q {k}"), session=session).status_code
                    for k in range(2)]

    with ThreadPoolExecutor(128) as pool:
        codes = [c for result in pool.map(client, range(128)) for c in result]
    assert codes == [200] * 256
    stats = server.stats()
    assert stats["completed"] == 256 and stats["max_running_seen"] == 16
    # Event-driven: a bounded number of wake-ups per request, not one per tick.
    assert stats["scheduler_wakeups"] - wakeups_before <= 3 * 256 + 20


# -- lifecycle ------------------------------------------------------------------------------------


def test_crash_resets_connections_and_restart_restores_health(
        make_server: Callable[..., SimServer]) -> None:
    server = make_server(crash_after_requests=3, restart_after_s=0.5, token_time_s=0.01,
                         length_scale=0.05)
    url, port = server.url, server.port
    session = requests.Session()
    assert _chat(url, session=session).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(_chat, url, _msgs("a long request in flight"))
        assert _wait_for(lambda: server.stats()["running"] == 1)
        with pytest.raises(requests.ConnectionError):
            _chat(url)  # the 3rd generation request triggers the crash
        with pytest.raises(requests.ConnectionError):
            in_flight.result(timeout=5)
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=1)
    assert _wait_for(lambda: _health(url) == 200, timeout=3.0)
    assert server.port == port
    stats = server.stats()
    assert stats["crashes"] == 1 and stats["restarts"] == 1 and stats["aborted"] >= 1
    assert _chat(url).status_code == 200  # counter restarted: request 1 of the new life

    requests.post(url + "/sim/crash", json={"restart_after_s": None}, timeout=5) \
        .raise_for_status()
    assert _wait_for(lambda: _health(url) is None)
    time.sleep(0.3)
    assert _health(url) is None and server.stats()["restarts"] == 1


def _health(url: str) -> int | None:
    try:
        return requests.get(url + "/health", timeout=1).status_code
    except requests.ConnectionError:
        return None


def test_startup_delay(make_server: Callable[..., SimServer]) -> None:
    server = make_server(startup_delay_s=0.5)
    assert _health(server.url) == 503
    assert requests.get(server.url + "/health_generate", timeout=5).status_code == 503
    assert _chat(server.url).status_code == 503
    assert requests.get(server.url + "/get_server_info", timeout=5).status_code == 200
    assert _wait_for(lambda: _health(server.url) == 200, timeout=2.0)
    assert _chat(server.url).status_code == 200

    server.crash(restart_after_s=0.1)  # a restart goes through the startup delay again
    assert _wait_for(lambda: _health(server.url) == 503, timeout=2.0)
    assert _wait_for(lambda: _health(server.url) == 200, timeout=2.0)


def test_fleet_and_cli(tmp_path: Path) -> None:
    with SimFleet.uniform(3, **FAST) as fleet:
        assert len(set(fleet.urls)) == 3
        assert all(_health(url) == 200 for url in fleet.urls)
        assert [s.config.fault_seed for s in fleet] == [0, 1, 2]

    urls_file = tmp_path / "urls.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_pipeline.dev.sim", "--count", "2", "--base-port", "0",
         "--max-running-requests", "4", "--token-time-s", "0.001", "--length-scale", "0.01",
         "--reasoning-parser", "none", "--set", "error_rate=0.0",
         "--server-set", "1:slow_factor=2.0", "--urls-file", str(urls_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
    try:
        assert _wait_for(urls_file.exists, timeout=4.0), proc.stderr
        urls = urls_file.read_text().split()
        assert len(urls) == 2 and all(_health(url) == 200 for url in urls)
        stats = [requests.get(url + "/sim/stats", timeout=5).json() for url in urls]
        assert [s["slow_factor"] for s in stats] == [1.0, 2.0]
        assert [s["capacity_slots"] for s in stats] == [4, 4]
        info = requests.get(urls[0] + "/get_server_info", timeout=5).json()
        assert info["reasoning_parser"] is None
        assert _chat(urls[1]).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _err = proc.communicate(timeout=5)
    assert proc.returncode == 0
    assert out.decode().split() == urls
