"""Prompt parsing: every bad row is a Reject with its line number and a reason."""

from __future__ import annotations

import gzip
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.dataset.prompts import Prompt, PromptFileError, Reject, derive_id, iter_prompt_file


def _jsonl(*rows: object) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def _parse(data: bytes, key: str = "p.jsonl") -> list[Prompt | Reject]:
    return list(iter_prompt_file(io.BytesIO(data), key))


def test_messages_and_prompt_rows() -> None:
    out = _parse(
        _jsonl(
            {"id": "a", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
            {"prompt": "what is 2+2?"},
            {"id": 7, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old answer"}]},
        )
    )
    assert all(isinstance(p, Prompt) for p in out)
    a, b, c = out  # type: ignore[misc]
    assert a.id == "a" and len(a.messages) == 2
    assert b.messages == [{"role": "user", "content": "what is 2+2?"}]
    assert b.id == derive_id(b.messages) and b.id.startswith("h")
    assert c.id == "7" and c.messages == [{"role": "user", "content": "q"}], "old completion dropped"


def test_derived_id_is_stable_and_content_based() -> None:
    m = [{"role": "user", "content": "x"}]
    assert derive_id(m) == derive_id([{"content": "x", "role": "user"}])
    assert derive_id(m) != derive_id([{"role": "user", "content": "y"}])


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"messages": [', "malformed JSON"),
        (b'{"id": "x"}', "none of 'messages', 'conversations'"),
        (b'{"prompt": "   "}', "'prompt' is empty"),
        (b'{"messages": [{"role": "tool", "content": "x"}]}', "no user turn"),
        (b'{"messages": [{"role": "user", "content": ""}]}', "has empty content"),
        (b'{"messages": []}', "non-empty list"),
        (b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "give only one"),
        (b'{"prompt": "caf\xe9"}', "invalid UTF-8"),
        (b'[1, 2]', "expected an object"),
        (b'{"messages": [{"role": "assistant", "content": "only an answer"}]}', "must end with a user"),
    ],
)
def test_bad_rows_name_their_line(line: bytes, reason: str) -> None:
    data = _jsonl({"prompt": "fine"}, b"", line, {"prompt": "also fine"})
    out = _parse(data)
    rejects = [r for r in out if isinstance(r, Reject)]
    assert len(rejects) == 1
    assert rejects[0].line == 3, "blank line 2 is skipped but counted"
    assert reason in rejects[0].reason
    assert sum(isinstance(p, Prompt) for p in out) == 2


def test_gzip_is_detected_by_magic() -> None:
    data = gzip.compress(_jsonl({"prompt": "a"}, {"prompt": "b"}))
    out = _parse(data, key="prompts.jsonl.gz")
    assert [p.messages[0]["content"] for p in out if isinstance(p, Prompt)] == ["a", "b"]


def test_parquet_rows_and_wrong_columns() -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ["x", "y"], "prompt": ["hello", ""]}), buf)
    out = _parse(buf.getvalue(), key="p.parquet")
    assert isinstance(out[0], Prompt) and out[0].id == "x"
    assert isinstance(out[1], Reject) and out[1].line == 2

    bad = io.BytesIO()
    pq.write_table(pa.table({"question": ["hello"]}), bad)
    with pytest.raises(PromptFileError, match="needs a 'messages', 'conversations' or 'prompt' column"):
        _parse(bad.getvalue(), key="p.parquet")


def test_unknown_format() -> None:
    with pytest.raises(PromptFileError):
        _parse(b"col1,col2\n", key="p.csv")
