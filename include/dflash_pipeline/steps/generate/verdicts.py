"""What main does with a verdict on its server: the breaker's (breaker.py) and a failing one's
(failing.py). Split out of worker.py so the main loop reads as dispatch only.

Owner: main only. `Verdicts` holds no state of its own: the breaker owns its judgement (its judge
thread writes only the verdict main polls), ServerHealth owns the failing state, the Ledger where
each chunk is, the Closer the hand-off. Every move here runs on main between two outcomes, so no
request thread sees a half-made change. An exception raised here (ServerBroken, ServerLost) ends
`Worker.run()` like any other on main: its stop path saves, commits and releases what is held; a
kill loses only the rows not yet saved, as anywhere (worker.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dflash_pipeline.steps.generate.breaker import Breaker
from dflash_pipeline.steps.generate.claiming import Claimer
from dflash_pipeline.steps.generate.failing import ServerHealth
from dflash_pipeline.steps.generate.ledger import Ledger
from dflash_pipeline.steps.generate.settings import WorkerSettings
from dflash_pipeline.steps.generate.state import OpenChunk, ServerBroken, ServerLost, State, WorkerStats
from dflash_pipeline.steps.generate.stopping import Closer, Job, StopRequest


class Verdicts:
    """Main's reactions to the breaker's verdict and to a failing server (module docstring)."""

    def __init__(self, *, settings: WorkerSettings, stats: WorkerStats, breaker: Breaker, health: ServerHealth,
                 ledger: Ledger, claimer: Claimer, closer: Closer, stop: StopRequest,
                 finish_chunk: Callable[[OpenChunk], None], take_open: Callable[..., list[Job]]) -> None:
        self.settings = settings
        self.stats = stats
        self.breaker = breaker
        self.health = health
        self.ledger = ledger
        self.claimer = claimer
        self.closer = closer
        self.stop = stop
        self._finish_chunk = finish_chunk
        self._take_open = take_open

    def judge(self) -> None:
        """The breaker's verdicts, once in: its judgement and its context check. Broken: this
        server's permanent error rows are taken out of its open chunks (none of them is committed;
        their prompts are redone elsewhere) and ServerBroken raised. Otherwise the chunks completed
        while it was judged, or held for an unconfirmed context refusal, go to the committer
        (`finish_chunk` keeps those still unconfirmed open)."""
        try:
            verdict = self.breaker.poll()
            confirmed = self.breaker.poll_context()
        except ServerBroken:
            for chunk in self.ledger.open_chunks():
                chunk.results = {k: r for k, r in chunk.results.items()
                                 if not r.get("error_class") or r.get("retryable")}
                chunk.unconfirmed.clear()
            raise
        if verdict is not None:
            self.stats.breaker_checks += 1
            self.stats.prompt_verdicts += verdict == "prompts"
        if (verdict is None and not confirmed) or self.breaker.deciding:
            return
        for chunk in self.ledger.open_chunks():
            if chunk.complete and not chunk.dropped and chunk.lease is not None \
                    and chunk.lease.state in (State.OPEN, State.REPAIRING):
                self._finish_chunk(chunk)

    def while_failing(self, in_flight: int) -> None:
        """While the server is failing: probe it; hand the open chunks to the fleet after
        `handoff_after_s`; give up after `server_lost_after_s` (worker.py's docstring)."""
        if self.health.poll(in_flight):
            self.claimer.wake.set()
            return
        down_for = self.health.failing_for()
        s = self.settings
        if down_for >= s.handoff_after_s and any(ch.in_flight <= 0 for ch in self.ledger.open_chunks()):
            # A chunk with requests in flight stays until they are back: a generation finishing
            # now is kept (its row is handed back with the chunk, or the server resumes).
            why = f"server {s.server.name} failing for {down_for:.0f}s"
            jobs = self._take_open(keep_errors=True, keep_busy=True)
            t0 = time.monotonic()
            self.closer.hand_off(why, jobs, lambda: min(t0 + 30.0, self.stop.deadline()))
        if down_for >= s.server_lost_after_s:
            raise ServerLost(
                f"server {s.server.name} lost: no generation for {down_for:.0f}s "
                f"(server_lost_after_s={s.server_lost_after_s:g})"
            )
