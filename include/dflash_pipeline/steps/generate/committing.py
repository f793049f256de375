"""The committer thread: QUEUED -> COMMITTING -> COMMITTED, the part written once
(chunks.ChunkStore.commit), its retry marker and partial cleanup, then the claim released.

Owner: a chunk is the committer's from `Ledger.to_commit` (main moved its lease to QUEUED) until it
calls `Ledger.committed` (the part is in S3, ours or a peer's). A commit that raises leaves the
chunk in the Ledger, marked failed, and ends the thread with `error` set: main's stop path then
saves the chunk's rows as a partial, so a failed commit never throws finished rows away. When the
worker stops, the committer takes no chunk after `until` and bounds a commit in flight by it; main
then owns every lease left (`Leases.give_up_owner`) and saves what was not committed.

Hook: `on_committed(chunk, data)` is called with the part's bytes right after our part is in S3 (before
its marker and claim release), on this thread. It must return at once and never raise (the quality
digests' PartWatcher queues the bytes for its own thread); an exception from it is logged and ignored,
so the chunk protocol never depends on it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import encode_part, unit_key
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.steps.generate.chunks import (
    ChunkStore,
    CommitOutcome,
    Leases,
    State,
)
from dflash_pipeline.steps.generate.ledger import Ledger
from dflash_pipeline.steps.generate.scan import Scanner
from dflash_pipeline.steps.generate.settings import WorkerSettings
from dflash_pipeline.steps.generate.state import OpenChunk

logger = logging.getLogger(__name__)


class Committer:
    """The committer thread and its stop deadline (module docstring)."""

    def __init__(self, *, store: Store, layout: DatasetLayout, settings: WorkerSettings, leases: Leases,
                 chunks: ChunkStore, ledger: Ledger, scanner: Scanner, count: Callable[[str, int], None],
                 on_committed: Callable[[int, bytes], None] | None = None) -> None:
        self.store = store
        self.layout = layout
        self.settings = settings
        self.leases = leases
        self.chunks = chunks
        self.ledger = ledger
        self.scanner = scanner
        self._count = count
        self._on_committed = on_committed
        self._stop = threading.Event()
        #: Stopping: no chunk is taken after this monotonic time, and a commit in flight is bounded by it.
        self.until: float | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="committer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, until: float | None = None) -> None:
        """At the normal end (`until` None) drain the queue and return; when stopping, take no
        chunk after `until` (main saves what is left)."""
        if until is not None:
            self.until = until
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout=max(0.0, timeout_s))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            chunk = self.ledger.next_to_commit(timeout_s=0.1)
            if chunk is None:
                if self._stop.is_set():
                    return
                continue
            if self.until is not None and time.monotonic() >= self.until:
                return  # its lease stays QUEUED and the chunk in the Ledger: main's to save
            try:
                self._commit(chunk)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main loop
                logger.warning("commit of chunk %d failed (%r); its %d rows are saved as a partial when the "
                               "worker stops", chunk.index, exc, len(chunk.results))
                self.ledger.failed(chunk)
                self.error = exc
                return
            self.ledger.committed(chunk)

    def _deadline(self) -> float:
        """Seconds left for the commit's S3 calls: the store deadline, or up to `until`
        (one absolute time for all of a stopping commit's calls)."""
        stop_at = self.until
        if stop_at is None:
            return self.settings.store_deadline_s
        return max(0.1, stop_at - time.monotonic())

    def _commit(self, chunk: OpenChunk) -> None:
        lease = chunk.lease
        assert lease is not None
        if not self.leases.move(lease, State.COMMITTING, "committer"):
            return  # stopping: main released it meanwhile and saves its rows
        if chunk.base_rows is not None:
            rows = [chunk.results.get(unit_key(r), r) for r in chunk.base_rows]
        else:
            rows = [chunk.results[unit_key(p)] for p in chunk.prompts]
        key = self.layout.part_key(chunk.index)
        data = encode_part(rows)
        outcome = self.chunks.commit(key, data, nonce=lease.nonce, if_match=chunk.part_etag,
                                     deadline_s=self._deadline())
        if outcome is CommitOutcome.REFUSED:
            self._count("commits_refused", 1)
            self._count("rows_discarded", len(chunk.results))
            logger.warning(
                "chunk %d was already committed by another worker; %d rows of ours discarded",
                chunk.index, len(chunk.results),
            )
        else:
            self._count("chunks_committed", 1)
            logger.info("committed chunk %d (%d rows) -> %s", chunk.index, len(rows), key)
            self._hook(chunk.index, data)
            self._write_marker(chunk, rows)
            if chunk.todo is not None or chunk.checkpointed:
                with_retries(lambda: self.store.delete(self.layout.partial_key(chunk.index)), what="partial",
                             deadline_s=self._deadline())
        self.scanner.mark_done(chunk.index)
        if self.leases.move(lease, State.COMMITTED, "committer"):
            self.chunks.release(lease, deadline_s=min(60.0, self._deadline()))
        # else: stopping, main released the lease meanwhile (and owns that release)

    def _hook(self, index: int, data: bytes) -> None:
        if self._on_committed is None:
            return
        try:
            self._on_committed(index, data)
        except Exception as exc:  # noqa: BLE001 - the hook must never fail a commit (module docstring)
            logger.warning("on_committed hook failed for chunk %d: %r", index, exc)

    def _write_marker(self, chunk: OpenChunk, rows: list[dict[str, Any]]) -> None:
        """Flag a part with error rows so a later run retries them (validation re-creates lost flags).

        A chunk committed for the first time cannot have a marker yet (markers only flag committed
        parts), so a clean first commit costs no request; a clean repair clears the old flag. The
        marker lists every run that produced or repaired the rows (each run repairs a chunk once).
        """
        retryable = sum(1 for r in rows if r.get("error_class") and r.get("retryable"))
        permanent = sum(1 for r in rows if r.get("error_class") and not r.get("retryable"))
        key = self.layout.retry_key(chunk.index)
        repaired = chunk.base_rows is not None
        if retryable or permanent:
            runs = [*chunk.marker_runs, self.settings.run_id] if repaired else [self.settings.run_id]
            body = json.dumps({"runs": runs, "run_id": self.settings.run_id,
                               "retryable": retryable, "permanent": permanent})
            with_retries(lambda: self.store.put(key, body.encode(), content_type="application/json"), what="marker",
                         deadline_s=self._deadline())
        elif repaired:
            with_retries(lambda: self.store.delete(key), what="marker", deadline_s=self._deadline())
        self.scanner.forget_repairs()
