"""Live progress of a run: what each generate task publishes, and the run-level arithmetic.

Each generate task hands `Worker._progress` snapshots to a :class:`ProgressWriter`, which keeps a
bounded throughput history and PUTs one small JSON object per snapshot to
`runs/<run>/progress/<worker>.json` from a background thread, so S3 trouble never stalls
generation. The page (and anything else) combines those objects with the manifest and the list of
committed parts through :func:`monitor.fleet.aggregate`.

Done means committed or finished-and-waiting-for-its-part, never submitted. Prompts committed by
earlier runs into the same `output_uri` count as done (a resumed run starts part-way). The ETA is
`remaining prompts x mean output tokens per completion / recent output tokens per second`: token
based, because a thinking model's mix is long-tailed and rows per second swing with it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

PROGRESS_FORMAT = 1
#: History samples kept per worker; when full, every other sample is dropped (the whole run stays
#: covered, at half the resolution), so an object stays a few KB however long the run.
HISTORY_MAX = 240
#: Buckets of the throughput-over-time series (the page's chart), whatever the run's length.
SERIES_POINTS = 120
#: Snapshots kept for the history while a PUT is under way (beyond this the oldest are dropped).
UNRECORDED_MAX = 32
#: No ETA before this many completions: the first ones are the short ones of a long-tailed mix.
MIN_COMPLETIONS_FOR_ETA = 20
#: Window of the output-token rate the ETA divides by.
RATE_WINDOW_S = 300.0
#: A worker whose object is older than this many of its intervals is treated as gone.
STALE_INTERVALS = 4.0
LIVE_STATES = frozenset({"running", "failing", "idle"})

# A history sample: [unix time, completions, errors, output tokens, output tokens/s, in flight,
# in-flight limit] (the limit is absent from objects written before it was recorded).
H_T, H_COMPLETIONS, H_ERRORS, H_TOKENS, H_RATE, H_IN_FLIGHT, H_LIMIT = range(7)


class _Store(Protocol):
    def get(self, key: str) -> tuple[bytes, str] | None: ...

    def put(self, key: str, data: bytes, *, content_type: str = ...) -> str: ...


# ------------------------------------------------------------------------------------ arithmetic


def eta_seconds(remaining_prompts: int, mean_output_tokens: float | None, tokens_per_s: float,
                completions: int, *, max_completion_tokens: int = 0, in_flight: int = 0) -> float | None:
    """Seconds left, or None while there is not enough to go on (no rate, too few completions).

    `remaining x mean / rate` is the work; with a long-tailed mix the run then still waits for
    its last long requests, which decode alone at one request's speed (`rate / in_flight`). Half
    the longest completion seen at that speed stands in for that drain (in a simulated
    continuous-batching fleet it cut the error of a lognormal mix from ~-30 % to within +-20 %).
    """
    if remaining_prompts <= 0:
        return 0.0
    if completions < MIN_COMPLETIONS_FOR_ETA or not mean_output_tokens or tokens_per_s <= 0:
        return None
    work = remaining_prompts * mean_output_tokens / tokens_per_s
    drain = 0.0
    if max_completion_tokens > 0 and in_flight > 0:
        drain = 0.5 * max_completion_tokens / (tokens_per_s / in_flight)
    return work + drain


def recent_rate(history: Sequence[Sequence[float]], window_s: float = RATE_WINDOW_S) -> float | None:
    """Output tokens/s over the last `window_s` of a history (cumulative tokens), None if < 2 samples.

    Longer than the worker's 2-minute figure on purpose: with a long-tailed mix a few long
    completions landing together make short windows jump.
    """
    if len(history) < 2:
        return None
    last = history[-1]
    first = history[0]
    for h in history:
        if h[H_T] >= last[H_T] - window_s:
            first = h
            break
    if first is last:
        first = history[-2]
    dt = last[H_T] - first[H_T]
    return max(0.0, (last[H_TOKENS] - first[H_TOKENS]) / dt) if dt > 0 else None


def committed_prompts(sizes: Sequence[int], chunks: Iterable[int]) -> int:
    """Prompts in the committed chunks (a part holds exactly its chunk's rows)."""
    n = len(sizes)
    return sum(sizes[c] for c in set(chunks) if 0 <= c < n)


def downsample(history: list[list[float]], max_len: int = HISTORY_MAX) -> list[list[float]]:
    """Halve the resolution until it fits, always keeping the newest sample."""
    while len(history) > max_len:
        history = history[::-1][::2][::-1]
    return history


def carried_totals(previous: Mapping[str, Any] | None, run_id: str, try_number: int) -> dict[str, Any]:
    """What earlier tries of the same map index in the same run had done (from their last object)."""
    empty: dict[str, Any] = {"completions": 0, "errors": 0, "output_tokens": 0, "errors_by_class": {},
                             "max_completion_tokens": 0, "history": [], "tries": []}
    if not previous or previous.get("run_id") != run_id or int(previous.get("try_number", 0)) >= try_number:
        return empty
    totals = previous.get("totals") or {}
    return {
        "completions": int(totals.get("completions", 0)),
        "errors": int(totals.get("errors", 0)),
        "output_tokens": int(totals.get("output_tokens", 0)),
        "errors_by_class": dict(totals.get("errors_by_class") or {}),
        "max_completion_tokens": int(totals.get("max_completion_tokens", 0)),
        "history": [list(h) for h in previous.get("history") or []],
        "tries": list(previous.get("tries") or [previous.get("try_number")]),
    }


def add_counts(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + int(v)
    return out


def progress_doc(snapshot: Mapping[str, Any], carried: Mapping[str, Any], history: list[list[float]],
                 now: float, every_s: float, n_servers: int, max_completion_tokens: int = 0) -> dict[str, Any]:
    """The JSON object one worker publishes: its snapshot, totals over its tries, history and ETA.

    The worker's own ETA assumes the run's other servers go as fast as this one (`eta_basis`);
    the page computes the fleet's from every worker's rate.
    """
    totals = {
        "completions": int(carried.get("completions", 0)) + int(snapshot.get("completions", 0)),
        "errors": int(carried.get("errors", 0)) + int(snapshot.get("errors", 0)),
        "output_tokens": int(carried.get("output_tokens", 0)) + int(snapshot.get("output_tokens", 0)),
        "errors_by_class": add_counts(carried.get("errors_by_class") or {}, snapshot.get("errors_by_class") or {}),
        "max_completion_tokens": max(int(carried.get("max_completion_tokens", 0)), max_completion_tokens,
                                     int(snapshot.get("max_completion_tokens_recent", 0))),
    }
    mean = totals["output_tokens"] / totals["completions"] if totals["completions"] else None
    remaining = max(0, int(snapshot.get("prompts_total", 0)) - int(snapshot.get("prompts_committed_total", 0))
                    - int(snapshot.get("rows_pending_commit", 0)))
    rate = recent_rate(history)
    if rate is None:
        rate = float(snapshot.get("output_tokens_per_s") or 0.0)
    k = max(1, n_servers)
    tries = sorted({*(t for t in carried.get("tries") or [] if t is not None), int(snapshot.get("try_number", 1))})
    eta = eta_seconds(remaining, mean, rate * k, totals["completions"],
                      max_completion_tokens=totals["max_completion_tokens"],
                      in_flight=int(snapshot.get("in_flight", 0)) * k)
    return {
        "format": PROGRESS_FORMAT,
        **snapshot,
        "written_at": round(now, 3),
        "every_s": every_s,
        "tries": tries,
        "totals": totals,
        "mean_output_tokens": round(mean, 1) if mean is not None else None,
        "recent_output_tokens_per_s": round(rate, 1),
        "remaining_prompts": remaining,
        "eta_s": round_or_none(eta),
        "eta_basis": f"this server's rate x {k} server(s)",
        "history": history,
    }


def round_or_none(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


# ---------------------------------------------------------------------------------------- writer


class ProgressWriter:
    """`on_progress` callback: publish each snapshot with one PUT, off the generation thread.

    A call only stores the snapshot and wakes the writer thread; if a PUT is still under way the
    newer snapshot replaces the waiting one. S3 errors are logged (once per failure streak) and
    never raised. The final snapshot (`state == "done"`) is waited for, at most `final_wait_s`.
    On the first write the object of an earlier try of the same map index is read once, so the
    totals and the history span every try of the run.

    The worker only reports while it has requests to handle; while it waits with nothing in
    flight (nothing claimable yet, e.g. chunks still leased by a killed task) the writer itself
    publishes an `idle` heartbeat every interval, so a live but waiting task is not taken for a
    dead one (whose object simply stops changing).
    """

    def __init__(self, store: _Store, key: str, *, run_id: str, try_number: int, every_s: float,
                 n_servers: int = 1, clock: Callable[[], float] = time.time, final_wait_s: float = 10.0,
                 history_max: int = HISTORY_MAX) -> None:
        self.store = store
        self.key = key
        self.run_id = run_id
        self.try_number = try_number
        self.every_s = every_s
        self.n_servers = n_servers
        self.clock = clock
        self.final_wait_s = final_wait_s
        self.history_max = history_max
        self.writes = 0
        self.failures = 0
        self._cond = threading.Condition()
        self._waiting: tuple[float, dict[str, Any]] | None = None
        # Snapshots not yet in the history: a PUT under way lets newer snapshots replace the waiting
        # one, but each still becomes a history sample.
        self._unrecorded: list[tuple[float, dict[str, Any]]] = []
        self._started = False
        self._busy = False
        self._carried: dict[str, Any] | None = None
        self._history: list[list[float]] = []
        self._min_gap_s = 0.0
        self._failing = False
        self._max_tokens = 0
        self._last: tuple[float, dict[str, Any]] | None = None  # (monotonic time, snapshot) of the last call
        self._thread: threading.Thread | None = None

    def __call__(self, snapshot: Mapping[str, Any]) -> None:
        try:
            with self._cond:
                self._waiting = (self.clock(), dict(snapshot))
                self._unrecorded = [*self._unrecorded[-(UNRECORDED_MAX - 1):], self._waiting]
                self._last = (time.monotonic(), dict(snapshot))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="progress-writer", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
            if snapshot.get("state") == "done":
                self.flush(self.final_wait_s)
        except Exception:  # noqa: BLE001 - progress must never break generation
            logger.warning("progress: could not queue a snapshot", exc_info=True)

    def flush(self, timeout_s: float) -> bool:
        """Wait until nothing is waiting or being written; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._waiting is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None:
                    self._cond.wait(self.every_s)
                    if self._waiting is None:
                        heartbeat = self._heartbeat()
                        if heartbeat is not None:
                            self._waiting = (self.clock(), heartbeat)
                now, snapshot = self._waiting
                earlier = [x for x in self._unrecorded if x is not self._waiting]
                self._waiting = None
                self._unrecorded = []
                self._busy = True
            try:
                self.write(snapshot, now, earlier=earlier)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _heartbeat(self) -> dict[str, Any] | None:
        """The last snapshot as `idle` (nothing in flight), once the worker has been quiet a while."""
        if self._last is None:
            return None
        since, last = self._last
        quiet = time.monotonic() - since
        if last.get("state") == "done" or quiet < 1.5 * self.every_s:
            return None
        return {**last, "state": "idle", "idle_s": round(quiet, 1), "in_flight": 0, "output_tokens_per_s": 0.0}

    def _load_carried(self) -> dict[str, Any]:
        previous: dict[str, Any] | None = None
        try:
            got = self.store.get(self.key)
            if got is not None:
                previous = json.loads(got[0])
        except Exception as exc:  # noqa: BLE001 - an unreadable old object only loses history
            logger.warning("progress: could not read %s (%s); totals start at this try", self.key, exc)
        carried = carried_totals(previous, self.run_id, self.try_number)
        self._history = downsample(carried.pop("history"), self.history_max)
        return carried

    def _record(self, snapshot: Mapping[str, Any], now: float) -> None:
        assert self._carried is not None
        if not self._started:
            # This try's start (tokens as carried, nothing in flight): the curve begins where the
            # task began, not at its first report an interval later.
            self._started = True
            start = round(now - float(snapshot.get("elapsed_s") or 0.0), 1)
            if start < now and (not self._history or start > self._history[-1][H_T]):
                self._history.append([start, int(self._carried["completions"]), int(self._carried["errors"]),
                                      int(self._carried["output_tokens"]), 0.0, 0,
                                      int(snapshot.get("in_flight_limit") or 0)])
        sample = [
            round(now, 1),
            int(self._carried["completions"]) + int(snapshot.get("completions", 0)),
            int(self._carried["errors"]) + int(snapshot.get("errors", 0)),
            int(self._carried["output_tokens"]) + int(snapshot.get("output_tokens", 0)),
            float(snapshot.get("output_tokens_per_s") or 0.0),
            int(snapshot.get("in_flight", 0)),
            int(snapshot.get("in_flight_limit") or 0),
        ]
        if self._history and now - self._history[-1][H_T] < self._min_gap_s:
            self._history[-1] = sample  # too soon after the last kept sample: refresh it instead
            return
        self._history.append(sample)
        if len(self._history) > self.history_max:
            self._history = downsample(self._history, self.history_max)
            span = self._history[-1][H_T] - self._history[0][H_T]
            self._min_gap_s = span / max(1, len(self._history) - 1)

    def write(self, snapshot: Mapping[str, Any], now: float | None = None,
              earlier: Sequence[tuple[float, Mapping[str, Any]]] = ()) -> bool:
        """Build and PUT the object now (the writer thread calls this); True if it was stored.

        `earlier` are snapshots that were replaced before they were written: history samples only.
        """
        now = self.clock() if now is None else now
        if self._carried is None:
            self._carried = self._load_carried()
        for t, snap in earlier:
            if t <= now:
                self._record(snap, t)
        self._record(snapshot, now)
        self._max_tokens = max(self._max_tokens, int(snapshot.get("max_completion_tokens_recent", 0)))
        doc = progress_doc(snapshot, self._carried, self._history, now, self.every_s, self.n_servers,
                           self._max_tokens)
        try:
            self.store.put(self.key, json.dumps(doc, separators=(",", ":")).encode(),
                           content_type="application/json")
        except Exception as exc:  # noqa: BLE001 - never raised into the worker
            self.failures += 1
            if not self._failing:
                logger.warning("progress: could not write %s (%s); generation goes on", self.key, exc)
            self._failing = True
            return False
        if self._failing:
            logger.info("progress: writing %s again", self.key)
        self._failing = False
        self.writes += 1
        return True
