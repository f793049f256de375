"""The generate step: one worker drives one SGLang server and shares the chunks with the others.

Dispatch. `concurrency` daemon threads each hold one request; the moment one returns, the main loop
hands it the next prompt, so the server's slots never wait for a batch to gather. Chunks are claimed
ahead of need (whenever fewer than `concurrency` prompts are ready), so there is no barrier between
chunks either, and a finished chunk is committed by a background thread while generation goes on.

Sharing. Work is not bound to a server. Each chunk is claimed with a conditional create of
`claims/chunk-N.json` (If-None-Match: *), renewed every lease/4 with If-Match, and taken over by any
worker once the lease expires (judged by the S3 server's clock, so hosts' clocks do not matter) or
at once by the same map index in a later try. A worker whose server is lost deletes its claims so the
others pick the work up immediately.

Exactly once. A chunk's output is one Parquet part written with If-None-Match: *. If two workers ever
finish the same chunk (a stalled worker whose lease was taken over), the second commit is refused and
its rows are discarded; no id can appear twice. A killed worker loses only the chunks it had not yet
committed; everything committed is skipped by every later try and run.

Memory is bounded by the open chunks (at most about `concurrency + save_every` prompts and their
results), never by the size of the prompt set.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.config import Sampling
from dflash_pipeline.dataset.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.dataset.records import decode_inputs, decode_part, encode_part, warm_up
from dflash_pipeline.dataset.store import ObjectInfo, PreconditionFailed, Store, StoreUnavailable, with_retries
from dflash_pipeline.serving.sglang import (
    RequestFailure,
    ServerSpec,
    build_chat_body,
    chat_once,
    check_health,
    new_chat_client,
    new_session,
)

logger = logging.getLogger(__name__)


MAX_REQUEUES = 3


class ServerLost(Exception):
    """The server stopped answering for good; its work was released. Airflow may retry later."""


class ServerConfigError(Exception):
    """The server refuses us (API key, endpoint, model): a retry cannot fix it."""


@dataclass(frozen=True)
class WorkerSettings:
    run_id: str
    worker: str
    server: ServerSpec
    model: str
    sampling: Sampling
    concurrency: int
    request_timeout_s: float = 300.0
    max_attempts: int = 5
    server_lost_after_s: float = 120.0
    lease_s: float = 180.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 30.0
    poll_s: float = 1.0
    progress_every_s: float = 10.0
    # Early in a run progress is published more often (every elapsed/10 s, at least this often), so
    # a short run still draws a throughput curve; from 10 x progress_every_s on it is every_s.
    progress_first_s: float = 1.0
    store_deadline_s: float = 600.0
    try_number: int = 1
    retry_failed_rows: str = "transient"
    # Derived concurrency (not set by the user): queue about `headroom_s` of work at the server on
    # top of `concurrency`, so a fast server's freed slots never wait for the client's round trip.
    adaptive_headroom: bool = False
    headroom_s: float = 0.25
    # Claim the next chunk while at least this many seconds of work (at the current completion
    # rate) are still ready, or 3x the measured claim latency if that is longer: a claim is
    # several S3 round trips, and a slow S3 must not leave the server's slots empty.
    claim_ahead_s: float = 0.5
    map_index: int = 0
    n_workers: int = 1
    # A claim may use a listing of parts and claims this recent (see Worker._try_claim).
    scan_reuse_s: float = 1.0
    # Retry markers of earlier runs only change when a run ends; list them this often, not per claim.
    marker_scan_every_s: float = 30.0

    @property
    def owner(self) -> str:
        return f"{self.run_id}#{self.worker}"


def settings_for(
    cfg: Any,
    *,
    run_id: str,
    map_index: int,
    server: ServerSpec,
    server_info: dict[str, Any],
    try_number: int = 1,
    **overrides: Any,
) -> WorkerSettings:
    """WorkerSettings of the generate task for one server, from the run's config (`RunConfig`) and
    preflight's per-server dict: the one place the DAG, the benchmarks and the fault lab build them."""
    values: dict[str, Any] = dict(
        run_id=run_id,
        worker=f"w{map_index:04d}",
        map_index=map_index,
        n_workers=len(cfg.servers),
        server=server,
        model=server_info["model"],
        sampling=cfg.sampling,
        concurrency=int(server_info["concurrency"]),
        request_timeout_s=cfg.request_timeout_s,
        max_attempts=cfg.max_attempts,
        server_lost_after_s=cfg.server_lost_after_s,
        lease_s=cfg.claim_lease_s,
        try_number=try_number,
        retry_failed_rows=cfg.retry_failed_rows,
        adaptive_headroom=cfg.concurrency_per_server is None,
    )
    values.update(overrides)
    return WorkerSettings(**values)


@dataclass
class OpenChunk:
    index: int
    claim_etag: str
    prompts: list[dict[str, Any]]
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    lost: bool = False
    # A repair: the committed part's rows and ETag; `prompts` are only the rows to redo.
    base_rows: list[dict[str, Any]] | None = None
    part_etag: str | None = None
    # Prompts still to send (all of them unless rows were reused from a partial).
    todo: list[dict[str, Any]] | None = None

    def prompts_to_send(self) -> list[dict[str, Any]]:
        return self.prompts if self.todo is None else self.todo

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.prompts)


@dataclass
class _Outcome:
    chunk: OpenChunk
    prompt: dict[str, Any]
    row: dict[str, Any] | None = None
    failure: RequestFailure | None = None
    first_failure_t: float | None = None
    last_failure_t: float | None = None
    done_t: float = 0.0
    attempts: int = 0


@dataclass
class WorkerStats:
    completions: int = 0
    errors: int = 0
    errors_by_class: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    chunks_committed: int = 0
    chunks_taken_over: int = 0
    chunks_lost_to_others: int = 0
    commits_refused: int = 0
    rows_discarded: int = 0
    requests_sent: int = 0
    requests_requeued: int = 0
    started_t: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["elapsed_s"] = round(time.monotonic() - d.pop("started_t"), 3)
        return d


def _rotate(items: list[int], width: int, k: int) -> list[int]:
    """`items` with its first `width` rotated left by k (mod how many there are)."""
    n = min(len(items), width)
    if n <= 1:
        return items
    k %= n
    return items[k:n] + items[:k] + items[n:]


class _RequestPool:
    """`n` daemon threads, each with its own keep-alive session, running one request at a time.

    Daemon threads (not a ThreadPoolExecutor) so a task that gives up on a dead server is not kept
    alive by requests still waiting for their timeout.
    """

    def __init__(self, n: int, fn: Callable[[Any, Any], Any], session_factory: Callable[[], Any]) -> None:
        self._in: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads = []
        for i in range(n):
            t = threading.Thread(target=self._loop, args=(fn, session_factory), name=f"req-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _loop(self, fn: Callable[[Any, Any], Any], session_factory: Callable[[], Any]) -> None:
        session = session_factory()
        while not self._stop.is_set():
            item = self._in.get()
            if item is None:
                return
            try:
                self.out.put(fn(session, item))
            except BaseException as exc:  # noqa: BLE001 - surfaced to the main loop
                self.out.put(exc)

    def submit(self, item: Any) -> None:
        self._in.put(item)

    def close(self) -> None:
        self._stop.set()
        for _ in self._threads:
            self._in.put(None)


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
    ) -> None:
        self.store = store
        self.layout = layout
        self.settings = settings
        self.sizes: list[int] = list(manifest["chunks"]["sizes"])
        self.plan_id: str = manifest["plan_id"]
        self.n_chunks = len(self.sizes)
        self.session_factory = session_factory
        self.on_progress = on_progress
        self.stats = WorkerStats()
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
        self._done_cache: set[int] = set()
        # Chunks we hold a claim on, from the claim to its release (open, queued or committing).
        self._ours: set[int] = set()
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
        self._done_times: deque[float] = deque()
        self._claim_latency_s = 0.0
        self._last_scan: tuple[float, tuple[set[int], dict[int, ObjectInfo], set[int]]] | None = None
        # The plan's last stretch has chunks smaller than the rest (guided self-scheduling). Once
        # we hold one, we claim only as far ahead as a claim takes: work held by one worker at
        # the end cannot move to an idle server.
        self._full_chunk = max(self.sizes, default=0)
        self._in_tail = False
        self._repair_cache: tuple[float, set[int]] | None = None
        self._io = ThreadPoolExecutor(3, thread_name_prefix="s3io")
        warm_up()

    # -- request thread ----------------------------------------------------------------------
    def _do_request(self, session: Any, item: tuple[OpenChunk, dict[str, Any]]) -> _Outcome:
        chunk, prompt = item
        s = self.settings
        body = build_chat_body(prompt["messages"], s.model, s.sampling, prompt["id"])
        out = _Outcome(chunk, prompt)
        for attempt in range(1, s.max_attempts + 1):
            out.attempts = attempt
            if chunk.lost:
                return out
            try:
                completion, latency = chat_once(session, s.server, body, s.request_timeout_s)
                out.done_t = time.monotonic()
            except RequestFailure as exc:
                out.failure = exc
                out.last_failure_t = time.monotonic()
                if out.first_failure_t is None:
                    out.first_failure_t = out.last_failure_t
                if not exc.transient or attempt == s.max_attempts:
                    return out
                delay = min(s.backoff_cap_s, s.backoff_base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                time.sleep(delay)
                continue
            out.failure = None
            out.row = {
                "id": prompt["id"],
                "messages": prompt["messages"],
                "reasoning": completion.reasoning,
                "content": completion.content,
                "finish_reason": completion.finish_reason,
                "matched_stop": completion.matched_stop,
                "prompt_tokens": completion.prompt_tokens,
                "completion_tokens": completion.completion_tokens,
                "reasoning_tokens": completion.reasoning_tokens,
                "model": completion.model or s.model,
                "server": s.server.name,
                "attempts": attempt,
                "latency_s": round(latency, 4),
                "chunk": chunk.index,
                "run_id": s.run_id,
            }
            return out
        return out

    def _error_row(self, out: _Outcome) -> dict[str, Any]:
        f = out.failure
        assert f is not None
        return {
            "id": out.prompt["id"],
            "messages": out.prompt["messages"],
            "model": self.settings.model,
            "server": self.settings.server.name,
            "attempts": out.attempts,
            "error_class": f.error_class,
            "error_message": f.message,
            "retryable": f.transient,
            "chunk": out.chunk.index,
            "run_id": self.settings.run_id,
        }

    # -- claims --------------------------------------------------------------------------------
    def _scan(self, fresh_markers: bool = False) -> tuple[set[int], dict[int, ObjectInfo], set[int]]:
        """(committed chunks, live or stale claims of unfinished chunks, chunks to repair).

        The two listings run at once (a claim waits for the slower, not for both in a row).
        """
        claims_f = self._io.submit(lambda: list(self.store.list(self.layout.claims_prefix)))
        with self._scan_lock:
            done = set(self._done_cache)
            low = self._lowest_unfinished
            after = self.layout.part_key(low - 1) if low > 0 else None
            for obj in self.store.list(self.layout.completions_prefix, start_after=after):
                c = chunk_of_key(obj.key)
                if c is not None:
                    done.add(c)
            while low < self.n_chunks and low in done:
                low += 1
            self._lowest_unfinished = low
            self._done_cache = done
        claims: dict[int, ObjectInfo] = {}
        for obj in claims_f.result():
            c = chunk_of_key(obj.key)
            if c is not None:
                claims[c] = obj
        return done, claims, self._repairs(done, fresh_markers)

    def _repairs(self, done: set[int], fresh: bool) -> set[int]:
        """Committed chunks whose retry marker (left by an earlier run) asks for a repair."""
        if self.settings.retry_failed_rows == "none":
            return set()
        now = time.monotonic()
        cached = self._repair_cache
        if fresh or cached is None or now - cached[0] >= self.settings.marker_scan_every_s:
            wanted: set[int] = set()
            for obj in self.store.list(self.layout.retry_prefix):
                c = chunk_of_key(obj.key)
                if c is not None and self._marker_wants_repair(obj):
                    wanted.add(c)
            cached = self._repair_cache = (now, wanted)
        return {c for c in cached[1] if c in done}

    def _marker_wants_repair(self, obj: ObjectInfo) -> bool:
        """A marker left by an earlier run (never our own: one repair per chunk per run)."""
        cached = self._markers.get(obj.key)
        if cached is None or cached[0] != obj.etag:
            got = self.store.get(obj.key)
            if got is None:
                return False
            try:
                body = json.loads(got[0])
            except ValueError:
                return False
            cached = (obj.etag, body)
            self._markers[obj.key] = cached
        body = cached[1]
        if body.get("run_id") == self.settings.run_id:
            return False
        if self.settings.retry_failed_rows == "all":
            return int(body.get("retryable", 0)) + int(body.get("permanent", 0)) > 0
        return int(body.get("retryable", 0)) > 0

    def _wants_redo(self, row: dict[str, Any]) -> bool:
        if not row.get("error_class"):
            return False
        return self.settings.retry_failed_rows == "all" or bool(row.get("retryable"))

    def _claim_body(self) -> bytes:
        s = self.settings
        return json.dumps(
            {"owner": s.owner, "worker": s.worker, "server": s.server.name, "run_id": s.run_id, "try": s.try_number}
        ).encode()

    def _find_own_stale(self, claims: dict[int, ObjectInfo]) -> set[int]:
        """Chunks a previous try of this same worker claimed: ours to take back without waiting."""
        own: set[int] = set()
        for c in claims:
            got = self.store.get(self.layout.claim_key(c))
            if got is None:
                continue
            try:
                if json.loads(got[0]).get("owner") == self.settings.owner:
                    own.add(c)
            except ValueError:
                continue
        if own:
            logger.info("taking back %d chunk(s) claimed by an earlier try of this task: %s", len(own), sorted(own))
        return own

    def _try_claim(self) -> OpenChunk | None:
        """Claim one chunk: from the last listing if it is recent, else (or if that finds none) a new one.

        A listing up to `scan_reuse_s` old is safe to claim from: every claim is a conditional write
        and a chunk is checked for a committed part after it is claimed, so a stale entry costs one
        refused request, never a duplicate. It halves the round trips of a claim.
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
            info = claims.get(c)
            if c in self._ours:
                return True
            if info is None or c in self._own_stale:
                return False
            return (now - info.last_modified).total_seconds() <= self.settings.lease_s

        free = [c for c in range(self.n_chunks) if c not in done and c not in self._done_cache and not held(c)]
        # Plan order (the plan's shrinking tail stays last), except where workers claim at the same
        # moment: all of them at the start, and often at the end, where chunks are small. Walking
        # the same list they would queue up behind each other's refusals, a round trip each. So the
        # first claim starts at the worker's own place among the first few free chunks, and after
        # a refusal each jumps to its own place among the next few. (Not always its own place: the
        # first free chunk would be left to one worker, which, if slow, gets to a big chunk late.)
        w = max(1, self.settings.n_workers)
        if not self._ours_ever:
            free = _rotate(free, w, self.settings.map_index)
        candidates = deque([*free, *sorted(c for c in repair if not held(c))])
        refused = False
        while candidates:
            c = candidates.popleft()
            info = claims.get(c)
            body = self._claim_body()
            key = self.layout.claim_key(c)
            try:
                if info is None:
                    etag = self.store.put(key, body, if_none_match=True, content_type="application/json")
                else:
                    # Not held (see `held`): our own earlier try's claim, or an expired lease.
                    mine = c in self._own_stale
                    etag = self.store.put(key, body, if_match=info.etag, content_type="application/json")
                    self._own_stale.discard(c)
                    if not mine:
                        self.stats.chunks_taken_over += 1
                        age = (now - info.last_modified).total_seconds()
                        logger.warning("took over chunk %d: its claim was not renewed for %.0fs", c, age)
            except PreconditionFailed:
                if stale:
                    self._last_scan = None
                    return None
                if not refused:
                    refused = True
                    candidates = deque(_rotate(list(candidates), w, self.settings.map_index))
                continue
            self._ours.add(c)
            self._ours_ever = True
            chunk = self._open_claimed(c, etag, repairing=c in repair)
            if chunk is not None:
                return chunk
        return None

    def _open_claimed(self, c: int, etag: str, repairing: bool) -> OpenChunk | None:
        """Load the work of a chunk we now hold, or let go if someone finished it meanwhile."""
        if repairing:
            got = self.store.get(self.layout.part_key(c))
            marker = self.store.head(self.layout.retry_key(c))
            # The marker is re-read: the listing may be up to marker_scan_every_s old, and a chunk
            # already repaired by this run (its marker now names this run) is not repaired again.
            if got is None or marker is None or not self._marker_wants_repair(marker):
                self._release(c)
                return None
            rows = decode_part(got[0]).to_pylist()
            redo = [{"id": r["id"], "messages": r["messages"]} for r in rows if self._wants_redo(r)]
            if not redo:
                self._release(c)
                return None
            logger.info("repairing chunk %d: %d failed row(s) from an earlier run", c, len(redo))
            return OpenChunk(c, etag, redo, base_rows=rows, part_etag=got[1])
        # The chunk may have been committed between our listing and our claim. The three reads
        # are independent, so they go out at once.
        part_f = self._io.submit(self.store.head, self.layout.part_key(c))
        partial_f = self._io.submit(self.store.get, self.layout.partial_key(c))
        got = self.store.get(self.layout.input_key(self.plan_id, c))
        if part_f.result() is not None:
            self._done_cache.add(c)
            self._release(c)
            return None
        if got is None:
            raise RuntimeError(f"input of chunk {c} is missing: {self.layout.input_key(self.plan_id, c)}")
        chunk = OpenChunk(c, etag, decode_inputs(got[0]))
        partial = partial_f.result()
        if partial is not None:
            ids = {p["id"] for p in chunk.prompts}
            for row in decode_part(partial[0]).to_pylist():
                if row["id"] in ids:
                    chunk.results[row["id"]] = row
            chunk.todo = [p for p in chunk.prompts if p["id"] not in chunk.results]
            logger.info("chunk %d: %d row(s) saved by a worker that gave up are reused", c, len(chunk.results))
        return chunk

    def _release(self, c: int) -> None:
        self._ours.discard(c)
        try:
            self.store.delete(self.layout.claim_key(c))
        except Exception as exc:  # noqa: BLE001 - best effort; the lease expires anyway
            logger.warning("could not release claim of chunk %d: %s", c, exc)

    def _all_done(self) -> bool:
        """Every chunk committed and nothing left to repair (by this worker's policy)."""
        done, _, repair = with_retries(
            lambda: self._scan(fresh_markers=True), what="scan", deadline_s=self.settings.store_deadline_s
        )
        return not repair and len(done & set(range(self.n_chunks))) == self.n_chunks

    # -- committer thread -----------------------------------------------------------------------
    def _committer(self) -> None:
        last_renew = time.monotonic()
        renew_every = max(1.0, self.settings.lease_s / 4)
        while True:
            try:
                chunk = self._commit_q.get(timeout=min(renew_every, 5.0))
            except queue.Empty:
                chunk = None
            else:
                if chunk is None:
                    return
            try:
                if chunk is not None:
                    self._commit(chunk)
                if time.monotonic() - last_renew >= renew_every:
                    self._renew_leases()
                    last_renew = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main loop
                self._commit_error = exc
                return
            finally:
                if chunk is not None:
                    with self._committing_lock:
                        self._committing -= 1
                        self._committing_rows -= len(chunk.prompts)

    def _commit(self, chunk: OpenChunk) -> None:
        if chunk.base_rows is not None:
            rows = [chunk.results.get(r["id"], r) for r in chunk.base_rows]
        else:
            rows = [chunk.results[p["id"]] for p in chunk.prompts]
        data = encode_part(rows)
        key = self.layout.part_key(chunk.index)
        try:
            with_retries(
                lambda: self.store.put(
                    key,
                    data,
                    if_none_match=chunk.part_etag is None,
                    if_match=chunk.part_etag,
                ),
                what=f"commit chunk {chunk.index}",
                deadline_s=self.settings.store_deadline_s,
            )
        except PreconditionFailed:
            self.stats.commits_refused += 1
            self.stats.rows_discarded += len(chunk.results)
            logger.warning(
                "chunk %d was already committed by another worker; %d rows of ours discarded",
                chunk.index, len(chunk.results),
            )
        else:
            self.stats.chunks_committed += 1
            logger.info("committed chunk %d (%d rows) -> %s", chunk.index, len(rows), key)
            self._write_marker(chunk.index, rows, repaired=chunk.base_rows is not None)
            if chunk.todo is not None:
                with_retries(lambda: self.store.delete(self.layout.partial_key(chunk.index)), what="partial")
        self._done_cache.add(chunk.index)
        with_retries(lambda: self._release(chunk.index), what="release claim", deadline_s=60)

    def _write_marker(self, c: int, rows: list[dict[str, Any]], repaired: bool) -> None:
        """Flag a part with error rows so a later run retries them (validation re-creates lost flags).

        A chunk committed for the first time cannot have a marker yet (markers only flag committed
        parts), so a clean first commit costs no request; a clean repair clears the old flag.
        """
        retryable = sum(1 for r in rows if r.get("error_class") and r.get("retryable"))
        permanent = sum(1 for r in rows if r.get("error_class") and not r.get("retryable"))
        key = self.layout.retry_key(c)
        if retryable or permanent:
            body = json.dumps({"run_id": self.settings.run_id, "retryable": retryable, "permanent": permanent})
            with_retries(lambda: self.store.put(key, body.encode(), content_type="application/json"), what="marker")
        elif repaired:
            with_retries(lambda: self.store.delete(key), what="marker")

    def _renew_leases(self) -> None:
        with self._open_lock:
            chunks = list(self.open.values())
        for chunk in chunks:
            if chunk.lost or chunk.complete:
                continue
            try:
                chunk.claim_etag = with_retries(
                    lambda: self.store.put(
                        self.layout.claim_key(chunk.index),
                        self._claim_body(),
                        if_match=chunk.claim_etag,
                        content_type="application/json",
                    ),
                    what=f"renew claim {chunk.index}",
                    deadline_s=self.settings.lease_s / 2,
                )
            except PreconditionFailed:
                chunk.lost = True
                self._ours.discard(chunk.index)
                self._maybe_drop(chunk)
                self.stats.chunks_lost_to_others += 1
                logger.warning("chunk %d was taken over by another worker; dropping our copy", chunk.index)
            except StoreUnavailable:
                logger.warning("could not renew claim of chunk %d; S3 unavailable", chunk.index)

    # -- main loop ------------------------------------------------------------------------------
    def _limit(self) -> int:
        """Requests to keep in flight: `concurrency`, plus adaptive headroom when it was derived."""
        s = self.settings
        if not s.adaptive_headroom:
            return s.concurrency
        return s.concurrency + min(s.concurrency, int(-(-self._rate() * s.headroom_s // 1)))

    def _rate(self) -> float:
        """Completions per second over the last 10 s (0 until the first one)."""
        now = time.monotonic()
        while self._done_times and now - self._done_times[0] > 10.0:
            self._done_times.popleft()
        span = min(10.0, max(1.0, now - self.stats.started_t))
        return len(self._done_times) / span

    def _claim_wanted(self) -> bool:
        """Claim while the prompts ready to send cover less than the time a claim takes (with margin)."""
        ready = len(self.pending) + self._claimed_prompts
        ahead_s = 3.0 * self._claim_latency_s
        if not self._in_tail:
            ahead_s = max(self.settings.claim_ahead_s, ahead_s)
        want = self._limit() + int(self._rate() * ahead_s)
        # Rows waiting to be written are bounded (an S3 outage must not grow memory without end);
        # counted in rows, not parts, so the small parts at the end do not stop claims.
        backlog_ok = self._committing_rows <= 2 * self._full_chunk
        return ready < want and backlog_ok and self._suspect_since is None

    def _claimer(self) -> None:
        """Claims chunks ahead of need on its own thread, so S3 round trips never stall dispatch."""
        s = self.settings
        while not self._claimer_stop.is_set():
            if not self._claim_wanted():
                self._claimer_wake.wait(0.05)
                self._claimer_wake.clear()
                continue
            started = time.monotonic()
            try:
                chunk = with_retries(self._try_claim, what="claim", deadline_s=s.store_deadline_s)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main loop
                self._claim_error = exc
                return
            took = time.monotonic() - started
            # Quick to rise, slow to fall: one slow claim raises the lookahead at once.
            self._claim_latency_s = max(took, 0.8 * self._claim_latency_s + 0.2 * took)
            if chunk is None:
                logger.debug("claim found nothing in %.3fs; %d ready", time.monotonic() - started, len(self.pending) + self._claimed_prompts)
                self._claimer_idle.set()
                self._claimer_wake.wait(s.poll_s)
                self._claimer_wake.clear()
                continue
            self._claimer_idle.clear()
            if len(chunk.prompts) < self._full_chunk and chunk.base_rows is None:
                self._in_tail = True
            logger.debug(
                "claimed chunk %d (%d prompts) in %.3fs; %d ready, %d in flight",
                chunk.index, len(chunk.prompts_to_send()), took, len(self.pending) + self._claimed_prompts, self.in_flight,
            )
            with self._open_lock:
                self.open[chunk.index] = chunk
            with self._committing_lock:
                self._claimed_prompts += len(chunk.prompts_to_send())
            self._claimed.put(chunk)

    def _fill(self, pool: _RequestPool) -> None:
        while True:
            try:
                chunk = self._claimed.get_nowait()
            except queue.Empty:
                break
            todo = chunk.prompts_to_send()
            with self._committing_lock:
                self._claimed_prompts -= len(todo)
            if not todo:
                self._finish_chunk(chunk)
                continue
            self.pending.extend((chunk, p) for p in todo)
        limit = self._limit()
        while self.in_flight < limit and self.pending:
            chunk, prompt = self.pending.popleft()
            if chunk.lost:
                continue
            pool.submit((chunk, prompt))
            self.in_flight += 1
            self.stats.requests_sent += 1
        if self._claim_wanted():
            self._claimer_wake.set()

    def _finish_chunk(self, chunk: OpenChunk) -> None:
        with self._open_lock:
            self.open.pop(chunk.index, None)
        with self._committing_lock:
            self._committing += 1
            self._committing_rows += len(chunk.prompts)
        self._commit_q.put(chunk)

    def _handle(self, out: _Outcome) -> None:
        self.in_flight -= 1
        chunk = out.chunk
        if chunk.lost:
            self.stats.rows_discarded += 1
            self._maybe_drop(chunk)
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
        else:
            f = out.failure
            assert f is not None
            if f.kind == "config":
                raise ServerConfigError(f"server {self.settings.server.name} refused the request: {f.message}")
            pid = out.prompt["id"]
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
        chunk.results[row["id"]] = row
        if chunk.complete:
            self._finish_chunk(chunk)

    def _maybe_drop(self, chunk: OpenChunk) -> None:
        with self._open_lock:
            self.open.pop(chunk.index, None)

    def _check_suspect(self, session: Any) -> None:
        if self._suspect_since is None:
            return
        if check_health(session, self.settings.server, timeout_s=5.0):
            logger.info("server %s answers /health again; resuming", self.settings.server.name)
            self._suspect_since = None
            self._last_success_t = time.monotonic()
            return
        down_for = time.monotonic() - self._suspect_since
        if down_for >= self.settings.server_lost_after_s:
            raise ServerLost(
                f"server {self.settings.server.name} lost: no answer for {down_for:.0f}s "
                f"(server_lost_after_s={self.settings.server_lost_after_s:g})"
            )

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
            pending_rows = sum(len(ch.results) for ch in self.open.values() if not ch.lost)
        pending_rows += sum(len(ch.results) for ch in list(self._commit_q.queue) if ch is not None)
        done_chunks = self._done_cache & set(range(self.n_chunks))
        s = self.settings
        snapshot = {
            "run_id": s.run_id,
            "worker": s.worker,
            "server": s.server.name,
            "try_number": s.try_number,
            "concurrency": s.concurrency,
            "in_flight_limit": self._limit(),
            "state": "done" if force else ("failing" if self._suspect_since is not None else "running"),
            "elapsed_s": round(now - self.stats.started_t, 1),
            "completions": self.stats.completions,
            "errors": self.stats.errors,
            "errors_by_class": dict(self.stats.errors_by_class),
            "requests_sent": self.stats.requests_sent,
            "requests_requeued": self.stats.requests_requeued,
            "rows_discarded": self.stats.rows_discarded,
            "chunks_committed": self.stats.chunks_committed,
            "chunks_taken_over": self.stats.chunks_taken_over,
            "chunks_lost_to_others": self.stats.chunks_lost_to_others,
            "in_flight": self.in_flight,
            "ready": len(self.pending),
            "open_chunks": len(self.open),
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

    def run(self) -> dict[str, Any]:
        s = self.settings
        logger.info(
            "worker %s on %s: %d chunks in the plan, concurrency %d, model %s",
            s.worker, s.server.name, self.n_chunks, s.concurrency, s.model,
        )
        pool_size = 2 * s.concurrency if s.adaptive_headroom else s.concurrency
        pool = _RequestPool(pool_size, self._do_request, self.session_factory)
        committer = threading.Thread(target=self._committer, name="committer", daemon=True)
        committer.start()
        claimer = threading.Thread(target=self._claimer, name="claimer", daemon=True)
        claimer.start()
        probe_session = new_session()
        last_progress = time.monotonic()
        try:
            while True:
                if self._commit_error is not None:
                    raise self._commit_error
                if self._claim_error is not None:
                    raise self._claim_error
                if self._suspect_since is None:
                    self._fill(pool)
                else:
                    self._check_suspect(probe_session)
                if self.in_flight == 0 and not self.pending:
                    if self._suspect_since is not None:
                        time.sleep(1.0)
                        continue
                    if not self._claimed.empty() or not self._claimer_idle.is_set():
                        self._claimer_wake.set()
                        time.sleep(0.02)
                        continue
                    self._wait_commits()
                    if not self.open and self._claimed.empty() and self._all_done():
                        break
                    self._claimer_idle.clear()
                    self._claimer_wake.set()
                    time.sleep(s.poll_s)
                    continue
                try:
                    item = pool.out.get(timeout=1.0)
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
        except BaseException:
            self._give_up()
            raise
        finally:
            self._claimer_stop.set()
            self._claimer_wake.set()
            pool.close()
            self._io.shutdown(wait=False)
        self._commit_q.put(None)
        committer.join(timeout=60)
        if self._commit_error is not None:
            raise self._commit_error
        self._progress(force=True)
        result = self.stats.to_dict()
        result.update({"worker": s.worker, "server": s.server.name})
        logger.info("worker %s done: %s", s.worker, result)
        return result

    def _wait_commits(self) -> None:
        while self._committing > 0:
            if self._commit_error is not None:
                raise self._commit_error
            time.sleep(0.05)

    def _give_up(self) -> None:
        """Stop, save what our unfinished chunks already have, and hand them to the fleet now."""
        self._claimer_stop.set()
        self._claimer_wake.set()
        with self._open_lock:
            chunks = list(self.open.values())
            self.open.clear()
        while True:
            try:
                chunks.append(self._claimed.get_nowait())
            except queue.Empty:
                break
        for chunk in chunks:
            chunk.lost = True
        self.pending.clear()
        for chunk in chunks:
            if chunk.results and chunk.base_rows is None:
                try:
                    self.store.put(self.layout.partial_key(chunk.index), encode_part(list(chunk.results.values())))
                except Exception as exc:  # noqa: BLE001 - best effort; the rows are redone otherwise
                    logger.warning("could not save the %d finished rows of chunk %d: %s", len(chunk.results), chunk.index, exc)
            self._release(chunk.index)
        if chunks:
            logger.warning(
                "released %d unfinished chunk(s) to the other servers (%d finished rows saved for reuse)",
                len(chunks), sum(len(c.results) for c in chunks if c.base_rows is None),
            )
