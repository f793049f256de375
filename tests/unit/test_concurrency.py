"""The concurrency controller (serving/concurrency.py) driven by a fake clock and fake servers: growth,
back-off, the cap, stability, the latency rule, 503/429. No sleeping, no timing: each probe is one
call, the clock is moved by hand, and the server models below answer from the limit we give them."""

from __future__ import annotations

import math
from typing import Any

import pytest
from dflash_pipeline.serving.concurrency import ConcurrencyController, ConcurrencyPolicy, queue_for
from dflash_pipeline.serving.engines import LoadSample
from dflash_pipeline.serving.probe import derive_concurrency


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class BatchServer:
    """A continuous-batching server of `slots` slots: of `given` requests it runs min(given, slots)
    and queues the rest (vLLM / SGLang as their load endpoints describe them)."""

    def __init__(self, slots: int, kv_usage: float | None = None) -> None:
        self.slots = slots
        self.kv_usage = kv_usage

    def sample(self, given: int) -> LoadSample:
        return LoadSample(min(given, self.slots), max(0, given - self.slots), self.kv_usage)


def controller(start: int = 16, *, declared: bool = False, probing: bool = True, **policy: Any
               ) -> tuple[ConcurrencyController, Clock]:
    clock = Clock()
    return ConcurrencyController(ConcurrencyPolicy(**policy), start, declared=declared, probing=probing,
                                 clock=clock, wall=clock), clock


def drive(ctl: ConcurrencyController, clock: Clock, server: BatchServer, probes: int) -> list[int]:
    """`probes` probe intervals with the client keeping the limit in flight; the limits seen."""
    seen = []
    for _ in range(probes):
        clock.t += ctl.policy.probe_every_s
        given = ctl.limit
        ctl.on_probe(server.sample(given), ours=given)
        seen.append(ctl.limit)
    return seen


def test_the_queue_is_derive_concurrency_plus_the_old_headroom() -> None:
    """With a declared figure and no rate yet the limit is what preflight derived (unchanged for
    SGLang); the rate term is the adaptive headroom the worker added before: +rate x 0.25 s, at most
    as many again."""
    p = ConcurrencyPolicy()
    for slots in (1, 4, 16, 64, 256):
        assert slots + queue_for(slots, 0.0, p) == derive_concurrency(slots)
        for rate in (0.5, 7.0, 40.0, 10_000.0):
            base = derive_concurrency(slots)
            assert slots + queue_for(slots, rate, p) == base + min(base, math.ceil(rate * 0.25))


def test_grows_from_the_assumed_16_to_a_hidden_64_and_settles() -> None:
    ctl, clock = controller(16)
    server = BatchServer(64)
    seen = drive(ctl, clock, server, 12)
    assert ctl.slots == 64
    assert ctl.limit == 64 + 16  # the slots plus a quarter (no completions: no rate headroom)
    # Slow start doubles: 16 -> 32 -> 64 -> (128 seen saturated) -> 64; a handful of probes.
    first_full = next(i for i, lim in enumerate(seen) if lim >= 64)
    assert first_full <= 3, seen
    # Stable afterwards: the same limit at every probe, never below the server's slots.
    settled = drive(ctl, clock, server, 200)
    assert set(settled) == {80}


def test_growth_needs_the_server_to_take_everything_we_give() -> None:
    ctl, clock = controller(16)
    server = BatchServer(64)
    for _ in range(20):  # we do not have the work to fill the limit: no evidence, no growth
        clock.t += 0.5
        ctl.on_probe(server.sample(5), ours=5)
    assert ctl.slots == 16
    clock.t += 0.5
    ctl.on_probe(BatchServer(64, kv_usage=0.97).sample(ctl.limit), ours=ctl.limit)
    assert ctl.slots == 16, "a full KV cache is no room"
    clock.t += 0.5
    ctl.on_probe(LoadSample(20, 0), ours=ctl.limit)
    assert ctl.slots == 32


def test_waiting_inside_the_server_within_step_jitter_is_not_saturation() -> None:
    ctl, clock = controller(64, declared=False)
    clock.t += 0.5
    ctl.on_probe(LoadSample(70, 1), ours=ctl.limit)  # one waiting: a request between two engine steps
    assert ctl.slots > 70


def test_a_full_server_with_our_queue_in_transit_is_not_room() -> None:
    """Declared 8 slots, 10 in flight: at some probes the 2 queued are on their way (not waiting in
    the server yet, or their answers on the way back). 8 running is a full server: no growth."""
    ctl, clock = controller(8, declared=True)
    for i in range(200):
        clock.t += 0.5
        ctl.on_probe(LoadSample(8, i % 2), ours=ctl.limit)
    assert ctl.slots == 8 and len(ctl.snapshot()["changes"]) == 1


def test_declared_sglang_slots_stay_put() -> None:
    """SGLang's max_running_requests 16, which is what really limits it: 20 in flight, 4 queued,
    at every probe (the figure the dispatch bench measured before this controller)."""
    ctl, clock = controller(16, declared=True)
    assert set(drive(ctl, clock, BatchServer(16), 100)) == {20}
    assert ctl.slots == 16


def test_kv_bound_server_runs_fewer_than_declared() -> None:
    """max_running_requests 16 declared, but the KV cache lets only 10 run: requests wait, slots 10."""
    ctl, clock = controller(16, declared=True)
    drive(ctl, clock, BatchServer(10), 4)
    assert ctl.slots == 10 and ctl.limit == 10 + 3
    assert "wait inside the server" in ctl.reason


def test_capacity_halving_is_followed_down_and_the_batch_never_empties() -> None:
    ctl, clock = controller(16)
    server = BatchServer(64)
    drive(ctl, clock, server, 12)
    assert ctl.slots == 64
    # Halved: the running requests above the new figure finish over a few probes (the sim's and a
    # preempting vLLM's behaviour), new ones wait.
    for running in (60, 52, 41, 33, 32, 32, 32):
        clock.t += 0.5
        given = ctl.limit
        ctl.on_probe(LoadSample(running, given - running), ours=given)
        assert ctl.limit >= running, "the limit never drops below what the server runs"
    assert ctl.slots == 32 and ctl.limit == 40
    assert set(drive(ctl, clock, BatchServer(32), 100)) == {40}


def test_a_burst_still_being_admitted_is_not_a_smaller_capacity() -> None:
    """After growth, a vLLM server admits a burst over several steps (prefill budget): running rises
    while requests wait. Rising `running` never shrinks the estimate."""
    ctl, clock = controller(64, declared=True)
    for running in (40, 47, 55, 61, 64):
        clock.t += 0.5
        ctl.on_probe(LoadSample(running, 80 - running), ours=80)
    assert ctl.slots == 64


def test_two_low_probes_are_needed_to_shrink() -> None:
    ctl, clock = controller(64, declared=True)
    clock.t += 0.5
    ctl.on_probe(LoadSample(50, 10), ours=80)
    assert ctl.slots == 64
    clock.t += 0.5
    ctl.on_probe(LoadSample(64, 16), ours=80)  # back to full: the low reading was jitter
    clock.t += 0.5
    ctl.on_probe(LoadSample(50, 10), ours=80)
    assert ctl.slots == 64
    clock.t += 0.5
    ctl.on_probe(LoadSample(50, 10), ours=80)
    assert ctl.slots == 50


def test_never_above_the_cap() -> None:
    ctl, clock = controller(16, cap=100)
    seen = drive(ctl, clock, BatchServer(5000), 60)
    assert max(seen) == 100 and ctl.limit == 100 and ctl.slots <= 100
    for _ in range(50):  # completions raise the rate headroom: still capped
        ctl.on_completion(100, 0.5)
    assert ctl.limit == 100
    ctl2, clock2 = controller(2000, cap=100, declared=True)
    assert ctl2.limit == 100 and ctl2.slots == 100


def test_rate_headroom_follows_completions() -> None:
    ctl, clock = controller(16, declared=True)
    for _ in range(40):  # 40 completions in the first second: 40/s x 0.25 s = 10 more in flight
        ctl.on_completion(100, 0.2)
    assert ctl.limit == 20 + 10
    clock.t += 11  # the window has passed: no rate
    assert ctl.limit == 20


def test_503_cuts_the_queue_once_per_window_and_never_the_batch() -> None:
    ctl, clock = controller(16)
    server = BatchServer(64)
    drive(ctl, clock, server, 12)
    assert ctl.limit == 80
    for _ in range(7):  # a burst of refusals from many request threads
        ctl.on_rejection(503)
    clock.t += 0.5
    ctl.on_probe(server.sample(80), ours=80)
    assert ctl.limit == 64, "0.75 x 80 = 60 would be below the 64 the server runs: cut to 64"
    assert "refused" in ctl.reason and ctl.snapshot()["rejections"] == {503: 7}
    ctl.on_rejection(503)  # more within reject_every_s: no second cut
    clock.t += 0.5
    ctl.on_probe(server.sample(64), ours=64)
    assert ctl.limit == 64
    # Held for reject_hold_s, then the ceiling rises by 1/16 per probe until it no longer binds.
    seen = drive(ctl, clock, server, int(30 / 0.5) - 3)
    assert set(seen) == {64}
    seen = drive(ctl, clock, server, 20)
    assert seen[-1] == 80 and ctl.snapshot()["ceiling"] is None
    assert all(b >= a for a, b in zip(seen, seen[1:])), seen


def test_503_cuts_to_what_the_server_holds_when_it_just_shrank() -> None:
    """The server dropped to 32 slots and a queue of 20 while 105 of ours were out: one cut to what
    it holds (52), not a quarter per window; the limit never goes below what it runs."""
    ctl, clock = controller(64, declared=True)
    for _ in range(100):
        ctl.on_completion(100, 0.4)  # 100 completions/s: 64 + 16 + 25 = 105 in flight
    assert ctl.limit == 105
    for _ in range(40):
        ctl.on_rejection(503)
    clock.t += 0.5
    ctl.on_probe(LoadSample(32, 20), ours=105)
    assert ctl.limit == 52 and ctl.snapshot()["ceiling"] == 52


def test_429_on_a_generic_server_backs_off_multiplicatively() -> None:
    ctl, clock = controller(16, probing=False)
    limits = [ctl.limit]
    for _ in range(4):
        ctl.on_rejection(429)
        clock.t += 2.0
        ctl.on_probe(None, ours=ctl.limit)
        limits.append(ctl.limit)
    assert limits == [20, 15, 11, 8, 6]


def test_probe_failures_change_nothing() -> None:
    ctl, clock = controller(16)
    for _ in range(20):
        clock.t += 0.5
        ctl.on_probe(None, ours=ctl.limit)
    assert ctl.slots == 16 and ctl.limit == 20


def drive_latency(ctl: ConcurrencyController, clock: Clock, latency: Any, probes: int, *,
                  sample: Any = None, per_probe: int = 20, tokens: int = 200) -> list[int]:
    """Event-driven: at each probe `per_probe` requests begin under the limit then in force and
    finish `latency(limit, tokens)` later (the clock is at each finish when it is reported); the
    probe sees `sample(limit)` (None: no load endpoint). Returns the limits seen."""
    import heapq

    events: list[tuple[float, float]] = []
    seen = []
    every = ctl.policy.probe_every_s
    for _ in range(probes):
        nxt = clock.t + every
        while events and events[0][0] <= nxt:
            finish, lat = heapq.heappop(events)
            clock.t = max(clock.t, finish)
            ctl.on_completion(tokens, lat)
        clock.t = nxt
        given = ctl.limit
        ctl.on_probe(sample(given) if sample else None, ours=given)
        seen.append(ctl.limit)
        begin_limit = ctl.limit
        for i in range(per_probe):
            lat = latency(begin_limit, tokens)
            heapq.heappush(events, (clock.t + 1e-6 * i + lat, lat))
    return seen


class ComputeBoundServer:
    """Runs everything it is given (max_num_seqs 1024, plenty of KV), but past `knee` concurrent
    requests each token takes proportionally longer: more concurrency adds no throughput."""

    def __init__(self, knee: int, tpot_s: float = 0.001) -> None:
        self.knee = knee
        self.tpot_s = tpot_s

    def latency(self, given: int, tokens: int) -> float:
        return tokens * self.tpot_s * max(1.0, given / self.knee)


def test_latency_that_does_not_hold_stops_growth_and_holds() -> None:
    """Nothing ever waits inside this server, so only the latency per token can stop the growth."""
    ctl, clock = controller(16, hold_s=60.0)
    server = ComputeBoundServer(knee=100)
    limits = drive_latency(ctl, clock, server.latency, 240, sample=lambda given: LoadSample(given, 0))
    changes = ctl.snapshot()["changes"]
    assert any("slower" in c[4] for c in changes), changes
    assert max(limits) >= 100, "grew while latency held"
    assert max(limits) <= 4 * 100, "never ran away"
    # After the break the limit stays at the level that held for the whole hold (60 s = 120 probes).
    broke = next(i for i, c in enumerate(changes) if "slower" in c[4])
    held = changes[broke + 1][1] if changes[broke + 1][3] is not None else changes[broke][1]
    first = next(i for i, lim in enumerate(limits) if lim == held and i > 5)
    assert set(limits[first:first + 110]) == {held}, limits[first:first + 110]
    assert held <= 2 * 100


class QueueingGenericServer:
    """A generic server of `slots` slots with no load endpoint: the queue shows only as latency."""

    def __init__(self, slots: int, tpot_s: float = 0.001) -> None:
        self.slots = slots
        self.tpot_s = tpot_s

    def latency(self, given: int, tokens: int) -> float:
        return tokens * self.tpot_s * max(1.0, given / self.slots)


def test_generic_server_grows_on_latency_evidence_only_and_stops_near_its_capacity() -> None:
    ctl, clock = controller(16, probing=False, hold_s=30.0)
    server = QueueingGenericServer(slots=60)
    for _ in range(20):  # no completions yet: no latency evidence, no growth
        clock.t += 0.5
        ctl.on_probe(None, ours=ctl.limit)
    assert ctl.slots == 16
    limits = drive_latency(ctl, clock, server.latency, 400)
    assert 40 <= limits[-1] <= 2 * 60, limits[-40:]
    assert max(limits) <= 3 * 60, max(limits)
    assert any("slower" in c[4] for c in ctl.snapshot()["changes"])


def test_generic_server_backs_off_when_latency_rises_at_a_constant_limit() -> None:
    ctl, clock = controller(16, probing=False)
    clock.t += 5.0
    for _ in range(30):  # requests of 0.2 s at 1 ms per token
        clock.t += 0.01
        ctl.on_completion(200, 0.2)
    clock.t += 0.5
    ctl.on_probe(None, ours=3)  # not binding: no growth, the limit stays where it was
    assert ctl.slots == 16
    for _ in range(30):  # the server slowed down (another tenant, a smaller batch): same limit, 3x latency
        clock.t += 0.01
        ctl.on_completion(200, 0.6)
    clock.t += 0.5
    ctl.on_probe(None, ours=3)
    assert ctl.slots == 12 and any("rose" in c[4] for c in ctl.snapshot()["changes"]), ctl.snapshot()


@pytest.mark.parametrize("probing", [True, False])
def test_change_log_is_bounded(probing: bool) -> None:
    ctl, clock = controller(16, probing=probing)
    for i in range(500):
        clock.t += 2.1
        ctl.on_rejection(503)
        ctl.on_probe(LoadSample(3, 0) if probing else None, ours=1)
    changes = ctl.snapshot()["changes"]
    assert len(changes) <= 64 and changes[0][4].startswith("assumed")


def test_the_gate_holds_an_attempt_until_one_of_ours_ends() -> None:
    """ServerWatch.begin waits under the pilot's limit: with 2 out and a limit of 2, a third attempt
    (a retry after a 503, say) goes out only once one of the two has ended."""
    import threading

    from dflash_pipeline.serving.deadline import DeadlinePolicy, ServerWatch

    watch = ServerWatch(DeadlinePolicy(request_timeout_s=60), None)
    limit = [2]
    watch.set_gate(lambda: limit[0])
    first, second = watch.begin(), watch.begin()
    began = threading.Event()
    third: list[int] = []

    def attempt() -> None:
        third.append(watch.begin())
        began.set()

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    assert not began.wait(0.3) and watch.outstanding() == 2
    watch.end(first)
    assert began.wait(5) and watch.outstanding() == 2
    watch.set_gate(None)  # no gate (concurrency_per_server, or the pilot stopped): never waits
    watch.begin()
    assert watch.outstanding() == 3
    t.join(5)
    del second


def test_the_request_pool_grows_to_the_limit_and_runs_on_the_new_threads() -> None:
    import threading

    from dflash_pipeline.steps.generate.pool import RequestPool

    together = threading.Barrier(5)  # passes only when five requests are running at once
    pool = RequestPool(2, lambda session, item: (together.wait(timeout=10), item)[1], lambda: object())
    pool.ensure(5)
    pool.ensure(3)  # never shrinks
    assert pool.size == 5
    for i in range(5):
        pool.submit(i)
    assert sorted(pool.out.get(timeout=15) for _ in range(5)) == [0, 1, 2, 3, 4]
    pool.close()
