"""A stop signal handled outside the signal handler.

A Python signal handler runs in the main thread between two bytecodes, whatever main is doing, and
possibly while main holds a lock the handler's work needs: `threading.Event.set()` takes the lock of
the Event's Condition, which main itself holds for a moment inside `Event.wait()` or `Event.set()`.
A handler that asks the worker to stop directly can therefore deadlock the main thread until the
supervisor's SIGKILL (cpython#126434 describes the hazard). So the handler here takes no lock: it
writes one byte to a pipe, and a daemon thread blocked on that pipe calls `on_signal`.

Owners: the handler owns nothing but the pipe's write end; the watcher thread calls `on_signal` (once
per signal); `__exit__` restores the previous handlers and closes the pipe, which ends the watcher.
The previous handler, if a Python callable (Airflow's task runner installs one), is still called from
the handler as before.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any, Callable

logger = logging.getLogger(__name__)


class SignalStop:
    """Context manager: while inside, each of `signals` makes a watcher thread call `on_signal()`.
    Outside the main thread (signals cannot be handled there) it does nothing."""

    def __init__(self, on_signal: Callable[[], None], signals: tuple[signal.Signals, ...] = (signal.SIGTERM,),
                 chain: bool = True) -> None:
        self._on_signal = on_signal
        self._signals = signals
        self._chain = chain
        self._previous: dict[signal.Signals, Any] = {}
        self._read_fd = self._write_fd = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read_fd, self._write_fd = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="stop-signal", daemon=True)
        self._thread.start()
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._write_fd >= 0:
            os.close(self._write_fd)  # the watcher reads EOF and ends
            self._write_fd = -1
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: no lock, no logging (logging takes locks), one byte to the watcher."""
        try:
            os.write(self._write_fd, b"\0")
        except OSError:
            pass
        previous = self._previous.get(signal.Signals(signum))
        if self._chain and callable(previous):
            previous(signum, frame)

    def _watch(self) -> None:
        while True:
            try:
                got = os.read(self._read_fd, 64)
            except OSError:
                return
            if not got:
                return
            for _ in got:
                logger.warning("stop signal: stopping the worker (saving finished rows, releasing claims)")
                try:
                    self._on_signal()
                except Exception:  # noqa: BLE001 - a failed stop request must not end the watcher
                    logger.exception("stop request failed")
