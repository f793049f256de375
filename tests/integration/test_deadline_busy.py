"""A hung request on a BUSY server is cut within request_timeout_s (serving/deadline.py's shortfall
rule), while long healthy generations on the same server run to the end.

Real sockets: an in-process simulator (SGLang's or vLLM's wire) with 8 slots all decoding long
generations, and one request the simulator accepted and never answers (its `hang` fault: no slot
held, so not counted in the server's load). The load endpoint never reads zero, so only the
shortfall (the server holds fewer of our requests than are outstanding) can catch the hang before
its budget (15 s here).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from dflash_pipeline.config import Sampling
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.serving.deadline import DeadlinePolicy, forget, server_watch
from dflash_pipeline.serving.sglang import RequestFailure, ServerSpec, build_chat_body, chat_once, new_chat_client

TIMEOUT_S = 1.0
MAX_TOKENS = 3000  # ~3.6 s at 1.2 ms per token: well over request_timeout_s
LONG = 8


def _body(engine: str, i: int) -> dict[str, Any]:
    s = Sampling(max_tokens=MAX_TOKENS, temperature=0.6, top_p=0.95, enable_thinking=True, seed=None)
    msgs = [{"role": "user", "content": f"think long about {i} plus two"}]
    return build_chat_body(msgs, "Qwen/Qwen3-8B", s, f"p-{i}", engine)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_hung_request_on_busy_server_is_cut_and_long_generations_are_not(engine: str) -> None:
    forget()
    cfg = SimConfig(engine=engine, max_running_requests=LONG, token_time_s=0.0012, mean_tokens=200000,
                    hang_rate=1.0, hang_s=60.0)
    outcomes: dict[int, tuple[str, float, Any]] = {}

    with SimServer(cfg) as sim:
        spec = ServerSpec("busy", sim.url)
        policy = DeadlinePolicy(request_timeout_s=TIMEOUT_S, min_decode_tok_s=200)  # budget 15 s
        watch = server_watch(f"busy-{engine}", spec, engine, policy)

        def one(i: int) -> None:
            t0 = time.monotonic()
            try:
                with watch.waiter(MAX_TOKENS) as wait:
                    completion, _ = chat_once(new_chat_client(), spec, _body(engine, i), TIMEOUT_S, wait)
                outcomes[i] = ("ok", time.monotonic() - t0, completion)
            except RequestFailure as exc:
                outcomes[i] = (exc.error_class, time.monotonic() - t0, exc.message)

        hung = threading.Thread(target=one, args=(0,))
        hung.start()
        deadline = time.monotonic() + 5
        while sim.stats()["faults"]["hang"] < 1:  # the simulator took it and will never answer
            assert time.monotonic() < deadline
            time.sleep(0.005)
        sim.update_config(hang_rate=0.0)
        longs = [threading.Thread(target=one, args=(i,)) for i in range(1, LONG + 1)]
        for t in longs:
            t.start()
        hung.join(timeout=30)
        for t in longs:
            t.join(timeout=60)
        assert sim.stats()["max_running_seen"] == LONG  # the server was full all along
    forget()

    kind, took, message = outcomes[0]
    assert kind == "Timeout" and "fewer of our requests" in message, outcomes[0]
    assert TIMEOUT_S <= took < TIMEOUT_S + 2 * watch.check_every_s + 0.5, took
    for i in range(1, LONG + 1):
        kind, took, completion = outcomes[i]
        assert kind == "ok", outcomes[i]
        assert completion.completion_tokens == MAX_TOKENS and completion.finish_reason == "length"
        assert took > 2 * TIMEOUT_S, took
