"""SpecForge 0.2.0 reads issue 38's other training sets as it reads the regenerated ones: the original answers'
files (`answers: original`) and the planted-defect files (dev/data_defects.py), with its own loaders.

* Original answers: SpecForge's pre-tokenized path keeps every row with our ids and masks; its conversations path
  on our export reproduces them; and on the **raw** dataset (the input's conversations as a user who did not
  regenerate gives them to SpecForge, `reasoning_content` and all) SpecForge's own template and parser build the
  same rows token for token, the empty think block of a thinking-on answer without reasoning trained included:
  that is what training on the original answers means with SpecForge.
* Planted defects: SpecForge's pre-tokenized path reads the defect rows unchanged (no repair, no drop), so the
  defect reaches the trainer exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from test_trainers_read_profiles import _texts

from dflash_pipeline.dataset.records import PART_SCHEMA
from dflash_pipeline.dev.data_defects import SHIFTED_LOSS_MASK, THINKING_OFF_AS_ON, generation_prompts, part_files, plant
from dflash_pipeline.dev.qwen_tokenizer import copy_with_template
from dflash_pipeline.dev.sim.rows import engine_row
from dflash_pipeline.dev.sim.tokens import SimTokenModel
from dflash_pipeline.steps.tokenize import TokenizeSettings, TrainingRowBuilder, tokenize_table
from dflash_pipeline.steps.tokenize.dflash import dflash_ready
from dflash_pipeline.steps.tokenize.profiles import build_profile_files, profile_keys
from dflash_pipeline.steps.tokenize.rowlabels import labels_by_unit, with_labels
from dflash_pipeline.steps.validate.tokencount import load_recounter

pytestmark = pytest.mark.slow

MAX_LENGTH = 1024
RAW = "raw:"
"""The key prefix of the raw dataset's records in the file SpecForge reads."""
SYSTEM = "You answer questions about Python precisely."


def _builder(path: Path, tmp: Path, **kw: Any) -> TrainingRowBuilder:
    s = TokenizeSettings(tokenizer=str(path), max_length=MAX_LENGTH, profiles=("parquet", "specforge"), **kw)
    return TrainingRowBuilder(load_recounter(str(path), lambda b, k: None, enable_thinking=s.enable_thinking,
                                             workdir=tmp), s)


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist([{c: r.get(c) for c in PART_SCHEMA.names} for r in rows], schema=PART_SCHEMA)


def _dataset(tm: SimTokenModel, thinking: bool, n: int = 6) -> list[dict[str, Any]]:
    """Completions rows regenerated from a prompt set with original answers (a system message each, so SpecForge's
    templates add no default one): every third original answer has no reasoning."""
    texts = _texts()
    rows = []
    for i in range(n):
        question = texts[(7 * i) % len(texts)][:300].strip() + "\n\nExplain this."
        answer = texts[(7 * i + 3) % len(texts)][:500].strip()
        reasoning = None if i % 3 == 0 else texts[(7 * i + 5) % len(texts)][:400].strip()
        original = [{"role": "system", "content": SYSTEM, "reasoning": None},
                    {"role": "user", "content": question, "reasoning": None},
                    {"role": "assistant", "content": answer, "reasoning": reasoning}]
        row = engine_row(tm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                         [(f"Regenerated thinking {i}.", f"Regenerated answer {i}.")], thinking=thinking,
                         row_id=f"o{i:02d}", regenerate_all=False)
        row["original_messages"], row["thinking"] = original, thinking
        rows.append(row)
    return rows


def _write(root: Path, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)


CASES = [("qwen3.6", True, "qwen3.5"), ("qwen3", True, "qwen3-thinking"), ("qwen3", False, "qwen3-instruct")]


def test_specforge_reads_the_original_answers_and_builds_the_same_rows_from_the_raw_dataset(
        qwen_tokenizer: Path, tmp_path: Path, run_loaders: Any) -> None:
    """Every (template, thinking) case in one run of the loaders (one import of torch and SpecForge)."""
    jobs: list[tuple[str, list[str]]] = []
    cases = []
    for template, thinking, sf_template in CASES:
        case = tmp_path / f"{template}-{thinking}"
        tok_dir = copy_with_template(case / "tokenizer", template, source=qwen_tokenizer)
        rows = _dataset(SimTokenModel(tok_dir), thinking)
        b = _builder(tok_dir, case / "work", enable_thinking=thinking, answers="original")
        out, convs, stats = tokenize_table(_table(rows), b)
        assert stats.dropped == {} and out.num_rows == len(rows)
        assert set(out.column("ids_source").to_pylist()) == {"original"}
        out = with_labels(out, labels_by_unit(_table(rows), thinking), thinking)
        files = build_profile_files(out, 0, ("parquet", "specforge"), thinking=thinking, conversations=convs)
        root = case / "dataset"
        _write(root, files.files)
        # our conversations export, then the raw dataset as a user who did not regenerate hands it to SpecForge
        # (one file, so SpecForge's dataset map, whose fingerprint pickles the tokenizer, runs once per case)
        both = root / "conversations-and-raw.jsonl"
        both.write_text(files.files[profile_keys("specforge", 0)["conversations"]].decode() + "".join(
            json.dumps({"id": RAW + r["id"], "conversations": [
                {"role": m["role"], "content": m["content"], **({"reasoning_content": m["reasoning"]}
                                                               if m["reasoning"] else {})}
                for m in r["original_messages"]]}) + "\n" for r in rows))
        jobs += [("specforge-tokens", ["--file", str(root / profile_keys("specforge", 0)["tokens"]),
                                      "--max-length", str(MAX_LENGTH)]),
                 ("specforge-conversations", ["--file", str(both), "--tokenizer", str(tok_dir), "--chat-template",
                                              sf_template, "--max-length", str(MAX_LENGTH)])]
        cases.append((template, thinking, rows, out, files, b))
    loaded = run_loaders(jobs)
    for k, (template, thinking, rows, out, files, b) in enumerate(cases):
        (_, tok_rows), (conv_sum, loaded_rows) = loaded[2 * k: 2 * k + 2]
        conv_rows = [r for r in loaded_rows if not r["key"].startswith(RAW)]
        raw_rows = [{**r, "key": r["key"][len(RAW):]} for r in loaded_rows if r["key"].startswith(RAW)]
        ours = {key: (i, m) for key, i, m in zip(out.column("key").to_pylist(), out.column("input_ids").to_pylist(),
                                                  out.column("loss_mask").to_pylist())}
        # pre-tokenized: every row, in order, our ids and masks
        assert [(r["input_ids"], r["loss_mask"]) for r in tok_rows] == list(ours.values())
        # our conversations export (thinking on: the rows without reasoning are left out, expand's rule)
        without = sum(1 for r in rows if thinking and not r["original_messages"][-1]["reasoning"])
        assert files.conversations is not None and files.conversations.rows == len(rows) - without
        assert conv_sum["keyed_by"] == "entry" and conv_sum["entry_rows"] == len(loaded_rows)  # SpecForge dropped none
        assert len(conv_rows) == len(rows) - without and len(raw_rows) == len(rows)
        assert {r["key"]: (r["input_ids"], r["loss_mask"]) for r in conv_rows} == {r["key"]: ours[r["key"]]
                                                                                  for r in conv_rows}
        _same_as_specforge_on_the_raw_dataset(template, thinking, rows, ours, raw_rows, b)


def _same_as_specforge_on_the_raw_dataset(template: str, thinking: bool, rows: list[dict[str, Any]],
                                          ours: dict[str, Any], raw_rows: list[dict[str, Any]],
                                          b: TrainingRowBuilder) -> None:
    """SpecForge's own template and parser on the raw dataset build our rows token for token, the answers
    without reasoning too (thinking on: SpecForge's thinking templates train the empty think block the model's
    chat template writes; thinking off: qwen3-instruct drops reasoning_content and masks the empty block) ..."""
    theirs = {r["key"]: (r["input_ids"], r["loss_mask"]) for r in raw_rows}
    tokenizer = b.tokenizer
    no_reasoning = {r["id"] for r in rows if not r["original_messages"][-1]["reasoning"]}
    nl, nl2 = (tokenizer.token_to_id(t) for t in ("\u010a", "\u010a\u010a"))  # "\n", "\n\n" (byte-level)
    for key, (ids, mask) in ours.items():
        start = mask.index(1)
        trained = tokenizer.decode(ids[start:], skip_special_tokens=False)
        if thinking and key in no_reasoning:
            assert trained.startswith("<think>\n\n</think>\n\n" if template == "qwen3" else "\n</think>\n\n")
        if thinking and key in no_reasoning and template == "qwen3.6":
            # ... but one: SpecForge encodes the whole text, so the "\n" that ends the generation prompt
            # ("<think>\n", the prompt the engine encodes and serves) and the empty thinking's "\n" become one
            # "\n\n" token of the context, and its loss starts at </think>. Ours keeps the served prompt's ids.
            assert ids[start - 1:start + 1] == [nl, nl]
            assert theirs[key] == (ids[:start - 1] + [nl2] + ids[start + 1:], [0] * start + mask[start + 1:]), key
        else:
            assert theirs[key] == (ids, mask), (template, thinking, key)


def test_specforge_reads_the_planted_defects_unchanged(qwen_tokenizer: Path, tmp_path: Path, run_loaders: Any) -> None:
    tok_dir = copy_with_template(tmp_path / "tokenizer", "qwen3.6", source=qwen_tokenizer)
    tm = SimTokenModel(tok_dir)
    rows = []
    for thinking, part in ((True, _dataset(tm, True)), (False, _dataset(tm, False))):
        for r in part:
            r["id"] = f"{r['id']}-{'on' if thinking else 'off'}"
        rows += part
    b = _builder(tok_dir, tmp_path / "work", enable_thinking=True)
    clean, _, stats = tokenize_table(_table(rows), b)
    clean = with_labels(clean, labels_by_unit(_table(rows), True), True)
    assert stats.dropped == {} and clean.num_rows == 12
    prompts = generation_prompts(b)
    jobs, expected = [], {}
    for defect in (SHIFTED_LOSS_MASK, THINKING_OFF_AS_ON):
        planted = plant(defect, clean, b.settings, prompts)
        ready = dflash_ready(planted.table, max_length=MAX_LENGTH, min_loss_tokens=b.settings.min_loss_tokens)
        files, _ = part_files(ready.table, 0, b.settings)
        root = tmp_path / defect
        _write(root, files)
        assert files[profile_keys("specforge", 0)["conversations"]] == b""
        expected[defect] = list(zip(ready.table.column("input_ids").to_pylist(), ready.table.column("loss_mask").to_pylist()))
        assert expected[defect] != list(zip(clean.column("input_ids").to_pylist(), clean.column("loss_mask").to_pylist()))
        jobs.append(("specforge-tokens", ["--file", str(root / profile_keys("specforge", 0)["tokens"]),
                                          "--max-length", str(MAX_LENGTH)]))
    for defect, (summary, loaded) in zip((SHIFTED_LOSS_MASK, THINKING_OFF_AS_ON), run_loaders(jobs)):
        assert summary["rows"] == len(expected[defect]) == 12, (defect, summary)
        assert [(r["input_ids"], r["loss_mask"]) for r in loaded] == [(list(i), list(m)) for i, m in expected[defect]]
