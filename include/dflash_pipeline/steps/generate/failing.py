"""Is this worker's server failing? One `ServerHealth` per worker owns the answer.

Failing means errors without successes AND without healthy work in flight. A server is failing
from a transient failure with nothing succeeded since, unless it shows a sign of life: its load
endpoint (serving/probe.py, through the server's shared ServerWatch, which the concurrency pilot
also samples) says it is running requests while requests of ours are in flight. That server is
busy, not failing: a request it refused with 503 "queue full" goes back in line (worker.py) and
nothing is handed off, however long its running generations take (a request stuck inside the
server is the deadline policy's business, serving/deadline.py, never a reason to drop the healthy
ones). It stops failing when a generation succeeds again (a real request's answer or a probe) or
a sign of life is seen. `/health` alone does not end it: a server whose /health answers 200 while
every chat request fails (a wedged engine, a broken router) would otherwise be resumed at once and
turn every prompt into an error row. While failing, main sends nothing new, the claimer claims
nothing, and a tiny generation (1 token) is sent at once and then every `probe_every_s` on a daemon
thread, so a hung server never blocks main; after `handoff_after_s` main hands the open chunks to
the fleet (a chunk with requests still in flight only once they are back: worker.py), after
`server_lost_after_s` the task fails (ServerLost), as for a dead server. A probe that succeeds
resumes the worker. A server without a load endpoint (a generic OpenAI server) shows no sign of
life but its answers.

Threads and owners: main calls every method except `failing_since()`, which the claimer reads.
Two daemon threads never block main: the probe writes `_probe_ok_t` (and counts `probes`), the
life sampler writes `_life` (when a load sample last showed requests running); main only reads
those. The sampler samples every `life_every_s` while main keeps asking (`_life_until`, main's,
which the sampler reads: a transient failure unexplained, or failing) and ends `life_watch_s`
after the last question; a question asked as it is ending may find it still alive and start none,
so that question sees no fresh sample and the next one starts it again. A probe's or a load
sample's exception is a failed probe / no sign of life, never raised. A kill takes both threads
with it; nothing here needs saving.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dflash_pipeline.serving.engines import LoadSample
from dflash_pipeline.serving.sglang import RequestFailure, build_chat_body, chat_once
from dflash_pipeline.steps.generate.settings import WorkerSettings

logger = logging.getLogger(__name__)

PROBE_MESSAGES = [{"role": "user", "content": "Reply with OK."}]


class ServerHealth:
    """The failing state of one server and its generation probe (module docstring)."""

    #: A load sample this recent counts as a sign of life; sampled this often while asked.
    life_fresh_s = 2.0
    life_every_s = 0.5
    life_watch_s = 5.0

    def __init__(self, settings: WorkerSettings, client_factory: Callable[[], Any], probe_every_s: float = 1.0,
                 load: Callable[[], LoadSample | None] | None = None) -> None:
        self.settings = settings
        self._client_factory = client_factory
        self._probe_every_s = probe_every_s
        self._since: float | None = None
        self.last_success_t = 0.0
        self._probe: threading.Thread | None = None
        self._probe_ok_t: float | None = None
        self._last_probe_t = 0.0
        self.probes = 0
        # The sign of life: `load()` blocks (an HTTP GET), so only the sampler thread calls it.
        self._load = load
        self._life: tuple[float, int] | None = None  # (monotonic t, requests running) of the last sample
        self._life_until = 0.0
        self._sampler: threading.Thread | None = None
        self.busy_episodes = 0

    def failing_since(self) -> float | None:
        return self._since

    @property
    def failing(self) -> bool:
        return self._since is not None

    def succeeded(self, t: float) -> None:
        """A real request finished: the server generates."""
        self.last_success_t = max(self.last_success_t, t)
        self._since = None

    def servers_fault(self, last_failure_t: float | None) -> bool:
        """A transient failure with nothing succeeded since it happened: the server, not the prompt."""
        return (last_failure_t or 0.0) >= self.last_success_t

    def busy(self, in_flight: int) -> bool:
        """Main: a sign of life now? Requests of ours in flight and a fresh load sample showing the
        server running requests. Never blocks: asking keeps the sampler going for a while, so the
        first question after a quiet spell answers False and later ones have a sample."""
        self._watch()
        life = self._life
        return (in_flight > 0 and life is not None and life[1] > 0
                and time.monotonic() - life[0] <= self.life_fresh_s)

    def _watch(self) -> None:
        if self._load is None:
            return
        self._life_until = time.monotonic() + self.life_watch_s
        if self._sampler is None or not self._sampler.is_alive():
            self._sampler = threading.Thread(target=self._sample_life, name="life-sampler", daemon=True)
            self._sampler.start()

    def _sample_life(self) -> None:
        assert self._load is not None
        while time.monotonic() < self._life_until:
            try:
                sample = self._load()
            except Exception:  # noqa: BLE001 - no answer is no sign of life
                sample = None
            if sample is not None:
                self._life = (time.monotonic(), sample.running)
            time.sleep(self.life_every_s)  # bounded: daemon sampler thread, never joined by main

    def failed(self, message: str) -> None:
        self._watch()
        if self._since is None:
            self._since = time.monotonic()
            self._probe_ok_t = None
            self._last_probe_t = 0.0  # the episode's first probe goes out at once
            logger.warning("server %s is failing (%s); pausing new requests and probing it with a 1-token "
                           "generation", self.settings.server.name, message)

    def failing_for(self) -> float:
        return 0.0 if self._since is None else time.monotonic() - self._since

    def poll(self, in_flight: int = 0) -> bool:
        """Main, while failing: start a probe if one is due; True once a probe has succeeded or the
        server shows a sign of life (`busy`): the failing state is then over."""
        if self._since is None:
            return True
        if self.busy(in_flight):
            assert self._life is not None
            logger.info("server %s is busy, not failing: %d requests running, %d of ours in flight; resuming",
                        self.settings.server.name, self._life[1], in_flight)
            self.busy_episodes += 1
            self._since = None
            return True
        if self._probe_ok_t is not None and self._probe_ok_t >= self._since:
            logger.info("server %s generates again (probe answered); resuming", self.settings.server.name)
            self._since = None
            self.last_success_t = max(self.last_success_t, self._probe_ok_t)
            return True
        now = time.monotonic()
        if (self._probe is None or not self._probe.is_alive()) and now - self._last_probe_t >= self._probe_every_s:
            self._last_probe_t = now
            self._probe = threading.Thread(target=self._run_probe, name="probe", daemon=True)
            self._probe.start()
        return False

    def _run_probe(self) -> None:
        s = self.settings
        self.probes += 1
        body = build_chat_body(PROBE_MESSAGES, s.model, dataclasses.replace(s.sampling, max_tokens=1),
                               "dflash-probe", engine=s.engine, max_tokens_cap=1)
        try:
            chat_once(self._client_factory(), s.server, body, min(10.0, s.request_timeout_s))
        except RequestFailure as exc:
            logger.info("probe of %s failed: %s", s.server.name, exc.message[:200])
            return
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run is a failed probe
            logger.info("probe of %s failed: %r", s.server.name, exc)
            return
        self._probe_ok_t = time.monotonic()


class ShedCap:
    """After a busy server shed a request of ours (503 queue full): at most as many in flight as it
    held then, one more after each round of that many completions, until the limit again. With a
    discovered limit the pilot cuts it too; with a fixed `concurrency_per_server` above what the
    server holds this is what keeps the refused requests few. Owner: main only."""

    def __init__(self) -> None:
        self._cap: int | None = None
        self._done = 0

    def limit(self, limit: int) -> int:
        return limit if self._cap is None else min(limit, self._cap)

    def shed(self, in_flight: int) -> None:
        self._cap, self._done = max(1, in_flight), 0

    def completed(self, limit: int) -> None:
        if self._cap is None:
            return
        self._done += 1
        if self._done >= self._cap:
            self._done = 0
            self._cap = None if self._cap + 1 >= limit else self._cap + 1
