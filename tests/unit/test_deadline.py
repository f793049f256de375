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


class _FakeServer:
    """A clock and a load endpoint under the test's control (the shortfall rule's inputs)."""

    def __init__(self, timeout_s: float = 8.0) -> None:
        self.now = 0.0
        self.held: int | None = 0
        self.probes = 0
        self.watch = ServerWatch(DeadlinePolicy(request_timeout_s=timeout_s), self._probe, clock=lambda: self.now)

    def _probe(self) -> int | None:
        self.probes += 1
        return self.held

    def step(self) -> None:
        """One probe interval later, a waiter's poll (which probes)."""
        self.now += self.watch.check_every_s
        self.watch.stuck()


def _open(server: _FakeServer, count: int) -> list[Any]:
    waits = []
    for _ in range(count):
        wait = server.watch.waiter(100)
        waits.append(wait.__enter__())
        server.now += 0.01
    return waits


def test_shortfall_cuts_the_oldest_request_past_request_timeout() -> None:
    srv = _FakeServer(timeout_s=8.0)  # check_every_s = 1
    waits = _open(srv, 5)  # waits[0] is the oldest
    srv.held = 4  # the server holds 4 of our 5
    for _ in range(10):
        srv.step()
    elapsed = [srv.now - 0.01 * i for i in range(5)]
    assert all(e >= 8.0 for e in elapsed)
    assert [w(e) for w, e in zip(waits[1:], elapsed[1:])] == [True] * 4  # younger ones: never
    assert not waits[0](elapsed[0]) and "fewer of our requests" in waits[0].why
    waits[0].__exit__(None, None, None)
    assert all(w(e) for w, e in zip(waits[1:], elapsed[1:]))  # the shortfall is used up


def test_shortfall_never_cuts_within_request_timeout() -> None:
    srv = _FakeServer(timeout_s=8.0)
    waits = _open(srv, 3)
    srv.held = 0 + 2  # one of ours missing, but nobody is past request_timeout_s yet
    for _ in range(6):
        srv.step()
    assert srv.now < 8.0
    assert all(w(srv.now - 0.5) for w in waits)
    assert srv.watch.lost(waits[0].ticket) is None  # too young to be called lost
    for _ in range(3):
        srv.step()
    assert not waits[0](srv.now)  # once past it, the oldest is cut


def test_shortfall_needs_two_consecutive_probes() -> None:
    srv = _FakeServer(timeout_s=8.0)
    waits = _open(srv, 4)
    srv.held = 4
    for _ in range(10):
        srv.step()
    srv.held = 3  # one probe short ...
    srv.step()
    srv.step()  # ... evaluated one interval later: one strike
    srv.held = 4
    srv.step()
    srv.step()
    assert all(w(srv.now) for w in waits)
    srv.held = 3  # short on two probes in a row
    for _ in range(3):
        srv.step()
    assert not waits[0](srv.now) and all(w(srv.now) for w in waits[1:])


def test_server_holding_as_many_or_more_never_cuts() -> None:
    """N >= M (another client shares the server, or ours are all there): nothing is cut."""
    for held in (3, 4, 50):
        srv = _FakeServer(timeout_s=8.0)
        waits = _open(srv, 3)
        srv.held = held
        for _ in range(12):
            srv.step()
        assert all(w(srv.now) for w in waits)
        assert not waits[0](srv.watch.budget_s(100)) and "tokens/s" in waits[0].why  # only the budget


def test_short_requests_passing_through_make_no_shortfall() -> None:
    """Requests the server does not count at a probe although they are open (still being
    tokenized, or their answer on its way back) are left out of M: a steady stream of them
    makes no shortfall."""
    srv = _FakeServer(timeout_s=8.0)
    waits = _open(srv, 2)
    srv.held = 2
    for _ in range(10):
        srv.step()
    for _ in range(6):  # every interval a new request of ours, not yet counted by the server
        fresh = srv.watch.waiter(100).__enter__()
        srv.now += srv.watch.check_every_s * 0.5
        srv.watch.stuck()
        srv.now += srv.watch.check_every_s * 0.5
        srv.watch.stuck()
        fresh.__exit__(None, None, None)
    assert all(w(srv.now) for w in waits)


def test_a_cut_request_counts_as_closed_at_once() -> None:
    """Between the cut and the waiter's exit, a probe must not count the cut request as still
    missing (that would cut a second, healthy one)."""
    srv = _FakeServer(timeout_s=8.0)
    waits = _open(srv, 3)
    srv.held = 2
    for _ in range(10):
        srv.step()
    assert not waits[0](srv.now)  # cut; its __exit__ has not run yet
    srv.step()  # a probe evaluated in that window
    waits[0].__exit__(None, None, None)
    assert all(w(srv.now) for w in waits[1:])
