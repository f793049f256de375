"""Request deadlines (serving/deadline.py) against the simulator over HTTP, and the budget rule."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from dflash_pipeline.config import Sampling
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.serving.deadline import DeadlinePolicy, ServerWatch, forget, server_watch
from dflash_pipeline.serving.sglang import RequestFailure, ServerSpec, build_chat_body, chat_once, new_chat_client

MSGS = [{"role": "user", "content": "think long about two plus two"}]


def _body(engine: str, max_tokens: int) -> dict[str, Any]:
    s = Sampling(max_tokens=max_tokens, temperature=0.6, top_p=0.95, enable_thinking=True, seed=None)
    return build_chat_body(MSGS, "Qwen/Qwen3-8B", s, "p-1", engine)


@pytest.fixture(autouse=True)
def _fresh_watches() -> Any:
    forget()
    yield
    forget()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_generation_longer_than_request_timeout_is_not_cut(engine: str) -> None:
    """~2.4 s of decoding with request_timeout_s=0.5: the server holds the request, so it waits."""
    with SimServer(SimConfig(engine=engine, token_time_s=0.0012, mean_tokens=20000)) as sim:
        spec = ServerSpec("slow", sim.url)
        watch = server_watch("run", spec, engine, DeadlinePolicy(request_timeout_s=0.5, min_decode_tok_s=200))
        t0 = time.monotonic()
        with watch.waiter(2000) as wait:
            completion, latency = chat_once(new_chat_client(), spec, _body(engine, 2000), 0.5, wait)
        assert completion.completion_tokens == 2000 and completion.finish_reason == "length"
        assert time.monotonic() - t0 > 2.0 and completion.reasoning


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_hung_request_on_idle_server_is_cut_within_request_timeout(engine: str) -> None:
    with SimServer(SimConfig(engine=engine, hang_rate=1.0, hang_s=30.0, context_length=40000)) as sim:
        spec = ServerSpec("hang", sim.url)
        watch = server_watch("run", spec, engine, DeadlinePolicy(request_timeout_s=1.0, min_decode_tok_s=5))
        t0 = time.monotonic()
        with pytest.raises(RequestFailure) as info, watch.waiter(32768) as wait:
            chat_once(new_chat_client(), spec, _body(engine, 32768), 1.0, wait)
        took = time.monotonic() - t0
    assert info.value.error_class == "Timeout" and "not generating" in info.value.message
    assert 1.0 <= took < 1.0 + 2 * watch.check_every_s + 0.2, took


def test_server_that_stops_answering_is_cut() -> None:
    """A peer that accepts connections and never answers (a frozen server): probes fail, cut."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    try:
        spec = ServerSpec("frozen", f"http://127.0.0.1:{listener.getsockname()[1]}")
        watch = server_watch("run", spec, "vllm", DeadlinePolicy(request_timeout_s=1.0))
        t0 = time.monotonic()
        with pytest.raises(RequestFailure) as info, watch.waiter(32768) as wait:
            chat_once(new_chat_client(), spec, _body("vllm", 32768), 1.0, wait)
        assert info.value.error_class == "Timeout"
        assert time.monotonic() - t0 < 2.0
    finally:
        stop.set()
        listener.close()
        for s in held:
            s.close()


def test_budget_follows_measured_speed() -> None:
    now = [0.0]
    watch = ServerWatch(DeadlinePolicy(request_timeout_s=300, min_decode_tok_s=5), None, clock=lambda: now[0])
    assert watch.budget_s(32768) == pytest.approx(32768 / 5)  # nothing measured yet
    for _ in range(50):
        watch.record(3000, 100.0)  # 30 tokens/s per request
    watch.record(10, 100.0)  # too short to say anything about decode speed: ignored
    assert watch.slow_speed() == pytest.approx(15.0)
    assert watch.budget_s(32768) == pytest.approx(32768 / 15)
    assert watch.budget_s(1000) == 300  # never below request_timeout_s
    wait = watch.waiter(32768)
    assert wait(299) and wait(2000)  # no load signal (generic server): only the budget cuts
    assert not wait(32768 / 15 + 1) and "tokens/s" in wait.why


def test_generic_server_without_load_endpoint_is_never_called_stuck() -> None:
    watch = ServerWatch(DeadlinePolicy(request_timeout_s=1), None)
    with watch.waiter(100):
        assert not watch.stuck()
