"""The concurrency controller against a real vLLM server (CPU build, the tiny checkpoint): vLLM does
not publish `--max-num-seqs`, and the controller must find it from `/metrics` alone.

The requests go the production way: request threads call `chat_once` inside the server's ServerWatch
waiter (so every attempt waits under the pilot's limit, and completions reach the controller), and
a ConcurrencyPilot probes `/metrics` and feeds the controller. More threads than the server has
sequences are ready to send; the controller starts at 4 slots, below the server's 16.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from dflash_pipeline.config import Sampling
from dflash_pipeline.serving.concurrency import ConcurrencyController, ConcurrencyPolicy
from dflash_pipeline.serving.deadline import DeadlinePolicy, forget, server_watch
from dflash_pipeline.serving.pilot import ConcurrencyPilot
from dflash_pipeline.serving.probe import server_load_sample
from dflash_pipeline.serving.sglang import (
    RequestFailure,
    ServerSpec,
    build_chat_body,
    chat_once,
    new_chat_client,
    new_session,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 48


def test_max_num_seqs_is_discovered_from_metrics(vllm_server: Any) -> None:
    forget()
    spec = ServerSpec("real-vllm", vllm_server.base_url)
    watch = server_watch("engine-concurrency", spec, "vllm", DeadlinePolicy(request_timeout_s=120))
    assert watch.probing
    controller = ConcurrencyController(ConcurrencyPolicy(cap=64), 4, declared=False, probing=True)
    pilot = ConcurrencyPilot(controller, watch, spec.name)
    stop = threading.Event()
    failures: list[str] = []

    def sender(i: int) -> None:
        client = new_chat_client()
        k = 0
        while not stop.is_set():
            sampling = Sampling(max_tokens=MAX_TOKENS, temperature=0.6, seed=1000 * i + k)
            body = build_chat_body([{"role": "user", "content": f"Count the primes below {50 + 7 * k + i}."}],
                                   vllm_server.model, sampling, f"c{i}-{k}", engine="vllm")
            try:
                with watch.waiter(MAX_TOKENS) as wait:
                    completion, latency = chat_once(client, spec, body, 120, wait)
                watch.record(completion.completion_tokens, latency)
            except RequestFailure as exc:
                failures.append(exc.message)
            k += 1

    threads = [threading.Thread(target=sender, args=(i,), daemon=True) for i in range(3 * vllm_server.max_num_seqs)]
    pilot.start()
    for t in threads:
        t.start()
    session = new_session()
    most_running = 0
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            sample = server_load_sample(session, spec, "vllm")
            if sample is not None:
                most_running = max(most_running, sample.running)
            if controller.snapshot()["runs"] == vllm_server.max_num_seqs:
                break  # seen running 16 while requests waited in it: its capacity
            time.sleep(0.2)
    finally:
        stop.set()
        pilot.stop()
        for t in threads:
            t.join(timeout=150)
        forget()
    changes = controller.snapshot()["changes"]
    print("controller changes:", [(round(c[0] - changes[0][0], 1), c[1], c[2], c[4]) for c in changes])
    assert not failures, failures[:3]
    # The server never ran more than its --max-num-seqs, and the controller found exactly that figure
    # from requests waiting inside it (not from a guess): 4 -> more -> 16 once requests waited.
    assert most_running == vllm_server.max_num_seqs, (most_running, changes)
    assert controller.slots == vllm_server.max_num_seqs, changes
    assert any("room" in c[4] for c in changes) and controller.snapshot()["runs"] == vllm_server.max_num_seqs
    assert controller.limit <= vllm_server.max_num_seqs + 4 + vllm_server.max_num_seqs + 4
