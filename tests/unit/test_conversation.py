"""all_turns conversations, samples and their seeds, the new part columns, plan's rejections."""

from __future__ import annotations

import hashlib
import io
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.config import ConfigError, RunConfig, Sampling
from dflash_pipeline.dataset.prompts import Prompt, Reject, normalize_row
from dflash_pipeline.dataset.records import (
    PART_SCHEMA,
    decode_inputs,
    decode_part,
    encode_inputs,
    encode_part,
    unit_key,
    unit_keys,
)
from dflash_pipeline.serving.sglang import Completion, RequestFailure, build_chat_body, parse_chat_response, request_seed
from dflash_pipeline.steps.generate.conversation import conversation_row, run_conversation, turns_to_regenerate
from dflash_pipeline.steps.plan import check_pins, pinned_settings

CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "old answer 1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "old answer 2"},
    {"role": "user", "content": "q3"},
]


def _completion(content: str, finish: str = "stop", reasoning: str | None = "think", tokens: int = 5) -> Completion:
    return Completion(reasoning=reasoning, content=content, finish_reason=finish, matched_stop=None, prompt_tokens=10,
                      completion_tokens=tokens, reasoning_tokens=2, model="m", cached_tokens=4)


class FakeServer:
    """Answers turn k with `new k`; scripted outcomes per turn (a finish reason or a RequestFailure)."""

    def __init__(self, script: dict[int, Any] | None = None) -> None:
        self.sent: list[list[dict[str, str]]] = []
        self.script = script or {}

    def __call__(self, messages: list[dict[str, str]]) -> tuple[Completion, float, int] | None:
        k = len(self.sent)
        self.sent.append(messages)
        what = self.script.get(k, "stop")
        if isinstance(what, RequestFailure):
            raise what
        if what is None:
            return None
        return _completion(f"new {k}", finish=what), 0.5, 1


# -- seeds -----------------------------------------------------------------------------------------


def test_sample_zero_keeps_the_seed_rows_had_before_samples() -> None:
    old = int(hashlib.sha256(b"7:id1").hexdigest()[:8], 16) & 0x7FFFFFFF
    assert request_seed(7, "id1") == request_seed(7, "id1", 0) == old


def test_each_sample_has_its_own_seed_and_none_without_a_seed() -> None:
    seeds = {request_seed(7, "id1", k) for k in range(8)}
    assert len(seeds) == 8
    assert request_seed(7, "id2", 1) not in seeds
    assert request_seed(None, "id1", 3) is None
    body = build_chat_body([{"role": "user", "content": "q"}], "m", Sampling(seed=7), "id1", sample=2)
    assert body["seed"] == request_seed(7, "id1", 2)


# -- conversation building -------------------------------------------------------------------------------


def test_last_turn_sends_the_history_as_given_once() -> None:
    server = FakeServer()
    res = run_conversation(CONV, "last_turn", server)
    assert server.sent == [[{"role": m["role"], "content": m["content"]} for m in CONV]]
    assert [m["content"] for m in res.conversation] == [m["content"] for m in CONV] + ["new 0"]
    assert res.conversation[-1]["reasoning"] == "think" and res.cut_short is None and res.failure is None


def test_all_turns_replays_every_assistant_turn_with_the_regenerated_answers() -> None:
    server = FakeServer()
    res = run_conversation(CONV, "all_turns", server)
    assert turns_to_regenerate(CONV, "all_turns") == 3 and len(res.turns) == 3
    assert [m["content"] for m in server.sent[0]] == ["be brief", "q1"]
    assert [m["content"] for m in server.sent[1]] == ["be brief", "q1", "new 0", "q2"]
    assert [m["content"] for m in server.sent[2]] == ["be brief", "q1", "new 0", "q2", "new 1", "q3"]
    sent = [m for req in server.sent for m in req]
    assert not any(m["content"].startswith("old answer") for m in sent)  # no original answer re-sent
    assert all(set(m) == {"role", "content"} for m in sent)  # earlier reasoning is not sent back
    assert [(m["role"], m["content"]) for m in res.conversation] == [
        ("system", "be brief"), ("user", "q1"), ("assistant", "new 0"), ("user", "q2"), ("assistant", "new 1"),
        ("user", "q3"), ("assistant", "new 2")]
    assert res.conversation[2]["reasoning"] == "think" and res.conversation[1]["reasoning"] is None


def test_length_before_the_last_turn_cuts_the_conversation_short() -> None:
    res = run_conversation(CONV, "all_turns", FakeServer({1: "length"}))
    assert len(res.turns) == 2 and res.cut_short == "length" and res.failure is None
    assert res.conversation[-1]["content"] == "new 1"


def test_length_on_the_last_turn_is_a_truncated_row_not_a_cut() -> None:
    res = run_conversation(CONV, "all_turns", FakeServer({2: "length"}))
    assert len(res.turns) == 3 and res.cut_short is None


def test_permanent_failure_after_a_turn_cuts_short_with_its_class() -> None:
    fail = RequestFailure("ContextLengthExceeded", "too long", kind="permanent", status=400)
    res = run_conversation(CONV, "all_turns", FakeServer({2: fail}))
    assert len(res.turns) == 2 and res.cut_short == "ContextLengthExceeded" and res.failure is None


def test_transient_failure_after_a_turn_makes_the_unit_a_retryable_error() -> None:
    fail = RequestFailure("Timeout", "no response", kind="transient")
    res = run_conversation(CONV, "all_turns", FakeServer({1: fail}))
    assert res.failure is not None and res.failure.transient and res.failure.message.startswith("turn 2 of 3")


def test_failure_of_the_first_turn_is_the_unit_failure() -> None:
    fail = RequestFailure("ContextLengthExceeded", "too long", kind="permanent", status=400)
    res = run_conversation(CONV, "all_turns", FakeServer({0: fail}))
    assert res.failure is not None and not res.turns and res.cut_short is None
    res = run_conversation(CONV, "last_turn", FakeServer({0: fail}))
    assert res.failure is fail


def test_a_stop_between_turns_is_no_result() -> None:
    res = run_conversation(CONV, "all_turns", FakeServer({1: None}))
    assert res.stopped and res.failure is None


def test_row_takes_the_last_turn_and_sums_the_tokens() -> None:
    prompt = {"id": "a", "sample": 2, "messages": CONV, "original_messages": [dict(m, reasoning=None) for m in CONV]}
    res = run_conversation(CONV, "all_turns", FakeServer())
    row = conversation_row(prompt, res, model="m", server="s", chunk=0, run_id="r")
    assert row["content"] == "new 2" and row["finish_reason"] == "stop" and row["sample"] == 2
    assert row["completion_tokens"] == 15 and row["prompt_tokens"] == 30 and row["reasoning_tokens"] == 6
    assert row["cached_tokens"] == 12 and row["attempts"] == 3 and row["latency_s"] == 1.5
    assert len(row["turns"]) == 3 and row["turns"][0]["cached_tokens"] == 4
    assert row["original_messages"][2]["content"] == "old answer 1"


# -- usage ---------------------------------------------------------------------------------------------


def test_cached_tokens_parsed_when_reported() -> None:
    body = {"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 6}}}
    assert parse_chat_response(body).cached_tokens == 6
    body["usage"]["prompt_tokens_details"] = None
    assert parse_chat_response(body).cached_tokens is None


# -- schema ----------------------------------------------------------------------------------------------


def test_part_round_trip_with_the_new_columns() -> None:
    prompt = {"id": "a", "sample": 1, "messages": CONV, "original_messages": [dict(m, reasoning=None) for m in CONV]}
    res = run_conversation(CONV, "all_turns", FakeServer({1: "length"}))
    row = conversation_row(prompt, res, model="m", server="s", chunk=0, run_id="r")
    got = decode_part(encode_part([row])).to_pylist()[0]
    for col in ("sample", "conversation", "original_messages", "turns", "cut_short", "cached_tokens", "content"):
        assert got[col] == row[col], col
    assert decode_part(encode_part([row])).schema == PART_SCHEMA


def test_inputs_carry_samples_and_old_inputs_read_as_sample_zero() -> None:
    rows = [{"id": "a", "messages": CONV[:2], "sample": k, "original_messages": None} for k in range(2)]
    assert [(r["id"], r["sample"]) for r in decode_inputs(encode_inputs(rows))] == [("a", 0), ("a", 1)]
    old = pa.table({"id": ["a"], "messages": [[{"role": "user", "content": "q"}]], "prompt_chars": [1]})
    buf = io.BytesIO()
    pq.write_table(old, buf)
    assert decode_inputs(buf.getvalue()) == [
        {"id": "a", "messages": [{"role": "user", "content": "q"}], "sample": 0, "original_messages": None}]


def test_unit_keys() -> None:
    assert unit_key({"id": "a"}) == "a" == unit_key({"id": "a", "sample": 0})
    assert unit_key({"id": "a", "sample": 2}) == "a#sample=2"
    assert unit_keys(["a", "a"], [0, 1]) == ["a", "a#sample=1"] and unit_keys(["a"], None) == ["a"]


# -- plan --------------------------------------------------------------------------------------------------


def test_all_turns_rejects_tool_turns_with_the_reason() -> None:
    row = {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "calling"},
                        {"role": "tool", "content": "sunny"}, {"role": "user", "content": "thanks"}]}
    got = normalize_row(row, 4, "all_turns")
    assert isinstance(got, Reject) and got.line == 4 and "all_turns" in got.reason and "tool" in got.reason
    assert isinstance(normalize_row(row, 4, "last_turn"), Prompt)  # last_turn sends tool turns as they are


def test_all_turns_rejects_tool_calls_and_an_answer_without_a_question() -> None:
    calls = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x",
                                                              "tool_calls": [{"id": "1"}]}, {"role": "user", "content": "q"}]}
    assert "tool_calls" in normalize_row(calls, 1, "all_turns").reason  # type: ignore[union-attr]
    first = {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "hi"},
                          {"role": "user", "content": "q"}]}
    assert "does not follow a user turn" in normalize_row(first, 1, "all_turns").reason  # type: ignore[union-attr]
    assert isinstance(normalize_row(first, 1, "last_turn"), Prompt)


def test_original_messages_are_the_row_as_read() -> None:
    raw = [*CONV, {"role": "assistant", "content": "old final", "reasoning_content": "old thinking"}]
    got = normalize_row({"id": "x", "messages": raw}, 1, "all_turns")
    assert isinstance(got, Prompt)
    assert got.messages == CONV  # the trailing old answer is what gets regenerated
    assert [m["content"] for m in got.original] == [m["content"] for m in raw]
    assert got.original[-1]["reasoning"] == "old thinking"


def _cfg(**params: Any) -> RunConfig:
    return RunConfig.from_params({"prompts_uri": "s3://bkt/in.jsonl", "output_uri": "s3://bkt/out", "servers": ["http://x"],
                                  **params})


def test_params_bounds_and_pins() -> None:
    with pytest.raises(ConfigError):
        _cfg(samples_per_prompt=0)
    with pytest.raises(ConfigError):
        _cfg(regenerate="every_turn")
    default = pinned_settings(_cfg(), "e", 1)
    assert "samples_per_prompt" not in default["input"] and "regenerate" not in default["input"]  # old roots match
    three = pinned_settings(_cfg(samples_per_prompt=3, regenerate="all_turns"), "e", 1)
    assert three["input"]["samples_per_prompt"] == 3 and three["input"]["regenerate"] == "all_turns"
    with pytest.raises(ValueError, match="samples_per_prompt"):
        check_pins({"pinned": three}, default, _cfg(accept_pin_changes=True))  # the plan's shape never changes
