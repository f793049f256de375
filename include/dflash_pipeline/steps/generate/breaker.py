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
   endpoint, serving/probe.py) against its own at preflight (the manifest): smaller means it was
   restarted with a smaller --context-length and refuses prompts that fit the fleet it was planned
   with: broken. Equal or larger: it is the server preflight saw; a server whose context was always
   smaller than a peer's is not broken for it (issue 39: judged against the fleet's largest, the
   healthy small server of a mixed fleet was ServerBroken for prompts too long for every server).
   A server publishing no context length (generic) cannot be shown to refuse what its peers serve.
Neither: the prompts' fault.

The context check comes before any commit, not only after a suspicion: a context refusal depends on
the server (a restart with a smaller context makes prompts that fit the fleet refused here), so
each one is *unconfirmed* until a context check started after it finds the server's context not
smaller than at preflight (`context_refused`, `poll_context`, `confirmed`). Main completes no
chunk holding an unconfirmed refusal and saves none in a partial (worker.py); a check that finds it
smaller is ServerBroken (the refusals are dropped, their prompts redone by the fleet). Before
(issue 39) the refusals of a server restarted mid-run were committed as the prompts' error rows
until 20 of its last 40 results were refusals. The check is one GET of the server's info on a
daemon thread of its own; dispatch goes on meanwhile (a refusal only holds its chunk). A check
that cannot read the context is tried again every second; after CONTEXT_CHECK_GIVE_UP_S of that,
the refusals it covers are confirmed (as before: nothing shows a peer would serve them), so no
chunk is held forever. Their rows stay error rows, the window is cleared, and a new suspicion
needs a full `breaker_window` of results. A judgement that cannot get an answer (the server
failing transiently) decides nothing; the worker resumes and may suspect again 5 s later.

Limit: a server-specific refusal that a one-line prompt does not show and that is not about the
context (a template failing only on some messages) is judged the prompts'; its error rows are
counted by class and validate's max_error_rate reports them.

Threads and owners: main calls `record`, `deciding`, `poll`, `context_refused`, `poll_context` and
`confirmed` (`_ctx_*` are main's but `_ctx_verdict`, which only the context-check thread writes);
while `deciding`, main sends no new request and completes no chunk (worker.py), so no error row of a
server being judged is committed. The judgement runs on one daemon thread (HTTP, bounded timeouts:
the canary at most 30 s, the context probe 10 s), which writes only `_verdict` (an exception in it
is an "undecided" verdict); main never waits for it, so a stop is never delayed by it. What main
does with the verdict is verdicts.py. A kill takes the thread with it (nothing committed while
deciding, nothing saved here). A stop or an exception on main while deciding ends the run through
`Closer.give_up` with `keep_errors` and `finish_complete` off (worker.py asks `deciding`): no chunk
is committed and the suspect's permanent error rows are neither handed back nor checkpointed; their
prompts are redone.
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
#: A context check that cannot read the server's context this long confirms the refusals it covers.
CONTEXT_CHECK_GIVE_UP_S = 30.0


def fleet_context(servers: list[dict[str, Any]] | None) -> tuple[int | None, str | None]:
    """(largest context length, its server) among the servers preflight found in this run's manifest."""
    best: tuple[int | None, str | None] = (None, None)
    for entry in servers or []:
        ctx = entry.get("context_length") if isinstance(entry, dict) else None
        if isinstance(ctx, int) and not entry.get("unreachable") and (best[0] is None or ctx > best[0]):
            best = (ctx, str(entry.get("name")))
    return best


def own_context(servers: list[dict[str, Any]] | None, name: str) -> int | None:
    """This server's context length at preflight (the run's manifest), None if it recorded none."""
    for entry in servers or []:
        if isinstance(entry, dict) and str(entry.get("name")) == name and isinstance(entry.get("context_length"), int):
            return int(entry["context_length"])
    return None


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
        # The context check (module docstring): the start of the last check that found the context
        # not smaller than at preflight; the latest context refusal; the running check.
        self._preflight_ctx = own_context(fleet_servers, settings.server.name)
        if self._preflight_ctx is None:
            self._preflight_ctx = fleet_context(fleet_servers)[0]
        self._ctx_ok_t = -1e18
        self._ctx_wanted_t = -1e18
        self._ctx_thread: threading.Thread | None = None
        self._ctx_started_t = 0.0
        self._ctx_retry_t = 0.0
        self._ctx_verdict: tuple[str, str] | None = None
        self._ctx_undecided_since: float | None = None
        self.context_checks = 0

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

    # -- the context check ----------------------------------------------------------------------
    def context_refused(self, t: float) -> None:
        """Main: a context refusal answered at `t` (monotonic); it stays unconfirmed until a check
        started after it is in."""
        self._ctx_wanted_t = max(self._ctx_wanted_t, t)
        self._start_context_check()

    def confirmed(self, t: float) -> bool:
        """Main: may a context refusal answered at `t` be committed as the prompt's error row?"""
        return t <= self._ctx_ok_t

    def poll_context(self) -> bool:
        """Main: True when a check came in that confirms refusals; raises ServerBroken when the
        server's context is now smaller than at preflight."""
        thread = self._ctx_thread
        if thread is None or thread.is_alive():
            self._start_context_check()
            return False
        self._ctx_thread = None
        verdict, why = self._ctx_verdict or ("undecided", "the check did not finish")
        if verdict == "broken":
            raise ServerBroken(
                f"server {self.settings.server.name} is broken: {why}. Its context-length refusals were not "
                f"committed (the prompts fit the fleet it was planned with); its open chunks were released "
                f"without them."
            )
        if verdict == "ok":
            self._ctx_undecided_since = None
            self._ctx_ok_t = max(self._ctx_ok_t, self._ctx_started_t)
            self._start_context_check()
            return True
        now = time.monotonic()
        if self._ctx_undecided_since is None:
            self._ctx_undecided_since = now
        if now - self._ctx_undecided_since >= CONTEXT_CHECK_GIVE_UP_S:
            # Never hold a chunk forever on a server whose info cannot be read: as before the
            # check, nothing then shows a peer would serve those prompts.
            logger.warning("server %s: its context length could not be checked for %.0fs (%s); its context "
                           "refusals so far are taken as the prompts'", self.settings.server.name,
                           now - self._ctx_undecided_since, why)
            self._ctx_undecided_since = None
            self._ctx_ok_t = max(self._ctx_ok_t, self._ctx_started_t)
            return True
        logger.info("server %s: its context length could not be checked (%s); checking again",
                    self.settings.server.name, why)
        self._ctx_retry_t = now + 1.0
        return False

    def _start_context_check(self) -> None:
        if self._ctx_thread is not None or self._ctx_wanted_t <= self._ctx_ok_t \
                or time.monotonic() < self._ctx_retry_t:
            return
        self.context_checks += 1
        self._ctx_verdict = None
        self._ctx_started_t = time.monotonic()
        self._ctx_thread = threading.Thread(target=self._run_context_check, name="breaker-context", daemon=True)
        self._ctx_thread.start()

    def _run_context_check(self) -> None:
        try:
            self._ctx_verdict = self._context_verdict()
        except RequestFailure as exc:
            self._ctx_verdict = ("undecided", f"its context length could not be read ({exc.error_class})")
        except Exception as exc:  # noqa: BLE001 - a check that cannot run decides nothing
            self._ctx_verdict = ("undecided", f"{type(exc).__name__}: {exc}")

    def _context_verdict(self) -> tuple[str, str]:
        """("broken", why) when the server's context is now smaller than at preflight, else ("ok", why)."""
        ours, planned = self._context_now(), self._preflight_ctx
        if ours is not None and planned is not None and ours < planned:
            return "broken", (f"its context length is now {ours} tokens, it had {planned} at preflight: it refuses "
                              "prompts that fit the fleet it was planned with (restarted with a smaller "
                              "--context-length?)")
        return "ok", f"its context length is {ours} tokens (at preflight {planned})"

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
            try:
                verdict = self._context_verdict()
            except RequestFailure as exc:
                return "undecided", f"its context length could not be read ({exc.error_class})"
            if verdict[0] == "broken":
                return verdict
            return "prompts", f"it serves a one-line prompt and {verdict[1]}: those prompts are too long for it"
        return "prompts", "it serves a one-line prompt: the refused requests are the prompts'"

    def _probe_context(self) -> int | None:
        """The server's context length now (None: it publishes none); RequestFailure if unreachable."""
        return probe_server(new_session(), self.settings.server, timeout_s=10.0).context_length
