"""Planted data defects (dev/data_defects.py): exactly the bug, token by token against the clean row, nothing more.

Clean rows are built by the tokenize step itself (tokenize_table) from engine rows with Qwen's real BPE, thinking
on and off, Qwen3- and Qwen3.6-style templates; each defect is planted on them and compared position by position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from test_tokenize_exact import IM_END, NEWLINE, PARAS, _builder, _table, _trained

from dflash_pipeline.dev.data_defects import (
    DefectError,
    generation_prompts,
    shift_loss_mask,
    thinking_off_as_on,
)
from dflash_pipeline.dev.qwen_tokenizer import QWEN3_STYLE_TEMPLATE, copy_with_template
from dflash_pipeline.dev.sim.rows import engine_row
from dflash_pipeline.dev.sim.tokens import SimTokenModel
from dflash_pipeline.steps.tokenize import tokenize_table
from dflash_pipeline.steps.tokenize.rowlabels import labels_by_unit, with_labels

EMPTY_BLOCK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def templates(qwen_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("defects")
    return {"qwen3": qwen_tokenizer, "qwen3.6": copy_with_template(root / "q36", "qwen3.6", source=qwen_tokenizer)}


def _clean(path: Path) -> tuple[pa.Table, Any, list[dict[str, Any]]]:
    """Clean training rows (labels on): thinking on and off, one two-turn conversation, as tokenize builds them."""
    tm = SimTokenModel(path)
    rows = []
    for i, on in enumerate((True, False, True, False)):
        rows.append(engine_row(tm, [{"role": "user", "content": PARAS[100 + i]}], [(PARAS[110 + i], PARAS[120 + i])],
                               thinking=on, row_id=f"r{i}"))
        rows[-1]["thinking"] = on
    multi = engine_row(tm, [{"role": "system", "content": "Be exact."}, {"role": "user", "content": PARAS[130]},
                            {"role": "assistant", "content": "old"}, {"role": "user", "content": PARAS[131]}],
                       [(None, PARAS[132]), (None, PARAS[133])], thinking=False, row_id="multi")
    multi["thinking"] = False
    rows.append(multi)
    b = _builder(path)
    out, _, stats = tokenize_table(_table(rows), b)
    assert stats.dropped == {} and out.num_rows == 6
    return with_labels(out, labels_by_unit(_table(rows), True), True), b, rows


@pytest.mark.parametrize("name", ["qwen3", "qwen3.6"])
def test_shifted_loss_mask_moves_every_mask_one_token_right_and_nothing_else(templates: dict[str, Path],
                                                                              name: str) -> None:
    clean, b, _ = _clean(templates[name])
    planted = shift_loss_mask(clean)
    assert planted.changed.all()
    tok = b.tokenizer
    for c, d in zip(clean.to_pylist(), planted.table.to_pylist()):
        assert d["input_ids"] == c["input_ids"]  # the ids are the clean row's
        n = len(c["loss_mask"])
        start = c["loss_mask"].index(1)
        for j in range(n):  # position by position: the mask lags one token behind
            assert d["loss_mask"][j] == (c["loss_mask"][j - 1] if j else 0), (c["key"], j)
        # what that means on our rows (the generated run ends the row): the first generated token, and only it,
        # loses its loss; the trained run still ends at the row's end
        lost = [j for j in range(n) if c["loss_mask"][j] and not d["loss_mask"][j]]
        gained = [j for j in range(n) if d["loss_mask"][j] and not c["loss_mask"][j]]
        assert lost == [start] and gained == [] and d["loss_mask"][-1] == 1
        assert d["num_loss_tokens"] == c["num_loss_tokens"] - 1 and d["num_tokens"] == c["num_tokens"]
        first = tok.decode([c["input_ids"][start]], skip_special_tokens=False)
        if c["thinking"] and name == "qwen3":
            assert first == "<think>"  # the Qwen3-style model writes <think>: the token right after the prompt
        (run,) = _trained(tok, d["input_ids"], d["loss_mask"])
        (clean_run,) = _trained(tok, c["input_ids"], c["loss_mask"])
        assert clean_run == first + run and run.endswith(IM_END + NEWLINE)
        assert {k: v for k, v in d.items() if k not in ("loss_mask", "num_loss_tokens")} == \
            {k: v for k, v in c.items() if k not in ("loss_mask", "num_loss_tokens")}


@pytest.mark.parametrize("name", ["qwen3", "qwen3.6"])
def test_thinking_off_rows_get_the_thinking_on_prompt_and_keep_their_answer(templates: dict[str, Path],
                                                                            name: str) -> None:
    clean, b, rows = _clean(templates[name])
    prompts = generation_prompts(b)
    planted = thinking_off_as_on(clean, prompts, default_thinking=True, max_length=1 << 20)
    tok = b.tokenizer
    enc = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    assert planted.changed.tolist() == [not r["thinking"] for r in clean.to_pylist()]
    by_key = {r["key"]: r for r in planted.table.to_pylist()}
    src = {r["id"]: r for r in rows}
    for c in clean.to_pylist():
        d = by_key[c["key"]]
        if c["thinking"]:
            assert d == c  # thinking-on rows are the clean rows
            continue
        start = c["loss_mask"].index(1)
        generated = c["input_ids"][start:]
        # the defect row: the prompt the thinking-ON template renders for this row's context, then the clean
        # row's generated ids (the thinking-off answer), trained exactly as before
        conv = src[c["id"]]["conversation"]
        context = [{"role": m["role"], "content": m["content"]} for m in conv[: [i for i, m in enumerate(conv)
                                                                                 if m["role"] == "assistant"][c["turn"]]]]
        on_prompt = b.rec.render_messages(context, add_generation_prompt=True, enable_thinking=True)
        off_prompt = b.rec.render_messages(context, add_generation_prompt=True, enable_thinking=False)
        assert c["input_ids"][:start] == enc(off_prompt)
        assert d["input_ids"] == enc(on_prompt) + generated
        assert d["loss_mask"] == [0] * len(enc(on_prompt)) + c["loss_mask"][start:]
        assert d["num_loss_tokens"] == c["num_loss_tokens"] and _trained(tok, d["input_ids"], d["loss_mask"]) == \
            _trained(tok, c["input_ids"], c["loss_mask"])
        # token by token: a common prefix, then the clean row's thinking-off generation prompt tail replaced
        common = 0
        while d["input_ids"][common] == c["input_ids"][common]:
            common += 1
        clean_tail = tok.decode(c["input_ids"][common:start], skip_special_tokens=False)
        planted_tail = tok.decode(d["input_ids"][common:len(enc(on_prompt))], skip_special_tokens=False)
        if name == "qwen3":  # the model writes <think>: the on prompt stops after "assistant\n"
            assert (clean_tail, planted_tail) == (EMPTY_BLOCK, "")
        else:  # Qwen3.6: the on prompt opens the thinking, the off one writes it closed
            assert tok.decode(c["input_ids"][:start], skip_special_tokens=False).endswith(
                "assistant\n" + EMPTY_BLOCK)
            assert tok.decode(d["input_ids"][:len(enc(on_prompt))], skip_special_tokens=False).endswith(
                "assistant\n<think>\n")
            assert clean_tail.endswith("</think>\n\n") and planted_tail.startswith("\n") and "</think>" not in planted_tail
        assert d["finish_reason"] == c["finish_reason"] and d["thinking"] is False


def test_thinking_off_as_on_refuses_what_it_cannot_plant_exactly(templates: dict[str, Path], tmp_path: Path,
                                                                  qwen_tokenizer: Path) -> None:
    clean, b, _ = _clean(templates["qwen3"])
    prompts = generation_prompts(b)
    # a thinking-on row labelled off: its prompt has no thinking-off generation prompt to replace
    on_row = clean.filter(pa.array([bool(t) for t in clean.column("thinking").to_pylist()]))
    mislabelled = on_row.set_column(on_row.schema.get_field_index("thinking"), "thinking",
                                    pa.array([False] * on_row.num_rows))
    with pytest.raises(DefectError, match="does not end with the thinking-off generation prompt"):
        thinking_off_as_on(mislabelled, prompts, default_thinking=True, max_length=1 << 20)
    # a template whose thinking mode changes the conversation itself, not only the generation prompt
    odd = QWEN3_STYLE_TEMPLATE.replace("{%- for m in messages -%}{%- if m['role'] == 'assistant'",
                                       "{%- if enable_thinking is defined and enable_thinking is false -%}/no_think"
                                       "{%- endif -%}{%- for m in messages -%}{%- if m['role'] == 'assistant'", 1)
    assert odd != QWEN3_STYLE_TEMPLATE
    with pytest.raises(DefectError, match="renders the conversation itself differently"):
        generation_prompts(_builder(copy_with_template(tmp_path / "odd", odd, source=qwen_tokenizer)))
    # a planted row longer than max_length is cut there, as tokenize cuts (here the on prompt is the shorter one)
    shorter = len(prompts.off) - len(prompts.on)
    assert shorter == 4  # <think>, "\n\n", </think>, "\n\n"
    limit = min(len(r) for r in clean.column("input_ids").to_pylist()) - 2
    planted = thinking_off_as_on(clean, prompts, default_thinking=True, max_length=limit)
    lengths = [len(r) for r in planted.table.column("input_ids").to_pylist()]
    want = [len(r) - shorter * ch > limit for r, ch in zip(clean.column("input_ids").to_pylist(), planted.changed)]
    assert [t for t, ch in zip(planted.table.column("truncated_to_max_length").to_pylist(), planted.changed) if ch] == \
        [w for w, ch in zip(want, planted.changed) if ch]
    assert all(n <= limit for n, ch in zip(lengths, planted.changed) if ch)
