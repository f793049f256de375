"""One unit's requests, on a request thread: all its turns (conversation.py has the rules), each
turn with its own bounded retries. Reads only its chunk's `dropped` (from the chunk's lease) and
the stop event; whatever happens becomes the unit's Outcome for main (a failed request is a row).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from dflash_pipeline.config.sampling import sampling_json
from dflash_pipeline.serving.deadline import DeadlinePolicy, server_watch
from dflash_pipeline.serving.sglang import RequestFailure, build_chat_body, chat_once, sent_sampling
from dflash_pipeline.steps.generate.conversation import (
    conversation_row,
    run_conversation,
)
from dflash_pipeline.steps.generate.outcomes import judge, unexpected_failure
from dflash_pipeline.steps.generate.settings import WorkerSettings
from dflash_pipeline.steps.generate.state import OpenChunk, Outcome

logger = logging.getLogger(__name__)


def do_request(s: WorkerSettings, stop: threading.Event, session: Any, item: tuple[OpenChunk, dict[str, Any]]
               ) -> Outcome:
    """Never raises: whatever happens becomes this row's outcome (a failed request is a row).

    One unit is one (id, sample); in all_turns mode its whole conversation runs here, turn
    after turn on this thread's server (conversation.py has the rules)."""
    chunk, prompt = item
    out = Outcome(chunk, prompt)
    watch = server_watch(s.run_id, s.server, s.engine, DeadlinePolicy(s.request_timeout_s, s.min_decode_tok_s))

    # The row's mix (plan wrote it into the chunk inputs): its thinking mode (None: the run's flag)
    # and its sampling overrides; the row records both as sent.
    thinking = prompt.get("thinking")
    thinking = s.sampling.enable_thinking if thinking is None else bool(thinking)
    sent: dict[str, Any] = {}

    def send(messages: list[dict[str, str]]) -> tuple[Any, float, int] | None:
        """One turn: its own retries; a timeout is retried once, never regenerated max_attempts times."""
        body = build_chat_body(messages, s.model, s.sampling, prompt["id"], sample=int(prompt.get("sample") or 0),
                               engine=s.engine, spec_fields=dict(s.spec_request), thinking=thinking,
                               overrides=prompt.get("sampling_override"))
        sent.update(sent_sampling(body))
        timeouts = 0
        for attempt in range(1, s.max_attempts + 1):
            out.attempts += 1
            if chunk.dropped or stop.is_set():
                return None  # stopped or dropped: not a result, never an error row
            try:
                with watch.waiter(int(body["max_tokens"])) as wait:
                    completion, latency = chat_once(session, s.server, body, s.request_timeout_s, wait)
                watch.record(completion.completion_tokens, latency)
                out.done_t = time.monotonic()
                completion = judge(completion, s.sampling, thinking)
            except RequestFailure as exc:
                out.failure = exc
                out.last_failure_t = time.monotonic()
                if out.first_failure_t is None:
                    out.first_failure_t = out.last_failure_t
                timeouts += exc.error_class == "Timeout"
                if not exc.transient or attempt == s.max_attempts or timeouts >= 2:
                    raise
                delay = min(s.backoff_cap_s, s.backoff_base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                stop.wait(delay)
                continue
            out.failure = None
            return completion, latency, attempt
        return None

    try:
        res = run_conversation(prompt["messages"], s.sampling.regenerate, send)
        if res.stopped:
            out.failure = None  # a failure seen before the stop is not this row's outcome
        elif res.failure is not None:
            out.failure = res.failure
        elif res.turns and not res.stopped:
            out.failure = None  # a permanent refusal that only cut the conversation short
            out.row = conversation_row(prompt, res, model=s.model, server=s.server.name,
                                       chunk=chunk.index, run_id=s.run_id)
            out.row["thinking"] = thinking  # the mode this request was sent with
            out.row["sampling"] = sampling_json(sent)
    except Exception as exc:  # noqa: BLE001 - one row's failure, never the task's
        logger.warning("request for %s failed unexpectedly: %r", prompt.get("id"), exc)
        out.row = None
        out.failure = unexpected_failure(exc)
        out.last_failure_t = time.monotonic()
    return out

