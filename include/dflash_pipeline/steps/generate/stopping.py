"""How a generate worker ends: the stop request, and the two endings of `Worker.run()`.

Owners:
- `StopRequest` owns the stop: whether it was asked (an Event every thread may read or wait on),
  when, and so its absolute deadline (`stop_grace_s` after the request). Only `request()` changes
  it; it is called from the stop-signal watcher thread (stopsignal.py), never inside a handler.
  It is the one clock of every blocking call on main (docs/liveness.md): work that only serves a
  running worker (scans, sweeps: main's S3 calls go through
  `Worker.main_store`, a `StopBoundStore`) is abandoned at `abandon_at()`, the request itself; the
  stop's own work (commits, saves, releases, the joins below) runs to `deadline()`.
- `Closer` runs in main, after main's loop has left: it owns the order of the end. It changes the
  protocol only through the owners' own interfaces (the claimer's and committer's stop/join, the
  Ledger's take methods, `Leases.move` with `give_up_owner` = "main", `hand_back`).

Two endings:
- `end_normally`: the dataset is complete. The claimer may be releasing a chunk it claimed from a
  stale listing just as the dataset completed: let it finish (its S3 calls are bounded), then
  release anything still held, in parallel; raise any thread's error (none is lost at the end). A
  stop requested meanwhile bounds all of it by the stop's deadline: joins end, releases get only the
  time left (a claim not released in time expires, and a later scan sweeps it; the dataset is
  complete either way).
- `give_up` (a stop, or an exception): one absolute deadline (`stop_grace_s` after a stop request,
  else at least 30 s; a stop during a long give-up shortens it to the stop grace). The claimer stops
  first (a claim it completes after this it releases itself); complete open chunks are queued; the
  committer commits queued chunks until half the time left, then takes no more; then main owns
  every lease left and hands back, all at once, the chunks not committed (complete ones first, then
  open ones' finished rows), parked claims, and claims whose answer was lost (found by their
  nonce: `ChunkStore.pending`). A commit still in flight when main releases its lease
  may still land: chunks.py invariant 1 keeps the part exact, and a partial left beside a part is
  swept at the end of a later run. Errors other threads met on the way are logged, never dropped
  (run() raises what made it give up): S3 not answering within the stop's time as a warning (an
  outage), anything else as an error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dflash_pipeline.dataset.store import StoreUnavailable
from dflash_pipeline.steps.generate.chunks import ChunkStore, Lease, LeaseKeeper, Leases, State
from dflash_pipeline.steps.generate.claiming import Claimer
from dflash_pipeline.steps.generate.committing import Committer
from dflash_pipeline.steps.generate.handback import PartialWriter, hand_back
from dflash_pipeline.steps.generate.ledger import Ledger
from dflash_pipeline.steps.generate.settings import WorkerSettings
from dflash_pipeline.steps.generate.state import OpenChunk

logger = logging.getLogger(__name__)

Job = tuple[Lease, list[dict[str, Any]]]


class StopRequest:
    """Whether, and when, the worker was asked to stop (module docstring)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.event = threading.Event()
        self.t: float | None = None  # monotonic, the first request

    def request(self) -> None:
        if self.t is None:
            self.t = time.monotonic()
        self.event.set()

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def deadline(self) -> float:
        """The absolute end of the stop (monotonic); no stop asked: never."""
        return float("inf") if self.t is None else self.t + self.grace_s

    def abandon_at(self) -> float:
        """When work that only serves a running worker (scans, sweeps, load
        probes) is abandoned: at the request itself (monotonic; no stop asked: never). The stop's time
        up to `deadline()` is for the stop's own work: commits, saving rows, releasing claims."""
        return float("inf") if self.t is None else self.t

    def left(self) -> float:
        """Seconds to the stop's deadline (inf: no stop asked)."""
        return max(0.0, self.deadline() - time.monotonic())

    def wait(self, timeout_s: float) -> bool:
        return self.event.wait(timeout_s)


class Closer:
    """The end of a run, in main (module docstring)."""

    def __init__(self, *, settings: WorkerSettings, stop: StopRequest, claimer: Claimer, committer: Committer,
                 ledger: Ledger, leases: Leases, keeper: LeaseKeeper, chunks: ChunkStore, partials: PartialWriter,
                 finish_chunk: Callable[[OpenChunk], None], take_open: Callable[[bool], list[Job]],
                 count: Callable[[str, int], None]) -> None:
        self.settings = settings
        self.stop = stop
        self.claimer = claimer
        self.committer = committer
        self.ledger = ledger
        self.leases = leases
        self.keeper = keeper
        self.chunks = chunks
        self.partials = partials
        self._finish_chunk = finish_chunk
        self._take_open = take_open
        self._count = count

    def thread_error(self) -> BaseException | None:
        return self.committer.error or self.claimer.error or self.keeper.error

    def hand_off(self, why: str, jobs: list[Job], deadline: Callable[[], float], unanswered: list[int] | None = None
                 ) -> None:
        """Save each job's rows as its chunk's partial and release its claim, all at once, by `deadline`
        (re-read: a stop arriving shortens it); `unanswered` (the end of a run only: the claimer
        has stopped): claims whose answer was lost, released if they are ours (`_unanswered`)."""
        saved = hand_back(jobs, partials=self.partials, chunks=self.chunks, deadline=deadline,
                          unanswered=unanswered or [])
        if jobs:
            self._count("handoffs", len(jobs))
            logger.warning("%s: released %d unfinished chunk(s) to the other servers (%d finished rows saved)",
                           why, len(jobs), saved)

    def _unanswered(self) -> list[int]:
        """Chunks whose claim of ours may exist although no answer said so (ChunkStore.pending: lost
        while its re-send was retried, or given up on at the stop) and that no lease of ours knows:
        the end of a run looks each up by its nonce and releases it, or peers wait out its lease."""
        return [c for c in self.chunks.pending() if not self.leases.held(c)]

    def end_normally(self) -> None:
        s = self.settings

        def left(cap_s: float, started: float) -> float:
            return max(0.0, min(started + cap_s, self.stop.deadline()) - time.monotonic())

        def join(thread: Claimer | Committer, cap_s: float) -> None:
            started = time.monotonic()
            while thread.alive and left(cap_s, started) > 0:
                thread.join(timeout_s=min(0.1, left(cap_s, started)))

        join(self.claimer, min(120.0, s.store_deadline_s))
        self.committer.stop()
        join(self.committer, 60.0)
        self.leases.give_up_owner = "main"
        jobs: list[Job] = [(lease, []) for lease in [*self.claimer.release_parked(), *self.leases.live()]
                           if lease.state is not State.COMMITTING and self.leases.move(lease, State.RELEASED, "main")]
        unanswered = self._unanswered()
        if jobs or unanswered:
            started = time.monotonic()
            hand_back(jobs, partials=self.partials, chunks=self.chunks,
                      deadline=lambda: min(started + 30.0, self.stop.deadline()), unanswered=unanswered)
        self.keeper.stop(timeout_s=left(5.0, time.monotonic()))
        err = self.thread_error()
        if err is not None:
            raise err

    def log_stop(self) -> None:
        """The last line of a stopped run, written by run() once everything of the stop is over
        (threads joined or given up on by the deadline): how long the stop really took."""
        if self.stop.requested and self.stop.t is not None:
            logger.info("stop of worker %s took %.2fs (grace %.1fs)", self.settings.worker,
                        time.monotonic() - self.stop.t, self.settings.stop_grace_s)

    def give_up(self, keep_errors: bool = True, finish_complete: bool = True) -> None:
        """`keep_errors` False (the server is broken, or the breaker is still judging it): its
        permanent error rows are not saved; `finish_complete` False (the breaker is judging): complete
        chunks are not committed but handed back like open ones, since their error rows may be the
        server's fault, not the prompts'."""
        s = self.settings
        started = time.monotonic()
        grace = s.stop_grace_s if self.stop.requested else max(s.stop_grace_s, 30.0)

        def deadline() -> float:
            return min(started + grace, self.stop.deadline())

        self.claimer.stop()
        self.claimer.join(timeout_s=min(0.5, grace / 6, deadline() - time.monotonic()))
        for chunk in self.ledger.open_chunks() if finish_complete else []:
            if chunk.complete and not chunk.dropped and chunk.lease is not None \
                    and chunk.lease.state in (State.OPEN, State.REPAIRING):
                self._finish_chunk(chunk)
        until = started + (deadline() - started) * 0.5
        self.committer.stop(until=until)
        self.committer.join(timeout_s=until - time.monotonic())
        self.leases.give_up_owner = "main"
        jobs: list[Job] = []
        for chunk in self.ledger.take_queued():  # complete, not committed: all rows become a partial
            lease = chunk.lease
            if lease is not None and lease.state in (State.QUEUED, State.COMMITTING) \
                    and self.leases.move(lease, State.RELEASED, "main"):
                jobs.append((lease, list(chunk.results.values()) if chunk.base_rows is None else []))
        jobs.extend(self._take_open(keep_errors))
        for lease in [*self.claimer.release_parked(), *self.leases.live()]:  # parked, or claimed late
            if self.leases.move(lease, State.RELEASED, "main"):
                jobs.append((lease, []))
        self.hand_off("stopping", jobs, deadline, unanswered=self._unanswered())
        self.keeper.stop(timeout_s=max(0.0, deadline() - time.monotonic()))
        for name, err in (("committer", self.committer.error), ("claimer", self.claimer.error),
                          ("lease keeper", self.keeper.error)):
            if isinstance(err, StoreUnavailable):
                # S3 did not answer within the stop's time: expected in an outage; what it held was
                # handed back above (a failed commit's rows with the queued chunks).
                logger.warning("worker %s: the %s could not reach S3 while stopping: %s", s.worker, name, err)
            elif err is not None:
                logger.error("worker %s: the %s thread failed: %r", s.worker, name, err, exc_info=err)
