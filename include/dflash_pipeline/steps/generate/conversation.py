"""One planned row (an (id, sample) unit) into one outcome: the requests of its conversation.

Kept apart from dispatch: the worker hands a request thread one unit, and this module decides
which requests that unit needs, in which order, and what the row says afterwards.

- `last_turn`: one request with the conversation as given (the old trailing answer already
  dropped by plan); the row's `conversation` is that history plus the new answer.
- `all_turns`: system and user turns are kept verbatim; every assistant turn is regenerated in
  order, each request carrying the answers regenerated before it (never their reasoning: the
  Qwen3 template drops earlier reasoning, and the fleet must see what a chat would see). All turns
  run on the calling thread, so on one server, whose radix cache already holds the prefix.
- A turn cut at `length` with turns still to go ends the conversation there (`cut_short` =
  "length"); so does a turn refused for good by a permanent error (`cut_short` = its error class),
  once at least one turn was regenerated. A transient failure left after the turn's retries makes
  the whole unit a retryable error row instead: a later run replays the conversation, rather than
  keeping a conversation cut short by a server's bad minute.
- The row's `reasoning`, `content`, `finish_reason` are its last regenerated turn's; its token
  columns are sums over its turns, so totals stay the totals generated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.serving.sglang import Completion, RequestFailure
from dflash_pipeline.serving.specstats import SPEC_COLUMNS, SpecStats, total
from dflash_pipeline.steps.generate.outcomes import completion_row

REGENERATE_MODES = ("last_turn", "all_turns")

# Sends one request (retrying transient failures itself): (judged completion, latency, attempts),
# None when the unit must stop (its chunk was dropped or the task is stopping), or raises the
# RequestFailure the request ended with.
SendTurn = Callable[[list[dict[str, str]]], "tuple[Completion, float, int] | None"]


@dataclass(frozen=True)
class Turn:
    completion: Completion
    latency_s: float
    attempts: int

    def to_dict(self) -> dict[str, Any]:
        c = self.completion
        return {
            "finish_reason": c.finish_reason,
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "reasoning_tokens": c.reasoning_tokens,
            "cached_tokens": c.cached_tokens,
            "latency_s": round(self.latency_s, 4),
            **spec_columns(c.spec),
        }


@dataclass
class ConversationResult:
    turns: list[Turn] = field(default_factory=list)
    # What a trainer reads: role, content, reasoning (assistant turns as regenerated).
    conversation: list[dict[str, Any]] = field(default_factory=list)
    failure: RequestFailure | None = None  # the unit is an error row
    cut_short: str | None = None
    stopped: bool = False
    turns_planned: int = 0

    @property
    def attempts(self) -> int:
        return sum(t.attempts for t in self.turns)


def turns_to_regenerate(messages: list[dict[str, Any]], regenerate: str) -> int:
    """Requests a unit needs: 1 in last_turn mode; every assistant turn plus the final answer in all_turns."""
    if regenerate == "all_turns":
        return sum(1 for m in messages if m["role"] == "assistant") + 1
    return 1


def _verbatim(m: dict[str, Any]) -> dict[str, Any]:
    return {"role": m["role"], "content": m["content"], "reasoning": None}


def _answer(c: Completion) -> dict[str, Any]:
    return {"role": "assistant", "content": c.content, "reasoning": c.reasoning}


def run_conversation(messages: list[dict[str, Any]], regenerate: str, send: SendTurn) -> ConversationResult:
    """Regenerate one unit's assistant turns in order (see the module docstring for the rules)."""
    if regenerate not in REGENERATE_MODES:
        raise ValueError(f"regenerate={regenerate!r}; must be one of {list(REGENERATE_MODES)}")
    res = ConversationResult(turns_planned=turns_to_regenerate(messages, regenerate))
    if regenerate == "last_turn":
        history = [{"role": m["role"], "content": m["content"]} for m in messages]
        res.conversation = [_verbatim(m) for m in messages]
        _turn(res, history, send)
        return res
    history: list[dict[str, str]] = []  # type: ignore[no-redef]
    for m in messages:
        if m["role"] != "assistant":
            history.append({"role": m["role"], "content": m["content"]})
            res.conversation.append(_verbatim(m))
            continue
        if not _turn(res, history, send):
            return res
    _turn(res, history, send)
    return res


def _turn(res: ConversationResult, history: list[dict[str, str]], send: SendTurn) -> bool:
    """One regenerated turn appended to `history` and the result; False when the conversation ends."""
    k = len(res.turns)
    try:
        got = send(list(history))
    except RequestFailure as exc:
        if not res.turns or exc.kind != "permanent":
            res.failure = exc if res.turns_planned == 1 else RequestFailure(
                exc.error_class, f"turn {k + 1} of {res.turns_planned}: {exc.message}", kind=exc.kind, status=exc.status
            )
        else:
            res.cut_short = exc.error_class
        return False
    if got is None:
        res.stopped = True
        return False
    completion, latency, attempts = got
    res.turns.append(Turn(completion, latency, attempts))
    history.append({"role": "assistant", "content": completion.content})
    res.conversation.append(_answer(completion))
    if completion.finish_reason == "length" and len(res.turns) < res.turns_planned:
        res.cut_short = "length"
        return False
    return True


def spec_columns(spec: SpecStats | None) -> dict[str, Any]:
    """A turn's or row's spec columns; all null when the server gave no statistics."""
    return spec.to_columns() if spec is not None else dict.fromkeys(SPEC_COLUMNS)


def row_spec(cs: list[Completion]) -> dict[str, Any]:
    """The row's spec columns: sums over its turns, and its acceptance length. A row whose turns
    are only partly known (a turn without statistics) is null: a partial sum would read as the
    row's total."""
    if any(c.spec is None for c in cs):
        return {**dict.fromkeys(SPEC_COLUMNS), "acceptance_length": None}
    summed = total(c.spec for c in cs)
    return {**spec_columns(summed), "acceptance_length": summed.acceptance_length if summed else None}


def _sum(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def conversation_row(
    prompt: dict[str, Any], res: ConversationResult, *, model: str, server: str, chunk: int, run_id: str
) -> dict[str, Any]:
    """The completion row of a unit with at least one regenerated turn."""
    last = res.turns[-1]
    row = completion_row(
        prompt, last.completion, model=model, server=server, attempts=res.attempts,
        latency_s=sum(t.latency_s for t in res.turns), chunk=chunk, run_id=run_id,
    )
    cs = [t.completion for t in res.turns]
    row.update({
        "prompt_tokens": _sum([c.prompt_tokens for c in cs]),
        "completion_tokens": _sum([c.completion_tokens for c in cs]),
        "reasoning_tokens": _sum([c.reasoning_tokens for c in cs]),
        "cached_tokens": _sum([c.cached_tokens for c in cs]),
        "conversation": res.conversation,
        "turns": [t.to_dict() for t in res.turns],
        "cut_short": res.cut_short,
        **row_spec(cs),
    })
    if any(c.output_token_ids is not None for c in cs):
        row["prompt_token_ids"] = [c.prompt_token_ids for c in cs]
        row["output_token_ids"] = [c.output_token_ids for c in cs]
    return row
