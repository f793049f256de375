"""The request threads: `n` daemon threads, each with its own keep-alive client, one request each."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
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


def rotate(items: list[int], width: int, k: int) -> list[int]:
    """`items` with its first `width` rotated left by k (mod how many there are)."""
    n = min(len(items), width)
    if n <= 1:
        return items
    k %= n
    return items[k:n] + items[:k] + items[n:]
