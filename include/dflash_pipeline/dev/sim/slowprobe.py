"""Slow load probes: a simulated server that answers its load endpoints late (issue 31).

A real SGLang or vLLM under heavy load can take seconds to answer `/v1/loads`, `/get_load` or
`/metrics` (the tokenizer manager's event loop is busy). A worker's stop must not wait for such a
probe: the concurrency pilot and the deadline rules probe from their own threads, and the stop joins
them by its deadline. This module holds each probe request `delay_s` before the server handles it.

Owners: `set_probe_delay` (the test or chaos runner, any thread) writes one float per SimServer
under a module lock; the server's handler threads only read it (`hold`). A server's stop (or a
crash) does not end a hold already under way: the handler answers (or finds its socket closed)
when the delay is over, as a slow server would.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

#: The load endpoints of the three wire flavours (SGLang, SGLang before 0.5.21, vLLM).
PROBE_PATHS = frozenset({"/v1/loads", "/get_load", "/metrics"})

_lock = threading.Lock()
_delays: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()  # SimServer -> seconds


#: The server-info endpoints (what a breaker's context probe or preflight reads).
INFO_PATHS = frozenset({"/get_server_info", "/server_info", "/v1/models"})
_info_delays: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()  # SimServer -> seconds


def set_probe_delay(sim: Any, delay_s: float) -> None:
    """Every load probe `sim` receives from now on waits `delay_s` seconds first (0: none)."""
    _set(_delays, sim, delay_s)


def set_info_delay(sim: Any, delay_s: float) -> None:
    """Every server-info request `sim` receives from now on waits `delay_s` seconds first (0: none)."""
    _set(_info_delays, sim, delay_s)


def _set(table: weakref.WeakKeyDictionary[Any, float], sim: Any, delay_s: float) -> None:
    with _lock:
        if delay_s > 0:
            table[sim] = float(delay_s)
        else:
            table.pop(sim, None)


def probe_delay(sim: Any) -> float:
    with _lock:
        return _delays.get(sim, 0.0)


def hold(sim: Any, path: str) -> None:
    """The server.py hook: called by a handler thread before it handles `path`."""
    if path in PROBE_PATHS:
        delay = probe_delay(sim)
    elif path in INFO_PATHS:
        with _lock:
            delay = _info_delays.get(sim, 0.0)
    else:
        return
    if delay > 0:
        time.sleep(delay)
