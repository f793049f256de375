"""How many requests to keep in flight on one server, discovered from what the server shows live.

Why: SGLang tells us `max_running_requests`, but vLLM does not publish `max_num_seqs` (its
defaults are 256, or 1024 on GPUs of 70 GiB and more), a generic OpenAI server publishes nothing,
and an SGLang server bound by its KV cache runs fewer than its limit. A fixed guess leaves a big
server mostly idle, or queues requests long enough to eat into their timeouts on a small one.

This module is the decision alone: no threads, no HTTP, an injected clock. `serving/pilot.py`
feeds it (and owns the probing thread); the generate worker only reads `limit`.

Observations:
- `on_probe(sample, ours)`, every `probe_every_s`: the server's load endpoint (vLLM `/metrics`:
  `vllm:num_requests_running`, `…_waiting`, `vllm:kv_cache_usage_perc`; SGLang `/v1/loads`:
  `num_running_reqs`, `num_waiting_reqs`, `token_usage`, or `/get_load`) as a LoadSample, None
  for a generic server (no endpoint) or a probe that failed; `ours` = our requests outstanding on
  the server at the probe.
- `on_completion(tokens, latency_s)`: per-token latency and the completion rate.
- `on_rejection(status)`: a 503 or 429 answer.

Output: `limit` = slots + queue, never above `cap` (nor under `min_limit`): `slots` is the
estimate of how many requests the server runs at once; the queue is what `derive_concurrency`
adds to `max_running_requests` (a quarter, at least 2) plus about `headroom_s` of completions at
the current rate (at most as many again), so a freed slot is refilled from the server's own queue.

Rules (each evaluated at a probe):
- **Waiting inside the server** (more than `max(1, 2 % of running)` waiting, the engines' step
  jitter): the server runs R at once, so slots = R: at once when R is above the estimate; when R
  is below it, after `shrink_probes` probes in a row that all show it, R not rising (a burst still
  being prefilled is not a smaller capacity). The limit never goes below what the server runs.
- **Room** (nothing waiting, more than `slots` running, our outstanding requests at the limit,
  KV cache below `kv_full`): grow slots to max(R, slots x factor): x2 until the server was first seen
  saturated (or its capacity was declared), probing every `ramp_probe_every_s` (0.25 s) then,
  x1.25 after; at most one step per probe interval.
- **Latency per token** (every engine): a growth step is judged once both it and the level it
  grew from have `latency_min_samples` completions (of at least `min_latency_tokens` tokens and
  half the median length, so short answers' prefill share does not skew it). When less than
  `latency_efficiency` of the added concurrency turned into throughput (per-token latency rose
  nearly as much as the concurrency), the step is undone and the limit held at the earlier
  level's for `hold_s`; growth after that goes one judged step at a time.
  A generic server (no load endpoint) grows only on this evidence, one judged step at a time,
  and backs off by `reject_cut` when its per-token latency rises by half at a constant limit.
- **503 / 429**: the limit is cut to what the server holds at that probe (running + waiting: its
  queue is full), and by `reject_cut` at least, never below what it runs (so only the queue
  shrinks); at most once per `reject_every_s`; no growth at that probe. The cut is held for
  `reject_hold_s`, then the ceiling rises by 1/16 per probe until it no longer binds. Requests
  already in flight above a cut wait for room before their retry (the gate in
  ServerWatch.begin), so a cut is not undone by retries.

Stability: with a load endpoint every decrease is to a figure the server was seen running (or to
a queue it accepted), so a back-off trims the queue, never the batch; without one, to a level
whose latency held, or by a quarter. Growth needs the server to show room at the current limit;
holds stop a refused or too-slow level from being retried for a while.
Cost: one GET of the load endpoint per `probe_every_s` (0.5 s) per server (per 0.25 s during the
first slow start, which takes a few probes), none for a generic one.

Thread safety: `on_completion` / `on_rejection` come from request threads, `on_probe` from the
pilot's thread, `limit` / `snapshot` from main and the claimer; everything is under one lock.
"""

from __future__ import annotations

import bisect
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_pipeline.serving.engines import LoadSample

#: Change-log entries kept (the first one and the most recent); a change is a rule acting.
HISTORY_MAX = 64


@dataclass(frozen=True)
class ConcurrencyPolicy:
    cap: int = 1024
    min_limit: int = 1
    probe_every_s: float = 0.5
    ramp_probe_every_s: float = 0.25  # until the server is first seen saturated (slow start)
    slow_start_factor: float = 2.0
    growth_factor: float = 1.25
    queue_share: float = 0.25
    queue_min: int = 2
    headroom_s: float = 0.25
    waiting_noise_share: float = 0.02
    shrink_probes: int = 2
    kv_full: float = 0.95
    latency_min_samples: int = 12
    min_latency_tokens: int = 32
    latency_efficiency: float = 0.25
    latency_rise: float = 0.5
    hold_s: float = 60.0
    reject_cut: float = 0.75
    reject_every_s: float = 1.0
    reject_hold_s: float = 30.0
    rate_window_s: float = 10.0


@dataclass
class _Level:
    """One growth step: from when, at which limit, the slots it grew from, its latency samples."""

    t: float
    limit: int
    slots: int
    base: _Level | None  # the level it grew from; None: not a growth step
    samples: list[tuple[int, float]]  # (completion tokens, latency s) of requests begun during it
    judged: bool = False
    saturated: bool = False  # the server showed waiting requests during it: latency has a queue in it


def queue_for(slots: int, rate_per_s: float, policy: ConcurrencyPolicy) -> int:
    """Requests queued at the server on top of `slots` (derive_concurrency's quarter, at least 2,
    plus `headroom_s` of completions at the current rate, at most as many again)."""
    base = slots + max(policy.queue_min, math.ceil(slots * policy.queue_share))
    return base - slots + min(base, math.ceil(rate_per_s * policy.headroom_s - 1e-9))


class ConcurrencyController:
    """The in-flight limit of one server (module docstring: the rules)."""

    def __init__(self, policy: ConcurrencyPolicy, start_slots: int, *, declared: bool, probing: bool,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self.start_slots = max(1, min(policy.cap, int(start_slots)))
        self.declared = declared
        self.probing = probing  # False: no load endpoint, latency is the only evidence
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        now = clock()
        self._t0 = now
        self._slots = self.start_slots
        self._seen_saturated = declared
        # What the server was last seen running while requests waited in it (or declared): a
        # refusal cuts the queue above it, never the batch.
        self._runs = self.start_slots if declared else 0
        self._ceiling: int | None = None
        self._ceiling_until = 0.0
        self._ceiling_kind = ""  # "refused" (503/429: relaxed step by step) or "latency" (lifted at once)
        self._careful = not probing  # after a latency break: one judged growth step at a time
        self._last_growth_t = -1e18
        self._last_cut_t = -1e18
        self._rejections: dict[int, int] = {}
        self._rejected_total: dict[int, int] = {}
        self._low: list[int] = []
        self._done: deque[float] = deque()
        self._tokens: deque[int] = deque(maxlen=200)
        self._levels: list[_Level] = [_Level(now, 0, self._slots, None, [])]
        self._levels[0].limit = self._compute(now)
        self.reason = "declared by the server" if declared else "assumed (the server does not tell)"
        self._history: list[list[Any]] = []
        self._note(now, self.reason)

    def begin(self) -> None:
        """Dispatch starts now: the completion rate is measured from here (not from construction)."""
        with self._lock:
            self._t0 = self._clock()

    # -- observations (any thread) --------------------------------------------------------------
    def on_completion(self, tokens: int | None, latency_s: float) -> None:
        now = self._clock()
        with self._lock:
            self._done.append(now)
            if tokens and latency_s > 0:
                self._tokens.append(int(tokens))
                begun = now - latency_s
                i = bisect.bisect_right([lv.t for lv in self._levels], begun) - 1
                if i >= 0:
                    samples = self._levels[i].samples
                    samples.append((int(tokens), float(latency_s)))
                    if len(samples) > 400:  # keep a level's first samples and its recent ones
                        keep = 2 * self.policy.latency_min_samples
                        del samples[keep:keep + 100]

    def on_rejection(self, status: int) -> None:
        with self._lock:
            self._rejections[status] = self._rejections.get(status, 0) + 1
            self._rejected_total[status] = self._rejected_total.get(status, 0) + 1

    def on_probe(self, sample: LoadSample | None, ours: int) -> None:
        """One evaluation: the rules of the module docstring, in order (rejections first)."""
        now = self._clock()
        with self._lock:
            self._relax_ceiling(now)
            self._judge_latency(now)
            refused = bool(self._rejections)
            if refused:
                self._on_rejections(now, self._compute(now), sample if self.probing else None)
            limit = self._compute(now)
            if self.probing:
                if sample is not None:
                    self._on_load(now, sample, ours, limit, may_grow=not refused)
            else:
                self._on_latency_only(now, ours, limit, may_grow=not refused)

    # -- reading (any thread) -------------------------------------------------------------------
    @property
    def limit(self) -> int:
        with self._lock:
            return self._compute(self._clock())

    @property
    def slots(self) -> int:
        return self._slots

    def snapshot(self) -> dict[str, Any]:
        """What the progress page and the manifest show."""
        with self._lock:
            return {
                "mode": "load" if self.probing else "latency",
                "start": self.start_slots,
                "slots": self._slots,
                # what the server was last seen running while requests waited in it (or declared):
                # the slots confirmed, 0 until then
                "runs": self._runs,
                "limit": self._compute(self._clock()),
                "ceiling": self._ceiling,
                "cap": self.policy.cap,
                "reason": self.reason,
                "rejections": dict(self._rejected_total),
                "changes": [list(h) for h in self._history],
            }

    # -- internals (under _lock) ----------------------------------------------------------------
    def _rate(self, now: float) -> float:
        """Completions per second over the last `rate_window_s` (or since the start, at least 1 s)."""
        window = self.policy.rate_window_s
        while self._done and now - self._done[0] > window:
            self._done.popleft()
        return len(self._done) / min(window, max(1.0, now - self._t0))

    def _uncapped(self, slots: int, now: float) -> int:
        return slots + queue_for(slots, self._rate(now), self.policy)

    def _compute(self, now: float) -> int:
        p = self.policy
        limit = self._uncapped(self._slots, now)
        if self._ceiling is not None:
            limit = min(limit, self._ceiling)
        return max(p.min_limit, min(p.cap, limit))

    def _note(self, now: float, reason: str) -> None:
        self.reason = reason
        entry = [round(self._wall(), 1), self._compute(now), self._slots, self._ceiling, reason]
        if self._history and self._history[-1][1:4] == entry[1:4]:
            return
        self._history.append(entry)
        if len(self._history) > HISTORY_MAX:
            del self._history[1]

    def _set_slots(self, now: float, slots: int, reason: str, growth: bool = False) -> None:
        slots = max(1, min(self.policy.cap, int(slots)))
        if slots == self._slots:
            return
        before = self._levels[-1]
        self._slots = slots
        if growth:
            self._last_growth_t = now
        self._levels.append(_Level(now, self._compute(now), slots, before if growth else None, []))
        del self._levels[:-8]  # the last few levels are all the latency rule compares
        self._note(now, reason)

    def _set_ceiling(self, now: float, ceiling: int, hold_s: float, reason: str, kind: str) -> None:
        self._ceiling = max(self.policy.min_limit, int(ceiling))
        self._ceiling_until = now + hold_s
        self._ceiling_kind = kind
        self._note(now, reason)

    def _relax_ceiling(self, now: float) -> None:
        """After its hold: a latency ceiling is lifted (growth then goes one judged step at a time);
        a refusal ceiling rises by 1/16 per probe until it no longer binds (refusals cut it again)."""
        if self._ceiling is None or now < self._ceiling_until:
            return
        if self._ceiling_kind == "latency" or self._ceiling >= self._uncapped(self._slots, now):
            self._ceiling = None
            self._note(now, "hold over")
            return
        self._ceiling += max(1, self._ceiling // 16)

    def _on_rejections(self, now: float, limit: int, sample: LoadSample | None) -> None:
        """Cut the limit: to what the server holds now (running + waiting: its queue is full) when
        a probe says so, by `reject_cut` at least; never below what it runs."""
        counts, self._rejections = self._rejections, {}
        if now - self._last_cut_t < self.policy.reject_every_s:
            return
        self._last_cut_t = now
        cut = math.floor(limit * self.policy.reject_cut)
        floor = self.policy.min_limit
        if sample is not None:
            cut = min(cut, sample.held)
            floor = max(floor, min(self._runs, sample.running))
        cut = max(floor, cut)
        what = ", ".join(f"{n} x {code}" for code, n in sorted(counts.items()))
        self._set_ceiling(now, min(cut, limit), self.policy.reject_hold_s,
                          f"the server refused requests ({what}): limit cut to {min(cut, limit)}", "refused")

    @property
    def probe_every_s(self) -> float:
        """How soon the next probe is due: faster while slow start is still finding the slots."""
        ramping = self.probing and not self._seen_saturated
        return self.policy.ramp_probe_every_s if ramping else self.policy.probe_every_s

    def _growth_allowed(self, now: float, limit: int) -> bool:
        if now - self._last_growth_t < self.probe_every_s * 0.99:
            return False
        if self._careful and any(lv.base is not None and not lv.judged for lv in self._levels):
            return False  # latency mattered here before: the last step is judged first
        return self._ceiling is None or limit < self._ceiling

    def _binding(self, ours: int, limit: int) -> bool:
        """Our outstanding requests are at the limit: the server was given all we may give it."""
        return ours >= limit - max(1, limit // 8)

    def _factor(self) -> float:
        return self.policy.growth_factor if self._seen_saturated else self.policy.slow_start_factor

    def _on_load(self, now: float, sample: LoadSample, ours: int, limit: int, may_grow: bool) -> None:
        p = self.policy
        running, waiting = sample.running, sample.waiting
        noise = max(1, math.ceil(p.waiting_noise_share * running))
        if waiting > noise and running > 0:  # requests wait inside the server: it runs `running`
            self._seen_saturated = True
            self._levels[-1].saturated = True
            if running >= self._slots:
                self._low = []
                self._runs = running
                self._set_slots(now, running, f"{running} running with {waiting} waiting: the server runs {running}")
                return
            # Fewer run than we thought: believe it once it holds for shrink_probes probes with
            # `running` not rising (a burst still being admitted or prefilled rises).
            self._low = [running] if self._low and running > self._low[-1] else self._low + [running]
            if len(self._low) >= p.shrink_probes:
                self._low = []
                self._runs = running
                self._set_slots(now, running, f"{waiting} requests wait inside the server while {running} run: "
                                              f"slots {running}")
            return
        self._low = []
        kv_full = sample.kv_usage is not None and sample.kv_usage >= p.kv_full
        # Room: the server runs more than we thought it could, nothing waits, and we gave it all we
        # may (running == slots with our queue in transit is a full server, not room).
        if may_grow and running > self._slots and self._binding(ours, limit) and not kv_full \
                and self._growth_allowed(now, limit):
            grown = max(running, math.ceil(self._slots * self._factor()))
            self._set_slots(now, grown, f"{running} running, none waiting, {ours} of ours out: room, slots {grown}",
                            growth=True)

    def _on_latency_only(self, now: float, ours: int, limit: int, may_grow: bool) -> None:
        """A server without a load endpoint: grow one judged step at a time; back off when the
        per-token latency rises at a constant limit (requests now wait inside the server)."""
        current = self._levels[-1]
        risen = self._latency_rise(current)
        if risen is not None and risen > 1 + self.policy.latency_rise:
            shrunk = max(1, math.floor(self._slots * self.policy.reject_cut))
            self._set_slots(now, shrunk, f"latency per token rose x{risen:.2f} at a constant limit: slots {shrunk}")
            self._set_ceiling(now, self._compute(now), self.policy.hold_s, "hold after a latency rise", "latency")
            return
        if self._median(current) is None:
            return  # this level has no latency figure yet
        if may_grow and self._binding(ours, limit) and self._growth_allowed(now, limit):
            grown = math.ceil(self._slots * self._factor())
            self._set_slots(now, grown, f"latency per token holds at limit {limit}: slots {grown}", growth=True)

    def _qualifying(self, level: _Level) -> list[float]:
        p = self.policy
        if not self._tokens:
            return []
        floor = max(p.min_latency_tokens, 0.5 * statistics.median(self._tokens))
        return [lat / tok for tok, lat in level.samples if tok >= floor]

    def _median(self, level: _Level) -> float | None:
        per_token = self._qualifying(level)
        return statistics.median(per_token) if len(per_token) >= self.policy.latency_min_samples else None

    def _latency_rise(self, level: _Level) -> float | None:
        """Per-token latency of a level's latest samples over its first ones (None: too few)."""
        per_token = self._qualifying(level)
        k = self.policy.latency_min_samples
        if len(per_token) < 2 * k:
            return None
        return statistics.median(per_token[-k:]) / statistics.median(per_token[:k])

    def _judge_latency(self, now: float) -> None:
        """Judge each growth step once both it and the level it grew from have enough samples."""
        for level in list(self._levels):
            base = level.base
            if level.judged or base is None:
                continue
            new, old = self._median(level), self._median(base)
            if new is None or old is None:
                continue
            level.judged = True
            if level.saturated or base.saturated:
                continue  # a queue inside the server is in these latencies: the load rule decides
            grew = level.limit / max(1, base.limit)
            throughput = grew / (new / old)
            if grew > 1 and throughput - 1 < self.policy.latency_efficiency * (grew - 1):
                self._careful = self._seen_saturated = True
                for later in self._levels:
                    later.judged = True  # steps taken on top of this one are void
                self._set_slots(now, base.slots, f"limit {level.limit} made each token x{new / old:.2f} slower "
                                                 f"(throughput x{throughput:.2f}): back to slots {base.slots}")
                self._set_ceiling(now, base.limit, self.policy.hold_s,
                                  f"holding at limit {base.limit} for {self.policy.hold_s:.0f}s", "latency")
                return
