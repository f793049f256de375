"""Is this worker's server failing? One `ServerHealth` per worker owns the answer.

A server is failing from the first transient failure with nothing succeeded since, until a
generation succeeds again: a real request's answer, or a probe. `/health` alone does not end it: a
server whose /health answers 200 while every chat request fails (a wedged engine, a broken
router) would otherwise be resumed at once and turn every prompt into an error row. While
failing, main sends nothing new, the claimer claims nothing, and a tiny generation (1 token) is
sent at once and then every `probe_every_s` on a daemon thread, so a hung server never blocks main; after
`handoff_after_s` main hands the open chunks to the fleet, after `server_lost_after_s` the task
fails (ServerLost), as for a dead server. A probe that succeeds resumes the worker.

Owner: main calls every method except `failing_since()`, which the claimer reads.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dflash_pipeline.serving.sglang import RequestFailure, build_chat_body, chat_once
from dflash_pipeline.steps.generate.settings import WorkerSettings

logger = logging.getLogger(__name__)

PROBE_MESSAGES = [{"role": "user", "content": "Reply with OK."}]


class ServerHealth:
    """The failing state of one server and its generation probe (module docstring)."""

    def __init__(self, settings: WorkerSettings, client_factory: Callable[[], Any], probe_every_s: float = 1.0) -> None:
        self.settings = settings
        self._client_factory = client_factory
        self._probe_every_s = probe_every_s
        self._since: float | None = None
        self.last_success_t = 0.0
        self._probe: threading.Thread | None = None
        self._probe_ok_t: float | None = None
        self._last_probe_t = 0.0
        self.probes = 0

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

    def failed(self, message: str) -> None:
        if self._since is None:
            self._since = time.monotonic()
            self._probe_ok_t = None
            self._last_probe_t = 0.0  # the episode's first probe goes out at once
            logger.warning("server %s is failing (%s); pausing new requests and probing it with a 1-token "
                           "generation", self.settings.server.name, message)

    def failing_for(self) -> float:
        return 0.0 if self._since is None else time.monotonic() - self._since

    def poll(self) -> bool:
        """Main, while failing: start a probe if one is due; True once a probe has succeeded (the
        failing state is then over)."""
        if self._since is None:
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
                               "dflash-probe", engine=s.engine)
        try:
            chat_once(self._client_factory(), s.server, body, min(10.0, s.request_timeout_s))
        except RequestFailure as exc:
            logger.info("probe of %s failed: %s", s.server.name, exc.message[:200])
            return
        except Exception as exc:  # noqa: BLE001 - a probe that cannot run is a failed probe
            logger.info("probe of %s failed: %r", s.server.name, exc)
            return
        self._probe_ok_t = time.monotonic()
