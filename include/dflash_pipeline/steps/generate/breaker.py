"""The breaker: is a server answering permanent errors broken, or are its prompts unservable?

A permanent error (ContextLengthExceeded, BadRequest) may be the prompt's fault (longer than every
server's context, an invalid message) or the server's (restarted with a smaller --context-length, a
broken chat template). The prompt's is an error row like any failed request: counted, committed,
reported. The server's must stop the server before it commits a dataset of error rows. A share of
permanent errors alone cannot tell them apart (a chunk of too-long prompts gives 100 % on whichever
server takes it), and neither can a comparison with the fleet's shares (the peers served other
prompts). So the breaker only *suspects* from the share, and then judges what the server fails
against what its peers serve:

1. the canary: a one-line prompt every server of the fleet serves (1 token). A server that refuses
   it permanently fails what any peer serves: broken, alone or in a fleet (a lone server with a
   broken template or a tiny context is caught here, with no peer to compare with);
2. for context-length refusals, the server's live context length (its server-info / models
   endpoint, serving/probe.py) against the fleet's at preflight (the manifest): smaller means
   prompts that fit the peers are refused here: broken. Equal or larger: no server of the fleet has
   more room, the prompts are too long. A server publishing no context length (generic) cannot be
   shown to refuse what its peers serve.
Neither: the prompts' fault. Their rows stay error rows, the window is cleared, and a new suspicion
needs a full `breaker_window` of results. A judgement that cannot get an answer (the server
failing transiently) decides nothing; the worker resumes and may suspect again 5 s later.

Limit: a server-specific refusal that a one-line prompt does not show and that is not about the
context (a template failing only on some messages) is judged the prompts'; its error rows are
counted by class and validate's max_error_rate reports them.

Threads and owners: main calls `record`, `deciding` and `poll`; while `deciding`, main sends no new
request and completes no chunk (worker.py), so no error row of a server being judged is committed.
The judgement runs on one daemon thread (HTTP, bounded timeouts: the canary at most 30 s, the
context probe 10 s), which writes only `_verdict` (an exception in it is an "undecided" verdict);
main never waits for it, so a stop is never delayed by it. What main does with the verdict is
verdicts.py. A kill takes the thread with it (nothing committed while deciding, nothing saved
here). A stop or an exception on main while deciding ends the run through `Closer.give_up` with
`keep_errors` and `finish_complete` off (worker.py asks `deciding`): no chunk is committed and the
suspect's permanent error rows are neither handed back nor checkpointed; their prompts are redone.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from dflash_pipeline.serving.probe import probe_server
from dflash_pipeline.serving.sglang import RequestFailure, build_chat_body, chat_once, new_session
from dflash_pipeline.steps.generate.settings import WorkerSettings
from dflash_pipeline.steps.generate.state import ServerBroken

logger = logging.getLogger(__name__)

CANARY_MESSAGES = [{"role": "user", "content": "Reply with OK."}]
JUDGE_AGAIN_S = 5.0


def fleet_context(servers: list[dict[str, Any]] | None) -> tuple[int | None, str | None]:
    """(largest context length, its server) among the servers preflight found in this run's manifest."""
    best: tuple[int | None, str | None] = (None, None)
    for entry in servers or []:
        ctx = entry.get("context_length") if isinstance(entry, dict) else None
        if isinstance(ctx, int) and not entry.get("unreachable") and (best[0] is None or ctx > best[0]):
            best = (ctx, str(entry.get("name")))
    return best


class Breaker:
    """Recent results of one server, the suspicion and the judgement (module docstring)."""

    def __init__(self, settings: WorkerSettings, client_factory: Callable[[], Any],
                 fleet_servers: list[dict[str, Any]] | None = None,
                 context_now: Callable[[], int | None] | None = None) -> None:
        self.settings = settings
        self._client_factory = client_factory
        self._fleet_servers = fleet_servers
        self._context_now = context_now or self._probe_context
        self._recent: deque[bool] = deque(maxlen=settings.breaker_window)
        self._need = max(10, settings.breaker_window // 2)
        self._last_permanent = ""
        self._classes: set[str] = set()
        self._judge: threading.Thread | None = None
        self._verdict: tuple[str, str] | None = None  # ("broken" | "prompts" | "undecided", why)
        self._judged_t = -1e18
        self.checks = 0
        self.prompt_verdicts = 0

    @property
    def deciding(self) -> bool:
        return self._judge is not None

    def record(self, failure: RequestFailure | None) -> None:
        """Main: a result, a completion (None) or an error row's failure; may start a judgement."""
        permanent = failure is not None and not failure.transient
        self._recent.append(permanent)
        if not permanent:
            return
        assert failure is not None
        self._last_permanent = f"{failure.error_class}: {failure.message[:200]}"
        self._classes.add(failure.error_class)
        recent = self._recent
        if self._judge is not None or len(recent) < self._need \
                or sum(recent) / len(recent) < self.settings.breaker_suspect_share \
                or time.monotonic() - self._judged_t < JUDGE_AGAIN_S:
            return
        self.checks += 1
        logger.warning("server %s answered %d of its last %d requests with a permanent error (last: %s); "
                       "pausing it while it is judged against the fleet", self.settings.server.name,
                       sum(recent), len(recent), self._last_permanent)
        self._verdict = None
        self._judge = threading.Thread(target=self._run_judge, args=(frozenset(self._classes),),
                                       name="breaker-judge", daemon=True)
        self._judge.start()

    def poll(self) -> str | None:
        """Main: the judgement's outcome once it is in ("prompts" / "undecided": resume), None while
        deciding or idle. Raises ServerBroken when the server fails what its peers serve."""
        if self._judge is None or self._judge.is_alive():
            return None
        self._judge = None
        self._judged_t = time.monotonic()
        verdict, why = self._verdict or ("undecided", "the judgement did not finish")
        name = self.settings.server.name
        if verdict == "broken":
            raise ServerBroken(
                f"server {name} is broken: {why}. It answered {sum(self._recent)} of its last "
                f"{len(self._recent)} requests with a permanent error (last: {self._last_permanent}). Check its "
                f"--context-length and chat template against the others'; its open chunks were released "
                f"without its error rows."
            )
        if verdict == "prompts":
            self.prompt_verdicts += 1
            logger.warning("server %s: its permanent errors are the prompts' (%s); they stay error rows",
                           name, why)
            self._recent.clear()
            self._classes.clear()
            self._need = self.settings.breaker_window
        else:
            logger.warning("server %s: could not judge its permanent errors (%s); resuming", name, why)
        return verdict

    # -- the judge thread ------------------------------------------------------------------------
    def _run_judge(self, classes: frozenset[str]) -> None:
        try:
            self._verdict = self._judgement(classes)
        except Exception as exc:  # noqa: BLE001 - a judgement that cannot run decides nothing
            self._verdict = ("undecided", f"{type(exc).__name__}: {exc}")

    def _judgement(self, classes: frozenset[str]) -> tuple[str, str]:
        s = self.settings
        body = build_chat_body(CANARY_MESSAGES, s.model, dataclasses.replace(s.sampling, max_tokens=1),
                               "dflash-breaker-canary", engine=s.engine, max_tokens_cap=1)
        try:
            chat_once(self._client_factory(), s.server, body, min(30.0, s.request_timeout_s))
        except RequestFailure as exc:
            if exc.transient:
                return "undecided", f"the one-line canary failed transiently ({exc.error_class})"
            return "broken", (f"it refuses even a one-line prompt that any server serves "
                              f"({exc.error_class}: {exc.message[:200]})")
        if "ContextLengthExceeded" in classes:
            fleet, where = fleet_context(self._fleet_servers)
            try:
                ours = self._context_now()
            except RequestFailure as exc:
                return "undecided", f"its context length could not be read ({exc.error_class})"
            if ours is not None and fleet is not None and ours < fleet:
                return "broken", (f"its context length is now {ours} tokens, {where} had {fleet} at preflight: "
                                  "it refuses prompts its peers serve (restarted with a smaller --context-length?)")
            if ours is None or fleet is None:
                return "prompts", ("it serves a one-line prompt, and no context length to compare with the "
                                   "fleet's is published (a generic server): nothing shows a peer would serve them")
            return "prompts", (f"it serves a one-line prompt and its context ({ours} tokens) is the fleet's "
                               f"largest ({fleet}): those prompts are too long for every server")
        return "prompts", "it serves a one-line prompt: the refused requests are the prompts'"

    def _probe_context(self) -> int | None:
        """The server's context length now (None: it publishes none); RequestFailure if unreachable."""
        return probe_server(new_session(), self.settings.server, timeout_s=10.0).context_length
