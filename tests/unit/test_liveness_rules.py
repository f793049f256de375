"""The rules behind "broken" and "failing" (issue 31 A) without servers: the fleet's context from
the manifest, the sign of life, and the chaos liveness draw (dev/chaos_liveness.py). The same rules
against real simulated servers: tests/integration/test_liveness_servers.py."""

from __future__ import annotations

import json
import time

from dflash_pipeline.config import Sampling
from dflash_pipeline.dev.chaos import random_schedule
from dflash_pipeline.dev.chaos_liveness import (
    CONTEXT_LENGTH,
    draw_liveness,
    liveness_prompts,
    unservable_ids,
)
from dflash_pipeline.dev.sim.lengths import count_prompt_tokens
from dflash_pipeline.serving.engines import LoadSample
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.steps.generate.breaker import fleet_context
from dflash_pipeline.steps.generate.failing import ServerHealth
from dflash_pipeline.steps.generate.settings import WorkerSettings
from dflash_pipeline.steps.plan import chunk_sizes


def _settings() -> WorkerSettings:
    return WorkerSettings(run_id="r", worker="w0000", server=ServerSpec("s", "http://127.0.0.1:9"), model="m",
                          sampling=Sampling(), concurrency=4)


def test_fleet_context_is_the_largest_reachable_server_at_preflight() -> None:
    servers = [{"name": "a", "context_length": 4096}, {"name": "b", "context_length": 32768},
               {"name": "c", "context_length": 65536, "unreachable": "down"}, {"name": "d"}]
    assert fleet_context(servers) == (32768, "b")
    assert fleet_context(None) == (None, None)


def _wait_for(pred, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_a_server_running_requests_while_ours_are_in_flight_is_busy_not_failing() -> None:
    running = [3]
    health = ServerHealth(_settings(), lambda: None, load=lambda: LoadSample(running[0], 0))
    health.life_every_s = 0.02
    assert _wait_for(lambda: health.busy(2)), "asking starts the sampler (main never waits for a probe)"
    assert not health.busy(0), "nothing of ours in flight: no healthy work of ours"
    health.failed("HTTP 503: The request queue is full.")
    assert health.failing
    assert health.poll(2) and not health.failing, "a sign of life ends the failing episode"
    running[0] = 0
    assert _wait_for(lambda: not health.busy(2)), "a server running nothing is no sign of life"
    health.failed("HTTP 503")
    assert not health.poll(2) and health.failing


def test_no_load_endpoint_no_sign_of_life() -> None:
    health = ServerHealth(_settings(), lambda: None, load=None)
    health.failed("HTTP 503")
    time.sleep(0.05)
    assert not health.busy(5) and health.failing


def test_liveness_faults_have_their_own_stream_and_whole_unservable_chunks() -> None:
    seeds = range(500, 530)
    with_faults = [random_schedule(s) for s in seeds]
    without = [random_schedule(s, liveness=False) for s in seeds]
    assert all(a.events == b.events and a.servers == b.servers and a.s3 == b.s3 for a, b in zip(with_faults, without))
    assert any(sc.liveness.unservable for sc in with_faults) and any(sc.liveness.busy for sc in with_faults)
    faults = draw_liveness(7, 330, 50, 3, always=True)
    assert faults.unservable and faults.busy
    long = unservable_ids(faults, 330, 50, 3)
    sizes = chunk_sizes(330, 50, 3)
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    assert long == {i for c in faults.unservable for i in range(starts[c], starts[c] + sizes[c])}
    rows = liveness_prompts(7, 330, long).decode().splitlines()
    for i, line in enumerate(rows):
        tokens = count_prompt_tokens([{"role": "user", "content": json.loads(line)["prompt"]}])
        fits = tokens + Sampling().max_tokens <= CONTEXT_LENGTH
        assert fits == (i not in long), (i, tokens)


def _checked(breaker, t: float) -> bool:  # type: ignore[no-untyped-def]
    """Poll the breaker's context check until it answers for a refusal at `t` (issue 39)."""
    return _wait_for(lambda: breaker.poll_context() or breaker.confirmed(t))


def test_a_context_refusal_is_confirmed_only_by_a_check_started_after_it() -> None:
    """Issue 39: the server is judged against its own context at preflight (a smaller server of a
    mixed fleet is not broken), and a refusal is the prompt's only after a check started after it."""
    import pytest

    from dflash_pipeline.steps.generate.breaker import Breaker
    from dflash_pipeline.steps.generate.state import ServerBroken

    fleet = [{"name": "big", "context_length": 8192}, {"name": "s", "context_length": 4352}]
    context = {"now": 4352}
    breaker = Breaker(_settings(), lambda: None, fleet_servers=fleet, context_now=lambda: context["now"])
    t0 = time.monotonic()
    assert not breaker.confirmed(t0), "nothing checked yet"
    breaker.context_refused(t0)
    assert _checked(breaker, t0) and breaker.confirmed(t0), "4352 as at preflight: the prompt's"
    later = time.monotonic() + 0.01
    assert not breaker.confirmed(later), "a refusal after the check waits for the next one"
    context["now"] = 4108  # restarted smaller
    time.sleep(0.02)
    breaker.context_refused(time.monotonic())
    with pytest.raises(ServerBroken, match="4108 tokens, it had 4352 at preflight"):
        assert _wait_for(lambda: breaker.poll_context() and False, timeout_s=2.0)


def test_a_context_check_that_cannot_read_the_context_gives_up_in_time(
        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from dflash_pipeline.serving.sglang import RequestFailure
    from dflash_pipeline.steps.generate import breaker as breaker_module

    monkeypatch.setattr(breaker_module, "CONTEXT_CHECK_GIVE_UP_S", 0.3)

    def unreadable() -> int | None:
        raise RequestFailure("ConnectionError", "refused", kind="transient")

    breaker = breaker_module.Breaker(_settings(), lambda: None,
                                     fleet_servers=[{"name": "s", "context_length": 4352}], context_now=unreadable)
    t0 = time.monotonic()
    breaker.context_refused(t0)
    assert not _wait_for(lambda: breaker.poll_context(), timeout_s=0.2), "undecided at first"
    assert _wait_for(lambda: breaker.poll_context(), timeout_s=3.0) and breaker.confirmed(t0)
