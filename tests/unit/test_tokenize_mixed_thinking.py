"""A run that mixes thinking modes per row: every row is rendered, re-encoded and recounted in its own mode.

The dataset's pinned `enable_thinking` is only the fallback for rows without a `thinking` value (parts
written before the column existed). A thinking-off row in a thinking-on dataset rendered with the
thinking-on template gets the wrong prompt (no empty think block) and a generated text the model never
wrote, so its ids differ from the engine's counts and the row was dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from test_tokenize_exact import IM_END, NEWLINE, PARAS, _builder, _table, _trained

from dflash_pipeline.dev.qwen_tokenizer import QWEN3_STYLE_TEMPLATE, copy_with_template
from dflash_pipeline.dev.sim.rows import engine_row
from dflash_pipeline.dev.sim.tokens import SimTokenModel
from dflash_pipeline.steps.tokenize import tokenize_table
from dflash_pipeline.steps.tokenize.profiles import build_profile_files, profile_keys
from dflash_pipeline.steps.tokenize.rowlabels import labels_by_unit, with_labels
from dflash_pipeline.steps.validate.tokencount import load_recounter


@pytest.fixture(scope="module")
def templates(qwen_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixed")
    return {"qwen3": qwen_tokenizer, "qwen3.6": copy_with_template(root / "q36", "qwen3.6", source=qwen_tokenizer)}


def _no_s3(bucket: str, key: str) -> bytes | None:
    raise AssertionError("local tokenizer")


def _mixed_rows(tm: SimTokenModel, *, with_ids: bool, pinned: bool) -> list[dict[str, Any]]:
    """Rows on, off, and one with no `thinking` (an old part: generated in the pinned mode)."""
    rows = []
    for i, mode in enumerate((True, False, True, False, None)):
        generated_in = pinned if mode is None else mode
        row = engine_row(tm, [{"role": "user", "content": PARAS[10 + i]}], [(PARAS[20 + i], PARAS[30 + i])],
                         thinking=generated_in, ids=True, row_id=f"r{i}")
        row["engine_ids"] = (row["prompt_token_ids"][0], row["output_token_ids"][0])  # what the engine made
        row["texts"] = (PARAS[20 + i], PARAS[30 + i])  # what the model wrote (before the parser)
        if not with_ids:  # an engine that returns no ids
            del row["prompt_token_ids"], row["output_token_ids"]
        row["thinking"] = mode
        row["sampling"] = None if mode is None else json.dumps({"max_tokens": 4096, "temperature": 0.6 + 0.1 * i},
                                                               sort_keys=True)
        rows.append(row)
    return rows


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("with_ids", [True, False])
@pytest.mark.parametrize("name", ["qwen3", "qwen3.6"])
def test_each_row_gets_the_ids_its_own_mode_renders(templates: dict[str, Path], name: str, with_ids: bool,
                                                     pinned: bool) -> None:
    tm = SimTokenModel(templates[name])
    rows = _mixed_rows(tm, with_ids=with_ids, pinned=pinned)
    b = _builder(templates[name], enable_thinking=pinned)
    out, _, stats = tokenize_table(_table(rows), b)
    assert stats.dropped == {}, stats.dropped
    assert stats.unverified == 0 and stats.prompt_template_differs == 0, stats
    got = {r["id"]: r for r in out.to_pylist()}
    assert sorted(got) == [r["id"] for r in rows]
    tok = b.tokenizer
    for row in rows:
        mode = pinned if row["thinking"] is None else row["thinking"]
        r = got[row["id"]]
        # The prompt is the template rendered with the row's own enable_thinking, the generated ids what the
        # engine produced in that mode (the simulator renders and encodes as vLLM / SGLang do).
        context = [{"role": "user", "content": row["messages"][0]["content"]}]
        prompt = b.rec.render_messages(context, add_generation_prompt=True, enable_thinking=mode)
        prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
        engine_prompt, engine_output = row["engine_ids"]
        assert engine_prompt == prompt_ids
        want = [*prompt_ids, *engine_output, *tok.encode(NEWLINE, add_special_tokens=False).ids]
        assert r["input_ids"] == want, (name, row["id"], mode)
        trained = _trained(tok, r["input_ids"], r["loss_mask"])
        if mode:
            opened = "" if name == "qwen3.6" else "<think>\n"
            assert trained == [f"{opened}{row['texts'][0]}\n</think>\n\n{row['texts'][1]}{IM_END}{NEWLINE}"]
        else:  # the empty think block is the prompt's, never trained
            assert trained == [row["texts"][1] + IM_END + NEWLINE]
            assert tok.decode(r["input_ids"], skip_special_tokens=False).endswith(
                "<|im_start|>assistant\n<think>\n\n</think>\n\n" + row["texts"][1] + IM_END + NEWLINE)
        assert r["ids_source"] == ("engine" if with_ids else "retokenized")
    # Labels: each row's own mode and sampling (null-safe for the old row).
    labelled = with_labels(out, labels_by_unit(_table(rows), pinned), pinned).to_pylist()
    for row, r in zip(rows, sorted(labelled, key=lambda r: r["id"])):
        assert r["thinking"] == (pinned if row["thinking"] is None else row["thinking"])
        assert r["sampling"] == row["sampling"]


def test_the_specforge_conversations_export_judges_each_row_by_its_own_mode(templates: dict[str, Path]) -> None:
    """A thinking-off row has no reasoning to demand: it is exported even from a thinking-on dataset; the
    reverse (a thinking-on row without reasoning) is skipped even from a thinking-off one."""
    tm = SimTokenModel(templates["qwen3"])
    rows = _mixed_rows(tm, with_ids=True, pinned=True)
    b = _builder(templates["qwen3"], enable_thinking=True, profiles=("specforge",))
    out, convs, _ = tokenize_table(_table(rows), b)
    out = with_labels(out, labels_by_unit(_table(rows), True), True)
    files = build_profile_files(out, 0, ("specforge",), thinking=True, conversations=convs)
    assert files.conversations is not None and files.conversations.rows == 5, files.conversations
    lines = [json.loads(x) for x in files.files[profile_keys("specforge", 0)["conversations"]].splitlines()]
    by_id = {x["source_id"]: x for x in lines}
    assert [by_id[f"r{i}"]["thinking"] for i in range(5)] == [True, False, True, False, True]
    assert "reasoning_content" not in by_id["r1"]["conversations"][-1]
    assert json.loads(by_id["r0"]["sampling"]) == {"max_tokens": 4096, "temperature": 0.6}
    assert by_id["r4"]["sampling"] == ""
    # thinking-off dataset, a thinking-on row without reasoning: skipped by its own mode
    files_off = build_profile_files(out, 0, ("specforge",), thinking=False,
                                    conversations=[[*c[:-1], {**c[-1], "reasoning": None}] for c in convs])
    assert files_off.conversations is not None and files_off.conversations.skipped == {"empty_reasoning": 3}


# A template whose assistant turns depend on the mode (as DeepSeek-V3.1's do): a thinking-off turn is written
# without a think block. Validation's recount renders the conversation, so it must render it in the row's mode.
MODE_IN_TURNS = QWEN3_STYLE_TEMPLATE.replace(
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}",
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning)"
    " and not (enable_thinking is defined and enable_thinking is false) -%}")


def test_the_recount_renders_each_row_in_its_own_mode(qwen_tokenizer: Path, tmp_path: Path) -> None:
    assert MODE_IN_TURNS != QWEN3_STYLE_TEMPLATE
    path = copy_with_template(tmp_path / "mode", MODE_IN_TURNS, source=qwen_tokenizer)
    rec = load_recounter(str(path), _no_s3, enable_thinking=True)
    msgs = [[{"role": "user", "content": PARAS[40 + i]}] for i in range(4)]
    reasoning = [PARAS[50], None, PARAS[52], None]
    content = [PARAS[60 + i] for i in range(4)]
    modes = [True, False, None, False]
    res = rec.recount(msgs, reasoning, content, thinking=modes)
    ref = rec.recount_separately(msgs, reasoning, content, thinking=modes)
    for i, mode in enumerate(modes):
        turn = {"role": "assistant", "content": content[i], **({"reasoning_content": reasoning[i]} if reasoning[i] else {})}
        text = rec.render_messages([*msgs[i], turn], enable_thinking=mode)
        assert ("<think>" in text) == (mode is not False)
        assert res.training[i] == ref.training[i] == len(rec.tokenizer.encode(text, add_special_tokens=False).ids)
        assert res.content[i] == len(rec.tokenizer.encode(content[i], add_special_tokens=False).ids)
    # the old call (no modes) renders every row in the recounter's mode
    old = rec.recount(msgs, reasoning, content)
    assert old.training[1] > res.training[1] and old.training[0] == res.training[0]
    assert np.array_equal(rec.recount(msgs, reasoning, content, thinking=[None] * 4).training, old.training)


def test_sampling_label_is_null_safe_on_old_parts(templates: dict[str, Path]) -> None:
    """A part from before the columns (one mode, the pinned one): rows as before, `sampling` null."""
    tm = SimTokenModel(templates["qwen3"])
    rows = [engine_row(tm, [{"role": "user", "content": PARAS[10 + i]}], [(None, PARAS[30 + i])], thinking=False,
                       ids=False, row_id=f"r{i}") for i in range(3)]
    old = _table(rows).drop_columns(["sampling", "thinking"])
    b = _builder(templates["qwen3"], enable_thinking=False)
    out, _, stats = tokenize_table(old, b)
    assert stats.dropped == {} and out.num_rows == 3
    labelled = with_labels(out, labels_by_unit(old, True), True)
    assert labelled.schema.field("sampling").type == pa.string()
    assert labelled.column("sampling").null_count == labelled.num_rows


def test_validation_recounts_each_row_in_its_own_mode(qwen_tokenizer: Path, tmp_path: Path) -> None:
    """Validator (steps/validate/checks.py) on a mixed part of a thinking-on dataset: no count mismatches, and the
    training tokens are those of each row's conversation rendered in its own mode."""
    from dflash_pipeline.steps.validate.checks import Validator

    path = copy_with_template(tmp_path / "mode", MODE_IN_TURNS, source=qwen_tokenizer)
    rec = load_recounter(str(path), _no_s3, enable_thinking=True)
    rows = _mixed_rows(SimTokenModel(path), with_ids=True, pinned=True)
    for row in rows:
        row.update(server="s", latency_s=0.1)
    v = Validator(True, rec)
    v.add_chunk([r["id"] for r in rows], _table(rows))
    rc = v.t.recount
    assert rc is not None and rc.rows == 5 and rc.compared == 5 and rc.mismatches == 0, rc
    want = 0
    for row in rows:
        mode = True if row["thinking"] is None else row["thinking"]
        last = row["conversation"][-1]
        turn = {"role": "assistant", "content": last["content"],
                **({"reasoning_content": last["reasoning"]} if last["reasoning"] else {})}
        text = rec.render_messages([*row["messages"], turn], enable_thinking=mode)
        want += len(rec.tokenizer.encode(text, add_special_tokens=False).ids)
    assert rc.training.total == want
    v.close()
