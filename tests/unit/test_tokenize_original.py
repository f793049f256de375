"""answers 'original': the input's own answers as training rows, as a user who did not regenerate trains on them.

Each original answer sits at a regenerated turn's place (same key as the regenerated row), its context the
original conversation before it, rendered with the chat template in the row's thinking mode and encoded from
its text (`ids_source` "original": no engine ids, nothing to check against). Thinking on: an answer without
reasoning gets the template's empty think block, trained (SpecForge's thinking templates train it on raw data,
tests/trainers shows it); thinking off: the answer's reasoning is left out (serving would not have thought).
Qwen's real BPE, Qwen3- and Qwen3.6-style templates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_tokenize_exact import IM_END, NEWLINE, PARAS, _builder, _table, _trained

from dflash_pipeline.config import ConfigError, TokenizeConfig
from dflash_pipeline.dev.qwen_tokenizer import copy_with_template
from dflash_pipeline.dev.sim.rows import engine_row
from dflash_pipeline.dev.sim.tokens import SimTokenModel
from dflash_pipeline.steps.tokenize import tokenize_table
from dflash_pipeline.steps.tokenize.gates import gate
from dflash_pipeline.steps.tokenize.turns import original_turns_of, split_inline_thinking


@pytest.fixture(scope="module")
def templates(qwen_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("original")
    return {"qwen3": qwen_tokenizer, "qwen3.6": copy_with_template(root / "q36", "qwen3.6", source=qwen_tokenizer)}


def _row(tm: SimTokenModel, original: list[dict[str, Any]], *, thinking: bool | None,
         row_id: str = "r", all_turns: bool = False) -> dict[str, Any]:
    """A completions row regenerated from the original conversation (its last answer, or every one: all_turns)
    that keeps the input's conversation, old answers included, as `original_messages`."""
    sent = [{"role": m["role"], "content": m["content"]} for m in original]
    while sent and sent[-1]["role"] == "assistant":  # plan drops the old answer being regenerated
        sent.pop()
    n = 1 + sum(m["role"] == "assistant" for m in sent) if all_turns else 1
    answers = [("REGENERATED reasoning", f"REGENERATED answer {k}") for k in range(n)]
    row = engine_row(tm, sent, answers, thinking=bool(thinking), row_id=row_id, regenerate_all=all_turns)
    row["original_messages"] = [{"role": m["role"], "content": m["content"], "reasoning": m.get("reasoning")}
                                for m in original]
    row["thinking"] = thinking
    return row


def _original(path: Path, rows: list[dict[str, Any]], **kw: Any) -> tuple[list[dict[str, Any]], Any, Any]:
    b = _builder(path, answers="original", **kw)
    out, convs, stats = tokenize_table(_table(rows), b)
    return out.to_pylist(), stats, b


@pytest.mark.parametrize("name", ["qwen3", "qwen3.6"])
def test_an_original_answer_is_the_template_rendering_of_the_input_answer_after_the_served_prompt(
        templates: dict[str, Path], name: str) -> None:
    tm = SimTokenModel(templates[name])
    original = [{"role": "user", "content": PARAS[0]},
                {"role": "assistant", "content": PARAS[2], "reasoning": PARAS[1]}]
    row = _row(tm, original, thinking=True)
    rows, stats, b = _original(templates[name], [row])
    (r,) = rows
    tok = b.tokenizer
    assert r["ids_source"] == "original" and r["ids_canonical"] is True and r["finish_reason"] is None
    assert r["key"] == "r" and r["turn"] == 0  # the place of the regenerated turn: the same key
    opened = "" if name == "qwen3.6" else "<think>\n"
    assert _trained(tok, r["input_ids"], r["loss_mask"]) == [f"{opened}{PARAS[1]}\n</think>\n\n{PARAS[2]}{IM_END}{NEWLINE}"]
    # token for token: the served prompt (template + generation prompt, thinking on), then the template's own
    # rendering of the input answer after it, encoded; no regenerated text anywhere
    prompt = b.rec.render_messages([{"role": "user", "content": PARAS[0]}], add_generation_prompt=True,
                                   enable_thinking=True)
    full = b.rec.render_messages([{"role": "user", "content": PARAS[0]},
                                  {"role": "assistant", "content": PARAS[2], "reasoning_content": PARAS[1]}],
                                 enable_thinking=True)
    assert full.startswith(prompt) and full.endswith(IM_END + NEWLINE)
    enc = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    assert r["input_ids"] == enc(prompt) + enc(full[len(prompt):-1]) + enc(NEWLINE)
    assert r["loss_mask"] == [0] * len(enc(prompt)) + [1] * (len(r["input_ids"]) - len(enc(prompt)))
    assert "REGENERATED" not in tok.decode(r["input_ids"], skip_special_tokens=False)
    assert stats.ids_source == {"original": 1} and stats.unverified == 0 and stats.original_answers == {}
    assert stats.rows_with_engine_ids == 0 and stats.rows_without_engine_ids == 0  # the engine's ids are not used


@pytest.mark.parametrize("name", ["qwen3", "qwen3.6"])
def test_thinking_on_without_reasoning_trains_the_empty_think_block_and_thinking_off_leaves_reasoning_out(
        templates: dict[str, Path], name: str) -> None:
    tm = SimTokenModel(templates[name])
    no_reasoning = _row(tm, [{"role": "user", "content": PARAS[3]},
                                        {"role": "assistant", "content": PARAS[4]}], thinking=True, row_id="on")
    off = _row(tm, [{"role": "user", "content": PARAS[5]},
                               {"role": "assistant", "content": PARAS[7], "reasoning": PARAS[6]}],
               thinking=False, row_id="off")
    inline = _row(tm, [{"role": "user", "content": PARAS[8]},
                                  {"role": "assistant", "content": f"<think>\n{PARAS[9]}\n</think>\n\n{PARAS[10]}"}],
                  thinking=True, row_id="inline")
    rows, stats, b = _original(templates[name], [no_reasoning, off, inline])
    got = {r["key"]: r for r in rows}
    tok = b.tokenizer
    # thinking on, no reasoning: the template writes an empty think block; it is part of the answer, trained
    block = "\n</think>\n\n" if name == "qwen3.6" else "<think>\n\n</think>\n\n"
    assert _trained(tok, got["on"]["input_ids"], got["on"]["loss_mask"]) == [f"{block}{PARAS[4]}{IM_END}{NEWLINE}"]
    # thinking off: the prompt ends in the empty think block (context, as served) and the reasoning is left out
    assert _trained(tok, got["off"]["input_ids"], got["off"]["loss_mask"]) == [f"{PARAS[7]}{IM_END}{NEWLINE}"]
    text = tok.decode(got["off"]["input_ids"], skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + PARAS[7] + IM_END + NEWLINE)
    assert PARAS[6] not in text
    # reasoning inline in the answer's text is split off as the template splits it
    opened = "" if name == "qwen3.6" else "<think>\n"
    assert _trained(tok, got["inline"]["input_ids"], got["inline"]["loss_mask"]) == [
        f"{opened}{PARAS[9]}\n</think>\n\n{PARAS[10]}{IM_END}{NEWLINE}"]
    assert stats.original_answers == {"thinking_off_reasoning_left_out": 1, "thinking_on_without_reasoning": 1}
    assert stats.dropped == {}


def test_the_original_answers_sit_at_the_regenerated_turns_places_with_the_original_history(
        templates: dict[str, Path]) -> None:
    tm = SimTokenModel(templates["qwen3.6"])
    original = [{"role": "system", "content": "You review Python."},
                {"role": "user", "content": "Q0 " + PARAS[11]},
                {"role": "assistant", "content": "OLD-0 " + PARAS[12], "reasoning": "R0 " + PARAS[13]},
                {"role": "user", "content": "Q1 " + PARAS[14]},
                {"role": "assistant", "content": "OLD-1 " + PARAS[15], "reasoning": "R1 " + PARAS[16]}]
    last = _row(tm, original, thinking=True, row_id="last")  # regenerate=last_turn: only turn 1 was answered
    every = _row(tm, original, thinking=True, row_id="all", all_turns=True)
    rows, _, b = _original(templates["qwen3.6"], [last, every])
    tok = b.tokenizer
    assert [r["key"] for r in rows] == ["last#turn=1", "all#turn=0", "all#turn=1"]
    for r in rows:
        text = tok.decode(r["input_ids"], skip_special_tokens=False)
        (trained,) = _trained(tok, r["input_ids"], r["loss_mask"])
        k = r["turn"]
        assert trained.startswith(f"R{k} ") and f"OLD-{k} " in trained and "REGENERATED" not in text
        assert ("OLD-0" in text) and ("R0" in text) == (k == 0)  # earlier answers as context, without reasoning
        assert ("Q1" in text) == (k == 1)
    # train_turns 'last' keeps the last original answer only
    only, _, _ = _original(templates["qwen3.6"], [every], train_turns="last")
    assert [r["key"] for r in only] == ["all#turn=1"]


def test_rows_without_an_original_answer_and_error_rows_are_dropped_and_counted(templates: dict[str, Path]) -> None:
    tm = SimTokenModel(templates["qwen3"])
    prompt_only = _row(tm, [{"role": "user", "content": PARAS[20]}], thinking=True, row_id="prompt")
    empty = _row(tm, [{"role": "user", "content": PARAS[21]}, {"role": "assistant", "content": " "}],
                 thinking=True, row_id="empty")
    old_part = _row(tm, [{"role": "user", "content": PARAS[22]}, {"role": "assistant", "content": "x y"}],
                    thinking=True, row_id="old")
    old_part["original_messages"] = None  # a part written before the column
    err = {"id": "err", "messages": [{"role": "user", "content": "x"}], "error_class": "Timeout",
           "original_messages": [{"role": "user", "content": "x", "reasoning": None},
                                 {"role": "assistant", "content": "an answer", "reasoning": None}]}
    rows, stats, _ = _original(templates["qwen3"], [prompt_only, empty, old_part, err])
    assert rows == [] and stats.dropped == {"error_row": 1, "no_original_answer": 3}


def test_split_inline_thinking_and_original_turns_of() -> None:
    assert split_inline_thinking("<think>\nR\n</think>\n\nA", None) == ("R", "A")
    assert split_inline_thinking("R</think>A", None) == ("R", "A")  # Qwen3-2507 answers open no <think>
    assert split_inline_thinking("A", "R") == ("R", "A") and split_inline_thinking("A", None) == (None, "A")
    row = {"id": "x", "conversation": [{"role": "user", "content": "q", "reasoning": None},
                                       {"role": "assistant", "content": "new", "reasoning": "nr"}],
           "turns": [{"finish_reason": "stop"}], "thinking": None,
           "original_messages": [{"role": "user", "content": "q", "reasoning": None},
                                 {"role": "assistant", "content": "old", "reasoning": "or"}]}
    on, off = original_turns_of(row, True), original_turns_of(row, False)  # a row without a mode: the pinned one
    assert (on[0].reasoning, on[0].content, on[0].reasoning_left_out) == ("or", "old", False)
    assert (off[0].reasoning, off[0].content, off[0].reasoning_left_out) == (None, "old", True)
    assert original_turns_of({**row, "error_class": "Timeout"}, True) == []


def test_answers_param_is_checked_and_narrows_the_quality_flags() -> None:
    cfg = TokenizeConfig.from_params({"answers": "original"})
    assert cfg.answers == "original" and cfg.drop_quality == ("near_duplicate",)
    assert TokenizeConfig.from_params({"answers": "original", "drop_quality": []}).drop_quality == ()
    assert TokenizeConfig.from_params({}).answers == "regenerated"
    with pytest.raises(ConfigError, match="cannot be the 'default' tokenization"):
        TokenizeConfig.from_params({"answers": "original", "tokenization": "default"})
    with pytest.raises(ConfigError, match=r"drop_quality \['loop_reasoning'\] with answers 'original'"):
        TokenizeConfig.from_params({"answers": "original", "drop_quality": ["loop_reasoning", "near_duplicate"]})
    with pytest.raises(ConfigError, match="not one of"):
        TokenizeConfig.from_params({"answers": "both"})


def test_the_other_samples_of_a_prompt_do_not_count_against_the_kept_share() -> None:
    report = {"rows_out": 10, "dropped_by_reason": {"original_answer_of_another_sample": 30, "heldout": 5,
                                                    "error_row": 1}}
    g = gate(report, 0.7)
    assert g["rows_counted"] == 11 and g["passed"]
