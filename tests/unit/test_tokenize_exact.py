"""Token-exact training rows with Qwen's real BPE: ids as the engine produced them, loss only on what it generated.

The "engine" here is the simulator's token model (dev/sim/tokens.py): the chat template rendered with
the generation prompt and encoded, as vLLM and SGLang do, and generated ids that may be a
non-canonical encoding of their text. tests/engine/ checks the same against a real vLLM server.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from dflash_pipeline.dataset.records import PART_SCHEMA
from dflash_pipeline.dev.qwen_tokenizer import copy_with_template
from dflash_pipeline.dev.sim.rows import engine_row
from dflash_pipeline.dev.sim.tokens import SimTokenModel
from dflash_pipeline.steps.tokenize import TokenizeSettings, TrainingRowBuilder, tokenize_table
from dflash_pipeline.steps.validate.tokencount import load_recounter

IM_END, NEWLINE = "<|im_end|>", "\n"


def _no_s3(bucket: str, key: str) -> bytes | None:
    raise AssertionError("local tokenizer")


@pytest.fixture(scope="module")
def templates(qwen_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen's BPE with a Qwen3-style template and with a Qwen3.6-style one (generation prompt opens <think>)."""
    root = tmp_path_factory.mktemp("templates")
    return {"qwen3": qwen_tokenizer, "qwen3.6": copy_with_template(root / "q36", "qwen3.6", source=qwen_tokenizer)}


def _builder(path: Path, **kw: Any) -> TrainingRowBuilder:
    """Exactness is tested on short turns too: DFlash's minimum of trained tokens is off unless asked for."""
    kw.setdefault("min_loss_tokens", 1)
    kw.setdefault("max_length", 1 << 20)
    s = TokenizeSettings(tokenizer=str(path), **kw)
    return TrainingRowBuilder(load_recounter(str(path), _no_s3, enable_thinking=s.enable_thinking), s)


def _paragraphs() -> list[str]:
    import argparse
    import textwrap

    src = inspect.getsource(argparse) + inspect.getsource(textwrap)
    return [p.strip("\n") for p in src.split("\n\n") if len(p.strip()) > 40][:200]


PARAS = _paragraphs()


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist([{c: r.get(c) for c in PART_SCHEMA.names} for r in rows], schema=PART_SCHEMA)


def _trained(tok: Any, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded runs of trained tokens."""
    a = np.asarray(mask)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], a, [0]])))
    return [tok.decode(ids[s:e], skip_special_tokens=False) for s, e in zip(edges[::2], edges[1::2])]


def _one(rows: list[dict[str, Any]], path: Path, **kw: Any) -> tuple[list[dict[str, Any]], Any, Any]:
    b = _builder(path, **kw)
    out, _, stats = tokenize_table(_table(rows), b)
    return out.to_pylist(), stats, b.tokenizer


# -- the five cases of issue 22 -------------------------------------------------------------------


@pytest.mark.parametrize("with_ids", [True, False])
def test_the_empty_think_block_of_thinking_off_is_never_trained(templates: dict[str, Path], with_ids: bool) -> None:
    for name in ("qwen3", "qwen3.6"):
        tm = SimTokenModel(templates[name])
        row = engine_row(tm, [{"role": "user", "content": PARAS[0]}], [("", PARAS[1])], thinking=False, ids=with_ids)
        rows, stats, tok = _one([row], templates[name], enable_thinking=False)
        assert len(rows) == 1, (name, stats)
        r = rows[0]
        assert _trained(tok, r["input_ids"], r["loss_mask"]) == [PARAS[1] + IM_END + NEWLINE]
        prompt = tok.decode(r["input_ids"], skip_special_tokens=False)
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + PARAS[1] + IM_END + NEWLINE)
        assert r["ids_source"] == ("engine" if with_ids else "retokenized")


@pytest.mark.parametrize("with_ids", [True, False])
def test_a_generation_prompt_that_opens_the_thinking_is_context(templates: dict[str, Path], with_ids: bool) -> None:
    tm = SimTokenModel(templates["qwen3.6"])
    row = engine_row(tm, [{"role": "user", "content": PARAS[2]}], [(PARAS[3], PARAS[4])], thinking=True, ids=with_ids)
    rows, stats, tok = _one([row], templates["qwen3.6"])
    (r,) = rows
    assert _trained(tok, r["input_ids"], r["loss_mask"]) == [f"{PARAS[3]}\n</think>\n\n{PARAS[4]}{IM_END}\n"]
    # the Qwen3-style template: the model writes <think>\n itself, so it is trained there
    tm3 = SimTokenModel(templates["qwen3"])
    row3 = engine_row(tm3, [{"role": "user", "content": PARAS[2]}], [(PARAS[3], PARAS[4])], thinking=True, ids=with_ids)
    rows3, _, _ = _one([row3], templates["qwen3"])
    assert _trained(tok, rows3[0]["input_ids"], rows3[0]["loss_mask"]) == [
        f"<think>\n{PARAS[3]}\n</think>\n\n{PARAS[4]}{IM_END}\n"]


@pytest.mark.parametrize("with_ids", [True, False])
def test_a_turn_cut_inside_its_thinking_trains_no_closer(templates: dict[str, Path], with_ids: bool) -> None:
    tm = SimTokenModel(templates["qwen3.6"])
    row = engine_row(tm, [{"role": "user", "content": PARAS[5]}], [(PARAS[6] + " " + PARAS[7], PARAS[8])],
                     thinking=True, max_tokens=40, ids=with_ids)
    assert row["finish_reason"] == "length" and row["content"] == ""
    rows, stats, tok = _one([row], templates["qwen3.6"])
    (r,) = rows
    (run,) = _trained(tok, r["input_ids"], r["loss_mask"])
    assert "</think>" not in run and IM_END not in run and not run.endswith("\n\n")
    assert r["num_loss_tokens"] == 40 and (PARAS[6] + " " + PARAS[7]).startswith(run)
    assert tok.decode(r["input_ids"], skip_special_tokens=False).endswith(run)  # nothing appended after the cut
    assert r["finish_reason"] == "length"


def test_each_turn_of_a_regenerated_conversation_is_a_row_with_the_context_as_sent(templates: dict[str, Path]) -> None:
    tm = SimTokenModel(templates["qwen3.6"])
    messages = [{"role": "system", "content": "You review Python."}]
    answers = []
    for k in range(3):
        messages.append({"role": "user", "content": f"Turn {k}: {PARAS[10 + k]}"})
        if k < 2:
            messages.append({"role": "assistant", "content": "old"})
        answers.append((f"REASONING-{k} {PARAS[20 + k]}", f"ANSWER-{k} {PARAS[30 + k]}"))
    row = engine_row(tm, messages, answers, thinking=True)
    rows, stats, tok = _one([row], templates["qwen3.6"])
    assert [r["turn"] for r in rows] == [0, 1, 2] and [r["key"] for r in rows] == ["r#turn=0", "r#turn=1", "r#turn=2"]
    for k, r in enumerate(rows):
        n_prompt = r["loss_mask"].index(1)
        assert r["input_ids"][:n_prompt] == list(row["prompt_token_ids"][k])
        assert r["input_ids"][n_prompt:n_prompt + len(row["output_token_ids"][k])] == list(row["output_token_ids"][k])
        text = tok.decode(r["input_ids"], skip_special_tokens=False)
        for j in range(3):
            assert (f"REASONING-{j}" in text) == (j == k), (k, j)  # no earlier turn's reasoning, ever
            assert (f"ANSWER-{j}" in text) == (j <= k)
        assert "old" not in text
    assert stats.conversations_by_assistant_turns == {"3": 1} and stats.rows_with_engine_ids == 1
    last, _, _ = _one([row], templates["qwen3.6"], train_turns="last")
    assert [r["turn"] for r in last] == [2] and last[0]["input_ids"] == rows[2]["input_ids"]


def test_engine_ids_are_kept_even_when_they_are_not_the_canonical_encoding(templates: dict[str, Path]) -> None:
    tm = SimTokenModel(templates["qwen3.6"])
    row = engine_row(tm, [{"role": "user", "content": PARAS[40]}], [(PARAS[41], PARAS[42])], thinking=True,
                     noncanonical=0.3)
    out = list(row["output_token_ids"][0])
    text = tm.tokenizer.decode(out, skip_special_tokens=False)
    assert tm.tokenizer.encode(text, add_special_tokens=False).ids != out  # the case that matters
    rows, stats, tok = _one([row], templates["qwen3.6"])
    (r,) = rows
    n = len(row["prompt_token_ids"][0])
    assert r["input_ids"] == list(row["prompt_token_ids"][0]) + out + tok.encode("\n", add_special_tokens=False).ids
    assert r["loss_mask"] == [0] * n + [1] * (len(out) + 1)
    # without the engine's ids the same text re-encodes to other ids with another count: refused, named
    no_ids = {k: v for k, v in row.items() if k not in ("prompt_token_ids", "output_token_ids")}
    rows2, stats2, _ = _one([no_ids], templates["qwen3.6"])
    assert rows2 == [] and stats2.dropped == {"ids_differ_from_engine_counts": 1} and stats2.unverified == 1
    assert stats2.unverified_examples[0].startswith("r: generated ")
    kept, stats3, _ = _one([no_ids], templates["qwen3.6"], keep_unverified=True)
    assert len(kept) == 1 and kept[0]["ids_source"] == "retokenized" and stats3.unverified == 1


# -- the rest of the rules ----------------------------------------------------------------------------


def test_answers_copied_from_the_input_are_context_never_trained(templates: dict[str, Path]) -> None:
    tm = SimTokenModel(templates["qwen3"])
    messages = [{"role": "user", "content": "Q1 " + PARAS[50]}, {"role": "assistant", "content": "ORIGINAL " + PARAS[51]},
                {"role": "user", "content": "Q2 " + PARAS[52]}]
    row = engine_row(tm, messages, [(PARAS[53], "NEW " + PARAS[54])], thinking=True, regenerate_all=False)
    rows, _, tok = _one([row], templates["qwen3"])
    (r,) = rows
    runs = _trained(tok, r["input_ids"], r["loss_mask"])
    assert len(runs) == 1 and "ORIGINAL" not in runs[0] and runs[0].endswith(f"NEW {PARAS[54]}{IM_END}\n")
    assert r["key"] == "r#turn=1" and r["turn"] == 1


def test_newline_after_eot_and_loss_on_reasoning_settings(templates: dict[str, Path]) -> None:
    tm = SimTokenModel(templates["qwen3.6"])
    row = engine_row(tm, [{"role": "user", "content": PARAS[60]}], [(PARAS[61], PARAS[62])], thinking=True)
    rows, _, tok = _one([row], templates["qwen3.6"], train_eot_newline=False)
    assert _trained(tok, rows[0]["input_ids"], rows[0]["loss_mask"]) == [f"{PARAS[61]}\n</think>\n\n{PARAS[62]}{IM_END}"]
    rows, _, tok = _one([row], templates["qwen3.6"], loss_on_reasoning=False)
    assert _trained(tok, rows[0]["input_ids"], rows[0]["loss_mask"]) == [f"\n\n{PARAS[62]}{IM_END}\n"]
    cut = engine_row(tm, [{"role": "user", "content": PARAS[60]}], [(PARAS[61], PARAS[62])], thinking=True, max_tokens=10)
    rows, stats, _ = _one([cut], templates["qwen3.6"], loss_on_reasoning=False)
    assert rows == [] and stats.dropped == {"no_loss_tokens_within_max_length": 1}


def test_max_length_cuts_and_error_rows_and_truncated_rows_are_counted(templates: dict[str, Path]) -> None:
    tm = SimTokenModel(templates["qwen3.6"])
    long_row = engine_row(tm, [{"role": "user", "content": PARAS[70]}], [(PARAS[71] * 3, PARAS[72])], thinking=True,
                          row_id="long")
    cut_row = engine_row(tm, [{"role": "user", "content": PARAS[73]}], [(PARAS[74], PARAS[75])], thinking=True,
                         max_tokens=12, row_id="cut")
    err = {"id": "err", "messages": [{"role": "user", "content": "x"}], "error_class": "Timeout"}
    n_prompt = len(long_row["prompt_token_ids"][0])
    rows, stats, _ = _one([long_row, cut_row, err], templates["qwen3.6"], max_length=n_prompt + 5, drop_truncated=True)
    assert [r["key"] for r in rows] == ["long"] and rows[0]["truncated_to_max_length"]
    assert rows[0]["num_tokens"] == n_prompt + 5 and rows[0]["num_loss_tokens"] == 5
    assert stats.dropped == {"error_row": 1, "finish_reason_length": 1} and stats.rows_in == 3


def test_engine_prompts_that_differ_from_our_template_are_counted_but_their_ids_used(templates: dict[str, Path]) -> None:
    tm = SimTokenModel(templates["qwen3.6"])  # the engine serves the Qwen3.6 template ...
    row = engine_row(tm, [{"role": "user", "content": PARAS[80]}], [(PARAS[81], PARAS[82])], thinking=True)
    rows, stats, _ = _one([row], templates["qwen3"])  # ... we were given the Qwen3 one
    assert stats.prompt_template_differs == 1 and stats.prompt_template_differs_examples == ["r"]
    assert rows[0]["input_ids"][: len(row["prompt_token_ids"][0])] == list(row["prompt_token_ids"][0])


def test_old_parts_without_conversation_or_ids_are_re_encoded_and_checked(templates: dict[str, Path]) -> None:
    tm = SimTokenModel(templates["qwen3"])
    question, reasoning, answer = PARAS[90], PARAS[91], PARAS[92]
    assert reasoning.startswith("    ")  # source code: indented

    def old_row(strip_parsed: bool) -> tuple[dict[str, Any], Any]:
        g = tm.generate([{"role": "user", "content": question}], {"enable_thinking": True}, reasoning, answer, None,
                        0.0, seed=0, strip_parsed=strip_parsed)
        return {"id": "o", "messages": [{"role": "user", "content": question}], "reasoning": g.reasoning,
                "content": g.content, "finish_reason": "stop", "prompt_tokens": len(g.prompt_ids),
                "completion_tokens": len(g.output_ids)}, g

    row, g = old_row(strip_parsed=False)
    rows, stats, _ = _one([row], templates["qwen3"])
    assert len(rows) == 1 and rows[0]["ids_source"] == "retokenized" and stats.rows_without_engine_ids == 1
    assert rows[0]["input_ids"][: len(g.prompt_ids)] == g.prompt_ids
    assert rows[0]["input_ids"][len(g.prompt_ids):-1] == g.output_ids
    # A parser that strips the reasoning's leading spaces (SGLang's does) loses text the model wrote:
    # the re-encoded turn no longer has the engine's token count, and the check says so.
    row, _ = old_row(strip_parsed=True)
    rows, stats, _ = _one([row], templates["qwen3"])
    assert rows == [] and stats.unverified == 1 and "engine counted" in stats.unverified_examples[0]


def test_a_turn_cut_right_after_its_closing_think_tag_is_verified_without_ids(templates: dict[str, Path]) -> None:
    """Cut inside the thinking, just after `</think>`, or after the newlines that follow it: the parsed fields
    look the same (all reasoning, empty answer); the re-encoding that has the engine's count is taken."""
    tm = SimTokenModel(templates["qwen3.6"])
    messages = [{"role": "user", "content": PARAS[95]}]
    full = engine_row(tm, messages, [(PARAS[96], PARAS[97])], thinking=True)
    out = list(full["output_token_ids"][0])
    close = out.index(tm.think_close_id)
    for cut in (close, close + 1, close + 2):
        row = engine_row(tm, messages, [(PARAS[96], PARAS[97])], thinking=True, max_tokens=cut, ids=False)
        assert row["content"].strip() == "" and row["finish_reason"] == "length"
        rows, stats, tok = _one([row], templates["qwen3.6"])
        assert stats.unverified == 0, (cut, stats.unverified_examples)
        (r,) = rows
        assert r["input_ids"][-cut:] == out[:cut] and r["num_loss_tokens"] == cut
