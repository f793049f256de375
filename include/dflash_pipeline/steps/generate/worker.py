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
- main: the dispatch loop; `pending`, `in_flight`, the open chunks' `results`, OPEN/REPAIRING ->
  QUEUED/RELEASED; the stop path (after stopping the others it owns every lease left).
- claimer: scanning S3 and claiming; CLAIMED and the moves out of it; `_done` / `_lowest` (under
  `_scan_lock`).
- committer: QUEUED -> COMMITTING -> COMMITTED, markers, partial cleanup.
- renewer (chunks.LeaseKeeper): renewals; a refused one marks the chunk dropped.
- request threads: one request each; they only read their chunk's `dropped` flag.

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
from dflash_pipeline.dataset.records import decode_inputs, decode_part, encode_part, unit_key, warm_up
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
from dflash_pipeline.serving.deadline import DeadlinePolicy, server_watch
from dflash_pipeline.steps.generate.chunks import (
    ChunkStore,
    CommitOutcome,
    Lease,
    LeaseKeeper,
    Leases,
    State,
    claim_body,
    claim_doc,
)
from dflash_pipeline.steps.generate.conversation import conversation_row, run_conversation
from dflash_pipeline.steps.generate.outcomes import FINISHED, error_row, judge, unexpected_failure

logger = logging.getLogger(__name__)


MAX_REQUEUES = 3


class ServerLost(Exception):
    """The server stopped answering for good; its work was released. Airflow may retry later."""


class ServerConfigError(Exception):
    """The server refuses us (API key, endpoint, model): a retry cannot fix it."""


class ServerBroken(ServerConfigError):
    """The server answers (nearly) every request with a permanent error while the fleet does not."""


class TaskStopped(Exception):
    """Stopped from outside (SIGTERM): finished rows were saved and claims released."""


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
    # The server's engine (serving/engines.py) as preflight detected it: the request body's dialect.
    engine: str = "sglang"
    # Before this server completed a request, the slowest decode speed (tokens/s per request) still
    # counted as generating: a request's deadline is max_tokens at that speed (serving/deadline.py).
    min_decode_tok_s: float = 5.0
    server_lost_after_s: float = 120.0
    # A server failing everything this long hands its open chunks to the fleet (and keeps probing).
    handoff_after_s: float = 5.0
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
    # Rows claimed and not yet committed (open, queued, committing); None = 2 chunks + 4x concurrency.
    held_rows_cap: int | None = None
    # After request_stop(): time to commit complete chunks, save partials and release claims.
    stop_grace_s: float = 3.0
    # Breaker: over the last `breaker_window` results, trip at this permanent-error share alone, or
    # at `breaker_share_vs_fleet` when the other workers' share is at most a quarter of ours.
    breaker_window: int = 40
    breaker_share_alone: float = 0.95
    breaker_share_vs_fleet: float = 0.5

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
        engine=server_info.get("engine") or "sglang",
        server_lost_after_s=cfg.server_lost_after_s,
        handoff_after_s=min(float(getattr(cfg, "server_handoff_after_s", 5.0)), cfg.server_lost_after_s),
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
    lease: Lease | None
    prompts: list[dict[str, Any]]
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Set (by main or the renewer) once the chunk is no longer ours to work on; request threads read it.
    dropped: bool = False
    # A repair: the committed part's rows and ETag; `prompts` are only the rows to redo.
    base_rows: list[dict[str, Any]] | None = None
    part_etag: str | None = None
    marker_runs: list[str] = field(default_factory=list)
    # Prompts still to send (all of them unless rows were reused from a partial).
    todo: list[dict[str, Any]] | None = None

    def prompts_to_send(self) -> list[dict[str, Any]]:
        return self.prompts if self.todo is None else self.todo

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.prompts)

    @property
    def lost(self) -> bool:
        return self.dropped


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
    permanent_errors: int = 0
    errors_by_class: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    chunks_committed: int = 0
    chunks_taken_over: int = 0
    chunks_lost_to_others: int = 0
    commits_refused: int = 0
    rows_discarded: int = 0
    requests_sent: int = 0
    requests_requeued: int = 0
    handoffs: int = 0
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
        session: Any = None
        while not self._stop.is_set():
            item = self._in.get()
            if item is None:
                return
            try:
                if session is None:
                    session = session_factory()
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
        warm_up()

    @property
    def held_rows_cap(self) -> int:
        s = self.settings
        return s.held_rows_cap if s.held_rows_cap is not None else 2 * self._full_chunk + 4 * s.concurrency

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
    def _do_request(self, session: Any, item: tuple[OpenChunk, dict[str, Any]]) -> _Outcome:
        """Never raises: whatever happens becomes this row's outcome (a failed request is a row).

        One unit is one (id, sample); in all_turns mode its whole conversation runs here, turn
        after turn on this thread's server (conversation.py has the rules)."""
        chunk, prompt = item
        s = self.settings
        out = _Outcome(chunk, prompt)
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

    def _error_row(self, out: _Outcome) -> dict[str, Any]:
        assert out.failure is not None
        s = self.settings
        return error_row(out.prompt, out.failure, model=s.model, server=s.server.name, attempts=out.attempts,
                         chunk=out.chunk.index, run_id=s.run_id)

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
            free = _rotate(free, w, self.settings.map_index)
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
                    candidates = deque(_rotate(list(candidates), w, self.settings.map_index))
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
        """Delete expired claims of committed chunks (a task SIGKILLed after claiming a chunk that
        a peer had just committed leaves one nobody needs to take over). If-Match the listed ETag,
        so a claim renewed meanwhile is left alone."""
        now = self.store.server_time()
        for c, info in claims.items():
            if c in done and not self.leases.held(c) and (now - info.last_modified).total_seconds() > self.settings.lease_s:
                try:
                    self.store.delete(info.key, if_match=info.etag)
                    logger.info("deleted the expired claim of committed chunk %d", c)
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

    # -- renewer callback -----------------------------------------------------------------------
    def _on_lost(self, lease: Lease) -> None:
        with self._open_lock:
            chunk = self.open.get(lease.chunk)
        if chunk is not None:
            chunk.dropped = True
        self._count("chunks_lost_to_others")

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
            if chunk.todo is not None:
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

    def _fill(self, pool: _RequestPool) -> None:
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

    def _handle(self, out: _Outcome) -> None:
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
        pool = _RequestPool(pool_size, self._do_request, self.session_factory)
        committer = threading.Thread(target=self._committer, name="committer", daemon=True)
        committer.start()
        claimer = threading.Thread(target=self._claimer, name="claimer", daemon=True)
        claimer.start()
        self.keeper.start()
        probe_session = new_session()
        last_progress = time.monotonic()
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
        except BaseException as exc:
            self._give_up(claimer, committer, keep_errors=not isinstance(exc, ServerBroken))
            raise
        finally:
            self._claimer_stop.set()
            self._claimer_wake.set()
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
        result.update({"worker": s.worker, "server": s.server.name})
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
