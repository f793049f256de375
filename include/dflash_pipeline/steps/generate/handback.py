"""Giving chunks back to the fleet: a chunk's finished rows saved as its partial, then its claim
released, for many chunks at once by one absolute deadline; and the periodic checkpoints.

`PartialWriter` is the one owner of partial writes. Writes of one chunk's partial are serialized
under that chunk's lock, and a final save (hand-off or stop) seals the chunk: a checkpoint still
in flight finishes before the final save is sent, and one not yet started is skipped, so a partial
with fewer rows can never land after, and overwrite, the stop's fuller one (chunks.py
invariant 6). All threads here are daemons: a save stuck in S3 past its deadline delays nothing,
the task ends and the claim expires with its lease.

Deadlines are callables (monotonic time), read again at every wait: a SIGTERM that arrives during
a hand-off shortens the hand-off to the stop's grace instead of waiting out the original deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import encode_part
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.steps.generate.chunks import ChunkStore, Lease

logger = logging.getLogger(__name__)

Deadline = Callable[[], float]


class PartialWriter:
    """Serialized partial writes per chunk (module docstring)."""

    def __init__(self, store: Store, layout: DatasetLayout) -> None:
        self.store = store
        self.layout = layout
        self._lock = threading.Lock()
        self._chunk_locks: dict[int, threading.Lock] = {}
        self._sealed: set[int] = set()

    def _chunk_lock(self, c: int) -> threading.Lock:
        with self._lock:
            return self._chunk_locks.setdefault(c, threading.Lock())

    def checkpoint(self, c: int, rows: list[dict[str, Any]], *, deadline_s: float,
                   should_stop: Callable[[], bool]) -> None:
        """A best-effort checkpoint on a daemon thread; skipped once the chunk is sealed."""

        def save() -> None:
            with self._chunk_lock(c):
                with self._lock:
                    if c in self._sealed:
                        return
                try:
                    data = encode_part(rows)
                    with_retries(lambda: self.store.put(self.layout.partial_key(c), data), what=f"checkpoint {c}",
                                 deadline_s=deadline_s, should_stop=should_stop)
                except Exception as exc:  # noqa: BLE001 - a checkpoint is best effort
                    logger.warning("could not checkpoint chunk %d: %s", c, exc)

        threading.Thread(target=save, name=f"checkpoint-{c}", daemon=True).start()

    def seal(self, c: int) -> None:
        """No checkpoint of chunk `c` starts after this (its rows are committed or handed back)."""
        with self._lock:
            self._sealed.add(c)

    def save_final(self, c: int, rows: list[dict[str, Any]], deadline: Deadline) -> bool:
        """Seal the chunk and save `rows` as its partial, after any checkpoint in flight."""
        self.seal(c)
        lock = self._chunk_lock(c)
        if not lock.acquire(timeout=max(0.0, deadline() - time.monotonic())):
            logger.warning("chunk %d: a checkpoint is still being written at the deadline; its %d rows are "
                           "not saved", c, len(rows))
            return False
        try:
            data = encode_part(rows)
            with_retries(lambda: self.store.put(self.layout.partial_key(c), data), what=f"save partial {c}",
                         deadline_s=max(0.1, deadline() - time.monotonic()), cap_s=0.5,
                         should_stop=lambda: time.monotonic() >= deadline())
            return True
        finally:
            lock.release()


def hand_back(jobs: list[tuple[Lease, list[dict[str, Any]]]], *, partials: PartialWriter, chunks: ChunkStore,
              deadline: Deadline, unanswered: list[int] | tuple[int, ...] = ()) -> int:
    """For each (lease already RELEASED by its owner, rows): save the rows as the chunk's partial,
    then delete the claim; all chunks at once, in the order given (complete chunks first is the
    caller's choice), each bounded by `deadline()`, re-read while waiting. `unanswered`: chunks
    whose claim of ours may exist with its answer lost (ChunkStore.pending, no lease known): each
    is looked up by its nonce and deleted if ours, at the same time. Returns the rows saved by
    the deadline."""
    saved = [0]
    lock = threading.Lock()

    def lost_answer(chunk: int) -> None:
        left = lambda: max(0.1, deadline() - time.monotonic())  # noqa: E731
        try:
            lease = chunks.recover(chunk, deadline_s=left())
            if lease is not None and time.monotonic() < deadline():
                chunks.release(lease, deadline_s=left(), should_stop=lambda: time.monotonic() >= deadline())
        except Exception as exc:  # noqa: BLE001 - the claim then expires with its lease
            logger.warning("could not release the claim of chunk %d whose answer was lost: %s", chunk, exc)

    def one(lease: Lease, rows: list[dict[str, Any]]) -> None:
        left = lambda: max(0.1, deadline() - time.monotonic())  # noqa: E731
        try:
            if rows and partials.save_final(lease.chunk, rows, deadline):
                with lock:
                    saved[0] += len(rows)
        except Exception as exc:  # noqa: BLE001 - best effort; the rows are redone otherwise
            logger.warning("could not save the %d finished rows of chunk %d: %s", len(rows), lease.chunk, exc)
        if time.monotonic() >= deadline():
            return  # out of time: the claim expires with its lease
        try:
            chunks.release(lease, deadline_s=left(), should_stop=lambda: time.monotonic() >= deadline())
        except Exception as exc:  # noqa: BLE001 - the claim then expires with its lease
            logger.warning("could not release chunk %d: %s", lease.chunk, exc)

    threads = [threading.Thread(target=one, args=job, name=f"handback-{job[0].chunk}", daemon=True)
               for job in jobs]
    threads += [threading.Thread(target=lost_answer, args=(c,), name=f"unanswered-{c}", daemon=True)
                for c in unanswered]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive() and time.monotonic() < deadline():
            t.join(timeout=min(0.1, max(0.0, deadline() - time.monotonic())))
    with lock:
        return saved[0]
