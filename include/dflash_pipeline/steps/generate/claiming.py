"""The claimer thread's half of the worker (a mixin of `Worker`): scanning S3, claiming chunks
ahead of need, opening what it claimed (or parking it while S3 is unavailable), repairs and their
markers, and main's `_all_done` check with its sweep. It owns CLAIMED and the moves out of it
(chunks.py), `_done_cache` / `_lowest_unfinished` (under `_scan_lock`) and `_unopened`.

It uses the Worker's state set up in `Worker.__init__` (store, layout, settings, leases, chunks,
open chunks and their lock, the claimer's events); nothing here runs on main except `_all_done`
and `_sweep_stale_claims`.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from typing import Any

from dflash_pipeline.dataset.layout import chunk_of_key
from dflash_pipeline.dataset.records import decode_inputs, decode_part, unit_key
from dflash_pipeline.dataset.store import ObjectInfo, PreconditionFailed, StoreUnavailable, with_retries
from dflash_pipeline.steps.generate.chunks import Lease, State, claim_doc
from dflash_pipeline.steps.generate.outcomes import FINISHED
from dflash_pipeline.steps.generate.pool import rotate
from dflash_pipeline.steps.generate.state import OpenChunk

logger = logging.getLogger(__name__)


class Claiming:
    """Mixin: the claimer thread's methods (module docstring)."""

    # Set by Worker.__init__ (listed for readers; the mixin has no state of its own).
    store: Any
    layout: Any
    settings: Any
    leases: Any
    chunks: Any

    # -- scanning (claimer thread, and main's _all_done) -----------------------------------------
    def _scan(self, fresh_markers: bool = False) -> tuple[set[int], dict[int, ObjectInfo], set[int]]:
        """(committed chunks, claims of chunks, chunks to repair). The two listings run at once."""
        claims_f = self._io.submit(lambda: list(self.store.list(self.layout.claims_prefix)))
        prefix = self.layout.completions_prefix
        with self._scan_lock:
            done = set(self._done_cache)
            low = self._lowest_unfinished
            after = self.layout.part_key(low - 1) if low > 0 else None
            for obj in self.store.list(prefix, start_after=after):
                c = chunk_of_key(obj.key, prefix)
                if c is not None:
                    done.add(c)
            while low < self.n_chunks and low in done:
                low += 1
            self._lowest_unfinished = low
            self._done_cache = done
        claims: dict[int, ObjectInfo] = {}
        for obj in claims_f.result():
            c = chunk_of_key(obj.key, self.layout.claims_prefix)
            if c is not None:
                claims[c] = obj
        return done, claims, self._repairs(done, fresh_markers)

    def _mark_done(self, c: int) -> None:
        with self._scan_lock:
            self._done_cache.add(c)

    def _repairs(self, done: set[int], fresh: bool) -> set[int]:
        """Committed chunks whose retry marker asks this run for a repair."""
        if self.settings.retry_failed_rows == "none":
            return set()
        now = time.monotonic()
        cached = self._repair_cache
        if fresh or cached is None or now - cached[0] >= self.settings.marker_scan_every_s:
            wanted: set[int] = set()
            prefix = self.layout.retry_prefix
            for obj in self.store.list(prefix):
                c = chunk_of_key(obj.key, prefix)
                if c is not None and self._marker_wants_repair(obj):
                    wanted.add(c)
            cached = self._repair_cache = (now, wanted)
        return {c for c in cached[1] if c in done}

    def _marker_body(self, obj: ObjectInfo) -> dict[str, Any] | None:
        cached = self._markers.get(obj.key)
        if cached is None or cached[0] != obj.etag:
            got = self.store.get(obj.key)
            if got is None:
                return None
            body = claim_doc(got[0])
            cached = (got[1], body)
            self._markers[obj.key] = cached
        return cached[1]

    @staticmethod
    def _marker_runs(body: dict[str, Any]) -> list[str]:
        runs = body.get("runs")
        if isinstance(runs, list):
            return [str(r) for r in runs]
        return [str(body["run_id"])] if body.get("run_id") else []

    def _marker_wants_repair(self, obj: ObjectInfo) -> bool:
        """A marker no run of ours has produced or repaired yet: each run touches a chunk's error
        rows at most once, so two runs on one root never repair each other's rows back and forth."""
        body = self._marker_body(obj)
        if body is None or self.settings.run_id in self._marker_runs(body):
            return False
        if self.settings.retry_failed_rows == "all":
            return int(body.get("retryable", 0)) + int(body.get("permanent", 0)) > 0
        return int(body.get("retryable", 0)) > 0

    def _wants_redo(self, row: dict[str, Any]) -> bool:
        if row.get("run_id") == self.settings.run_id:
            return False
        if not row.get("error_class"):
            # Stored as a completion by older code although unfinished ("abort"): retryable.
            return row.get("finish_reason") not in FINISHED
        return self.settings.retry_failed_rows == "all" or bool(row.get("retryable"))

    def _find_own_stale(self, claims: dict[int, ObjectInfo]) -> set[int]:
        """Chunks a previous try of this same worker claimed: ours to take back without waiting."""
        own: set[int] = set()
        for c in claims:
            got = self.store.get(self.layout.claim_key(c))
            if got is not None and claim_doc(got[0]).get("owner") == self.settings.owner:
                own.add(c)
        if own:
            logger.info("taking back %d chunk(s) claimed by an earlier try of this task: %s", len(own), sorted(own))
        return own

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
        scan = self._scan()
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

        def held(c: int) -> bool:
            if self.leases.held(c):
                return True
            info = claims.get(c)
            if info is None or c in self._own_stale:
                return False
            return (now - info.last_modified).total_seconds() <= self.settings.lease_s

        free = [c for c in range(self.n_chunks) if c not in done and not held(c)]
        # Plan order (the plan's shrinking tail stays last), except where workers claim at the same
        # moment: the first claim starts at the worker's own place among the first few free chunks,
        # and after a refusal each jumps to its own place among the next few.
        w = max(1, self.settings.n_workers)
        if not self._ours_ever:
            free = rotate(free, w, self.settings.map_index)
        candidates = deque([*free, *sorted(c for c in repair if not held(c))])
        refused = False
        while candidates and not self._claimer_stop.is_set():
            c = candidates.popleft()
            info = claims.get(c)
            lease = self.chunks.claim(c, info, deadline_s=min(30.0, self.settings.store_deadline_s),
                                      should_stop=self._claimer_stop.is_set)
            if lease is not None and self._claimer_stop.is_set():
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
            if info is not None:
                mine = c in self._own_stale
                self._own_stale.discard(c)
                if not mine:
                    self._count("chunks_taken_over")
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
            if got is None or marker is None or not self._marker_wants_repair(marker):
                self._release_claimed(lease)
                return None
            rows = decode_part(got[0]).to_pylist()
            redo = [{"id": r["id"], "messages": r["messages"], "sample": int(r.get("sample") or 0),
                     "original_messages": r.get("original_messages")} for r in rows if self._wants_redo(r)]
            body = self._marker_body(marker) or {}
            if not redo:
                self._settle_marker(c, marker, rows, body)
                self._release_claimed(lease)
                return None
            chunk = OpenChunk(c, lease, redo, base_rows=rows, part_etag=got[1], marker_runs=self._marker_runs(body))
            if not self.leases.move(lease, State.REPAIRING, "claimer"):
                return None
            logger.info("repairing chunk %d: %d failed row(s) from an earlier run", c, len(redo))
            return chunk
        # The chunk may have been committed between our listing and our claim. The three reads
        # are independent, so they go out at once.
        part_f = self._io.submit(self.store.head, self.layout.part_key(c))
        partial_f = self._io.submit(self.store.get, self.layout.partial_key(c))
        got = self.store.get(self.layout.input_key(self.plan_id, c))
        if part_f.result() is not None:
            self._mark_done(c)
            self._release_claimed(lease)
            return None
        if got is None:
            raise RuntimeError(f"input of chunk {c} is missing: {self.layout.input_key(self.plan_id, c)}")
        chunk = OpenChunk(c, lease, decode_inputs(got[0]))
        partial = partial_f.result()
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
                runs = [*self._marker_runs(body), self.settings.run_id]
                new = json.dumps({"runs": runs, "run_id": self.settings.run_id,
                                  "retryable": retryable, "permanent": permanent}).encode()
                self.store.put(key, new, if_match=marker.etag, content_type="application/json")
            else:
                self.store.delete(key, if_match=marker.etag)
            logger.info("chunk %d: retry marker had nothing for this run to redo; settled", c)
        except PreconditionFailed:
            pass
        self._repair_cache = None

    def _claim_wanted(self) -> bool:
        """Claim while the prompts ready to send cover less than the time a claim takes (with margin),
        and while the rows we hold stay under the cap."""
        if self._suspect_since is not None or self._stop_requested.is_set():
            return False
        ready = len(self.pending) + self._claimed_prompts
        ahead_s = 3.0 * self._claim_latency_s
        if not self._in_tail:
            ahead_s = max(self.settings.claim_ahead_s, ahead_s)
        want = self._limit() + int(self._rate() * ahead_s)
        return ready < want and self._held_rows() < self.held_rows_cap

    def _held_rows(self) -> int:
        with self._open_lock:
            open_rows = sum(len(ch.prompts) for ch in self.open.values())
        return open_rows + self._committing_rows + self._claimed_prompts

    def _claimer(self) -> None:
        """Claims chunks ahead of need on its own thread, so S3 round trips never stall dispatch."""
        s = self.settings
        unavailable_since: float | None = None
        while not self._claimer_stop.is_set():
            try:
                chunk = self._claim_step()
                unavailable_since = None
            except StoreUnavailable as exc:
                unavailable_since = unavailable_since or time.monotonic()
                if time.monotonic() - unavailable_since >= s.store_deadline_s:
                    self._claim_error = exc
                    return
                logger.warning("claimer: S3 unavailable (%s); retrying", exc)
                self._claimer_wake.wait(min(5.0, max(0.2, s.poll_s)))
                self._claimer_wake.clear()
                continue
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main loop
                self._claim_error = exc
                return
            if chunk is False:
                continue
            if chunk is None:
                self._claimer_idle.set()
                self._claimer_wake.wait(s.poll_s)
                self._claimer_wake.clear()
                continue
            self._claimer_idle.clear()
            if len(chunk.prompts) < self._full_chunk and chunk.base_rows is None:
                self._in_tail = True
            with self._open_lock:
                self.open[chunk.index] = chunk
            with self._committing_lock:
                self._claimed_prompts += len(chunk.prompts_to_send())
            self._claimed.put(chunk)
            if self._claimer_stop.is_set():
                return  # main's give-up drains `_claimed` and releases it

    def _claim_step(self) -> OpenChunk | None | bool:
        """One claimer step: an OpenChunk, None (nothing to claim now) or False (waited, go on)."""
        suspect = self._suspect_since
        if suspect is not None and time.monotonic() - suspect >= self.settings.handoff_after_s:
            # The server is failing: parked claims go to the fleet with the open chunks (main
            # hands those back; these are the claimer's own).
            while self._unopened:
                lease, _ = self._unopened.popleft()
                if not lease.gone:
                    self._release_claimed(lease)
        while self._unopened:
            lease, repairing = self._unopened[0]
            if lease.gone:
                self._unopened.popleft()
                continue
            chunk = self._open_claimed(lease, repairing)  # StoreUnavailable: stays parked
            self._unopened.popleft()
            if chunk is not None:
                return chunk
        if not self._claim_wanted():
            self._claimer_wake.wait(0.05)
            self._claimer_wake.clear()
            return False
        started = time.monotonic()
        chunk = self._try_claim()
        took = time.monotonic() - started
        # Quick to rise, slow to fall: one slow claim raises the lookahead at once.
        self._claim_latency_s = max(took, 0.8 * self._claim_latency_s + 0.2 * took)
        if chunk is None and self._unopened:
            return False
        return chunk

    def _all_done(self) -> bool:
        """Every chunk committed and nothing left to repair (by this worker's policy)."""
        done, claims, repair = with_retries(
            lambda: self._scan(fresh_markers=True), what="scan", deadline_s=self.settings.store_deadline_s,
            should_stop=self._stop_requested.is_set,
        )
        finished = not repair and len(done & set(range(self.n_chunks))) == self.n_chunks
        if finished:
            self._sweep_stale_claims(done, claims)
        return finished

    def _sweep_stale_claims(self, done: set[int], claims: dict[int, ObjectInfo]) -> None:
        """Delete claims of committed chunks nobody needs: expired ones (a task SIGKILLed after
        claiming a chunk a peer had just committed), and at once those an earlier try of this very
        task left (SIGKILLed between its commit and its release; the claim document names the
        owner, so "is it ours?" is read from S3). If-Match the listed ETag, so a claim renewed or
        retaken meanwhile is left alone."""
        now = self.store.server_time()
        for c, info in claims.items():
            if c not in done or self.leases.held(c):
                continue
            expired = (now - info.last_modified).total_seconds() > self.settings.lease_s
            try:
                if not expired:
                    if self.settings.try_number <= 1:
                        continue
                    got = self.store.get(info.key)
                    if got is None or got[1] != info.etag or claim_doc(got[0]).get("owner") != self.settings.owner:
                        continue
                self.store.delete(info.key, if_match=info.etag)
                logger.info("deleted the %s claim of committed chunk %d", "expired" if expired else "earlier try's", c)
            except (PreconditionFailed, StoreUnavailable):
                pass
        # A partial outlives its chunk's commit when the stop path saved it while a commit was in
        # flight, or a hand-off raced one: the part is what counts, the partial is only clutter.
        try:
            for obj in self.store.list(self.layout.partials_prefix):
                c = chunk_of_key(obj.key, self.layout.partials_prefix)
                if c is not None and c in done and not self.leases.held(c):
                    self.store.delete(obj.key, if_match=obj.etag)
        except (PreconditionFailed, StoreUnavailable):
            pass
