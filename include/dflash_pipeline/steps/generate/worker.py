"""The generate step: one worker drives one server and shares the dataset's chunks with the others.

Dispatch. `concurrency` daemon threads each hold one request; the moment one returns, the main loop
hands it the next prompt, so the server's slots never wait for a batch to gather. Chunks are claimed
ahead of need by the claimer thread, so there is no barrier between chunks either, and a finished
chunk is committed by the committer thread while generation goes on.

Sharing and exactly once: the chunk protocol (chunks.py states each chunk's states, which thread
owns each move, and what 412/409/404/503/lost answers mean). In short: a part is written only with
a conditional create (or If-Match when repairing), so no id can appear twice; leases (claims renewed
by their own thread) only keep workers from doing the same work.

Threads and what they own:
- main: the dispatch loop; `pending`, `in_flight`, the open chunks' `results` and `checkpointed`,
  OPEN/REPAIRING -> QUEUED/RELEASED (adding the chunk to `_queued`, under `_committing_lock`);
  checkpoints (a snapshot of finished rows taken on main, written by an `_io` thread); the stop
  path (after stopping the others it owns every lease left and hands them back in parallel).
- claimer (claiming.py): scanning S3 and claiming; CLAIMED and the moves out of it; `_done_cache`
  / `_lowest_unfinished` (under `_scan_lock`); parked claims (`_unopened`).
- committer (committing.py): QUEUED -> COMMITTING -> COMMITTED, markers, partial cleanup; removes
  a chunk from `_queued` when done with it.
- renewer (chunks.LeaseKeeper, one short thread per due renewal): renewals; a refused one marks the
  chunk dropped.
- request threads: one unit each (all its turns); they only read their chunk's `dropped` flag and
  lease state, and the stop flag.
- pilot (serving/pilot.py): the server's in-flight limit, discovered from its live load; main
  and the claimer only read it (`_limit()`), and main grows the request pool to it.

Failure handling. A failed request is a row (outcomes.py). A server that fails everything for
`handoff_after_s` hands its open chunks (finished rows saved as partials) to the fleet and keeps
probing /health; it takes work again on recovery or fails with ServerLost after
`server_lost_after_s`. A server answering nearly everything with permanent errors while the fleet
does not (a smaller --context-length, a broken template) trips the breaker (ServerBroken) before it
commits a dataset of error rows. `request_stop()` (SIGTERM: a task cleared/failed in the UI, an
eviction) saves finished rows, commits complete chunks and releases claims within `stop_grace_s`.

Memory and rework are bounded by `held_rows_cap` (rows claimed but not yet committed), never by
the size of the prompt set; a SIGKILL loses at most those rows' unsaved results.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import encode_part, unit_key, warm_up
from dflash_pipeline.dataset.store import ObjectInfo, Store, StoreUnavailable, with_retries
from dflash_pipeline.serving.sglang import (
    RequestFailure,
    build_chat_body,
    chat_once,
    check_health,
    new_chat_client,
    new_session,
)
from dflash_pipeline.serving.concurrency import ConcurrencyPolicy
from dflash_pipeline.serving.deadline import DeadlinePolicy, server_watch
from dflash_pipeline.serving.engines import DEFAULT_CAPACITY
from dflash_pipeline.serving.pilot import concurrency_for
from dflash_pipeline.steps.generate.chunks import (
    ChunkStore,
    Lease,
    LeaseKeeper,
    Leases,
    State,
    claim_body,
    claim_doc,
)
from dflash_pipeline.steps.generate.claiming import Claiming
from dflash_pipeline.steps.generate.committing import Committing
from dflash_pipeline.steps.generate.conversation import conversation_row, run_conversation
from dflash_pipeline.steps.generate.outcomes import error_row, judge, unexpected_failure
from dflash_pipeline.steps.generate.pool import RequestPool
from dflash_pipeline.steps.generate.settings import WorkerSettings
from dflash_pipeline.steps.generate.state import (
    MAX_REQUEUES,
    OpenChunk,
    Outcome,
    ServerBroken,
    ServerConfigError,
    ServerLost,
    TaskStopped,
    WorkerStats,
)

logger = logging.getLogger(__name__)


class Worker(Claiming, Committing):
    """Drives one server until every chunk of the dataset is committed (by anyone)."""

    def __init__(
        self,
        store: Store,
        layout: DatasetLayout,
        manifest: dict[str, Any],
        settings: WorkerSettings,
        session_factory: Callable[[], Any] = new_chat_client,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        s = settings
        self.store = store
        self.layout = layout
        self.settings = settings
        self.sizes: list[int] = list(manifest["chunks"]["sizes"])
        self.plan_id: str = manifest["plan_id"]
        self.n_chunks = len(self.sizes)
        self.session_factory = session_factory
        self.on_progress = on_progress
        self.stats = WorkerStats()
        self._stat_lock = threading.Lock()
        self.leases = Leases()
        self.chunks = ChunkStore(
            store, layout.claim_key,
            claim_body(s.owner, s.worker, s.server.name, s.run_id, s.try_number),
            store_deadline_s=s.store_deadline_s,
        )
        self.keeper = LeaseKeeper(self.leases, self.chunks, s.lease_s, on_lost=self._on_lost)
        # Open chunks by index (the claimer adds a chunk it opened, main removes it when it queues, hands
        # off or drops it; the renewer only flags `dropped`), under `_open_lock`.
        self.open: dict[int, OpenChunk] = {}
        self._open_lock = threading.Lock()
        self.pending: deque[tuple[OpenChunk, dict[str, Any]]] = deque()
        self.in_flight = 0
        self._commit_q: queue.Queue[OpenChunk | None] = queue.Queue()
        self._commit_error: BaseException | None = None
        self._committing = 0
        self._committing_rows = 0
        self._committing_lock = threading.Lock()
        self._last_success_t = 0.0
        self._suspect_since: float | None = None
        self._own_stale: set[int] | None = None
        # Chunks whose part was seen in S3 (a listing, our commit, a HEAD): never a local guess.
        self._done_cache: set[int] = set()
        self._ours_ever = False
        self._tok_window: deque[tuple[float, int]] = deque()
        self._markers: dict[str, tuple[str, dict[str, Any]]] = {}
        self._requeues: dict[str, int] = {}
        self._scan_lock = threading.Lock()
        self._lowest_unfinished = 0
        self._claimed: queue.SimpleQueue[OpenChunk] = queue.SimpleQueue()
        self._claimed_prompts = 0
        self._claimer_wake = threading.Event()
        self._claimer_idle = threading.Event()
        self._claimer_stop = threading.Event()
        self._claim_error: BaseException | None = None
        # Claims whose chunk could not be loaded yet (S3 unavailable): kept, renewed, retried.
        self._unopened: deque[tuple[Lease, bool]] = deque()
        self._done_times: deque[float] = deque()
        self._claim_latency_s = 0.0
        self._last_scan: tuple[float, tuple[set[int], dict[int, ObjectInfo], set[int]]] | None = None
        self._full_chunk = max(self.sizes, default=0)
        self._in_tail = False
        self._repair_cache: tuple[float, set[int]] | None = None
        self._stop_requested = threading.Event()
        self._stop_requested_t: float | None = None
        # Stopping: the committer takes no new chunk after `_commit_until`; main then owns every lease.
        self._committer_stop = threading.Event()
        self._commit_until: float | None = None
        # Chunks handed to the committer (QUEUED/COMMITTING), by index, so the stop path can save
        # the rows of any the committer did not finish. Under `_committing_lock`.
        self._queued: dict[int, OpenChunk] = {}
        self._recent_permanent: deque[bool] = deque(maxlen=s.breaker_window)
        self._breaker_checked_t = 0.0
        self._last_permanent: str = ""
        self._io = ThreadPoolExecutor(3, thread_name_prefix="s3io")
        # The in-flight limit: discovered from the server's live load, or the user's figure
        # (serving/pilot.py; its own thread probes, main and the claimer read `limit`).
        self.concurrency = concurrency_for(
            run_id=s.run_id, server=s.server, engine=s.engine,
            deadline=DeadlinePolicy(s.request_timeout_s, s.min_decode_tok_s),
            fixed=None if s.adaptive_headroom else s.concurrency, declared_slots=s.declared_slots,
            start_slots=DEFAULT_CAPACITY,
            policy=ConcurrencyPolicy(cap=max(1, s.concurrency_cap), headroom_s=s.headroom_s,
                                     probe_every_s=s.probe_every_s))
        warm_up()

    @property
    def held_rows_cap(self) -> int:
        s = self.settings
        return (s.held_rows_cap if s.held_rows_cap is not None
                else 2 * self._full_chunk + 4 * max(s.concurrency, self._limit()))

    def request_stop(self) -> None:
        """Ask the worker to stop (from a signal handler): it saves, commits and releases, then
        raises TaskStopped from run()."""
        if self._stop_requested_t is None:
            self._stop_requested_t = time.monotonic()
        self._stop_requested.set()
        self._claimer_stop.set()
        self._claimer_wake.set()

    def _count(self, name: str, n: int = 1) -> None:
        with self._stat_lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    # -- request thread ----------------------------------------------------------------------
    def _do_request(self, session: Any, item: tuple[OpenChunk, dict[str, Any]]) -> Outcome:
        """Never raises: whatever happens becomes this row's outcome (a failed request is a row).

        One unit is one (id, sample); in all_turns mode its whole conversation runs here, turn
        after turn on this thread's server (conversation.py has the rules)."""
        chunk, prompt = item
        s = self.settings
        out = Outcome(chunk, prompt)
        watch = server_watch(s.run_id, s.server, s.engine, DeadlinePolicy(s.request_timeout_s, s.min_decode_tok_s))

        def send(messages: list[dict[str, str]]) -> tuple[Any, float, int] | None:
            """One turn: its own retries; a timeout is retried once, never regenerated max_attempts times."""
            body = build_chat_body(messages, s.model, s.sampling, prompt["id"], sample=int(prompt.get("sample") or 0),
                                   engine=s.engine)
            timeouts = 0
            for attempt in range(1, s.max_attempts + 1):
                out.attempts += 1
                if chunk.dropped or self._stop_requested.is_set() or (chunk.lease is not None and chunk.lease.gone):
                    return None  # stopped or dropped: not a result, never an error row
                try:
                    with watch.waiter(s.sampling.max_tokens) as wait:
                        completion, latency = chat_once(session, s.server, body, s.request_timeout_s, wait)
                    watch.record(completion.completion_tokens, latency)
                    out.done_t = time.monotonic()
                    completion = judge(completion, s.sampling)
                except RequestFailure as exc:
                    out.failure = exc
                    out.last_failure_t = time.monotonic()
                    if out.first_failure_t is None:
                        out.first_failure_t = out.last_failure_t
                    timeouts += exc.error_class == "Timeout"
                    if not exc.transient or attempt == s.max_attempts or timeouts >= 2:
                        raise
                    delay = min(s.backoff_cap_s, s.backoff_base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                    self._stop_requested.wait(delay)
                    continue
                out.failure = None
                return completion, latency, attempt
            return None

        try:
            res = run_conversation(prompt["messages"], s.sampling.regenerate, send)
            if res.stopped:
                out.failure = None  # a failure seen before the stop is not this row's outcome
            elif res.failure is not None:
                out.failure = res.failure
            elif res.turns and not res.stopped:
                out.failure = None  # a permanent refusal that only cut the conversation short
                out.row = conversation_row(prompt, res, model=s.model, server=s.server.name,
                                           chunk=chunk.index, run_id=s.run_id)
        except Exception as exc:  # noqa: BLE001 - one row's failure, never the task's
            logger.warning("request for %s failed unexpectedly: %r", prompt.get("id"), exc)
            out.row = None
            out.failure = unexpected_failure(exc)
            out.last_failure_t = time.monotonic()
        return out

    def _error_row(self, out: Outcome) -> dict[str, Any]:
        assert out.failure is not None
        s = self.settings
        return error_row(out.prompt, out.failure, model=s.model, server=s.server.name, attempts=out.attempts,
                         chunk=out.chunk.index, run_id=s.run_id)

    # -- renewer callback -----------------------------------------------------------------------
    def _on_lost(self, lease: Lease) -> None:
        with self._open_lock:
            chunk = self.open.get(lease.chunk)
        if chunk is not None:
            chunk.dropped = True
        self._count("chunks_lost_to_others")

    # -- main loop ------------------------------------------------------------------------------
    def _limit(self) -> int:
        """Requests to keep in flight: the user's concurrency_per_server, or the figure discovered
        from the server's live load plus a small queue (serving/concurrency.py)."""
        return self.concurrency.limit

    def _rate(self) -> float:
        """Completions per second over the last 10 s (0 until the first one)."""
        now = time.monotonic()
        while self._done_times and now - self._done_times[0] > 10.0:
            self._done_times.popleft()
        span = min(10.0, max(1.0, now - self.stats.started_t))
        return len(self._done_times) / span

    def _fill(self, pool: RequestPool) -> None:
        while True:
            try:
                chunk = self._claimed.get_nowait()
            except queue.Empty:
                break
            todo = chunk.prompts_to_send()
            with self._committing_lock:
                self._claimed_prompts -= len(todo)
            if chunk.dropped:
                self._forget(chunk)
                continue
            if not todo:
                self._finish_chunk(chunk)
                continue
            self.pending.extend((chunk, p) for p in todo)
        limit = self._limit()
        pool.ensure(limit)
        while self.in_flight < limit and self.pending:
            chunk, prompt = self.pending.popleft()
            if chunk.dropped:
                self._forget(chunk)
                continue
            pool.submit((chunk, prompt))
            self.in_flight += 1
            self.stats.requests_sent += 1
        if self._claim_wanted():
            self._claimer_wake.set()

    def _forget(self, chunk: OpenChunk) -> None:
        with self._open_lock:
            if self.open.get(chunk.index) is chunk:
                del self.open[chunk.index]

    def _finish_chunk(self, chunk: OpenChunk) -> None:
        """Every row is in: hand the chunk to the committer (unless a peer took it over first)."""
        assert chunk.lease is not None
        self._forget(chunk)
        if not self.leases.move(chunk.lease, State.QUEUED, "main"):
            chunk.dropped = True
            self._count("rows_discarded", len(chunk.results))
            return
        with self._committing_lock:
            self._committing += 1
            self._committing_rows += len(chunk.prompts)
            self._queued[chunk.index] = chunk
        self._commit_q.put(chunk)

    def _handle(self, out: Outcome) -> None:
        self.in_flight -= 1
        chunk = out.chunk
        if chunk.dropped:
            self._count("rows_discarded")
            self._forget(chunk)
            return
        if out.row is not None:
            self._last_success_t = max(self._last_success_t, out.done_t)
            self._suspect_since = None
            row = out.row
            self.stats.completions += 1
            tokens = int(row.get("completion_tokens") or 0)
            self.stats.output_tokens += tokens
            self._tok_window.append((self._last_success_t, tokens))
            self._done_times.append(time.monotonic())
            self._recent_permanent.append(False)
        else:
            f = out.failure
            if f is None:  # stopped or dropped before any answer: not a result
                if not self._stop_requested.is_set():
                    self.pending.appendleft((chunk, out.prompt))
                return
            if f.kind == "config":
                raise ServerConfigError(f"server {self.settings.server.name} refused the request: {f.message}")
            pid = unit_key(out.prompt)
            if (
                f.transient
                and (out.last_failure_t or 0) >= self._last_success_t
                and self._requeues.get(pid, 0) < MAX_REQUEUES
            ):
                # Nothing succeeded since this request last failed: the server, not the prompt, is
                # the problem. Put it back; it is not an error row. (Bounded, so one prompt that
                # always fails on a healthy server still ends as an error row.)
                self._requeues[pid] = self._requeues.get(pid, 0) + 1
                self.pending.appendleft((chunk, out.prompt))
                self.stats.requests_requeued += 1
                if self._suspect_since is None:
                    self._suspect_since = time.monotonic()
                    logger.warning(
                        "server %s is failing (%s); pausing new requests and probing /health",
                        self.settings.server.name, f.message,
                    )
                return
            row = self._error_row(out)
            self.stats.errors += 1
            self.stats.errors_by_class[f.error_class] = self.stats.errors_by_class.get(f.error_class, 0) + 1
            self._recent_permanent.append(not f.transient)
            if not f.transient:
                self.stats.permanent_errors += 1
                self._last_permanent = f"{f.error_class}: {f.message[:200]}"
                self._check_breaker()
        chunk.results[unit_key(row)] = row
        if chunk.complete:
            self._finish_chunk(chunk)

    def _check_breaker(self) -> None:
        """Trip when this server's recent results are (nearly) all permanent errors and the fleet's
        are not: its context length or chat template differs, and every row it writes is lost."""
        s = self.settings
        recent = self._recent_permanent
        if len(recent) < max(10, s.breaker_window // 2):
            return
        share = sum(recent) / len(recent)
        if share < s.breaker_share_vs_fleet:
            return
        others_done, others_perm = 0, 0
        now = time.monotonic()
        if share < s.breaker_share_alone:
            if now - self._breaker_checked_t < 5.0:
                return
            self._breaker_checked_t = now
            others_done, others_perm = self._fleet_results()
            if others_done < s.breaker_window or others_perm / others_done > share / 4:
                return
        raise ServerBroken(
            f"server {s.server.name} answered {sum(recent)} of its last {len(recent)} requests with a permanent "
            f"error (last: {self._last_permanent}); the other servers: {others_perm} permanent errors in "
            f"{others_done} results. Check its --context-length and chat template against the others'; "
            f"its open chunks were released without its error rows."
        )

    def _fleet_results(self) -> tuple[int, int]:
        """(results, permanent errors) of the other workers of this run, from their progress docs."""
        prefix = self.layout.run_key(self.settings.run_id, "progress/")
        done = perm = 0
        try:
            for obj in self.store.list(prefix):
                if obj.key.endswith(f"/{self.settings.worker}.json"):
                    continue
                got = self.store.get(obj.key)
                doc = claim_doc(got[0]) if got else {}
                done += int(doc.get("completions") or 0) + int(doc.get("errors") or 0)
                perm += int(doc.get("permanent_errors") or 0)
        except (StoreUnavailable, ValueError, TypeError) as exc:
            logger.warning("breaker: could not read the fleet's progress (%s)", exc)
        return done, perm

    def _check_suspect(self, session: Any) -> None:
        if self._suspect_since is None:
            return
        if check_health(session, self.settings.server, timeout_s=5.0):
            logger.info("server %s answers /health again; resuming", self.settings.server.name)
            self._suspect_since = None
            self._last_success_t = time.monotonic()
            self._claimer_wake.set()
            return
        down_for = time.monotonic() - self._suspect_since
        if down_for >= self.settings.handoff_after_s:
            self._release_open(f"server {self.settings.server.name} failing for {down_for:.0f}s")
        if down_for >= self.settings.server_lost_after_s:
            raise ServerLost(
                f"server {self.settings.server.name} lost: no answer for {down_for:.0f}s "
                f"(server_lost_after_s={self.settings.server_lost_after_s:g})"
            )

    def _release_open(self, why: str, keep_errors: bool = True, deadline_s: float = 30.0) -> int:
        """Hand every open chunk to the fleet now: main's move OPEN/REPAIRING -> RELEASED, then its
        finished rows saved as a partial and the claim released, all chunks at once, within
        `deadline_s`. Returns how many were released."""
        while True:
            try:
                chunk = self._claimed.get_nowait()
            except queue.Empty:
                break
            with self._committing_lock:
                self._claimed_prompts -= len(chunk.prompts_to_send())
        with self._open_lock:
            chunks = [ch for ch in self.open.values() if not ch.dropped]
            self.open.clear()
        self.pending.clear()
        jobs: list[tuple[Lease, list[dict[str, Any]]]] = []
        for chunk in chunks:
            chunk.dropped = True
            lease = chunk.lease
            if lease is None or lease.state not in (State.OPEN, State.REPAIRING, State.CLAIMED):
                continue
            if not self.leases.move(lease, State.RELEASED, "main"):
                continue  # taken over meanwhile: the peer has it
            # Completions (and permanent errors, unless this server is the problem); never transient
            # error rows, which a failing server or the stop itself may have caused.
            rows = [r for r in chunk.results.values()
                    if not r.get("error_class") or (keep_errors and not r.get("retryable"))]
            jobs.append((lease, rows if chunk.base_rows is None else []))
        saved = self._hand_back(jobs, time.monotonic() + deadline_s)
        if jobs:
            self._count("handoffs", len(jobs))
            logger.warning("%s: released %d unfinished chunk(s) to the other servers (%d finished rows saved)",
                           why, len(jobs), saved)
        return len(jobs)

    def _checkpoint(self) -> None:
        """Save the finished rows of each open chunk that gained some since its last save, as its
        partial (the rows a hand-off would save), in the background: a SIGKILL then costs only the
        rows finished since. Only results for good are saved (completions, permanent errors);
        repairs are not checkpointed. A checkpoint landing after its chunk's commit deleted the
        partial is swept at the end of a run (the part is what counts)."""
        with self._open_lock:
            chunks = [ch for ch in self.open.values() if not ch.dropped and ch.base_rows is None]
        for chunk in chunks:
            if len(chunk.results) <= chunk.checkpointed or chunk.lease is None or chunk.lease.state is not State.OPEN:
                continue
            rows = [r for r in chunk.results.values() if not r.get("error_class") or not r.get("retryable")]
            if not rows:
                continue
            chunk.checkpointed = len(chunk.results)
            key = self.layout.partial_key(chunk.index)
            data = encode_part(rows)

            def save(key: str = key, data: bytes = data, index: int = chunk.index) -> None:
                try:
                    with_retries(lambda: self.store.put(key, data), what=f"checkpoint {index}",
                                 deadline_s=min(60.0, self.settings.checkpoint_every_s),
                                 should_stop=self._stop_requested.is_set)
                except Exception as exc:  # noqa: BLE001 - a checkpoint is best effort
                    logger.warning("could not checkpoint chunk %d: %s", index, exc)

            self._io.submit(save)

    def _hand_back(self, jobs: list[tuple[Lease, list[dict[str, Any]]]], deadline: float) -> int:
        """For each (lease already RELEASED by main, rows): save the rows as the chunk's partial,
        then delete the claim; the chunks in parallel, each bounded by `deadline` (monotonic).
        Daemon threads: one S3 call stuck past the deadline delays nothing (the lease expires).
        Returns the rows saved."""
        saved = [0]
        lock = threading.Lock()

        def one(lease: Lease, rows: list[dict[str, Any]]) -> None:
            left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
            try:
                if rows:
                    data = encode_part(rows)
                    with_retries(lambda: self.store.put(self.layout.partial_key(lease.chunk), data),
                                 what=f"save partial {lease.chunk}", deadline_s=left(), cap_s=0.5)
                    with lock:
                        saved[0] += len(rows)
            except Exception as exc:  # noqa: BLE001 - best effort; the rows are redone otherwise
                logger.warning("could not save the %d finished rows of chunk %d: %s", len(rows), lease.chunk, exc)
            try:
                self.chunks.release(lease, deadline_s=left())
            except Exception as exc:  # noqa: BLE001 - the claim then expires with its lease
                logger.warning("could not release chunk %d: %s", lease.chunk, exc)

        threads = [threading.Thread(target=one, args=job, name=f"handback-{job[0].chunk}", daemon=True)
                   for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        with lock:
            return saved[0]

    def _progress_interval(self) -> float:
        """Seconds between snapshots: a tenth of the time run so far, within [first_s, every_s]."""
        s = self.settings
        elapsed = time.monotonic() - self.stats.started_t
        return min(s.progress_every_s, max(s.progress_first_s, elapsed / 10.0))

    def _progress(self, force: bool = False) -> None:
        """Log one compact line and hand a snapshot to `on_progress` (the page and ETA read it).

        Counts are this try's; `rows_pending_commit` are finished rows not yet in a part, and
        `chunks_done_total` is this worker's latest view of the parts committed by anyone (earlier
        runs included), so the reader can tell done prompts from submitted ones.
        """
        now = time.monotonic()
        while self._tok_window and now - self._tok_window[0][0] > 120:
            self._tok_window.popleft()
        window_tokens = sum(t for _, t in self._tok_window)
        span = min(120.0, max(1e-9, now - self.stats.started_t))
        with self._open_lock:
            pending_rows = sum(len(ch.results) for ch in self.open.values() if not ch.dropped)
            open_chunks = len(self.open)
        pending_rows += sum(len(ch.results) for ch in list(self._commit_q.queue) if ch is not None)
        with self._scan_lock:
            done_chunks = self._done_cache & set(range(self.n_chunks))
        s = self.settings
        snapshot = {
            "run_id": s.run_id,
            "worker": s.worker,
            "server": s.server.name,
            "try_number": s.try_number,
            "concurrency": s.concurrency,
            "in_flight_limit": self._limit(),
            "concurrency_control": self.concurrency.snapshot(),
            "state": "done" if force else ("failing" if self._suspect_since is not None else "running"),
            "elapsed_s": round(now - self.stats.started_t, 1),
            "completions": self.stats.completions,
            "errors": self.stats.errors,
            "permanent_errors": self.stats.permanent_errors,
            "errors_by_class": dict(self.stats.errors_by_class),
            "requests_sent": self.stats.requests_sent,
            "requests_requeued": self.stats.requests_requeued,
            "rows_discarded": self.stats.rows_discarded,
            "chunks_committed": self.stats.chunks_committed,
            "chunks_taken_over": self.stats.chunks_taken_over,
            "chunks_lost_to_others": self.stats.chunks_lost_to_others,
            "handoffs": self.stats.handoffs,
            "in_flight": self.in_flight,
            "ready": len(self.pending),
            "open_chunks": open_chunks,
            "held_rows": self._held_rows(),
            "rows_pending_commit": pending_rows,
            "chunks_total": self.n_chunks,
            "chunks_done_total": len(done_chunks),
            "prompts_total": sum(self.sizes),
            "prompts_committed_total": sum(self.sizes[c] for c in done_chunks),
            "output_tokens": self.stats.output_tokens,
            "output_tokens_per_s": round(window_tokens / span, 1),
            # Longest completion of the last two minutes: snapshots overlap, so their running max is
            # the run's longest, which sizes the ETA's tail (the last long requests drain alone).
            "max_completion_tokens_recent": max((t for _, t in self._tok_window), default=0),
        }
        logger.info(
            "progress %s: done=%d err=%d inflight=%d parts=%d/%d tok/s=%.0f",
            snapshot["server"], snapshot["completions"], snapshot["errors"], snapshot["in_flight"],
            snapshot["chunks_done_total"], snapshot["chunks_total"], snapshot["output_tokens_per_s"],
        )
        if self.on_progress:
            self.on_progress(snapshot)

    def _raise_thread_errors(self) -> None:
        for err in (self._commit_error, self._claim_error, self.keeper.error):
            if err is not None:
                raise err
        if self._stop_requested.is_set():
            raise TaskStopped(f"worker {self.settings.worker} stopped from outside")

    def run(self) -> dict[str, Any]:
        s = self.settings
        logger.info(
            "worker %s on %s: %d chunks in the plan, concurrency %d, model %s",
            s.worker, s.server.name, self.n_chunks, s.concurrency, s.model,
        )
        pool_size = 2 * s.concurrency if s.adaptive_headroom else s.concurrency
        pool = RequestPool(pool_size, self._do_request, self.session_factory)
        committer = threading.Thread(target=self._committer, name="committer", daemon=True)
        committer.start()
        claimer = threading.Thread(target=self._claimer, name="claimer", daemon=True)
        claimer.start()
        self.keeper.start()
        self.concurrency.start()
        probe_session = new_session()
        last_progress = last_checkpoint = time.monotonic()
        try:
            while True:
                self._raise_thread_errors()
                if self._suspect_since is None:
                    self._fill(pool)
                else:
                    self._check_suspect(probe_session)
                if self.in_flight == 0 and not self.pending:
                    if self._suspect_since is not None:
                        time.sleep(min(1.0, s.handoff_after_s / 2))
                        continue
                    if not self._claimed.empty() or not self._claimer_idle.is_set() or self._unopened:
                        self._claimer_wake.set()
                        time.sleep(0.02)
                        continue
                    self._wait_commits()
                    if not self.open and self._claimed.empty() and not self._unopened and self._all_done():
                        break
                    self._claimer_idle.clear()
                    self._claimer_wake.set()
                    time.sleep(s.poll_s)
                    continue
                try:
                    item = pool.out.get(timeout=0.5)
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
            self._give_up(claimer, committer, keep_errors=not isinstance(exc, ServerBroken))
            raise
        finally:
            self._claimer_stop.set()
            self._claimer_wake.set()
            self.concurrency.stop()
            pool.close()
            self._io.shutdown(wait=False)
        # The claimer may be releasing a chunk it claimed from a stale listing just as the dataset
        # completed: let it finish (its S3 retries are bounded), then release anything still held.
        claimer.join(timeout=min(120.0, s.store_deadline_s))
        self._committer_stop.set()
        committer.join(timeout=60)
        self.leases.give_up_owner = "main"
        for lease in self.leases.live():
            if lease.state is not State.COMMITTING and self.leases.move(lease, State.RELEASED, "main"):
                self.chunks.release(lease, deadline_s=30.0)
        self.keeper.stop()
        if self._commit_error is not None:
            raise self._commit_error
        self._progress(force=True)
        result = self.stats.to_dict()
        control = self.concurrency.snapshot()
        result.update({"worker": s.worker, "server": s.server.name,
                       "concurrency": {k: control[k] for k in ("mode", "start", "slots", "limit")}})
        logger.info("worker %s done: %s", s.worker, result)
        return result

    def _wait_commits(self) -> None:
        while self._committing > 0:
            self._raise_thread_errors()
            time.sleep(0.05)

    def _give_up(self, claimer: threading.Thread, committer: threading.Thread, keep_errors: bool = True) -> None:
        """Stop by one absolute deadline (`stop_grace_s` after a stop request, else at least 30 s):
        complete chunks are committed while time allows, every other held chunk's finished rows are
        saved as partials and every claim released (conditionally) for the fleet.

        Order and owners: the claimer stops first (a claim it completes after this it releases
        itself); the committer commits queued chunks until half the grace, then takes no more;
        then main owns every lease left (`give_up_owner`) and hands back open, queued and
        committing chunks and parked claims at once (`_hand_back`). A commit still in flight when
        main releases its lease may still land: invariant 1 keeps the part exact, and a partial
        left beside a part is swept at the end of a later run."""
        s = self.settings
        started = time.monotonic()
        grace = s.stop_grace_s if self._stop_requested.is_set() else max(s.stop_grace_s, 30.0)

        def deadline() -> float:  # a SIGTERM during a long give-up shortens it to the stop grace
            t = self._stop_requested_t
            return started + grace if t is None else min(started + grace, t + s.stop_grace_s)

        self._claimer_stop.set()
        self._claimer_wake.set()
        claimer.join(timeout=max(0.0, min(0.5, grace / 6)))
        with self._open_lock:
            complete = [ch for ch in self.open.values() if ch.complete and not ch.dropped]
        for chunk in complete:
            self._finish_chunk(chunk)
        self._commit_until = started + (deadline() - started) * 0.5
        self._committer_stop.set()
        committer.join(timeout=max(0.0, self._commit_until - time.monotonic()))
        self.leases.give_up_owner = "main"
        remaining = max(0.2, deadline() - time.monotonic())
        self._release_open("stopping", keep_errors=keep_errors, deadline_s=remaining)
        jobs: list[tuple[Lease, list[dict[str, Any]]]] = []
        with self._committing_lock:
            queued = list(self._queued.values())
        for chunk in queued:  # complete, not committed in time: all rows become a partial
            lease = chunk.lease
            if lease is not None and lease.state in (State.QUEUED, State.COMMITTING) \
                    and self.leases.move(lease, State.RELEASED, "main"):
                jobs.append((lease, list(chunk.results.values()) if chunk.base_rows is None else []))
        for lease in self.leases.live():  # parked claims, and any claim the claimer made late
            if self.leases.move(lease, State.RELEASED, "main"):
                jobs.append((lease, []))
        self._hand_back(jobs, deadline())
        self.keeper.stop(timeout_s=max(0.1, deadline() - time.monotonic()))
