"""The one owner of the chunks a worker holds between its threads: where each chunk is, and the
counts the claimer and the progress page read. Every other thread changes it only through these
methods, under one lock, so no field is written by two threads behind each other's back.

Where a chunk is, and who hands it on (the lease's state moves with it, chunks.TRANSITIONS):

    claimer --offer()--> offered (open, not yet seen by main)
    main    --take_offered()--> open (main sends its prompts, fills `results`)
    main    --to_commit()--> queued (the committer's: QUEUED -> COMMITTING -> COMMITTED)
    committer --committed()--> gone          (the part exists, ours or a peer's)
    committer --failed()--> queued, failed   (its rows stay here for the stop path to save)
    main    --forget() / take_open()--> gone (dropped, handed off, or taken by the stop path)
    main    --take_queued()--> gone          (stopping: main saves what was not committed)

A kill loses nothing here that S3 does not have: the Ledger is memory; partials and parts are the
record. An exception in any thread leaves the chunks where they are, for main's stop path.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from dflash_pipeline.steps.generate.state import OpenChunk


class Ledger:
    """Open, offered and queued chunks of one worker (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, OpenChunk] = {}
        self._offered: list[OpenChunk] = []
        self._offered_prompts = 0
        self._queued: dict[int, OpenChunk] = {}
        self._failed: set[int] = set()
        self._commit_q: queue.Queue[OpenChunk] = queue.Queue()

    # -- claimer ----------------------------------------------------------------------------------
    def offer(self, chunk: OpenChunk) -> None:
        """A chunk the claimer opened: open from now on (a lost lease is read from the chunk's own
        lease state, chunks.py invariant 8, so there is no window where it is nobody's)."""
        with self._lock:
            self._open[chunk.index] = chunk
            self._offered.append(chunk)
            self._offered_prompts += len(chunk.prompts_to_send())

    # -- main -------------------------------------------------------------------------------------
    def take_offered(self) -> list[OpenChunk]:
        with self._lock:
            got, self._offered = self._offered, []
            self._offered_prompts = 0
            return got

    def forget(self, chunk: OpenChunk) -> None:
        with self._lock:
            if self._open.get(chunk.index) is chunk:
                del self._open[chunk.index]

    def take_open(self, keep: Callable[[OpenChunk], bool] | None = None) -> list[OpenChunk]:
        """Every open chunk, removed (the stop path takes them all); a hand-off leaves those `keep`
        says (main's: chunks with requests in flight)."""
        with self._lock:
            chunks = [ch for ch in self._open.values() if keep is None or not keep(ch)]
            for ch in chunks:
                del self._open[ch.index]
            self._offered = [ch for ch in self._offered if ch.index in self._open]
            self._offered_prompts = sum(len(ch.prompts_to_send()) for ch in self._offered)
            return chunks

    def to_commit(self, chunk: OpenChunk) -> None:
        """Main moved the lease to QUEUED: the chunk is the committer's now."""
        with self._lock:
            if self._open.get(chunk.index) is chunk:
                del self._open[chunk.index]
            self._queued[chunk.index] = chunk
        self._commit_q.put(chunk)

    def take_queued(self) -> list[OpenChunk]:
        """Stopping (the committer stopped or timed out): every chunk not committed, failed ones first."""
        with self._lock:
            chunks = sorted(self._queued.values(), key=lambda ch: (ch.index not in self._failed, ch.index))
            self._queued.clear()
            self._failed.clear()
            return chunks

    # -- committer --------------------------------------------------------------------------------
    def next_to_commit(self, timeout_s: float) -> OpenChunk | None:
        try:
            return self._commit_q.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def committed(self, chunk: OpenChunk) -> None:
        """The committer is done with the chunk: its part is in S3 (ours or a peer's)."""
        with self._lock:
            if self._queued.get(chunk.index) is chunk:
                del self._queued[chunk.index]

    def failed(self, chunk: OpenChunk) -> None:
        """The commit raised: the chunk stays queued (its rows are saved by the stop path)."""
        with self._lock:
            if self._queued.get(chunk.index) is chunk:
                self._failed.add(chunk.index)

    # -- readers (any thread) ---------------------------------------------------------------------
    def open_chunks(self) -> list[OpenChunk]:
        with self._lock:
            return list(self._open.values())

    def has_open(self) -> bool:
        with self._lock:
            return bool(self._open)

    def has_offered(self) -> bool:
        with self._lock:
            return bool(self._offered)

    def committing(self) -> int:
        """Chunks queued or committing that the committer has not finished (failed ones excluded)."""
        with self._lock:
            return len(self._queued) - len(self._failed)

    def offered_prompts(self) -> int:
        with self._lock:
            return self._offered_prompts

    def held_rows(self) -> int:
        """Rows claimed but not committed: open chunks' prompts plus queued chunks' prompts."""
        with self._lock:
            return sum(len(ch.prompts) for ch in self._open.values()) \
                + sum(len(ch.prompts) for ch in self._queued.values())

    def rows_pending_commit(self) -> int:
        with self._lock:
            return sum(len(ch.results) for ch in self._open.values() if not ch.dropped) \
                + sum(len(ch.results) for ch in self._queued.values())
