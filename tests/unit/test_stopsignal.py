"""The stop signal is handled outside the signal handler (steps/generate/stopsignal.py)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from dflash_pipeline.dev.transitions import STOP_WINDOWS, TransitionRates
from dflash_pipeline.steps.generate.stopsignal import SignalStop


@pytest.mark.timeout(20)
def test_the_stop_request_never_runs_inside_the_handler() -> None:
    """Main holds the lock of the Event the stop sets (as it does for a moment inside Event.wait() and
    Event.set()) when SIGTERM arrives. A handler that set the Event itself would wait for that lock in
    the main thread forever (cpython#126434); here the request runs in the watcher thread and waits
    until main lets go."""
    wake = threading.Event()
    previous = signal.getsignal(signal.SIGTERM)
    with SignalStop(wake.set, chain=False):
        with wake._cond:  # type: ignore[attr-defined]
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10_000):  # the Python handler runs between these bytecodes
                pass
            assert not wake.is_set()
        assert wake.wait(5)
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.timeout(20)
def test_each_signal_asks_once_from_the_watcher_thread_and_the_previous_handler_still_runs() -> None:
    calls: list[str] = []
    chained: list[int] = []
    done = threading.Semaphore(0)

    def on_signal() -> None:
        calls.append(threading.current_thread().name)
        done.release()

    before = signal.signal(signal.SIGTERM, lambda signum, frame: chained.append(signum))
    try:
        with SignalStop(on_signal):
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGTERM)
                assert done.acquire(timeout=5)
        assert calls == ["stop-signal", "stop-signal"] and chained == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_schedule_without_a_sure_sigterm_gets_a_certain_early_stop() -> None:
    from dflash_pipeline.dev.chaos import SURE_SIGTERM_S, random_schedule

    seeds = range(1, 200)
    schedules = [random_schedule(s) for s in seeds]
    without = [sc for sc in schedules if not any(e.kind == "sigterm" and e.at_s >= SURE_SIGTERM_S for e in sc.events)]
    assert without and all(sc.transitions.stop == 1.0 and sc.transitions.stop_first for sc in without)
    assert all(not sc.transitions.stop_first for sc in schedules if sc not in without)
    # the rest of a seed's schedule is the same with or without transition faults
    assert all(random_schedule(s, transitions=False).events == sc.events for s, sc in zip(seeds, schedules))
    assert STOP_WINDOWS[0][0].value == "claimed" and TransitionRates().any is False
