"""Report arithmetic: missing, duplicates, unexpected ids, truncation and token sums."""

from __future__ import annotations

import pyarrow as pa

from dflash_pipeline.dataset.records import PART_COLUMNS, PART_SCHEMA
from dflash_pipeline.steps.validate import Validator


def _part(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([{c: r.get(c) for c in PART_COLUMNS} for r in rows], schema=PART_SCHEMA)


def _ok(pid: str, **kw) -> dict:
    base = {"id": pid, "reasoning": "r", "content": "a", "finish_reason": "stop", "prompt_tokens": 5,
            "completion_tokens": 100, "reasoning_tokens": 80, "server": "s1", "latency_s": 1.0}
    base.update(kw)
    return base


def test_complete_chunk() -> None:
    v = Validator(thinking=True)
    v.add_chunk(["a", "b", "c"], _part([_ok("a"), _ok("b", finish_reason="length", content=""),
                                        {"id": "c", "server": "s2", "error_class": "ContextLengthExceeded", "retryable": False}]))
    t = v.finish()
    assert (t.prompts, t.completions, t.errors, t.missing, t.duplicates) == (3, 2, 1, 0, 0)
    assert (t.truncated, t.truncated_in_thinking, t.empty_content) == (1, 1, 1)
    assert (t.output_tokens, t.prompt_tokens, t.reasoning_tokens) == (200, 10, 160)
    assert t.errors_by_class == {"ContextLengthExceeded": 1}
    assert t.per_server["s1"].completions == 2 and t.per_server["s2"].errors == 1


def test_missing_duplicate_and_unexpected() -> None:
    v = Validator(thinking=True)
    v.add_chunk(["a", "b"], _part([_ok("a"), _ok("a"), _ok("zzz")]))
    v.add_chunk(["c"], None)
    v.add_chunk(["d"], _part([_ok("d"), _ok("b")]))
    t = v.finish()
    assert t.prompts == 4
    assert t.duplicates == 1 and t.duplicate_ids == ["a"]
    assert t.unexpected == 2  # zzz never planned; b planned in another chunk (and missing there)
    assert t.missing == 2 and set(t.missing_ids) == {"b", "c"}


def test_reasoning_missing_when_thinking_enabled() -> None:
    v = Validator(thinking=True)
    v.add_chunk(["a"], _part([_ok("a", reasoning=None)]))
    assert v.finish().reasoning_missing == 1
    v2 = Validator(thinking=False)
    v2.add_chunk(["a"], _part([_ok("a", reasoning=None)]))
    assert v2.finish().reasoning_missing == 0
