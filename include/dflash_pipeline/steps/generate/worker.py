"""The generate step's main thread: one worker drives one server and shares the dataset's chunks
with the others.

Dispatch. Request threads (pool.py) each hold one request; the moment one returns, main hands it the
next prompt, so the server's slots never wait for a batch to gather. Chunks are claimed ahead of
need by the claimer thread, so there is no barrier between chunks either, and a finished chunk is
committed by the committer thread while generation goes on.

Sharing and exactly once: the chunk protocol (chunks.py: each chunk's states, which thread owns
each move, what 412/409/404/503/lost answers mean). A part is written only with a conditional
create (or If-Match when repairing), so no id can appear twice; leases only avoid waste.

Threads and what they own (each shared thing has one owner object with a narrow interface):
- main (this module): `pending`, `in_flight`, an open chunk's `results` / `requeues` /
  `checkpointed`, the moves OPEN/REPAIRING -> QUEUED/RELEASED, checkpoints, hand-offs; the end of
  a run through `Closer` (stopping.py: the normal end and the bounded give-up).
- StopRequest (stopping.py): whether and when a stop was asked, its absolute deadline.
- Ledger (ledger.py): where each chunk is (offered, open, queued, failed); every thread changes
  it only through its methods.
- claimer (claiming.py, `Claimer`): claims, CLAIMED and the moves out of it, parked claims; it
  reads main's demand through one callable (`_demand`).
- committer (committing.py, `Committer`): QUEUED -> COMMITTING -> COMMITTED, markers.
- Scanner (scan.py): the view of what S3 says is done.
- renewer (chunks.LeaseKeeper): renewals; a refused one ends the lease (TAKEN_OVER), and the chunk
  reads itself as dropped from its lease (chunks.py invariant 8), so no flag has to be set in time.
- ServerHealth (failing.py): whether the server is failing, and its generation probe.
- Breaker (breaker.py): the permanent-error tally, its judge thread's verdict and its context
  check; main polls them and acts on them (verdicts.py, main only). A context refusal is held in
  its chunk's `unconfirmed` (main's) until a check started after it confirms it: such a chunk is
  not completed, and the refusal is in no partial (`_kept_rows`), so a server restarted with a
  smaller context commits none of its refusals.
- PartialWriter (handback.py): every partial write, serialized per chunk.
- request threads: one unit each (all its turns); they read their chunk's `dropped` and the stop.
- pilot (serving/pilot.py): the in-flight limit; main and the claimer only read it.

Failure handling (docs/liveness.md). A failed request is a row (outcomes.py). A failing server
(failing.py: transient failures, nothing succeeding, no sign of life) gets nothing new and a 1-token
probe; after `handoff_after_s` its open chunks go to the fleet (finished rows saved as partials; a
chunk with requests in flight only once they are back), after `server_lost_after_s` ServerLost. A
busy server (requests running, ours in flight) is not failing: what it refuses without generating
(503 queue full, 429: `outcomes.refused`) goes back in line uncounted and lowers the in-flight cap;
any other transient failure there (a 500 for one input, an abort, a reset, a second timeout) is the
prompt's counted put-back (at most MAX_REQUEUES, then an error row) and lowers nothing.
A server answering mostly permanent errors is paused and judged (breaker.py): ServerBroken only
when it refuses what its peers serve. What main does with either verdict is verdicts.py. `request_stop()` (SIGTERM) ends `run()` within
`stop_grace_s`, a hand-off in progress included: complete chunks are committed or saved first,
then every other held chunk's finished rows, and the claims released.

Memory and rework are bounded by `held_rows_cap` (rows claimed but not yet committed), never by
the size of the prompt set; a SIGKILL loses at most those rows' unsaved results.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import unit_key, warm_up
from dflash_pipeline.dataset.store import StopCut, Store, stop_bound
from dflash_pipeline.serving.concurrency import ConcurrencyPolicy
from dflash_pipeline.serving.deadline import DeadlinePolicy, server_watch
from dflash_pipeline.serving.engines import DEFAULT_CAPACITY
from dflash_pipeline.serving.pilot import concurrency_for
from dflash_pipeline.serving.sglang import new_chat_client
from dflash_pipeline.steps.generate.breaker import Breaker
from dflash_pipeline.steps.generate.chunks import (
    ChunkStore,
    Lease,
    LeaseKeeper,
    Leases,
    State,
    TransitionHook,
    claim_body,
)
from dflash_pipeline.steps.generate.claiming import Claimer
from dflash_pipeline.steps.generate.committing import Committer
from dflash_pipeline.steps.generate.failing import ServerHealth, ShedCap
from dflash_pipeline.steps.generate.handback import PartialWriter
from dflash_pipeline.steps.generate.ledger import Ledger
from dflash_pipeline.steps.generate.outcomes import error_row, refused
from dflash_pipeline.steps.generate.pool import DaemonPool, RequestPool
from dflash_pipeline.steps.generate.requesting import do_request
from dflash_pipeline.steps.generate.scan import Scanner
from dflash_pipeline.steps.generate.settings import WorkerSettings
from dflash_pipeline.steps.generate.snapshot import progress_snapshot
from dflash_pipeline.steps.generate.stopping import Closer, Job, StopRequest
from dflash_pipeline.steps.generate.state import (
    MAX_REQUEUES,
    OpenChunk,
    Outcome,
    ServerBroken,
    ServerConfigError,
    TaskStopped,
    WorkerStats,
)
from dflash_pipeline.steps.generate.verdicts import Verdicts

logger = logging.getLogger(__name__)

class Worker:
    """Drives one server until every chunk of the dataset is committed (by anyone)."""

    def __init__(
        self,
        store: Store,
        layout: DatasetLayout,
        manifest: dict[str, Any],
        settings: WorkerSettings,
        session_factory: Callable[[], Any] = new_chat_client,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        transition_hook: TransitionHook | None = None,
        on_part_committed: Callable[[int, bytes], None] | None = None,
    ) -> None:
        """`on_part_committed(chunk, part bytes)`: called by the committer after each part of ours is in S3
        (committing.py's hook: returns at once, never raises; the quality digests use it)."""
        s = settings
        self.store = store
        self.layout = layout
        self.settings = settings
        self.sizes: list[int] = list(manifest["chunks"]["sizes"])
        self.n_chunks = len(self.sizes)
        self.session_factory = session_factory
        self.on_progress = on_progress
        self.stats = WorkerStats()
        self._stat_lock = threading.Lock()
        self.leases = Leases(hook=transition_hook)
        self.chunks = ChunkStore(
            store, layout.claim_key,
            claim_body(s.owner, s.worker, s.server.name, s.run_id, s.try_number),
            store_deadline_s=s.store_deadline_s,
        )
        self.keeper = LeaseKeeper(self.leases, self.chunks, s.lease_s, on_lost=self._on_lost)
        self.ledger = Ledger()
        self._io = DaemonPool(3, "s3io")
        self.stop = StopRequest(s.stop_grace_s)
        # Main's S3 calls (scans, sweeps) are abandoned at a stop request:
        # they only serve a running worker, and the stop's time is for saving and releasing
        # (stopping.py). The stop path's own calls (commits, hand-backs) run to the stop's deadline.
        self.main_store = stop_bound(store, self.stop.event, self.stop.abandon_at)
        self.scanner = Scanner(self.main_store, layout, s, self.n_chunks, self.leases, self._io)
        self.partials = PartialWriter(store, layout)
        # Signs of life come from the server's shared load probe (the one the pilot samples).
        watch = server_watch(s.run_id, s.server, s.engine, DeadlinePolicy(s.request_timeout_s, s.min_decode_tok_s))
        self.health = ServerHealth(s, session_factory, probe_every_s=max(0.2, min(1.0, s.handoff_after_s / 4)),
                                   load=(lambda: watch.sample(max_age_s=0.25)[1]) if watch.probing else None)
        self.claimer = Claimer(store=store, layout=layout, settings=s, manifest=manifest, leases=self.leases,
                               chunks=self.chunks, ledger=self.ledger, scanner=self.scanner, io=self._io,
                               demand=self._demand, failing_since=self.health.failing_since, count=self._count)
        self.committer = Committer(store=store, layout=layout, settings=s, leases=self.leases, chunks=self.chunks,
                                   ledger=self.ledger, scanner=self.scanner, count=self._count,
                                   on_committed=on_part_committed)
        self.closer = Closer(settings=s, stop=self.stop, claimer=self.claimer, committer=self.committer,
                             ledger=self.ledger, leases=self.leases, keeper=self.keeper, chunks=self.chunks,
                             partials=self.partials, finish_chunk=self._finish_chunk, take_open=self._take_open,
                             count=self._count)
        # main's own
        self.pending: deque[tuple[OpenChunk, dict[str, Any]]] = deque()
        self.in_flight = 0
        self._tok_window: deque[tuple[float, int]] = deque()
        self._done_times: deque[float] = deque()
        self._full_chunk = max(self.sizes, default=0)
        self.shed = ShedCap()
        self.breaker = Breaker(s, session_factory, fleet_servers=manifest.get("servers"))
        # The in-flight limit: discovered from the server's live load, or the user's figure
        # (serving/pilot.py; its own thread probes, main and the claimer read `limit`).
        self.concurrency = concurrency_for(
            run_id=s.run_id, server=s.server, engine=s.engine,
            deadline=DeadlinePolicy(s.request_timeout_s, s.min_decode_tok_s),
            fixed=None if s.adaptive_headroom else s.concurrency, declared_slots=s.declared_slots,
            start_slots=DEFAULT_CAPACITY,
            policy=ConcurrencyPolicy(cap=max(1, s.concurrency_cap), headroom_s=s.headroom_s,
                                     probe_every_s=s.probe_every_s))
        self.verdicts = Verdicts(settings=s, stats=self.stats, breaker=self.breaker, health=self.health,
                                 ledger=self.ledger, claimer=self.claimer, closer=self.closer, stop=self.stop,
                                 finish_chunk=self._finish_chunk, take_open=self._take_open)
        warm_up()

    @property
    def held_rows_cap(self) -> int:
        s = self.settings
        return (s.held_rows_cap if s.held_rows_cap is not None
                else 2 * self._full_chunk + 4 * max(s.concurrency, self._limit()))

    def request_stop(self) -> None:
        """Ask the worker to stop (from the stop-signal watcher thread, stopsignal.py): it saves,
        commits and releases within `stop_grace_s`, then raises TaskStopped from run()."""
        self.stop.request()
        self.claimer.stop()

    def all_done(self) -> bool:
        """Every chunk committed and nothing left to repair, as S3 says now (stray claims swept)."""
        return self.scanner.all_done(should_stop=self.stop.event.is_set)

    _all_done = all_done  # the name tasks and tests used before the split

    def _count(self, name: str, n: int = 1) -> None:
        with self._stat_lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    # -- request thread ----------------------------------------------------------------------
    def _do_request(self, session: Any, item: tuple[OpenChunk, dict[str, Any]]) -> Outcome:
        """Never raises (requesting.py): whatever happens becomes this row's outcome."""
        return do_request(self.settings, self.stop.event, session, item)

    def _error_row(self, out: Outcome) -> dict[str, Any]:
        assert out.failure is not None
        s = self.settings
        return error_row(out.prompt, out.failure, model=s.model, server=s.server.name, attempts=out.attempts,
                         chunk=out.chunk.index, run_id=s.run_id)

    # -- renewer callback -----------------------------------------------------------------------
    def _on_lost(self, lease: Lease) -> None:
        """A refused renewal ended the lease (TAKEN_OVER): the chunk reads itself as dropped from its
        lease wherever it is (offered, open, pending), so there is nothing to find and flag here."""
        self._count("chunks_lost_to_others")

    # -- what the claimer reads ---------------------------------------------------------------------
    def _limit(self) -> int:
        """Requests to keep in flight: the user's concurrency_per_server, or the figure discovered
        from the server's live load plus a small queue (serving/concurrency.py)."""
        return self.concurrency.limit

    def _rate(self) -> float:
        """Completions per second over the last 10 s (0 until the first one). Any thread: it reads
        a copy; main prunes the window."""
        now = time.monotonic()
        recent = sum(1 for t in list(self._done_times) if now - t <= 10.0)
        span = min(10.0, max(1.0, now - self.stats.started_t))
        return recent / span

    def _demand(self, ahead_s: float) -> bool:
        """The claimer's question: claim more now? While the prompts ready to send cover less than
        the in-flight limit plus `ahead_s` of work, and the rows held stay under the cap; never
        while the server is failing or the worker stopping."""
        if self.health.failing or self.breaker.deciding or self.stop.requested:
            return False
        ready = len(self.pending) + self.ledger.offered_prompts()
        want = self._limit() + int(self._rate() * ahead_s)
        return ready < want and self.ledger.held_rows() < self.held_rows_cap

    # -- main loop ------------------------------------------------------------------------------
    def _fill(self, pool: RequestPool) -> None:
        for chunk in self.ledger.take_offered():
            if chunk.dropped:
                self.ledger.forget(chunk)
                continue
            todo = chunk.prompts_to_send()
            if not todo:
                self._finish_chunk(chunk)
                continue
            self.pending.extend((chunk, p) for p in todo)
        limit = self._limit()
        pool.ensure(limit)
        limit = self.shed.limit(limit)
        while self.in_flight < limit and self.pending and not self.breaker.deciding:
            chunk, prompt = self.pending.popleft()
            if chunk.dropped:
                self.ledger.forget(chunk)
                continue
            pool.submit((chunk, prompt))
            self.in_flight += 1
            chunk.in_flight += 1
            self.stats.requests_sent += 1
        if self._demand(self.claimer.lookahead_s()):
            self.claimer.wake.set()

    def _settled(self, chunk: OpenChunk) -> bool:
        """No context refusal of the chunk waits for the breaker's context check (breaker.py)."""
        if chunk.unconfirmed:
            chunk.unconfirmed = {k: t for k, t in chunk.unconfirmed.items() if not self.breaker.confirmed(t)}
        return not chunk.unconfirmed

    def _kept_rows(self, chunk: OpenChunk, keep_errors: bool) -> list[dict[str, Any]]:
        """The rows that are results for good, to save in a partial: completions, and permanent
        errors when `keep_errors` and confirmed as the prompts' (never a context refusal the
        breaker has not confirmed, nor a transient error row)."""
        self._settled(chunk)
        return [r for k, r in chunk.results.items()
                if not r.get("error_class")
                or (keep_errors and not r.get("retryable") and k not in chunk.unconfirmed)]

    def _finish_chunk(self, chunk: OpenChunk) -> None:
        """Every row is in: hand the chunk to the committer (unless a peer took it over first). A
        chunk holding an unconfirmed context refusal stays open: main finishes it once the
        breaker's context check confirms it (verdicts.py), or hands it back without the refusal."""
        assert chunk.lease is not None
        if not self._settled(chunk):
            return
        if not self.leases.move(chunk.lease, State.QUEUED, "main"):
            self.ledger.forget(chunk)
            self._count("rows_discarded", len(chunk.results))
            return
        self.partials.seal(chunk.index)
        self.ledger.to_commit(chunk)

    def _handle(self, out: Outcome) -> None:
        self.in_flight -= 1
        chunk = out.chunk
        chunk.in_flight -= 1
        if chunk.dropped:
            self._count("rows_discarded")
            self.ledger.forget(chunk)
            return
        if out.row is not None:
            self.health.succeeded(out.done_t)
            row = out.row
            self.stats.completions += 1
            tokens = int(row.get("completion_tokens") or 0)
            self.stats.output_tokens += tokens
            self._tok_window.append((self.health.last_success_t, tokens))
            now = time.monotonic()
            self._done_times.append(now)
            while self._done_times and now - self._done_times[0] > 10.0:
                self._done_times.popleft()
            self.breaker.record(None)
            self.shed.completed(self._limit())
        else:
            f = out.failure
            if f is None:  # stopped before any answer: not a result
                if not self.stop.requested:
                    self.pending.appendleft((chunk, out.prompt))
                return
            if f.kind == "config":
                raise ServerConfigError(f"server {self.settings.server.name} refused the request: {f.message}")
            pid = unit_key(out.prompt)
            servers_fault = f.transient and self.health.servers_fault(out.last_failure_t)
            busy = servers_fault and not self.health.failing and self.health.busy(self.in_flight)
            if busy and refused(f):
                # Busy, not failing (failing.py): refused (503 queue full, 429) without generating,
                # while running ours. Not the prompt's fault nor a reason to pause: back in line,
                # uncounted, fewer in flight.
                self.pending.appendleft((chunk, out.prompt))
                self.stats.requests_requeued += 1
                self.stats.busy_requeues += 1
                self.shed.shed(self.in_flight)
                return
            if servers_fault and (self.health.failing or chunk.requeues.get(pid, 0) < MAX_REQUEUES):
                # Nothing succeeded since this request last failed: perhaps the server, perhaps the
                # prompt. Put it back; it is not an error row yet. While the server is failing this
                # costs no requeue (nothing is sent until it generates again); otherwise the count
                # is bounded (a 500 for this input, an abort, a reset, a second timeout on a busy
                # server included), so one prompt that always fails ends as an error row. A busy
                # server (a sign of life) is not failing: nothing is paused, the cap is not lowered.
                if not self.health.failing:
                    chunk.requeues[pid] = chunk.requeues.get(pid, 0) + 1
                self.pending.appendleft((chunk, out.prompt))
                self.stats.requests_requeued += 1
                if not busy:
                    self.health.failed(f.message)
                return
            row = self._error_row(out)
            self.stats.errors += 1
            self.stats.errors_by_class[f.error_class] = self.stats.errors_by_class.get(f.error_class, 0) + 1
            if not f.transient:
                self.stats.permanent_errors += 1
            if f.error_class == "ContextLengthExceeded":
                # It may be the server's (a restart with a smaller context): held until the
                # breaker's context check, started after it, confirms it (breaker.py).
                refused_t = out.last_failure_t if out.last_failure_t is not None else time.monotonic()
                chunk.unconfirmed[unit_key(row)] = refused_t
                self.breaker.context_refused(refused_t)
            self.breaker.record(f)
        chunk.results[unit_key(row)] = row
        if chunk.complete and not self.breaker.deciding:  # held while the breaker judges (breaker.py)
            self._finish_chunk(chunk)

    def _take_open(self, keep_errors: bool, keep_busy: bool = False) -> list[Job]:
        """Main takes every open (and offered) chunk back from the Ledger and moves its lease
        OPEN/REPAIRING -> RELEASED: the jobs to hand back (finished rows to save). `keep_busy`
        (a hand-off): chunks with requests in flight stay open, with their unsent prompts."""
        busy = (lambda ch: ch.in_flight > 0) if keep_busy else None  # noqa: E731
        taken = self.ledger.take_open(keep=busy)
        self.pending = deque(item for item in self.pending if busy is not None and busy(item[0]))
        jobs: list[Job] = []
        for chunk in taken:
            lease = chunk.lease
            if chunk.dropped or lease is None or lease.state not in (State.OPEN, State.REPAIRING, State.CLAIMED):
                continue
            if not self.leases.move(lease, State.RELEASED, "main"):
                continue  # taken over meanwhile: the peer has it
            # Completions (and permanent errors, unless this server is the problem or the breaker
            # has not confirmed them); never transient error rows, which a failing server or the
            # stop itself may have caused.
            rows = self._kept_rows(chunk, keep_errors)
            jobs.append((lease, rows if chunk.base_rows is None else []))
        return jobs

    def _checkpoint(self) -> None:
        """Save the finished rows of each open chunk that gained some since its last save, as its
        partial (the rows a hand-off would save), in the background: a SIGKILL then costs only the
        rows finished since. Only results for good are saved (completions, permanent errors);
        repairs are not checkpointed. A checkpoint never lands after the chunk's final save
        (handback.PartialWriter); one landing after its chunk's commit deleted the partial is
        swept at the end of a run (the part is what counts)."""
        for chunk in self.ledger.open_chunks():
            if chunk.dropped or chunk.base_rows is not None or len(chunk.results) <= chunk.checkpointed \
                    or chunk.lease is None or chunk.lease.state is not State.OPEN:
                continue
            # Permanent errors are results for good, unless the breaker is judging this server.
            keep_errors = not self.breaker.deciding
            rows = self._kept_rows(chunk, keep_errors)
            if not rows:
                continue
            chunk.checkpointed = len(chunk.results)
            self.partials.checkpoint(chunk.index, rows, deadline_s=min(60.0, self.settings.checkpoint_every_s),
                                     should_stop=self.stop.event.is_set)

    def _progress_interval(self) -> float:
        """Seconds between snapshots: a tenth of the time run so far, within [first_s, every_s]."""
        s = self.settings
        elapsed = time.monotonic() - self.stats.started_t
        return min(s.progress_every_s, max(s.progress_first_s, elapsed / 10.0))

    def _progress(self, force: bool = False) -> None:
        """Log one compact line and hand a snapshot to `on_progress` (snapshot.py says what is in it)."""
        now = time.monotonic()
        while self._tok_window and now - self._tok_window[0][0] > 120:
            self._tok_window.popleft()
        state = "done" if force else ("failing" if self.health.failing else "running")
        snapshot = progress_snapshot(self, state)
        logger.info(
            "progress %s: done=%d err=%d inflight=%d parts=%d/%d tok/s=%.0f",
            snapshot["server"], snapshot["completions"], snapshot["errors"], snapshot["in_flight"],
            snapshot["chunks_done_total"], snapshot["chunks_total"], snapshot["output_tokens_per_s"],
        )
        if self.on_progress:
            self.on_progress(snapshot)

    def _raise_thread_errors(self) -> None:
        for err in (self.committer.error, self.claimer.error, self.keeper.error):
            if err is not None:
                raise err
        if self.stop.requested:
            raise TaskStopped(f"worker {self.settings.worker} stopped from outside")

    def run(self) -> dict[str, Any]:
        s = self.settings
        logger.info(
            "worker %s on %s: %d chunks in the plan, concurrency %d, model %s",
            s.worker, s.server.name, self.n_chunks, s.concurrency, s.model,
        )
        pool_size = 2 * s.concurrency if s.adaptive_headroom else s.concurrency
        pool = RequestPool(pool_size, self._do_request, self.session_factory)
        self.committer.start()
        self.claimer.start()
        self.keeper.start()
        self.concurrency.start()
        last_progress = last_checkpoint = time.monotonic()
        try:
            while True:
                self._raise_thread_errors()
                self.verdicts.judge()
                if self.health.failing:
                    self.verdicts.while_failing(self.in_flight)
                else:
                    self._fill(pool)
                if self.in_flight == 0 and not self.pending:
                    if self.health.failing:
                        self.stop.wait(0.1)
                        continue
                    if self.ledger.has_offered() or not self.claimer.idle.is_set() or self.claimer.has_parked():
                        self.claimer.wake.set()
                        self.stop.wait(0.02)
                        continue
                    self._wait_commits()
                    if not self.ledger.has_open() and not self.ledger.has_offered() \
                            and not self.claimer.has_parked() and self.all_done():
                        break
                    self.claimer.idle.clear()
                    self.claimer.wake.set()
                    self.stop.wait(s.poll_s)
                    continue
                try:
                    item = pool.out.get(timeout=0.1 if self.health.failing or self.breaker.deciding else 0.5)
                except queue.Empty:
                    item = None
                while item is not None:
                    if isinstance(item, BaseException):
                        raise item
                    self._handle(item)
                    try:
                        item = pool.out.get_nowait()
                    except queue.Empty:
                        item = None
                if time.monotonic() - last_progress >= self._progress_interval():
                    self._progress()
                    last_progress = time.monotonic()
                if s.checkpoint_every_s > 0 and time.monotonic() - last_checkpoint >= s.checkpoint_every_s:
                    self._checkpoint()
                    last_checkpoint = time.monotonic()
        except BaseException as exc:
            self.claimer.stop()
            self.concurrency.stop(timeout_s=0.0)  # asked to end now, waited for after the stop's work
            pool.close()
            # While the breaker judges this server, its permanent errors may be its own fault: they
            # are neither committed nor saved (breaker.py); the prompts are redone by whoever takes them.
            judging = self.breaker.deciding
            self.closer.give_up(keep_errors=not isinstance(exc, ServerBroken) and not judging,
                                finish_complete=not judging)
            self._io.close()
            self.concurrency.stop(timeout_s=self._pilot_join_s())
            self.closer.log_stop()
            if isinstance(exc, StopCut) and self.stop.requested:
                raise TaskStopped(f"worker {s.worker} stopped from outside") from exc
            raise
        self.claimer.stop()
        self.concurrency.stop(timeout_s=self._pilot_join_s())
        pool.close()
        self.closer.end_normally()
        self._io.close()
        self.closer.log_stop()  # a stop that came as the dataset completed
        self._progress(force=True)
        result = self.stats.to_dict()
        control = self.concurrency.snapshot()
        result.update({"worker": s.worker, "server": s.server.name,
                       "concurrency": {k: control[k] for k in ("mode", "start", "slots", "limit")}})
        logger.info("worker %s done: %s", s.worker, result)
        return result

    def _pilot_join_s(self) -> float:
        """How long main may wait for the pilot's thread to end (a tick may be waiting on a load probe
        with a 5 s timeout): 5 s, or while stopping a tenth of the time left to the stop's deadline.
        The thread is a daemon and holds nothing to save: one given up on never delays the exit."""
        if not self.stop.requested:
            return 5.0
        return min(5.0, self.stop.left() / 10)

    def _wait_commits(self) -> None:
        while self.ledger.committing() > 0:
            self._raise_thread_errors()
            self.stop.wait(0.05)
