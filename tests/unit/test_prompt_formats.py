"""The chat formats users have (issue 32): ShareGPT, OpenAI with developer/tool turns, list-of-parts
content, an empty trailing answer; and the truly broken rows, each a reject with its reason and code."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.dataset.prompts import Prompt, Reject, iter_prompt_file, normalize_row


def ok(row: dict, regenerate: str = "last_turn") -> Prompt:
    got = normalize_row(row, 1, regenerate)
    assert isinstance(got, Prompt), got
    return got


def bad(row: object, regenerate: str = "last_turn") -> Reject:
    got = normalize_row(row, 7, regenerate)
    assert isinstance(got, Reject), got
    assert got.line == 7
    return got


def test_sharegpt_from_value_roles_map_to_chat_roles() -> None:
    p = ok({"id": "s1", "conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"}, {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]})
    assert p.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]
    assert p.original is not None and p.original[-1] == {"role": "assistant", "content": "4", "reasoning": None}


def test_sharegpt_system_column_is_the_system_turn() -> None:
    p = ok({"system": "be kind", "conversations": [{"from": "human", "value": "q"}]})
    assert p.messages == [{"role": "system", "content": "be kind"}, {"role": "user", "content": "q"}]
    p = ok({"system": "column", "conversations": [{"from": "system", "value": "turn"}, {"from": "human", "value": "q"}]})
    assert p.messages[0] == {"role": "system", "content": "turn"}, "a system turn of its own wins"
    p = ok({"system": "not for messages rows", "messages": [{"role": "user", "content": "q"}]})
    assert p.messages == [{"role": "user", "content": "q"}] and p.metadata == {"system": "not for messages rows"}


def test_sharegpt_with_role_content_turns_as_specforge_writes_them() -> None:
    p = ok({"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    assert p.messages == [{"role": "user", "content": "q"}]


def test_sharegpt_function_call_and_observation_are_a_tool_call_and_its_result() -> None:
    p = ok({"conversations": [
        {"from": "human", "value": "weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": "{\"temp\": 3}"}]})
    assert p.messages == [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'},
        {"role": "tool", "content": "{\"temp\": 3}"}]


def test_developer_becomes_system() -> None:
    p = ok({"messages": [{"role": "developer", "content": "answer in French"}, {"role": "user", "content": "hi"}]})
    assert p.messages[0] == {"role": "system", "content": "answer in French"}


def test_openai_tool_calls_fold_as_the_qwen3_template_renders_them() -> None:
    """Qwen3's template writes content, then per call "\\n" (none before the first when content is
    empty) and `<tool_call>\\n{"name": "<name>", "arguments": <arguments>}\\n</tool_call>`, with
    string arguments verbatim and objects through tojson."""
    p = ok({"messages": [
        {"role": "user", "content": "sum and weather"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
        {"role": "assistant", "content": "old answer"}]})
    assert [m["role"] for m in p.messages] == ["user", "assistant", "tool", "tool"]
    assert p.messages[1]["content"] == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
    with_text = ok({"messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "Let me look.",
                                  "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                                 {"role": "tool", "content": "r"}]})
    assert with_text.messages[1]["content"] == 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def test_list_of_text_parts_joined_with_newlines_as_vllm_does() -> None:
    p = ok({"messages": [{"role": "system", "content": [{"type": "text", "text": "sys"}]},
                         {"role": "user", "content": [{"type": "text", "text": "part one"},
                                                      {"type": "input_text", "text": "part two"}]}]})
    assert p.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "part one\npart two"}]


def test_empty_trailing_assistant_turn_is_dropped_not_rejected() -> None:
    for empty in ("", None, [], "   "):
        p = ok({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": empty}]})
        assert p.messages == [{"role": "user", "content": "q"}]


def test_prompt_string_and_roles_case_insensitive() -> None:
    assert ok({"prompt": "hello"}).messages == [{"role": "user", "content": "hello"}]
    assert ok({"messages": [{"role": "User", "content": "x"}]}).messages == [{"role": "user", "content": "x"}]


def test_extra_columns_stay_metadata_for_every_format() -> None:
    p = ok({"conversations": [{"from": "human", "value": "q"}], "source": "sg", "category": "chat",
            "tools": [{"type": "function"}]})
    assert p.source == "sg" and p.metadata == {"category": "chat", "tools": [{"type": "function"}]}


@pytest.mark.parametrize(
    ("row", "code", "reason"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "non_text_content", "'image_url' part"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                    {"type": "input_audio", "input_audio": {}}]}]},
         "non_text_content", "messages[0].content[1] is a 'input_audio' part"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "bad_content", "without a string 'text'"),
        ({"messages": [{"role": "user", "content": 5}]}, "bad_content", "must be a string or a list"),
        ({"conversations": [{"from": "narrator", "value": "x"}]}, "unknown_role", "conversations[0].from is 'narrator'"),
        ({"messages": [{"content": "x"}]}, "unknown_role", "messages[0].role is None"),
        ({"conversations": [{"from": "human", "value": ""}]}, "empty_content", "conversations[0] has empty content"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                       {"role": "user", "content": "q2"}]}, "empty_content", "messages[1] has empty content"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {}}]},
                       {"role": "tool", "content": "r"}]}, "bad_tool_call", "has no function name"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "not json"},
                            {"from": "observation", "value": "r"}]}, "bad_tool_call", "not JSON"),
        ({"messages": [{"role": "user", "content": "q", "tool_calls": [{"function": {"name": "f"}}]}]},
         "bad_tool_call", "user turn with tool_calls"),
        ({"messages": [{"role": "tool", "content": "r"}]}, "no_turn_to_answer", "no user turn"),
        ({"messages": [{"role": "system", "content": "s"}]}, "no_turn_to_answer", "must end with a user"),
        ({"conversations": []}, "bad_messages", "non-empty list"),
        ({"messages": ["hi"]}, "bad_messages", "messages[0] is not an object"),
        ({"conversations": [{"from": "human", "value": "q"}], "prompt": "p"}, "two_conversations", "give only one"),
        ({"text": "no conversation"}, "no_conversation", "none of"),
        ({"prompt": "q", "id": 1.5}, "bad_id", "'id' must be"),
        ({"prompt": "q", "source": 3}, "bad_labels", "'source' must be a string"),
        ("a string", "not_an_object", "expected an object"),
    ],
)
def test_truly_broken_rows_are_rejects_with_their_reason(row: object, code: str, reason: str) -> None:
    got = bad(row)
    assert got.code == code and reason in got.reason, got


def test_all_turns_still_rejects_what_it_cannot_replay() -> None:
    tool = {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                         {"role": "tool", "content": "r"}, {"role": "user", "content": "thanks"}]}
    assert isinstance(normalize_row(tool, 1, "last_turn"), Prompt)
    got = bad(tool, "all_turns")
    assert got.code == "cannot_replay" and "tool_calls" in got.reason
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "observation", "value": "r"},
                                 {"from": "human", "value": "q2"}]}
    got = bad(sharegpt, "all_turns")
    assert got.code == "cannot_replay" and "tool turn" in got.reason
    # developer and list content replay fine
    p = ok({"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": [{"type": "text", "text": "q"}]},
                         {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]}, "all_turns")
    assert [m["role"] for m in p.messages] == ["system", "user", "assistant", "user"]


def test_parquet_sharegpt_and_list_content_columns() -> None:
    """A Parquet file has every struct field in every row (nulls for the ones a row lacks)."""
    rows = [
        {"id": "a", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "q2"}]},
    ]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    got = list(iter_prompt_file(io.BytesIO(buf.getvalue()), "x.parquet"))
    assert [p.messages for p in got if isinstance(p, Prompt)] == [[{"role": "user", "content": "q1"}],
                                                                 [{"role": "user", "content": "q2"}]]
    parts = [{"id": "c", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "image_url": None}],
                                       "tool_calls": None}]}]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(parts), buf)
    got = list(iter_prompt_file(io.BytesIO(buf.getvalue()), "x.parquet"))
    assert isinstance(got[0], Prompt) and got[0].messages == [{"role": "user", "content": "hi"}]


def test_jsonl_reject_keeps_code_and_excerpt() -> None:
    data = b'{"prompt": "fine"}\n{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}\n{oops\n'
    got = list(iter_prompt_file(io.BytesIO(data), "p.jsonl"))
    assert [r.code for r in got if isinstance(r, Reject)] == ["non_text_content", "malformed_json"]
    assert all(r.excerpt for r in got if isinstance(r, Reject))
    assert got[1].to_dict()["code"] == "non_text_content"
