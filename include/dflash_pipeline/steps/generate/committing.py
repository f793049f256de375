"""The committer thread's half of the worker (a mixin of `Worker`): QUEUED -> COMMITTING ->
COMMITTED, the part written once (chunks.ChunkStore.commit), its retry marker and partial cleanup,
then the claim released. When the worker stops it takes no chunk after `_commit_until`; main then
saves and releases whatever it did not commit (Worker._give_up)."""

from __future__ import annotations

import json
import logging
import queue
import time
from typing import Any

from dflash_pipeline.dataset.records import encode_part, unit_key
from dflash_pipeline.dataset.store import with_retries
from dflash_pipeline.steps.generate.chunks import CommitOutcome, State
from dflash_pipeline.steps.generate.state import OpenChunk

logger = logging.getLogger(__name__)


class Committing:
    """Mixin: the committer thread's methods (module docstring)."""

    store: Any
    layout: Any
    settings: Any
    leases: Any
    chunks: Any

    # -- committer thread -----------------------------------------------------------------------
    def _committer(self) -> None:
        """Commits queued chunks in order. `_committer_stop`: at the normal end, drain the queue and
        return; when stopping, take no chunk after `_commit_until` (main saves what is left)."""
        while True:
            try:
                chunk = self._commit_q.get(timeout=0.1)
            except queue.Empty:
                if self._committer_stop.is_set():
                    return
                continue
            if chunk is None:
                continue
            if self._commit_until is not None and time.monotonic() >= self._commit_until:
                return  # its lease stays QUEUED: main's to save and release
            try:
                self._commit(chunk)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main loop
                self._commit_error = exc
                return
            finally:
                with self._committing_lock:
                    self._committing -= 1
                    self._committing_rows -= len(chunk.prompts)
                    if self._queued.get(chunk.index) is chunk:
                        del self._queued[chunk.index]

    def _commit_deadline(self) -> float:
        """Seconds left for the commit's S3 calls: the store deadline, or up to `_commit_until`
        (one absolute time for all of a stopping commit's calls)."""
        stop_at = self._commit_until
        if stop_at is None:
            return self.settings.store_deadline_s
        return max(0.1, stop_at - time.monotonic())

    def _commit(self, chunk: OpenChunk) -> None:
        lease = chunk.lease
        assert lease is not None
        if not self.leases.move(lease, State.COMMITTING, "committer"):
            return
        if chunk.base_rows is not None:
            rows = [chunk.results.get(unit_key(r), r) for r in chunk.base_rows]
        else:
            rows = [chunk.results[unit_key(p)] for p in chunk.prompts]
        key = self.layout.part_key(chunk.index)
        outcome = self.chunks.commit(key, encode_part(rows), nonce=lease.nonce, if_match=chunk.part_etag,
                                     deadline_s=self._commit_deadline())
        if outcome is CommitOutcome.REFUSED:
            self._count("commits_refused")
            self._count("rows_discarded", len(chunk.results))
            logger.warning(
                "chunk %d was already committed by another worker; %d rows of ours discarded",
                chunk.index, len(chunk.results),
            )
        else:
            self._count("chunks_committed")
            logger.info("committed chunk %d (%d rows) -> %s", chunk.index, len(rows), key)
            self._write_marker(chunk, rows)
            if chunk.todo is not None or chunk.checkpointed:
                with_retries(lambda: self.store.delete(self.layout.partial_key(chunk.index)), what="partial",
                             deadline_s=self._commit_deadline())
        self._mark_done(chunk.index)
        if self.leases.move(lease, State.COMMITTED, "committer"):
            self.chunks.release(lease, deadline_s=min(60.0, self._commit_deadline()))
        # else: stopping, main released the lease meanwhile (and owns that release)

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
                         deadline_s=self._commit_deadline())
        elif repaired:
            with_retries(lambda: self.store.delete(key), what="marker", deadline_s=self._commit_deadline())
        self._repair_cache = None
