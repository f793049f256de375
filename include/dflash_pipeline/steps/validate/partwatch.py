"""The generate task's on-part-committed hook (issue 40): each committed part's digest, its live quality
figures and the fail-fast check, computed while the server generates.

Threads and ownership. The committer calls `committed(chunk, data)` right after the part is in S3; it only
queues the bytes and never raises, so the chunk protocol is untouched; when the queue is full it keeps only
the chunk's number (`_pending`, under `_lock`), and the watcher thread reads that part back from S3 once the
queue is empty, so the live figures still cover every part this try committed (they used to miss the parts
dropped under load, and validation computed those digests). One watcher thread owns everything else: it reads the chunk's planned ids,
makes the digest (digest.py, the same function validation uses), writes it, folds it into the task's
LiveTally, writes `runs/<run_id>/quality/<worker>-try<N>.json` (one object per try: a retry's tally starts
empty, and the parts only an earlier try committed keep their figures in that try's object; a part is
committed once, so no part is counted twice), reads the other tasks' figures of this run and,
with fail_fast on, asks the worker to stop (`on_stop(message)`) once a figure of the fleet is surely above
its limit, or its own server's alone is (steps/quality/live.py: `verdicts`; a server that alone breaks a
limit stops alone, the others carry on). A kill between a part and its digest loses only the digest: validation
computes it from the part. `close(timeout_s)` drains the queue at the task's end.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.monitor.livequality import merge_groups
from dflash_pipeline.steps.quality.live import Limit, LiveTally, verdicts
from dflash_pipeline.steps.validate.digest import DigestContext
from dflash_pipeline.steps.validate.run import digest_of_part, planned_ids, write_digest

logger = logging.getLogger(__name__)

QUEUE_PARTS = 8
"""Parts waiting for their digest (bounds the memory the hook holds: 8 encoded parts)."""


class RunStoppedEarly(Exception):
    """A live quality figure is surely above the run's limit; the message says which and what to change."""


class PartWatcher:
    """The hook object (module docstring)."""

    def __init__(self, store: Store, layout: DatasetLayout, ctx: DigestContext, *, run_id: str, worker: str,
                 limits: Sequence[Limit], fail_fast: bool, on_stop: Callable[[str], None] | None = None,
                 store_deadline_s: float = 60.0, server: str | None = None, try_number: int = 1) -> None:
        self.store = store
        self.layout = layout
        self.ctx = ctx
        self.run_id = run_id
        self.worker = worker
        self.try_number = try_number
        self.server = server
        self.limits = list(limits)
        self.fail_fast = fail_fast
        self.on_stop = on_stop
        self.deadline_s = store_deadline_s
        languages = ctx.quality.languages if ctx.quality is not None else None
        self.live = LiveTally(ctx.thinking, languages)
        self.verdict: str | None = None
        self.verdict_groups: list[dict[str, Any]] = []
        """The fleet's figures the verdict was reached on."""
        self.dropped = 0
        self.digests_written = 0
        self._q: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=QUEUE_PARTS)
        self._lock = threading.Lock()
        self._pending: list[int] = []
        """Parts committed while the queue was full: digested from S3 when the queue is empty."""
        self._close_by: float | None = None
        self._thread = threading.Thread(target=self._run, name="part-digests", daemon=True)
        self._thread.start()

    # -- the committer's side -------------------------------------------------------------------
    def committed(self, chunk: int, data: bytes) -> None:
        """Part `chunk` (its bytes) is in S3. Never blocks or raises."""
        try:
            self._q.put_nowait((chunk, data))
        except queue.Full:
            with self._lock:
                self._pending.append(chunk)
            logger.info("digest queue full: part %d is digested from S3 later", chunk)

    # -- the watcher thread -------------------------------------------------------------------
    def _run(self) -> None:
        closing = False
        while True:
            with self._lock:
                pending = self._pending[0] if self._pending else None
            try:
                item = self._q.get(timeout=0.2) if pending is not None or closing else self._q.get()
            except queue.Empty:
                item = ()
            if item is None:
                closing = True
                continue
            if item == ():  # the queue is empty: a part the full queue could not take, read back from S3
                if pending is None or (closing and self._close_by is not None and time.monotonic() > self._close_by):
                    with self._lock:
                        self.dropped += len(self._pending)
                    return
                with self._lock:
                    self._pending.pop(0)
                self._safe_digest(pending, None)
                continue
            self._safe_digest(*item)

    def _safe_digest(self, chunk: int, data: bytes | None) -> None:
        try:
            if data is None:
                got = with_retries(lambda: self.store.get(self.layout.part_key(chunk)), what="part for its digest",
                                   deadline_s=self.deadline_s)
                if got is None:
                    raise LookupError(f"part {chunk} is not in S3")
                data = got[0]
            self._digest(chunk, data)
        except Exception as exc:  # noqa: BLE001 - a digest is an optimisation: validation computes it
            logger.warning("digest of part %d failed (%r): validation computes it", chunk, exc)

    def _digest(self, chunk: int, data: bytes) -> None:
        started = time.perf_counter()
        d = digest_of_part(data, planned_ids(self.store, self.layout, self.ctx.plan_id, chunk), chunk, self.ctx)
        write_digest(self.store, self.layout, d)
        self.digests_written += 1
        self.live.add(d.table)
        doc = self.live.doc(self.run_id, self.worker, time.time())
        key = self.layout.live_quality_key(self.run_id, f"{self.worker}-try{self.try_number}")
        with_retries(lambda: self.store.put(key, json.dumps(doc).encode(), content_type="application/json"),
                     what="live quality", deadline_s=self.deadline_s)
        logger.info("digest of part %d (%d rows) in %.2fs", chunk, d.table.num_rows, time.perf_counter() - started)
        if self.fail_fast and self.verdict is None:
            self._check()

    def fleet_docs(self) -> list[dict[str, Any]]:
        """Every task's live figures of this run (its own included)."""
        prefix = self.layout.run_key(self.run_id, "quality/")
        docs = []
        for obj in self.store.list(prefix):
            got = with_retries(lambda: self.store.get(obj.key), what="live quality", deadline_s=self.deadline_s)
            if got is not None:
                try:
                    docs.append(json.loads(got[0]))
                except ValueError:
                    continue
        return docs

    def _check(self) -> None:
        groups = merge_groups(self.fleet_docs())
        found = verdicts(groups, self.limits)
        msg = found.get(self.server) if self.server is not None else None
        msg = msg or found.get(None)
        if msg is None:
            return
        self.verdict = msg
        self.verdict_groups = groups
        logger.error("%s", msg)
        if self.on_stop is not None:
            self.on_stop(msg)

    def close(self, timeout_s: float) -> None:
        """Digest what is queued, within `timeout_s` (what is left, validation computes)."""
        end = time.monotonic() + timeout_s
        self._close_by = end
        while True:
            try:
                self._q.put(None, timeout=max(0.05, end - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= end:
                    break
        self._thread.join(timeout=max(0.0, end - time.monotonic()))
        if self._thread.is_alive():
            logger.warning("digests still being computed at the task's end: validation computes the rest")
