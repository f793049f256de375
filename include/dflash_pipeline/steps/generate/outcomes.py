"""What one request's answer becomes: a completion row, or a failure (which may become an error row).

Kept apart from dispatch so the rules are read in one place:

- Only `finish_reason` "stop" or "length" is a completion. SGLang answers an aborted request (an
  operator's `/abort_request`, a scheduler abort) with HTTP 200, `finish_reason: "abort"` and the
  partial text; that, a missing finish reason, or anything else unfinished is a transient failure
  ("Unfinished"), retried like a 503 and never stored as training data.
- With thinking on, an answer cut at `length` before `</think>` whose `<think>` was in the prompt
  (the Qwen3-2507 template's shape) comes back with no tags at all: it is all reasoning, not answer.
- Any exception a request thread did not expect (an odd JSON shape, a bug) is one row's transient
  failure ("UnexpectedError"), never the task's: a failed request is a row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_pipeline.config import Sampling
from dflash_pipeline.dataset.records import row_labels
from dflash_pipeline.serving.sglang import Completion, RequestFailure

FINISHED = ("stop", "length")


def judge(completion: Completion, sampling: Sampling, thinking: bool | None = None) -> Completion:
    """The completion to store, or raise the RequestFailure it really is (`thinking`: the row's mode,
    None: the run's enable_thinking)."""
    reason = completion.finish_reason
    if reason not in FINISHED:
        raise RequestFailure(
            "Unfinished",
            f"the server did not finish the request (finish_reason={reason!r}); partial output discarded",
            kind="transient",
        )
    if (sampling.enable_thinking if thinking is None else thinking) and reason == "length" and completion.reasoning is None and completion.content:
        return dataclasses.replace(completion, reasoning=completion.content, content="")
    return completion


#: Answers that refuse a request without generating it: a full queue (SGLang's 503 "The request
#: queue is full.", a 503 in front of the engine) or a rate limit. Only these mean "busy"
#: (worker.py): any other failure on a server that runs others may be the prompt's and is counted.
REFUSALS = (429, 503)


def refused(failure: RequestFailure) -> bool:
    """The server refused this request without generating it (REFUSALS), nothing else."""
    return failure.transient and failure.status in REFUSALS


def unexpected_failure(exc: BaseException) -> RequestFailure:
    """A request thread's unexpected exception as one row's (transient) failure."""
    return RequestFailure("UnexpectedError", f"{type(exc).__name__}: {exc}", kind="transient")


def completion_row(
    prompt: dict[str, Any],
    completion: Completion,
    *,
    model: str,
    server: str,
    attempts: int,
    latency_s: float,
    chunk: int,
    run_id: str,
) -> dict[str, Any]:
    return {
        "id": prompt["id"],
        "messages": prompt["messages"],
        "reasoning": completion.reasoning,
        "content": completion.content,
        "finish_reason": completion.finish_reason,
        "matched_stop": completion.matched_stop,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "reasoning_tokens": completion.reasoning_tokens,
        "model": completion.model or model,
        "server": server,
        "attempts": attempts,
        "latency_s": round(latency_s, 4),
        "chunk": chunk,
        "run_id": run_id,
        "sample": int(prompt.get("sample") or 0),
        "original_messages": prompt.get("original_messages"),
        "cached_tokens": completion.cached_tokens,
        **row_labels(prompt),
    }


def error_row(
    prompt: dict[str, Any], failure: RequestFailure, *, model: str, server: str, attempts: int, chunk: int, run_id: str
) -> dict[str, Any]:
    return {
        "id": prompt["id"],
        "messages": prompt["messages"],
        "model": model,
        "server": server,
        "attempts": attempts,
        "error_class": failure.error_class,
        "error_message": failure.message,
        "retryable": failure.transient,
        "chunk": chunk,
        "run_id": run_id,
        "sample": int(prompt.get("sample") or 0),
        "original_messages": prompt.get("original_messages"),
        **row_labels(prompt),
    }
