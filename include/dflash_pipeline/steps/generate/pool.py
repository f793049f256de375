"""Daemon thread pools: the request threads (`n` threads, each with its own keep-alive client, one
request each) and a small executor for S3 side calls."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class RequestPool:
    """`n` daemon threads, each with its own keep-alive session, running one request at a time;
    `ensure(m)` adds threads when the in-flight limit grows (they are never removed: an idle one
    costs a blocked thread and, once used, one idle connection). Only the owner (the worker's main
    thread) calls `ensure`, `submit` and `close`.

    Daemon threads (not a ThreadPoolExecutor) so a task that gives up on a dead server is not kept
    alive by requests still waiting for their timeout.
    """

    def __init__(self, n: int, fn: Callable[[Any, Any], Any], session_factory: Callable[[], Any]) -> None:
        self._in: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._fn = fn
        self._session_factory = session_factory
        self.ensure(n)

    @property
    def size(self) -> int:
        return len(self._threads)

    def ensure(self, n: int) -> None:
        """At least `n` threads."""
        while len(self._threads) < n and not self._stop.is_set():
            i = len(self._threads)
            t = threading.Thread(target=self._loop, args=(self._fn, self._session_factory), name=f"req-{i}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def _loop(self, fn: Callable[[Any, Any], Any], session_factory: Callable[[], Any]) -> None:
        session: Any = None
        while not self._stop.is_set():
            item = self._in.get()  # bounded: an idle request thread waiting for work; close() ends it
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


def rotate(items: list[int], width: int, k: int) -> list[int]:
    """`items` with its first `width` rotated left by k (mod how many there are)."""
    n = min(len(items), width)
    if n <= 1:
        return items
    k %= n
    return items[k:n] + items[:k] + items[n:]


class DaemonPool:
    """A small executor of daemon threads for S3 side calls (listings, reads, checkpoints).

    Not concurrent.futures' ThreadPoolExecutor: its threads are joined at interpreter exit, so a
    task ending (a stop, a kill by its supervisor) would wait for, or be outlived by, a PUT still
    in flight. Work not started when `close()` is called never runs."""

    def __init__(self, n: int, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        self._closed = threading.Event()
        self._n = n
        for i in range(n):
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()  # bounded: an idle pool thread waiting for work; close() ends it
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        if self._closed.is_set():
            fut.set_running_or_notify_cancel()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)
            return fut
        self._q.put((fut, fn, args))
        return fut

    def close(self) -> None:
        self._closed.set()
        for _ in range(self._n):
            self._q.put(None)
