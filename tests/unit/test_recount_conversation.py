"""Validation's recount renders the regenerated `conversation` (all_turns rows) and compares the last turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_tokencount import LAX, PROMPT_WORDS
from test_validate_checks import write_dataset

from dflash_pipeline.dev.sim.lengths import plan_lengths, render_completion
from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer
from dflash_pipeline.steps.validate import run_validation


def _turn(messages: list[dict[str, Any]]) -> Any:
    return render_completion(plan_lengths(messages, length_scale=0.05), max_tokens=60, separate_reasoning=True)


def _rows(n: int, with_conversation: bool) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        q1 = {"role": "user", "content": f"question {i}"}
        first = _turn([q1])
        q2 = {"role": "user", "content": f"and then {i}"}
        history = [q1, {"role": "assistant", "content": first.content}, q2]
        last = _turn(history)
        turn = lambda c: {"finish_reason": c.finish_reason, "prompt_tokens": 1, "completion_tokens": c.completion_tokens,  # noqa: E731
                          "reasoning_tokens": c.reasoning_tokens, "cached_tokens": 0, "latency_s": 0.1}
        row = {"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}"}],
               "reasoning": last.reasoning_content, "content": last.content, "finish_reason": last.finish_reason,
               "completion_tokens": first.completion_tokens + last.completion_tokens,
               "reasoning_tokens": first.reasoning_tokens + last.reasoning_tokens, "prompt_tokens": 2,
               "server": "s", "latency_s": 0.2}
        if with_conversation:
            row["conversation"] = [
                {**q1, "reasoning": None}, {"role": "assistant", "content": first.content, "reasoning": first.reasoning_content},
                {**q2, "reasoning": None}, {"role": "assistant", "content": last.content, "reasoning": last.reasoning_content}]
            row["turns"] = [turn(first), turn(last)]
        rows.append(row)
    return rows


def test_recount_renders_the_conversation_and_compares_its_last_turn(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    tok = str(build_sim_tokenizer(tmp_path / "tok", PROMPT_WORDS))
    conv = _rows(20, with_conversation=True)
    uri = write_dataset(s3_client, bucket, "ds/conv", [[r["id"] for r in conv]], {0: conv})
    r = run_validation(s3_client, uri, thresholds=LAX, tokenizer=tok, plots=False)
    rc = r["token_recount"]
    assert rc["mismatches"] == 0 and rc["compared"] == 20
    assert r["turns_generated"] == 40 and r["multi_turn_rows"] == 20

    flat = _rows(20, with_conversation=False)  # the same rows as older parts store them: no conversation
    uri2 = write_dataset(s3_client, bucket, "ds/flat", [[r["id"] for r in flat]], {0: flat})
    r2 = run_validation(s3_client, uri2, thresholds=LAX, tokenizer=tok, plots=False)
    # Summed server counts against one turn's text: every old-style row mismatches, and trains on less.
    assert r2["token_recount"]["mismatches"] == 20
    assert rc["training_tokens"] > r2["token_recount"]["training_tokens"]
