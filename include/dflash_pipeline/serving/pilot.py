"""The in-flight limit of one generate task's server: discovered live, or the user's figure.

Why a separate piece: serving/concurrency.py decides (pure, clock-injected); this runs it. A
`ConcurrencyPilot` feeds the server's ConcurrencyController from the server's shared ServerWatch
(serving/deadline.py), which already sees every request of ours and owns the server's one load
probe; `FixedConcurrency` is the `concurrency_per_server` override. The worker reads `limit`
from either, and nothing else.

Threads and owners:
- the pilot's daemon thread (`pilot-<server>`): one load probe (or a reuse of a fresh one) and one
  `controller.on_probe` every `probe_every_s`; it only reads the watch's outstanding count;
- request threads: completions and 503/429s reach the controller through the watch's listener
  calls (`ServerWatch.record`, `RequestWait.__exit__`), and every attempt waits in
  `ServerWatch.begin` until fewer than `limit` of ours are out (the gate: after a cut, requests
  already in flight retry into room, not into more refusals), so the request path has no extra
  code;
- main and the claimer: `limit` and `snapshot()`.
`stop(timeout_s)` ends the thread and detaches the listener, waiting for it no longer than the
caller's stop deadline allows; a killed process takes the daemon thread with
it, and nothing the pilot holds needs saving (the task's progress object has the history).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from dflash_pipeline.serving.concurrency import ConcurrencyController, ConcurrencyPolicy
from dflash_pipeline.serving.deadline import DeadlinePolicy, ServerWatch, server_watch

logger = logging.getLogger(__name__)


class FixedConcurrency:
    """`concurrency_per_server` set by the user: used as given."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)

    def start(self) -> None:
        pass

    def stop(self, timeout_s: float = 5.0) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {"mode": "fixed", "start": self.limit, "slots": None, "runs": None, "limit": self.limit,
                "ceiling": None, "cap": None, "reason": "concurrency_per_server", "rejections": {}, "changes": []}


class ConcurrencyPilot:
    """Runs one server's ConcurrencyController (module docstring: threads and owners)."""

    def __init__(self, controller: ConcurrencyController, watch: ServerWatch, name: str) -> None:
        self.controller = controller
        self.watch = watch
        self.name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def limit(self) -> int:
        return self.controller.limit

    def snapshot(self) -> dict[str, Any]:
        return self.controller.snapshot()

    def start(self) -> None:
        if self._thread is not None:
            return
        self.controller.begin()
        self.watch.add_listener(self.controller)
        self.watch.set_gate(lambda: self.controller.limit)
        self._thread = threading.Thread(target=self._run, name=f"pilot-{self.name}"[:60], daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread: wait for it at most `timeout_s` (a stopping task passes what its stop
        deadline leaves; a tick waiting on a slow load probe is then given up on: the thread is a
        daemon and holds nothing that needs saving)."""
        self._stop.set()
        self.watch.remove_listener(self.controller)
        self.watch.set_gate(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(0.0, timeout_s))

    def tick(self) -> None:
        """One observation: the server's load (a probe at most half an interval old) and ours."""
        every = self.controller.probe_every_s
        answered, sample = self.watch.sample(max_age_s=every / 2) if self.watch.probing else (False, None)
        self.controller.on_probe(sample if answered else None, self.watch.outstanding())

    def _run(self) -> None:
        last_reason = self.controller.reason
        while not self._stop.wait(self.controller.probe_every_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the limit then stays where it is; never the task's failure
                logger.warning("concurrency pilot of %s: evaluation failed", self.name, exc_info=True)
            if self.controller.reason != last_reason:
                last_reason = self.controller.reason
                logger.info("server %s: in-flight limit %d (%s)", self.name, self.controller.limit, last_reason)


def concurrency_for(*, run_id: str, server: Any, engine: str | None, deadline: DeadlinePolicy,
                    fixed: int | None, declared_slots: int | None, start_slots: int,
                    policy: ConcurrencyPolicy) -> FixedConcurrency | ConcurrencyPilot:
    """The limit source of one generate task: `fixed` (the user's concurrency_per_server) as
    given, else a pilot starting from the server's declared slots (SGLang) or `start_slots`."""
    if fixed is not None:
        return FixedConcurrency(fixed)
    watch = server_watch(run_id, server, engine, deadline)
    controller = ConcurrencyController(policy, declared_slots or start_slots, declared=declared_slots is not None,
                                       probing=watch.probing)
    return ConcurrencyPilot(controller, watch, getattr(server, "name", str(server)))
