"""Response parsing for both reasoning styles, error classes, concurrency derivation."""

from __future__ import annotations

import json

import pytest
from dflash_pipeline.config import Sampling
from dflash_pipeline.serving.probe import concurrency_warning, derive_concurrency
from dflash_pipeline.serving.sglang import (
    build_chat_body,
    classify_http_error,
    parse_chat_response,
    request_seed,
    split_reasoning,
)


def _resp(content, reasoning=None, finish="stop", usage=None):
    return {
        "id": "x",
        "object": "chat.completion",
        "model": "Qwen/Qwen3-8B",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content, "reasoning_content": reasoning},
             "finish_reason": finish, "matched_stop": 151645 if finish == "stop" else None}
        ],
        "usage": usage or {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30, "reasoning_tokens": 15},
    }


def test_parser_split_response() -> None:
    c = parse_chat_response(_resp("The answer is 4.", "2+2 is 4"))
    assert (c.reasoning, c.content, c.finish_reason, c.matched_stop) == ("2+2 is 4", "The answer is 4.", "stop", "151645")
    assert (c.prompt_tokens, c.completion_tokens, c.reasoning_tokens) == (10, 20, 15)


def test_inline_think_response() -> None:
    c = parse_chat_response(_resp("<think>\nlet me see\n</think>\n\nFour."))
    assert c.reasoning == "let me see" and c.content == "Four."


@pytest.mark.parametrize(
    ("content", "reasoning_content", "expected"),
    [
        ("<think>\nhalf a thought", None, ("half a thought", "")),
        ("thinking without open tag\n</think>\n\nanswer", None, ("thinking without open tag", "answer")),
        ("plain answer", None, (None, "plain answer")),
        (None, "all thinking, no answer", ("all thinking, no answer", "")),
        ("", "", (None, "")),
    ],
)
def test_split_reasoning(content, reasoning_content, expected) -> None:
    assert split_reasoning(content, reasoning_content) == expected


def test_truncated_inside_thinking() -> None:
    c = parse_chat_response(_resp("", "long thought cut", finish="length"))
    assert c.finish_reason == "length" and c.content == "" and c.matched_stop is None


def test_reasoning_tokens_absent_is_null() -> None:
    c = parse_chat_response(_resp("a", usage={"prompt_tokens": 1, "completion_tokens": 2}))
    assert c.reasoning_tokens is None


@pytest.mark.parametrize(
    ("status", "message", "cls", "kind"),
    [
        (400, "The input (40000 tokens) is longer than the model's context length (32768 tokens).", "ContextLengthExceeded", "permanent"),
        (400, "Requested token count exceeds the model's maximum context length of 32768 tokens.", "ContextLengthExceeded", "permanent"),
        (400, "temperature must be non-negative", "BadRequest", "permanent"),
        (401, "Unauthorized", "Unauthorized", "config"),
        (404, "Not Found", "NotFound", "config"),
        (503, "The request queue is full.", "ServiceUnavailable", "transient"),
        (500, "Internal server error", "ServerError", "transient"),
        (429, "slow down", "RateLimited", "transient"),
    ],
)
def test_error_classes(status: int, message: str, cls: str, kind: str) -> None:
    body = json.dumps({"object": "error", "message": message, "type": "X", "param": None, "code": status})
    f = classify_http_error(status, body)
    assert (f.error_class, f.kind) == (cls, kind)
    assert message in f.message


def test_chat_body() -> None:
    body = build_chat_body([{"role": "user", "content": "q"}], "m", Sampling(seed=3), "id1")
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert body["max_tokens"] == 4096 and body["temperature"] == 0.6 and body["top_p"] == 0.95
    assert body["seed"] == request_seed(3, "id1") != request_seed(3, "id2")
    assert "seed" not in build_chat_body([], "m", Sampling(), "id1")


def test_concurrency_from_the_server() -> None:
    assert derive_concurrency(16) == 20
    assert derive_concurrency(4) == 6
    assert derive_concurrency(256) == 320
    warning = concurrency_warning(64, 16, 300)
    assert warning and "48 requests will wait" in warning and "request_timeout_s=300" in warning
    assert concurrency_warning(20, 16, 300) is None
