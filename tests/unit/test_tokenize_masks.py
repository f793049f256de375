"""Loss masks with Qwen's real BPE: the mask is read off one encoding of the rendered conversation."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from dflash_pipeline.dataset.records import PART_SCHEMA
from dflash_pipeline.steps.tokenize import ConversationTokenizer, TokenizeSettings, Turn, conversation_of, tokenize_table
from dflash_pipeline.steps.validate.tokencount import load_recounter


def _no_s3(bucket: str, key: str) -> bytes | None:
    raise AssertionError("local tokenizer")


def _ct(path: Path | str, **kw: Any) -> ConversationTokenizer:
    s = TokenizeSettings(tokenizer=str(path), **kw)
    return ConversationTokenizer(load_recounter(str(path), _no_s3, enable_thinking=s.enable_thinking), s)


def _real_paragraphs() -> list[str]:
    import argparse
    import textwrap

    src = inspect.getsource(argparse) + inspect.getsource(textwrap)
    return [p.strip("\n") for p in src.split("\n\n") if len(p.strip()) > 40][:200]


def _conversations(n: int) -> list[list[Turn]]:
    """Multi-turn conversations of real text (English docstrings and code), some without reasoning."""
    paras = _real_paragraphs()
    convs = []
    for i in range(n):
        p = lambda k: paras[(i * 7 + k) % len(paras)]  # noqa: E731
        conv = [Turn("system", "You are a careful Python reviewer.")] if i % 3 == 0 else []
        for t in range(1 + i % 3):
            conv.append(Turn("user", f"Explain this:\n{p(t)}"))
            reasoning = None if (i + t) % 4 == 3 else f"The user asks about:\n{p(t + 1)[:300]}\nLet me think."
            conv.append(Turn("assistant", f"{p(t + 2)}\n\nIn short: it {'works' if t else 'fails'}.", reasoning))
        convs.append(conv)
    return convs


def _expected_span(t: Turn, reasoning: bool) -> str:
    """What a trained Qwen3 turn must be, written independently of the code under test."""
    if reasoning:
        return f"<think>\n{(t.reasoning or '').strip(chr(10))}\n</think>\n\n{t.content.lstrip(chr(10))}<|im_end|>"
    return f"{t.content}<|im_end|>"


def _masked_runs(ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [ids[a:b] for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("train_turns", ["all", "last"])
@pytest.mark.parametrize("loss_on_reasoning", [True, False])
def test_masks_decode_exactly_to_the_trained_assistant_spans(qwen_tokenizer: Path, train_turns: str,
                                                             loss_on_reasoning: bool) -> None:
    ct = _ct(qwen_tokenizer, train_turns=train_turns, loss_on_reasoning=loss_on_reasoning)
    tok = ct.tokenizer
    convs = _conversations(30)
    results = ct.encode(convs)
    assert any(sum(t.role == "assistant" for t in c) == 3 for c in convs)
    for conv, r in zip(convs, results):
        assert r.drop is None and r.input_ids is not None and r.loss_mask is not None
        assert tok.decode(r.input_ids.tolist(), skip_special_tokens=False) == r.text
        assert len(r.input_ids) == len(r.loss_mask) and set(np.unique(r.loss_mask)) <= {0, 1}
        asst = [t for t in conv if t.role == "assistant"]
        trained = asst if train_turns == "all" else asst[-1:]
        last = asst[-1]
        expected = []
        for t in trained:
            # Qwen3 renders a think block for the last turn always (empty without reasoning); with
            # loss_on_reasoning a trained turn keeps its reasoning wherever it is.
            with_block = loss_on_reasoning and (t.reasoning is not None or t is last)
            span = _expected_span(t, with_block)
            if not loss_on_reasoning and t is last:
                span = f"{t.content.lstrip(chr(10))}<|im_end|>"
            expected.append(span)
        runs = _masked_runs(r.input_ids, r.loss_mask)
        assert [tok.decode(x.tolist(), skip_special_tokens=False) for x in runs] == expected
        assert [r.text[a:b] for a, b in r.spans] == expected
        # everything outside the spans is context: its tokens carry no loss
        unmasked = tok.decode(r.input_ids[r.loss_mask == 0].tolist(), skip_special_tokens=False)
        assert "<|im_start|>assistant\n" in unmasked and "You are a careful" not in "".join(expected)


def test_all_turns_keep_their_reasoning_where_the_template_drops_it(qwen_tokenizer: Path) -> None:
    conv = [Turn("user", "Q1"), Turn("assistant", "A1", "R1 thinking"), Turn("user", "Q2"), Turn("assistant", "A2", "R2")]
    ct_all = _ct(qwen_tokenizer)
    (r,) = ct_all.encode([conv])
    assert r.reinlined == 1 and r.reasoning_missing == 0
    assert "<think>\nR1 thinking\n</think>\n\nA1<|im_end|>" in r.text
    # train_turns=last: the earlier turn is rendered as the template does (as at inference)
    (r_last,) = _ct(qwen_tokenizer, train_turns="last").encode([conv])
    assert "R1 thinking" not in r_last.text and r_last.reinlined == 0


STRADDLE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ':' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ '.' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""No special tokens: the end of turn is '.', and Qwen's BPE merges '.\\n' into one token across it;
an answer starting with a space merges with nothing before it, ':' before it stays apart."""


def test_template_whose_tokens_straddle_turn_boundaries(qwen_tokenizer: Path, tmp_path: Path) -> None:
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((qwen_tokenizer / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": STRADDLE_TEMPLATE}))
    ct = _ct(d)
    assert ct.header == "assistant:" and ct.eot == "."
    conv = [Turn("user", "hi there"), Turn("assistant", "hello friend"), Turn("user", "more"),
            Turn("assistant", "\nok then")]
    (r,) = ct.encode([conv])
    tok = ct.tokenizer
    enc = tok.encode(r.text, add_special_tokens=False)
    assert enc.ids == r.input_ids.tolist() and tok.decode(enc.ids) == r.text
    assert [r.text[a:b] for a, b in r.spans] == ["hello friend.", "\nok then."]
    # the token '.\n' straddles each span's end: it starts inside, so it is trained, once
    starts = np.array([s for s, _ in enc.offsets])
    for (a, b), run in zip(r.spans, _masked_runs(np.arange(len(enc.ids)), r.loss_mask)):
        assert ((starts[run] >= a) & (starts[run] < b)).all()
        inside = np.flatnonzero((starts >= a) & (starts < b))
        assert run.tolist() == inside.tolist()
        assert enc.offsets[run[-1]][1] > b and r.text[b - 1 : enc.offsets[run[-1]][1]] == ".\n"
    # at the start, ':\n' straddles the header and the answer's leading newline: it starts in the
    # header, so it is context; each token is on exactly one side
    assert [tok.decode(x.tolist()) for x in _masked_runs(r.input_ids, r.loss_mask)] == ["hello friend.\n", "ok then.\n"]
    # no token is counted twice or lost: each token is trained at most once and the rest is context
    assert int(r.loss_mask.sum()) == sum(len(x) for x in _masked_runs(r.input_ids, r.loss_mask))


# Parts written before issue 14's generate half had none of the conversation columns.
OLD_SCHEMA = pa.schema([f for f in PART_SCHEMA if f.name not in
                        {"sample", "conversation", "original_messages", "turns", "cut_short", "cached_tokens"}])
NEW_SCHEMA = PART_SCHEMA


def _part(rows: list[dict[str, Any]], schema: pa.Schema = OLD_SCHEMA) -> pa.Table:
    return pa.Table.from_pylist([{c: r.get(c) for c in schema.names} for r in rows], schema=schema)


def test_tokenize_table_drops_errors_flags_truncation_and_reads_both_part_shapes(qwen_tokenizer: Path) -> None:
    user = [{"role": "user", "content": "Say hi"}]
    old = _part([
        {"id": "a", "messages": user, "reasoning": "think", "content": "hi", "finish_reason": "stop"},
        {"id": "b", "messages": user, "error_class": "ContextLength", "error_message": "too long"},
        {"id": "c", "messages": user, "reasoning": "long " * 300, "content": "", "finish_reason": "length"},
    ])
    ct = _ct(qwen_tokenizer, max_length=64)
    out, export, stats = tokenize_table(old, ct)
    assert out.column("id").to_pylist() == ["a", "c"] and out.column("sample").to_pylist() == [0, 0]
    assert stats.dropped == {"error_row": 1} and stats.rows_in == 3 and stats.rows_out == 2
    assert out.column("truncated_to_max_length").to_pylist() == [False, True]
    assert out.column("num_tokens").to_pylist()[1] == 64 and stats.truncated_to_max_length == 1
    assert export[0] == {"id": "a", "conversations": [{"role": "user", "content": "Say hi"},
                                                      {"role": "assistant", "content": "hi", "reasoning_content": "think"}]}
    for ids, mask, n, k in zip(*(out.column(c).to_pylist() for c in ("input_ids", "loss_mask", "num_tokens", "num_loss_tokens"))):
        assert len(ids) == len(mask) == n and sum(mask) == k > 0
    _, _, st2 = tokenize_table(old, _ct(qwen_tokenizer, drop_truncated=True))
    assert st2.dropped == {"error_row": 1, "finish_reason_length": 1}

    conv = [{"role": "user", "content": "Q1", "reasoning": None}, {"role": "assistant", "content": "A1", "reasoning": "r1"},
            {"role": "user", "content": "Q2", "reasoning": None}, {"role": "assistant", "content": "A2", "reasoning": "r2"}]
    new = _part([{"id": "m", "sample": 1, "messages": [{"role": "user", "content": "Q1"}], "content": "A2",
                  "reasoning": "r2", "finish_reason": "stop", "conversation": conv}], NEW_SCHEMA)
    assert [t.content for t in conversation_of(new.to_pylist()[0])] == ["Q1", "A1", "Q2", "A2"]
    out, export, stats = tokenize_table(new, _ct(qwen_tokenizer))
    assert out.column("sample").to_pylist() == [1] and export[0]["id"] == "m#sample=1"
    assert stats.trained_turns == 2 and stats.conversations_by_assistant_turns == {"2": 1}
    assert stats.reasoning_reinlined_turns == 1


def test_thinking_off_dataset_trains_the_answer_after_the_header(qwen_tokenizer: Path) -> None:
    ct = _ct(qwen_tokenizer, enable_thinking=False)
    assert ct.header == "<|im_start|>assistant\n"  # the generation prompt's empty think block is not header
    (r,) = ct.encode([[Turn("user", "Hi"), Turn("assistant", "Hello there.")]])
    runs = _masked_runs(r.input_ids, r.loss_mask)
    assert [ct.tokenizer.decode(x.tolist(), skip_special_tokens=False) for x in runs] == [
        "<think>\n\n</think>\n\nHello there.<|im_end|>"]
