"""Report arithmetic: missing, duplicates, unexpected ids, truncation and token sums."""

from __future__ import annotations

from dflash_pipeline.validate import Tally, tally_chunk


def _part(rows: list[dict]) -> dict[str, list]:
    cols = ["id", "reasoning", "content", "finish_reason", "prompt_tokens", "completion_tokens",
            "reasoning_tokens", "server", "latency_s", "error_class", "retryable"]
    return {c: [r.get(c) for r in rows] for c in cols}


def _ok(pid: str, **kw) -> dict:
    base = {"id": pid, "reasoning": "r", "content": "a", "finish_reason": "stop", "prompt_tokens": 5,
            "completion_tokens": 100, "reasoning_tokens": 80, "server": "s1", "latency_s": 1.0}
    base.update(kw)
    return base


def test_complete_chunk() -> None:
    t = Tally()
    seen: set[int] = set()
    tally_chunk(t, ["a", "b", "c"], _part([_ok("a"), _ok("b", finish_reason="length", content=""),
                                           {"id": "c", "server": "s2", "error_class": "ContextLengthExceeded", "retryable": False}]), seen, True)
    assert (t.prompts, t.completions, t.errors, t.missing, t.duplicates) == (3, 2, 1, 0, 0)
    assert (t.truncated, t.truncated_in_thinking, t.empty_content) == (1, 1, 1)
    assert (t.output_tokens, t.prompt_tokens, t.reasoning_tokens) == (200, 10, 160)
    assert t.errors_by_class == {"ContextLengthExceeded": 1}
    assert t.per_server["s1"].completions == 2 and t.per_server["s2"].errors == 1


def test_missing_duplicate_and_unexpected() -> None:
    t = Tally()
    seen: set[int] = set()
    tally_chunk(t, ["a", "b"], _part([_ok("a"), _ok("a"), _ok("zzz")]), seen, True)
    tally_chunk(t, ["c"], None, seen, True)
    tally_chunk(t, ["d"], _part([_ok("d"), _ok("b")]), seen, True)
    assert t.prompts == 4
    assert t.duplicates == 1 and t.duplicate_ids == ["a"]
    assert t.unexpected == 2  # zzz never planned; b planned in another chunk
    assert t.missing == 2 and set(t.missing_ids) == {"b", "c"}


def test_reasoning_missing_when_thinking_enabled() -> None:
    t = Tally()
    tally_chunk(t, ["a"], _part([_ok("a", reasoning=None)]), set(), True)
    assert t.reasoning_missing == 1
    t2 = Tally()
    tally_chunk(t2, ["a"], _part([_ok("a", reasoning=None)]), set(), False)
    assert t2.reasoning_missing == 0
