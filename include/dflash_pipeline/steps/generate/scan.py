"""What S3 says is done: the committed parts, the claims, the retry markers, and the end-of-run
check with its sweep. One `Scanner` per worker owns the view (`_done`, `_lowest_unfinished`, the
marker and repair caches) under its own lock; the claimer scans through it, the committer records
its own commits, main asks `all_done()` and the progress page reads `done()`.

The view only grows from what S3 showed (a listing, our commit, a HEAD): never a local guess
(chunks.py invariant 2). A lost Scanner (kill) loses nothing: it is rebuilt from S3.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from dflash_pipeline.dataset.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.dataset.store import (
    KeyGone,
    ObjectInfo,
    PreconditionFailed,
    Store,
    StoreUnavailable,
    with_retries,
)
from dflash_pipeline.steps.generate.chunks import Leases, claim_doc
from dflash_pipeline.steps.generate.pool import DaemonPool
from dflash_pipeline.steps.generate.settings import WorkerSettings

logger = logging.getLogger(__name__)
T = TypeVar("T")

Scan = tuple[set[int], dict[int, ObjectInfo], set[int]]
#: How long the end-of-run sweep, all claims together, retries through transient S3 failures.
SWEEP_RETRY_S = 20.0


def _background(fn: Callable[[], T]) -> Future[T]:
    """`fn` on a daemon thread of its own (the task never waits for it at exit)."""
    fut: Future[T] = Future()
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(exc)

    threading.Thread(target=run, name="scan-claims", daemon=True).start()
    return fut


class Scanner:
    """The worker's view of what is committed and what asks for a repair (module docstring)."""

    def __init__(self, store: Store, layout: DatasetLayout, settings: WorkerSettings, n_chunks: int,
                 leases: Leases, io: DaemonPool) -> None:
        self.store = store
        self.layout = layout
        self.settings = settings
        self.n_chunks = n_chunks
        self.leases = leases
        self._io = io
        self._lock = threading.Lock()
        self._done: set[int] = set()
        self._lowest_unfinished = 0
        self._markers: dict[str, tuple[str, dict[str, Any]]] = {}
        self._repair_cache: tuple[float, set[int]] | None = None

    # -- the view ---------------------------------------------------------------------------------
    def done(self) -> set[int]:
        with self._lock:
            return self._done & set(range(self.n_chunks))

    def mark_done(self, c: int) -> None:
        with self._lock:
            self._done.add(c)

    def forget_repairs(self) -> None:
        """A marker changed (we wrote, settled or deleted one): list them again next time."""
        with self._lock:
            self._repair_cache = None

    def scan(self, fresh_markers: bool = False) -> Scan:
        """(committed chunks, claims of chunks, chunks to repair). The two listings run at once."""
        # On a thread of its own, not the shared S3 pool: main waits for it, and a pool busy with the
        # claimer's reads would make main wait for those too, past any stop.
        claims_f = _background(lambda: list(self.store.list(self.layout.claims_prefix)))
        prefix = self.layout.completions_prefix
        with self._lock:
            done = set(self._done)
            low = self._lowest_unfinished
        after = self.layout.part_key(low - 1) if low > 0 else None
        for obj in self.store.list(prefix, start_after=after):
            c = chunk_of_key(obj.key, prefix)
            if c is not None:
                done.add(c)
        while low < self.n_chunks and low in done:
            low += 1
        with self._lock:
            self._done |= done
            self._lowest_unfinished = max(self._lowest_unfinished, low)
            done = set(self._done)
        claims: dict[int, ObjectInfo] = {}
        for obj in claims_f.result():  # bounded: its own thread, each page a call of the (stop-bound) store
            c = chunk_of_key(obj.key, self.layout.claims_prefix)
            if c is not None:
                claims[c] = obj
        return done, claims, self._repairs(done, fresh_markers)

    # -- retry markers ----------------------------------------------------------------------------
    def _repairs(self, done: set[int], fresh: bool) -> set[int]:
        """Committed chunks whose retry marker asks this run for a repair."""
        if self.settings.retry_failed_rows == "none":
            return set()
        now = time.monotonic()
        with self._lock:
            cached = self._repair_cache
        if fresh or cached is None or now - cached[0] >= self.settings.marker_scan_every_s:
            wanted: set[int] = set()
            prefix = self.layout.retry_prefix
            for obj in self.store.list(prefix):
                c = chunk_of_key(obj.key, prefix)
                if c is not None and self.marker_wants_repair(obj):
                    wanted.add(c)
            cached = (now, wanted)
            with self._lock:
                self._repair_cache = cached
        return {c for c in cached[1] if c in done}

    def marker_body(self, obj: ObjectInfo) -> dict[str, Any] | None:
        with self._lock:
            cached = self._markers.get(obj.key)
        if cached is None or cached[0] != obj.etag:
            got = self.store.get(obj.key)
            if got is None:
                return None
            cached = (got[1], claim_doc(got[0]))
            with self._lock:
                self._markers[obj.key] = cached
        return cached[1]

    @staticmethod
    def marker_runs(body: dict[str, Any]) -> list[str]:
        runs = body.get("runs")
        if isinstance(runs, list):
            return [str(r) for r in runs]
        return [str(body["run_id"])] if body.get("run_id") else []

    def marker_wants_repair(self, obj: ObjectInfo) -> bool:
        """A marker no run of ours has produced or repaired yet: each run touches a chunk's error
        rows at most once, so two runs on one root never repair each other's rows back and forth."""
        body = self.marker_body(obj)
        if body is None or self.settings.run_id in self.marker_runs(body):
            return False
        if self.settings.retry_failed_rows == "all":
            return int(body.get("retryable", 0)) + int(body.get("permanent", 0)) > 0
        return int(body.get("retryable", 0)) > 0

    # -- the end of a run -------------------------------------------------------------------------
    def all_done(self, should_stop: Any = None) -> bool:
        """Every chunk committed and nothing left to repair (by this worker's policy)."""
        done, claims, repair = with_retries(
            lambda: self.scan(fresh_markers=True), what="scan", deadline_s=self.settings.store_deadline_s,
            should_stop=should_stop,
        )
        finished = not repair and len(done & set(range(self.n_chunks))) == self.n_chunks
        if finished:
            self._sweep_stale_claims(done, claims, should_stop)
        return finished

    def _sweep_one(self, info: ObjectInfo, expired: bool) -> bool:
        """Delete one stale claim: if expired, the listed version; else only our earlier try's."""
        if not expired:
            got = self.store.get(info.key)
            if got is None or got[1] != info.etag or claim_doc(got[0]).get("owner") != self.settings.owner:
                return False
        try:
            self.store.delete(info.key, if_match=info.etag)
        except KeyGone:
            return False  # deleted meanwhile (a peer's sweep, or our own first send whose answer was lost)
        return True

    def _sweep_stale_claims(self, done: set[int], claims: dict[int, ObjectInfo], should_stop: Any = None) -> None:
        """Delete claims of committed chunks nobody needs: expired ones (a task SIGKILLed after
        claiming a chunk a peer had just committed), and at once those an earlier try of this very
        task left (SIGKILLed between its commit and its release; the claim document names the
        owner, so "is it ours?" is read from S3). If-Match the listed ETag, so a claim renewed or
        retaken meanwhile is left alone (every renewal changes the ETag: chunks.py invariant 7).

        Each check and delete is retried on a transient failure (503, a 409 ConditionalRequestConflict)
        until SWEEP_RETRY_S after the sweep began, or a stop (one deadline for all claims: an outage
        at the end delays the task by that much at most, then each claim gets one try). The claim of
        an earlier try of ours is deleted by nobody else (a peer waits for it to expire, and a peer
        that has already ended never will), so giving it up on one refused request would leave it
        behind for good (chaos seed 3008)."""
        now = self.store.server_time()
        until = time.monotonic() + SWEEP_RETRY_S
        for c, info in claims.items():
            if c not in done or self.leases.held(c):
                continue
            expired = (now - info.last_modified).total_seconds() > self.settings.lease_s
            if not expired and self.settings.try_number <= 1:
                continue
            try:
                deleted = with_retries(lambda info=info, expired=expired: self._sweep_one(info, expired),
                                       what=f"sweep claim of chunk {c}",
                                       deadline_s=max(0.0, until - time.monotonic()), should_stop=should_stop)
            except PreconditionFailed:
                continue  # renewed or retaken since the listing: a live claim, not ours to delete
            except StoreUnavailable as exc:
                logger.warning("could not delete the stale claim of committed chunk %d (%s); it stays until a "
                               "later try or run sweeps it, harmless to the data", c, exc)
                if should_stop is not None and should_stop():
                    return  # stopping: the sweep is abandoned, a later try or run does it
                continue
            if deleted:
                logger.info("deleted the %s claim of committed chunk %d", "expired" if expired else "earlier try's", c)
        self._sweep_partials(done, until, should_stop)

    def _sweep_partials(self, done: set[int], until: float, should_stop: Any = None) -> None:
        """Delete the partials of committed chunks. A partial outlives its chunk's commit when the stop
        path saved it while a commit was in flight, or a hand-off raced one: the part is what counts,
        the partial is only clutter. Each object is retried on its own through transient failures
        until `until` (the sweep's one deadline) or a stop; one refused delete never ends the sweep
        (before, the first 503 left every partial behind)."""
        left = lambda: max(0.0, until - time.monotonic())  # noqa: E731
        try:
            listed = with_retries(lambda: list(self.store.list(self.layout.partials_prefix)),
                                  what="list partials", deadline_s=left(), should_stop=should_stop)
        except StoreUnavailable as exc:
            logger.warning("could not list the partials to sweep (%s); a later run sweeps them", exc)
            return
        for obj in listed:
            c = chunk_of_key(obj.key, self.layout.partials_prefix)
            if c is None or c not in done or self.leases.held(c):
                continue
            try:
                with_retries(lambda obj=obj: self.store.delete(obj.key, if_match=obj.etag),
                             what=f"sweep partial of chunk {c}", deadline_s=left(), cap_s=1.0,
                             should_stop=should_stop)
            except PreconditionFailed:
                continue  # rewritten or deleted since the listing: not the object we listed
            except StoreUnavailable as exc:
                logger.warning("could not delete the stale partial of committed chunk %d (%s); a later run "
                               "sweeps it, harmless to the data", c, exc)
                if should_stop is not None and should_stop():
                    return
