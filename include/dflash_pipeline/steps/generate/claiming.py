"""The claimer thread: claiming chunks ahead of need, opening what it claimed (or parking it while
S3 is unavailable), repairs and their markers. One `Claimer` object per worker, with its own state
(`_unopened` parked claims, the last listing, the claim latency); it owns CLAIMED and the moves out
of it (chunks.py) and hands each opened chunk to the Ledger (`offer`), after which it never touches
it again. What it reads of main's state it reads through `Demand` (one narrow callable).

A kill loses its parked claims' leases (they expire); an exception ends the thread with `error`
set, which main raises; a claim completed after the stop began is released here, at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import ROW_LABEL_COLUMNS, decode_inputs, decode_part, unit_key
from dflash_pipeline.dataset.store import (
    ObjectInfo,
    PreconditionFailed,
    Store,
    StoreUnavailable,
)
from dflash_pipeline.steps.generate.chunks import (
    ChunkStore,
    Lease,
    Leases,
    State,
    claim_doc,
    quiet_after_s,
)
from dflash_pipeline.steps.generate.ledger import Ledger
from dflash_pipeline.steps.generate.outcomes import FINISHED
from dflash_pipeline.steps.generate.pool import DaemonPool, rotate
from dflash_pipeline.steps.generate.scan import Scanner
from dflash_pipeline.steps.generate.settings import WorkerSettings
from dflash_pipeline.steps.generate.state import OpenChunk

logger = logging.getLogger(__name__)

#: Main's answer to "claim more now?", given the lookahead in seconds the claimer wants covered.
Demand = Callable[[float], bool]


class Claimer:
    """The claimer thread and its state (module docstring)."""

    def __init__(self, *, store: Store, layout: DatasetLayout, settings: WorkerSettings, manifest: dict[str, Any],
                 leases: Leases, chunks: ChunkStore, ledger: Ledger, scanner: Scanner, io: DaemonPool,
                 demand: Demand, failing_since: Callable[[], float | None],
                 count: Callable[[str, int], None]) -> None:
        self.store = store
        self.layout = layout
        self.settings = settings
        self.sizes: list[int] = list(manifest["chunks"]["sizes"])
        self.plan_id: str = manifest["plan_id"]
        self.n_chunks = len(self.sizes)
        self.full_chunk = max(self.sizes, default=0)
        self.leases = leases
        self.chunks = chunks
        self.ledger = ledger
        self.scanner = scanner
        self._io = io
        self._demand = demand
        self._failing_since = failing_since
        self._count = count
        self.stop_event = threading.Event()
        self.wake = threading.Event()
        self.idle = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="claimer", daemon=True)
        # Claims whose chunk could not be loaded yet (S3 unavailable): kept, renewed, retried.
        self._unopened: deque[tuple[Lease, bool]] = deque()
        # Main takes the parked claims over at the stop (release_parked) while this thread may still be
        # in a step (given up on, not joined): every access to the deque is under this lock.
        self._parked_lock = threading.Lock()
        self._last_scan: tuple[float, tuple[set[int], dict[int, ObjectInfo], set[int]]] | None = None
        self._own_stale: set[int] | None = None
        self._ours_ever = False
        self._claim_latency_s = 0.0
        self._in_tail = False

    # -- lifecycle (main) -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.wake.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=max(0.0, timeout_s))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def has_parked(self) -> bool:
        with self._parked_lock:
            return bool(self._unopened)

    def lookahead_s(self) -> float:
        """Seconds of work to keep claimed ahead: enough to cover a claim's round trips (with
        margin), at least `claim_ahead_s` until the plan's short tail chunks are reached."""
        ahead_s = 3.0 * self._claim_latency_s
        if not self._in_tail:
            ahead_s = max(self.settings.claim_ahead_s, ahead_s)
        return ahead_s

    def _find_own_stale(self, claims: dict[int, ObjectInfo]) -> set[int]:
        """Chunks a previous try of this same worker claimed: ours to take back once their claims are
        no longer renewed (`quiet_after_s`, not the whole lease). An earlier try that is still
        running (its supervisor lost it) keeps renewing them and keeps its chunks: taking them at
        once had both tries generate them."""
        own: set[int] = set()
        for c in claims:
            got = self.store.get(self.layout.claim_key(c))
            if got is not None and claim_doc(got[0]).get("owner") == self.settings.owner:
                own.add(c)
        if own:
            logger.info("%d chunk(s) claimed by an earlier try of this task: taking back each once not renewed for "
                        "%.1fs: %s", len(own), quiet_after_s(self.settings.lease_s), sorted(own))
        return own

    def _wants_redo(self, row: dict[str, Any]) -> bool:
        if row.get("run_id") == self.settings.run_id:
            return False
        if not row.get("error_class"):
            # Stored as a completion by older code although unfinished ("abort"): retryable.
            return row.get("finish_reason") not in FINISHED
        return self.settings.retry_failed_rows == "all" or bool(row.get("retryable"))

    # -- claimer thread ------------------------------------------------------------------------
    def _try_claim(self) -> OpenChunk | None:
        """Claim one chunk: from the last listing if it is recent, else (or if that finds none) a new one.

        A listing up to `scan_reuse_s` old is safe to claim from: every claim is a conditional write
        and a chunk is checked for a committed part after it is claimed, so a stale entry costs one
        refused request, never a duplicate.
        """
        cached = self._last_scan
        if cached is not None and time.monotonic() - cached[0] < self.settings.scan_reuse_s:
            chunk = self._claim_from(*cached[1], stale=True)
            if chunk is not None:
                return chunk
        scan = self.scanner.scan()
        self._last_scan = (time.monotonic(), scan)
        return self._claim_from(*scan)

    def _claim_from(
        self, done: set[int], claims: dict[int, ObjectInfo], repair: set[int], stale: bool = False
    ) -> OpenChunk | None:
        """Claim the first free chunk of a listing. From a reused listing, the first refusal ends the
        attempt: others have been claiming since, and walking on would cost a round trip per chunk."""
        if self._own_stale is None:
            # Only a later try of this task can find claims of its own (the owner names run and worker).
            self._own_stale = (
                self._find_own_stale({c: o for c, o in claims.items() if c not in done or c in repair})
                if self.settings.try_number > 1 else set()
            )
        now = self.store.server_time()
        own_quiet_s = quiet_after_s(self.settings.lease_s)

        def live(c: int, info: ObjectInfo) -> bool:
            """Someone may be renewing this claim: a peer's within its lease, an earlier try's of
            ours within one renewal period (chunks.quiet_after_s)."""
            age = (now - info.last_modified).total_seconds()
            return age <= (own_quiet_s if c in self._own_stale else self.settings.lease_s)

        def held(c: int) -> bool:
            if self.leases.held(c):
                return True
            info = claims.get(c)
            if info is None or self.chunks.is_pending(c):
                return False  # free, or possibly our own unanswered claim (looked at below)
            return live(c, info)

        free = [c for c in range(self.n_chunks) if c not in done and not held(c)]
        # Plan order (the plan's shrinking tail stays last), except where workers claim at the same
        # moment: the first claim starts at the worker's own place among the first few free chunks,
        # and after a refusal each jumps to its own place among the next few.
        w = max(1, self.settings.n_workers)
        if not self._ours_ever:
            free = rotate(free, w, self.settings.map_index)
        candidates = deque([*free, *sorted(c for c in repair if not held(c))])
        refused = False
        while candidates and not self.stop_event.is_set():
            c = candidates.popleft()
            info = claims.get(c)
            recovered = None
            if self.chunks.is_pending(c):
                # A claim of ours whose answer was lost: its nonce says whether the key is ours, so
                # our own claim is never read as a peer's (and waited out for a lease).
                recovered = self.chunks.recover(c, deadline_s=min(30.0, self.settings.store_deadline_s))
                if recovered is None and info is not None and live(c, info) and not self.chunks.is_pending(c):
                    continue  # a peer's live claim
            lease = recovered or self.chunks.claim(c, info, deadline_s=min(30.0, self.settings.store_deadline_s),
                                                   should_stop=self.stop_event.is_set)
            if lease is not None and self.stop_event.is_set():
                # Stopping began while the claim was in flight: main may already have released
                # the leases it saw, so this one is released here, at once.
                self.leases.add(lease)
                self._release_claimed(lease)
                return None
            if lease is None:
                if stale:
                    self._last_scan = None
                    return None
                if not refused:
                    refused = True
                    candidates = deque(rotate(list(candidates), w, self.settings.map_index))
                continue
            if info is not None and recovered is None:
                mine = c in self._own_stale
                self._own_stale.discard(c)
                if not mine:
                    self._count("chunks_taken_over", 1)
                    age = (now - info.last_modified).total_seconds()
                    logger.warning("took over chunk %d: its claim was not renewed for %.0fs", c, age)
            self.leases.add(lease)
            self._ours_ever = True
            return self._open_or_park(lease, repairing=c in repair)
        return None

    def _open_or_park(self, lease: Lease, repairing: bool) -> OpenChunk | None:
        """Load a claimed chunk; if S3 is unavailable, keep the claim (renewed) and retry later."""
        try:
            return self._open_claimed(lease, repairing)
        except StoreUnavailable as exc:
            logger.warning("chunk %d: could not load it yet (%s); keeping the claim and retrying", lease.chunk, exc)
            with self._parked_lock:
                self._unopened.append((lease, repairing))
            return None

    def _release_claimed(self, lease: Lease) -> None:
        if self.leases.move(lease, State.RELEASED, "claimer"):
            self.chunks.release(lease, deadline_s=60)

    def _open_claimed(self, lease: Lease, repairing: bool) -> OpenChunk | None:
        """Load the work of a chunk we now hold, or let go if someone finished it meanwhile."""
        c = lease.chunk
        if repairing:
            got = self.store.get(self.layout.part_key(c))
            marker = self.store.head(self.layout.retry_key(c))
            # The marker is re-read: the listing may be up to marker_scan_every_s old.
            if got is None or marker is None or not self.scanner.marker_wants_repair(marker):
                self._release_claimed(lease)
                return None
            rows = decode_part(got[0]).to_pylist()
            redo = [{"id": r["id"], "messages": r["messages"], "sample": int(r.get("sample") or 0),
                     "original_messages": r.get("original_messages"),
                     **{c: r.get(c) for c in ROW_LABEL_COLUMNS}} for r in rows if self._wants_redo(r)]
            body = self.scanner.marker_body(marker) or {}
            if not redo:
                self._settle_marker(c, marker, rows, body)
                self._release_claimed(lease)
                return None
            chunk = OpenChunk(c, lease, redo, base_rows=rows, part_etag=got[1], marker_runs=self.scanner.marker_runs(body))
            if not self.leases.move(lease, State.REPAIRING, "claimer"):
                return None
            logger.info("repairing chunk %d: %d failed row(s) from an earlier run", c, len(redo))
            return chunk
        # The chunk may have been committed between our listing and our claim. The three reads
        # are independent, so they go out at once.
        part_f = self._io.submit(self.store.head, self.layout.part_key(c))
        partial_f = self._io.submit(self.store.get, self.layout.partial_key(c))
        got = self.store.get(self.layout.input_key(self.plan_id, c))
        if part_f.result() is not None:  # bounded: the claimer's thread, which main gives up on at the stop
            self.scanner.mark_done(c)
            self._release_claimed(lease)
            return None
        if got is None:
            raise RuntimeError(f"input of chunk {c} is missing: {self.layout.input_key(self.plan_id, c)}")
        chunk = OpenChunk(c, lease, decode_inputs(got[0]))
        partial = partial_f.result()  # bounded: the claimer's thread, which main gives up on at the stop
        if partial is not None:
            ids = {unit_key(p) for p in chunk.prompts}
            for row in decode_part(partial[0]).to_pylist():
                # Only rows that are results for good: a completion that finished (older code may
                # have saved an aborted one) or a permanent error; anything else is redone.
                usable = (row.get("finish_reason") in FINISHED) if not row.get("error_class") \
                    else not row.get("retryable")
                if unit_key(row) in ids and usable:
                    chunk.results[unit_key(row)] = row
            chunk.todo = [p for p in chunk.prompts if unit_key(p) not in chunk.results]
            logger.info("chunk %d: %d row(s) saved by a worker that gave up are reused", c, len(chunk.results))
        if not self.leases.move(lease, State.OPEN, "claimer"):
            return None
        return chunk

    def _settle_marker(self, c: int, marker: ObjectInfo, rows: list[dict[str, Any]], body: dict[str, Any]) -> None:
        """A marker that asks for a repair with nothing to redo (a task killed between a repair's
        part PUT and its marker update, or rows this run made) is rewritten from the part's rows,
        or deleted when it has none: otherwise every later task would poll it forever. If-Match: a
        marker changed meanwhile is left to its writer."""
        retryable = sum(1 for r in rows if r.get("error_class") and r.get("retryable"))
        permanent = sum(1 for r in rows if r.get("error_class") and not r.get("retryable"))
        key = self.layout.retry_key(c)
        try:
            if retryable or permanent:
                runs = [*self.scanner.marker_runs(body), self.settings.run_id]
                new = json.dumps({"runs": runs, "run_id": self.settings.run_id,
                                  "retryable": retryable, "permanent": permanent}).encode()
                self.store.put(key, new, if_match=marker.etag, content_type="application/json")
            else:
                self.store.delete(key, if_match=marker.etag)
            logger.info("chunk %d: retry marker had nothing for this run to redo; settled", c)
        except PreconditionFailed:
            pass
        self.scanner.forget_repairs()

    def _run(self) -> None:
        """Claims chunks ahead of need on its own thread, so S3 round trips never stall dispatch."""
        s = self.settings
        unavailable_since: float | None = None
        while not self.stop_event.is_set():
            try:
                chunk = self._step()
                unavailable_since = None
            except StoreUnavailable as exc:
                unavailable_since = unavailable_since or time.monotonic()
                if time.monotonic() - unavailable_since >= s.store_deadline_s:
                    self.error = exc
                    return
                logger.warning("claimer: S3 unavailable (%s); retrying", exc)
                self.wake.wait(min(5.0, max(0.2, s.poll_s)))
                self.wake.clear()
                continue
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main loop
                self.error = exc
                return
            if chunk is False:
                continue
            if chunk is None:
                self.idle.set()
                self.wake.wait(s.poll_s)
                self.wake.clear()
                continue
            self.idle.clear()
            if len(chunk.prompts) < self.full_chunk and chunk.base_rows is None:
                self._in_tail = True
            # From here the chunk is main's (Ledger); if the stop began meanwhile, main's stop path
            # takes it from the Ledger with every other open chunk.
            self.ledger.offer(chunk)
            if self.stop_event.is_set():
                return

    def _step(self) -> OpenChunk | None | bool:
        """One claimer step: an OpenChunk, None (nothing to claim now) or False (waited, go on)."""
        failing = self._failing_since()
        if failing is not None and time.monotonic() - failing >= self.settings.handoff_after_s:
            # The server is failing: parked claims go to the fleet with the open chunks (main
            # hands those back; these are the claimer's own).
            while (item := self._pop_parked()) is not None:
                if not item[0].gone:
                    self._release_claimed(item[0])
        while (item := self._first_parked()) is not None:
            lease, repairing = item
            if lease.gone:
                self._drop_parked(lease)
                continue
            chunk = self._open_claimed(lease, repairing)  # StoreUnavailable: stays parked
            self._drop_parked(lease)
            if chunk is not None:
                return chunk
        if self.stop_event.is_set() or not self._demand(self.lookahead_s()):
            self.wake.wait(0.05)
            self.wake.clear()
            return False
        started = time.monotonic()
        chunk = self._try_claim()
        took = time.monotonic() - started
        # Quick to rise, slow to fall: one slow claim raises the lookahead at once.
        self._claim_latency_s = max(took, 0.8 * self._claim_latency_s + 0.2 * took)
        if chunk is None and self.has_parked():
            return False
        return chunk

    def release_parked(self) -> list[Lease]:
        """Stopping (the thread has ended or been given up on): the parked claims, for main to release."""
        with self._parked_lock:
            leases = [lease for lease, _ in self._unopened if not lease.gone]
            self._unopened.clear()
        return leases

    def _first_parked(self) -> tuple[Lease, bool] | None:
        with self._parked_lock:
            return self._unopened[0] if self._unopened else None

    def _pop_parked(self) -> tuple[Lease, bool] | None:
        with self._parked_lock:
            return self._unopened.popleft() if self._unopened else None

    def _drop_parked(self, lease: Lease) -> None:
        """Remove `lease` if it is still first (main may have taken every parked claim meanwhile)."""
        with self._parked_lock:
            if self._unopened and self._unopened[0][0] is lease:
                self._unopened.popleft()
