"""Faults at the chunk protocol's state transitions, for the chaos harness (dev/chaos.py).

S3 and HTTP faults (dev/s3faults.py, dev/sim) land where the worker talks to something; the
protocol's own windows lie between its state transitions (chunks.TRANSITIONS): a lease lost
right after the claimer opened a chunk and before main saw it, a stop arriving while the committer
holds a chunk, a checkpoint still being written when the stop saves the chunk's fuller partial.
`TransitionFaults` is a `chunks.TransitionHook` (called in the moving thread right after every
lease transition, outside the locks) that, drawn from the schedule's seed:

- `delay`: sleeps after a transition, in whichever thread made it (up to `delay_max_s`; main's
  sleeps at most half the stop grace, see below);
- `lose`: loses the lease as a peer would make us lose it, at CLAIMED->OPEN (before main sees the
  chunk), OPEN->QUEUED, QUEUED->COMMITTING and COMMITTING->COMMITTED (committed, claim not yet
  released); the REPAIRING windows are listed too but a chaos run never repairs. A "peer" overwrites
  the claim with its own body and nonce; half the time it then deletes it again (a peer that took
  over and was stopped: our renewal meets a 404 instead of a 412). The lease is then made due and
  renewed at once: in the claimer's and committer's windows that thread waits for the renewal, so
  a working lease moves to TAKEN_OVER there and then (`lose_landed`), unless the renewal meets an
  S3 fault or one was already in flight (`lose_deferred`: it lands at a later tick, the chunk open);
  a QUEUED/COMMITTING lease stays (committed anyway, chunks.py invariant 3); main does not wait
  (its window's state is not changed by a loss, and a wait on S3 would eat its stop grace). The
  peer's writes go straight to the S3 server, not through the fault front, so the loss itself is
  never lost. A peer claim left on a committed chunk is the claim of a peer that died holding it;
  the runner deletes those at the end as that peer's retry would (dev/chaos.py counts them apart
  from the workers' own claims);
- `stop`: a try (the first two of each task) requests its own stop at the k-th occurrence of one
  transition, exactly in that window (the call the SIGTERM handler makes), and sometimes stays in
  the window a moment; logged with the wall-clock time so the runner measures the stop. A schedule
  without a SIGTERM event from 2 s on gets `stop_first`: each task's first try stops at its first CLAIMED->OPEN
  or OPEN->QUEUED, so every schedule measures a stop;
- `stop_delay_s`: main sleeps at its first move to RELEASED once the stop began (the hand-back of
  everything it holds is late);
- `slow_checkpoint_s`: every checkpoint's PUT is held (inside the checkpoint's per-chunk lock) up to
  this long and `checkpoint_every_s` is small, so checkpoints are in flight when a stop comes and
  the stop's final save of the same chunk has to wait for one (handback.PartialWriter).

Main's sleeps after a stop request are capped in total at `MAIN_STOP_SHARE` of `stop_grace_s`: a
main thread stalled for longer than the grace cannot stop within it whatever the protocol does, so
a stop over its bound is the protocol's doing (a deadline that is not absolute, an unbounded wait),
not the injection's. Other threads' sleeps are not capped: the stop must not wait for them.

Each injection is logged as one `chaos-fault kind=... ` line (the runner counts them from the logs,
a SIGKILLed try's included) and counted in `counts`.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dflash_pipeline.dataset.store import Store
from dflash_pipeline.steps.generate.chunks import FINAL, Lease, State

if TYPE_CHECKING:
    from dflash_pipeline.steps.generate.worker import Worker

logger = logging.getLogger(__name__)

S = State
#: Where a lease may be lost: right after these moves, in the thread that made them.
LOSE_WINDOWS: tuple[tuple[State, State], ...] = (
    (S.CLAIMED, S.OPEN), (S.CLAIMED, S.REPAIRING), (S.OPEN, S.QUEUED), (S.REPAIRING, S.QUEUED),
    (S.QUEUED, S.COMMITTING), (S.COMMITTING, S.COMMITTED),
)
#: Where a try may request its own stop (REPAIRING ones are left out: a chaos run never repairs).
STOP_WINDOWS: tuple[tuple[State, State], ...] = (
    (S.CLAIMED, S.OPEN), (S.OPEN, S.QUEUED), (S.QUEUED, S.COMMITTING), (S.COMMITTING, S.COMMITTED),
    (S.CLAIMED, S.RELEASED),
)
#: Main's sleeps once a stop was requested, in total, as a share of stop_grace_s (module docstring).
MAIN_STOP_SHARE = 0.5
#: The owner written into the injected peer's claims (the runner recognises them by it).
PEER_OWNER = "chaos-peer"
#: Log markers the runner parses (dev/chaos.py).
FAULT_MARK = "chaos-fault"
STOP_MARK = "chaos-stop"


@dataclass(frozen=True)
class TransitionRates:
    """A schedule's transition faults (module docstring); all zero: none."""

    delay: float = 0.0
    delay_max_s: float = 0.0
    lose: float = 0.0
    stop: float = 0.0
    stop_delay_s: float = 0.0
    slow_checkpoint_s: float = 0.0
    checkpoint_every_s: float = 60.0
    #: The stop is certain and early: each task's first try stops at its first CLAIMED->OPEN or
    #: OPEN->QUEUED (a schedule without a SIGTERM event from 2 s on still measures a stop).
    stop_first: bool = False

    @property
    def any(self) -> bool:
        return any((self.delay, self.lose, self.stop, self.stop_delay_s, self.slow_checkpoint_s))

    def with_certain_stop(self) -> TransitionRates:
        """These faults, plus an early stop in each task's first try (module docstring)."""
        return TransitionRates(**{**asdict(self), "stop": 1.0, "stop_first": True})

    @classmethod
    def draw(cls, rng: random.Random, *, always: bool = False) -> TransitionRates:
        """Most schedules get some (`always`: every one); each kind is on in about half of them."""
        if not always and rng.random() < 0.15:
            return cls()
        kinds = [rng.random() < 0.6 for _ in range(5)]
        if not any(kinds):
            kinds[rng.randrange(5)] = True
        delay, lose, stop, stop_delay, slow_ck = kinds
        return cls(
            delay=rng.uniform(0.03, 0.2) if delay else 0.0,
            delay_max_s=rng.uniform(0.5, 4.0) if delay else 0.0,
            lose=rng.uniform(0.02, 0.12) if lose else 0.0,
            stop=rng.uniform(0.3, 0.8) if stop else 0.0,
            stop_delay_s=rng.uniform(0.3, 1.5) if stop_delay else 0.0,
            slow_checkpoint_s=rng.uniform(0.5, 3.0) if slow_ck else 0.0,
            checkpoint_every_s=rng.uniform(0.2, 1.0) if slow_ck else 60.0,
        )

    def describe(self) -> str:
        if not self.any:
            return "no transition faults"
        parts = []
        if self.delay:
            parts.append(f"delay {self.delay:.0%}<{self.delay_max_s:.1f}s")
        if self.lose:
            parts.append(f"lose {self.lose:.0%}")
        if self.stop:
            parts.append("stop first" if self.stop_first else f"stop {self.stop:.0%}")
        if self.stop_delay_s:
            parts.append(f"stop-delay {self.stop_delay_s:.1f}s")
        if self.slow_checkpoint_s:
            parts.append(f"ckpt {self.checkpoint_every_s:.1f}s/{self.slow_checkpoint_s:.1f}s")
        return "T " + " ".join(parts)

    def to_dict(self) -> dict[str, float | bool]:
        return asdict(self)


class _SlowCheckpoints(Store):
    """The PartialWriter's store, with every checkpoint PUT held first (the checkpoint's thread holds
    the chunk's partial lock meanwhile, as a slow PUT would). Recognised by the thread's name
    (handback.PartialWriter.checkpoint names it `checkpoint-N`); the stop's final save is not slowed."""

    def __init__(self, inner: Store, faults: TransitionFaults) -> None:
        super().__init__(inner.client, inner.bucket)
        self._faults = faults

    def put(self, key: str, data: bytes, **kwargs: Any) -> str:
        if threading.current_thread().name.startswith("checkpoint-"):
            with self._faults.checkpoint_in_flight():
                self._faults.hold_checkpoint(key)
                return super().put(key, data, **kwargs)
        return super().put(key, data, **kwargs)


class TransitionFaults:
    """A `chunks.TransitionHook` injecting the faults of `rates` (module docstring). Build it, pass
    it as the Worker's `transition_hook`, then `attach(worker)`; transitions before that are left
    alone."""

    def __init__(self, rates: TransitionRates, *, seed: str, peer_store: Store, stop_grace_s: float,
                 try_number: int = 1) -> None:
        self.rates = rates
        self.peer_store = peer_store
        self.stop_grace_s = stop_grace_s
        self.try_number = try_number
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._stop_t: float | None = None  # monotonic, when the stop was requested
        self._stop_delay_done = False
        self._stop_at: tuple[tuple[State, State], int] | None = None
        self._seen: Counter[tuple[State, State]] = Counter()
        self._checkpoints_in_flight = 0

    # -- set-up ------------------------------------------------------------------------------------
    def attach(self, worker: Worker) -> None:
        self._worker = worker
        if self.stopping:  # a SIGTERM came before the worker existed
            worker.request_stop()
        if self.rates.slow_checkpoint_s > 0:
            worker.partials.store = _SlowCheckpoints(worker.partials.store, self)
        tries = 1 if self.rates.stop_first else 2
        if self.rates.stop > 0 and self.try_number <= tries and self._draw() < self.rates.stop:
            with self._lock:
                if self.rates.stop_first:
                    self._stop_at = (self._rng.choice(STOP_WINDOWS[:2]), 1)
                else:
                    self._stop_at = (self._rng.choice(STOP_WINDOWS), self._rng.randint(1, 3))
            (frm, to), k = self._stop_at
            logger.info("%s plan: stop at occurrence %d of %s->%s", FAULT_MARK, k, frm.value, to.value)

    # -- the stop -----------------------------------------------------------------------------------
    def request_stop(self, by: str) -> None:
        """Stop the worker (`by`: "signal" from the SIGTERM handler, "transition" from a fault), with
        a marker line the runner reads: the wall-clock time, whether a checkpoint was in flight."""
        worker = self._worker
        if self._stop_t is None:
            self._stop_t = time.monotonic()
            with self._lock:
                in_flight = self._checkpoints_in_flight
            if in_flight:
                self._count("stop_in_checkpoint", f"{in_flight} checkpoint(s) in flight")
            logger.warning("%s by=%s t=%.3f checkpoints_in_flight=%d", STOP_MARK, by, time.time(), in_flight)
        if worker is not None:
            worker.request_stop()

    @property
    def stopping(self) -> bool:
        return self._stop_t is not None

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint_in_flight(self) -> _InFlight:
        return _InFlight(self)

    def hold_checkpoint(self, key: str) -> None:
        s = self._draw_uniform(0.1, self.rates.slow_checkpoint_s)
        self._count("checkpoint_slowed", f"{key} held {s:.2f}s")
        time.sleep(s)

    # -- the hook ---------------------------------------------------------------------------------
    def __call__(self, lease: Lease, frm: State, to: State, role: str) -> None:
        worker = self._worker
        if worker is None:
            return
        r = self.rates
        where = f"chunk={lease.chunk} {frm.value}->{to.value} role={role}"
        if self._stop_at is not None and (frm, to) == self._stop_at[0]:
            with self._lock:
                self._seen[(frm, to)] += 1
                hit = self._seen[(frm, to)] == self._stop_at[1] and not self.stopping
            if hit:
                self._count("stop", where)
                self.request_stop("transition")
                if self._draw() < 0.5:  # stay in the window a moment while the stop goes on
                    self._sleep(role, self._draw_uniform(0.05, 1.0), "stop_hold", where)
        if (frm, to) in LOSE_WINDOWS and r.lose > 0 and self._draw() < r.lose:
            self._lose(worker, lease, to, role, where)
        if r.stop_delay_s > 0 and role == "main" and to is S.RELEASED and self.stopping \
                and not self._stop_delay_done:
            self._stop_delay_done = True
            self._sleep(role, self._draw_uniform(0.1, r.stop_delay_s), "stop_delay", where)
        if r.delay > 0 and self._draw() < r.delay:
            self._sleep(role, self._draw_uniform(0.02, r.delay_max_s), "delay", where)

    # -- the faults -------------------------------------------------------------------------------
    def _lose(self, worker: Worker, lease: Lease, to: State, role: str, where: str) -> None:
        """A peer takes the claim over (and, half the time, releases it again): our next renewal is
        refused. The renewal is made due and run now (module docstring: where the loss lands)."""
        key = worker.chunks.claim_key(lease.chunk)
        nonce = uuid.uuid4().hex
        body = json.dumps({"owner": PEER_OWNER, "worker": PEER_OWNER, "nonce": nonce, "renewal": 0}).encode()
        released = self._draw() < 0.5
        try:
            etag = self.peer_store.put(key, body, content_type="application/json", metadata={"nonce": nonce})
            if released:
                self.peer_store.delete(key, if_match=etag)
        except Exception as exc:  # noqa: BLE001 - a fault not injected is counted, never fatal
            self._count("lose_failed", f"{where} ({exc!r})")
            return
        self._count("lose_released" if released else "lose_held", where)
        if to in FINAL:
            return  # committed and no longer renewed: the release meets the peer's claim (or none)
        with lease.lock:
            lease.last_renewed_t = 0.0
        # The claimer's and committer's windows wait for the refused renewal, so the loss lands in the
        # window. Main never waits on S3 here: its moves (OPEN->QUEUED) are to states a loss does not
        # change (committed anyway, chunks.py invariant 3), and a wait would eat the stop's grace.
        worker.keeper.renew_due(wait=role != "main")
        if to in (S.OPEN, S.REPAIRING):
            # Seen from the lease: taken over now, or (an S3 fault on the renewal, or a renewal already
            # in flight) at a later tick, while the chunk is open.
            self._count("lose_landed" if lease.gone else "lose_deferred", where)

    def _sleep(self, role: str, seconds: float, kind: str, where: str) -> None:
        """Sleep `seconds`; main's sleeps once stopping end at its budget (module docstring)."""
        self._count(kind, f"{where} {seconds:.2f}s")
        end = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            left = end - now
            if role == "main" and self._stop_t is not None:
                budget_end = self._stop_t + MAIN_STOP_SHARE * self.stop_grace_s
                left = min(left, budget_end - now)
            if left <= 0:
                return
            time.sleep(min(0.05, left))

    # -- helpers ----------------------------------------------------------------------------------
    def _draw(self) -> float:
        with self._lock:
            return self._rng.random()

    def _draw_uniform(self, lo: float, hi: float) -> float:
        with self._lock:
            return self._rng.uniform(lo, max(lo, hi))

    def _count(self, kind: str, detail: str) -> None:
        with self._lock:
            self.counts[kind] += 1
        logger.info("%s kind=%s %s", FAULT_MARK, kind, detail)


class _InFlight:
    def __init__(self, faults: TransitionFaults) -> None:
        self._faults = faults

    def __enter__(self) -> None:
        with self._faults._lock:
            self._faults._checkpoints_in_flight += 1

    def __exit__(self, *exc: object) -> None:
        with self._faults._lock:
            self._faults._checkpoints_in_flight -= 1
