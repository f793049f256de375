"""How long to wait for one non-streaming chat request: long enough for the work, short for a hang.

Why: a fixed `request_timeout_s` (300 s) cuts off a healthy 16-32k-token thinking generation (at
tens of tokens/s per request it takes many minutes), which is then regenerated from scratch. A
non-streaming request gives no sign of progress, so the decision uses what we can observe:

1. **Budget from measured speed.** Every completed request on this server gives a per-request
   speed, completion_tokens / latency (queue wait and prefill included, so it errs slow). A
   request may take `max_tokens / v_slow`, where `v_slow` is the 10th percentile of the recent
   speeds times `speed_margin` (0.5: half as fast as the slowest tenth), and never less than
   `request_timeout_s`. Before any request completed, `v_slow` is `min_decode_tok_s`.
2. **Liveness after `request_timeout_s`.** From `request_timeout_s / 2` on, waiting request
   threads probe the server's load endpoint (at most every `check_every_s`, shared by all threads
   of the server). Two rules read the probes; each needs two probes in a row:
   - **Stuck**: the server does not answer the load endpoint, or holds no request at all while
     ours are outstanding: every request of ours past `request_timeout_s` is cut at once.
   - **Shortfall** (a busy server): the probe says the server holds N requests and M of ours are
     outstanding on it; N < M means at least M - N of ours are not on the server (a lost or hung
     request). Then the OLDEST M - N of our requests already past `request_timeout_s` are cut
     (the smaller shortfall of the two probes; never a request within `request_timeout_s`).
     M counts only requests that were open at the probe, begun at least `check_every_s` before it
     (so they left the server's tokenizer), and are still open one probe interval later (so an
     answer that was on its way back at the probe is not counted as lost): requests passing
     through the server's front end are not taken for losses. Another client on the same server
     only raises N, so sharing errs on the side of waiting.
   Otherwise a request is plausibly generating and waits up to its budget.

What N is: SGLang `/v1/loads` answers one entry per DP rank with `num_running_reqs` and
`num_waiting_reqs` of that rank's scheduler: we sum both over ranks (SGLang before 0.5.21 also
served `/get_load`, whose `num_reqs` is the same sum per rank; it is asked when `/v1/loads` is not
served, and it is gone from 0.5.21 on). vLLM `/metrics` has the gauges
`vllm:num_requests_running` and `vllm:num_requests_waiting` per engine (set each engine step from
the scheduler's running and waiting queues, `SchedulerStats` in `v1/core/sched/scheduler.py`):
we sum both over engines.
Neither counts a request still in the HTTP front end (tokenizing) or one whose answer is being
detokenized and sent; M leaves those out as above.

A hung request is therefore caught within about `request_timeout_s` (+ two checks) when the
server is stuck, gone, holds none of our requests, or, busy, holds fewer of ours than are
outstanding. Limits: the rule cannot tell which request was lost, so when the lost one is younger
than a healthy request already past `request_timeout_s`, the older healthy one is cut instead (it
is retried once; the lost one is then cut when it is the oldest left short). A request stuck
INSIDE the server while still counted in its load (a wedged slot) is indistinguishable, without
streaming, from a long generation, and is cut only at its budget. Streaming with an idle timeout
would tell them apart, but parsing one JSON event per token costs far more client CPU than the
whole non-streaming request. The caller (the generate worker) retries a timed-out request at most
once; a second timeout is an error row.

The waiting costs nothing for an answer that comes within `request_timeout_s / 2` (a plain
blocking read, as without deadlines); after that, one poll() per `check_every_s` on the request's
socket, and the response is read once bytes have arrived (see ChatClient.post).

One probe per server. The ServerWatch is also the server's one load prober: `sample(max_age_s)`
probes (one caller at a time) unless a probe that recent is cached, and the deadline rules take a
cached sample up to `check_every_s / 4` old (at most 1 s), so the concurrency pilot's probes
(serving/pilot.py, every 0.5 s) serve both and no second poller runs. A cached sample is older
than the rules' snapshot of our requests, which only errs towards waiting: a request of ours that
finished in between is counted by the server and not by us. Listeners (the pilot's controller)
get every completion `record`ed and every 503/429 a request ends with.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_pipeline.serving.engines import LoadSample

logger = logging.getLogger(__name__)

# Completed requests shorter than this say more about prefill and queueing than decode speed.
MIN_TOKENS_FOR_SPEED = 32


@dataclass(frozen=True)
class DeadlinePolicy:
    request_timeout_s: float = 300.0
    # Slowest per-request decode speed still called "generating" before any request completed.
    min_decode_tok_s: float = 5.0
    speed_margin: float = 0.5
    window: int = 200


class ServerWatch:
    """Per server and run: decode speeds of completed requests, our outstanding requests, and
    the server's answer to "how many requests do you hold" (cached, shared by request threads
    and the concurrency pilot)."""

    def __init__(self, policy: DeadlinePolicy, probe: Callable[[], int | LoadSample | None] | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._probe = probe  # None: the engine has no load endpoint (generic server)
        self._clock = clock
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()  # one deadline evaluation at a time
        self._fetch_lock = threading.Lock()  # one load probe at a time
        self._sample: tuple[float, bool, LoadSample | None] | None = None  # (t, answered, sample)
        self._listeners: list[Any] = []
        # The in-flight limit every attempt waits under (set by the concurrency pilot; None: none).
        self._gate: Callable[[], int] | None = None
        self._room = threading.Condition(self._lock)
        self._speeds: deque[float] = deque(maxlen=policy.window)
        self._open: dict[int, float] = {}
        self._ids = itertools.count()
        self._probe_t = -1e18
        self._probe_result: tuple[bool, int | None] = (True, None)
        self._strikes = 0
        self._strike_probe_t = -1e18
        # Shortfall rule: the tickets of ours that were open when the last probe was sent (and
        # begun at least check_every_s before it) with the count that probe reported; the
        # shortfalls of the last two evaluated probes; how many of ours may still be cut for them.
        self._pending: tuple[frozenset[int], int | None] | None = None
        self._shortfalls = (0, 0)
        self._lost = 0

    @property
    def check_every_s(self) -> float:
        return min(5.0, max(0.02, self.policy.request_timeout_s / 8))

    @property
    def probing(self) -> bool:
        """The server has a load endpoint."""
        return self._probe is not None

    def add_listener(self, listener: Any) -> None:
        """`listener.on_completion(tokens, latency_s)` and `listener.on_rejection(status)` will be
        called from request threads (they must be quick and never raise)."""
        with self._lock:
            self._listeners = [*self._listeners, listener]

    def remove_listener(self, listener: Any) -> None:
        with self._lock:
            self._listeners = [x for x in self._listeners if x is not listener]

    def set_gate(self, limit: Callable[[], int] | None) -> None:
        """Make every attempt (a first send, a retry, the next turn) wait in `begin` until fewer
        than `limit()` of ours are outstanding. Why: when the limit drops (a server refusing
        requests, a smaller batch) the requests already in flight above it would otherwise keep
        retrying into the refusals; with the gate they wait for room instead."""
        with self._room:
            self._gate = limit
            self._room.notify_all()

    def outstanding(self) -> int:
        """Our requests waiting for an answer from this server now."""
        with self._lock:
            return len(self._open)

    def sample(self, max_age_s: float) -> tuple[bool, LoadSample | None]:
        """(answered, load) of the server: a probe at most `max_age_s` old, else a new one (callers
        arriving during a probe wait for it and share it)."""
        with self._fetch_lock:
            cached = self._sample
            if cached is not None and self._clock() - cached[0] <= max_age_s:
                return cached[1], cached[2]
            try:
                got = self._probe() if self._probe else None
            except Exception:  # noqa: BLE001 - a failed probe is the signal
                got = None
            sample = LoadSample(got, 0) if isinstance(got, int) else got
            self._sample = (self._clock(), sample is not None, sample)
            return sample is not None, sample

    def record(self, completion_tokens: int | None, latency_s: float) -> None:
        if completion_tokens and completion_tokens >= MIN_TOKENS_FOR_SPEED and latency_s > 0:
            with self._lock:
                self._speeds.append(completion_tokens / latency_s)
        for listener in self._listeners:
            try:
                listener.on_completion(completion_tokens, latency_s)
            except Exception:  # noqa: BLE001 - an observer never fails a request
                logger.debug("listener failed on a completion", exc_info=True)

    def rejected(self, status: int) -> None:
        """A request of ours was refused with `status` (503/429): tell the listeners."""
        for listener in self._listeners:
            try:
                listener.on_rejection(status)
            except Exception:  # noqa: BLE001
                logger.debug("listener failed on a rejection", exc_info=True)

    def slow_speed(self) -> float:
        """Tokens/s a request of this server may plausibly be as slow as."""
        with self._lock:
            speeds = sorted(self._speeds)
        if not speeds:
            return self.policy.min_decode_tok_s
        return speeds[len(speeds) // 10] * self.policy.speed_margin

    def budget_s(self, max_tokens: int) -> float:
        return max(self.policy.request_timeout_s, max_tokens / self.slow_speed())

    def begin(self) -> int:
        """A request of ours goes out now (after waiting under the gate, at most request_timeout_s:
        a limit source that never makes room must not hang the request)."""
        with self._room:
            if self._gate is not None:
                give_up = time.monotonic() + self.policy.request_timeout_s
                while self._gate is not None and len(self._open) >= self._gate():
                    left = give_up - time.monotonic()
                    if left <= 0:
                        break
                    self._room.wait(min(0.25, left))
            ticket = next(self._ids)
            self._open[ticket] = self._clock()
            return ticket

    def end(self, ticket: int) -> None:
        with self._room:
            self._open.pop(ticket, None)
            self._room.notify()

    def _server_state(self) -> tuple[bool, int | None]:
        """(answered, requests held); probed at most every check_every_s by one thread."""
        now = self._clock()
        if now - self._probe_t < self.check_every_s or not self._probe_lock.acquire(blocking=False):
            return self._probe_result
        try:
            with self._lock:
                settled = now - self.check_every_s
                ours = frozenset(t for t, begun in self._open.items() if begun <= settled)
            answered, sample = self.sample(max_age_s=min(1.0, self.check_every_s / 4))
            held = sample.held if sample is not None else None
            result = (answered, held)
            with self._lock:
                self._probe_result, self._probe_t = result, self._clock()
                self._count_shortfall(ours, held)
            return result
        finally:
            self._probe_lock.release()

    def stuck(self) -> bool:
        """True when the server is not generating any of our requests: it does not answer its
        load endpoint, or holds nothing while requests of ours are outstanding, on two probes in
        a row (a finished response still on its way back is not mistaken for a loss)."""
        if self._probe is None:
            return False
        answered, held = self._server_state()
        with self._lock:
            if self._probe_t == self._strike_probe_t:
                return self._strikes >= 2
            self._strike_probe_t = self._probe_t
            lost = not answered or (held == 0 and bool(self._open))
            self._strikes = self._strikes + 1 if lost else 0
            return self._strikes >= 2

    def _count_shortfall(self, ours: frozenset[int], held: int | None) -> None:
        """Evaluate the previous probe now that one more probe interval has passed (under _lock).

        M is the previous probe's snapshot of our settled requests that are STILL open: a request
        whose answer was on its way back at that probe has arrived by now and is not counted, and
        one begun less than check_every_s before it (perhaps still being tokenized) was left out of
        the snapshot. Two consecutive probes short (N < M) set how many of ours may be cut: the
        smaller of the two shortfalls."""
        short = 0
        if self._pending is not None:
            tickets, was_held = self._pending
            if was_held is not None:
                short = max(0, sum(1 for t in tickets if t in self._open) - was_held)
        self._shortfalls = (self._shortfalls[1], short)
        self._lost = min(self._shortfalls)
        self._pending = (ours, held)

    def lost(self, ticket: int | None) -> tuple[int, int] | None:
        """(shortfall, rank) when `ticket` is among the oldest `shortfall` of our requests past
        request_timeout_s (so the server holds fewer of ours than are outstanding, and this one
        is old enough to be one it lost); None otherwise. A True answer uses up one of the
        shortfall, so concurrent waiters never cut more requests than the server is missing."""
        if self._lost <= 0 or ticket is None:
            return None
        with self._lock:
            if self._lost <= 0 or ticket not in self._open:
                return None
            horizon = self._clock() - self.policy.request_timeout_s
            old = sorted((begun, t) for t, begun in self._open.items() if begun <= horizon)
            oldest = [t for _, t in old[:self._lost]]
            if ticket not in oldest:
                return None
            short = self._lost
            self._lost -= 1
            # Closed now, not when the caller's exception reaches RequestWait.__exit__: a probe
            # evaluated in between would count it as still missing and cut one more.
            del self._open[ticket]
            return short, oldest.index(ticket) + 1

    def waiter(self, max_tokens: int) -> RequestWait:
        return RequestWait(self, max_tokens)


class RequestWait:
    """The `keep_waiting(elapsed)` callback of one request (see ChatClient.post)."""

    def __init__(self, watch: ServerWatch, max_tokens: int) -> None:
        self.watch = watch
        self.max_tokens = max_tokens
        self.ticket: int | None = None
        self.why: str = ""

    @property
    def slice_s(self) -> float:
        return self.watch.check_every_s

    @property
    def quiet_s(self) -> float:
        """Wait this long plainly (no checks: nothing is decided before request_timeout_s / 2)."""
        return self.watch.policy.request_timeout_s / 2

    def __enter__(self) -> RequestWait:
        self.ticket = self.watch.begin()
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self.ticket is not None:
            self.watch.end(self.ticket)
        status = getattr(exc, "status", None)
        if status in (429, 503):  # a RequestFailure: the server refused it (overload, rate limit)
            self.watch.rejected(int(status))  # type: ignore[arg-type]

    def __call__(self, elapsed: float) -> bool:
        timeout = self.watch.policy.request_timeout_s
        if elapsed < timeout:
            # Probe early so that two probes are in by request_timeout_s.
            if elapsed >= timeout / 2:
                self.watch.stuck()
            return True
        if self.watch.stuck():
            self.why = f"the server is not generating it (checked after {elapsed:.0f}s)"
            return False
        lost = self.watch.lost(self.ticket)
        if lost is not None:
            self.why = (f"the server holds {lost[0]} fewer of our requests than are outstanding, on two "
                        f"checks in a row; this is one of the oldest past request_timeout_s "
                        f"(#{lost[1]}, checked after {elapsed:.0f}s)")
            return False
        budget = self.watch.budget_s(self.max_tokens)
        if elapsed >= budget:
            self.why = (f"no answer within {budget:.0f}s, the time for max_tokens={self.max_tokens} at "
                        f"{self.watch.slow_speed():.1f} tokens/s")
            return False
        return True


_WATCHES: dict[tuple[str, str, str], ServerWatch] = {}
_WATCHES_LOCK = threading.Lock()


def watch_for(key: tuple[str, str, str], policy: DeadlinePolicy,
              probe: Callable[[], int | LoadSample | None] | None) -> ServerWatch:
    """The ServerWatch of (run_id, server name, base_url) in this process, created on first use:
    every request thread of one server shares its speeds and probes."""
    with _WATCHES_LOCK:
        watch = _WATCHES.get(key)
        if watch is None or watch.policy != policy:
            watch = _WATCHES[key] = ServerWatch(policy, probe)
        return watch


def forget(prefix: Any = None) -> None:
    """Drop the watches (all, or those whose run_id is `prefix`)."""
    with _WATCHES_LOCK:
        for key in [k for k in _WATCHES if prefix is None or k[0] == prefix]:
            del _WATCHES[key]


def server_watch(run_id: str, server: Any, engine: str | None, policy: DeadlinePolicy) -> ServerWatch:
    """The shared ServerWatch of one server (a serving.sglang.ServerSpec) in one run, probing the
    engine's load endpoint with its own HTTP session."""
    from dflash_pipeline.serving.engines import adapter
    from dflash_pipeline.serving.probe import server_load_sample
    from dflash_pipeline.serving.sglang import new_session

    key = (run_id, server.name, server.base_url)
    with _WATCHES_LOCK:
        existing = _WATCHES.get(key)
        if existing is not None and existing.policy == policy:
            return existing
    probe = None
    if adapter(engine).load_paths:
        session = new_session()
        session_lock = threading.Lock()

        def probe() -> LoadSample | None:
            with session_lock:
                return server_load_sample(session, server, engine, timeout_s=min(5.0, policy.request_timeout_s / 4))

    return watch_for(key, policy, probe)
