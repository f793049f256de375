"""What rides along to the training rows never changes what is trained: a turn's speculative-decoding
figures and the input row's labels (source, domain, metadata, thinking) leave `input_ids` and
`loss_mask` exactly as a row without them gives; held-out rows are dropped before any row is built.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from dflash_pipeline.dataset.heldout import HeldoutSplit
from dflash_pipeline.dataset.records import PART_SCHEMA
from dflash_pipeline.dev.sim.rows import engine_row
from dflash_pipeline.dev.sim.tokens import SimTokenModel
from dflash_pipeline.steps.tokenize import TokenizeSettings, TrainingRowBuilder, tokenize_table
from dflash_pipeline.steps.tokenize.heldout import drop_heldout
from dflash_pipeline.steps.tokenize.rowlabels import labels_by_unit, with_labels
from dflash_pipeline.steps.validate.tokencount import load_recounter

ANSWERS = [("Let me count.", "Two."), ("Again.", "Three.")]
MESSAGES = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "Some."},
            {"role": "user", "content": "And now?"}]


def _no_s3(bucket: str, key: str) -> bytes | None:
    raise AssertionError("local tokenizer")


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist([{c: r.get(c) for c in PART_SCHEMA.names} for r in rows], schema=PART_SCHEMA)


def _labelled(row: dict[str, Any]) -> dict[str, Any]:
    """The same row with spec figures on every turn and on the row, and every label set."""
    out = copy.deepcopy(row)
    for k, turn in enumerate(out["turns"]):
        turn.update(spec_verify_steps=5 + k, spec_accepted_tokens=7, spec_draft_tokens=15,
                    spec_accept_histogram=[1, 2, 2 + k])
    out.update(spec_verify_steps=11, spec_accepted_tokens=14, spec_draft_tokens=30, spec_accept_histogram=[2, 4, 5],
               acceptance_length=1 + 14 / 11, source="bench", domain="math", metadata='{"k": 1}',
               sampling='{"max_tokens": 64, "temperature": 0.6}',
               thinking=True)  # the mode it was generated in: a row's own mode decides how it is rendered

    return out


@pytest.mark.parametrize("with_ids", [True, False])
def test_spec_columns_and_labels_never_change_input_ids_or_loss_mask(qwen_tokenizer: Path, with_ids: bool) -> None:
    tm = SimTokenModel(qwen_tokenizer)
    rows = [engine_row(tm, MESSAGES, ANSWERS, thinking=True, ids=with_ids, row_id=f"r{i}") for i in range(3)]
    settings = TokenizeSettings(tokenizer=str(qwen_tokenizer), min_loss_tokens=1, max_length=1 << 20,
                                train_turns="all")
    builder = TrainingRowBuilder(load_recounter(str(qwen_tokenizer), _no_s3, enable_thinking=True), settings)
    plain, _, _ = tokenize_table(_table(rows), builder)
    labelled_in = _table([_labelled(r) for r in rows])
    labelled, _, _ = tokenize_table(labelled_in, builder)
    labelled = with_labels(labelled, labels_by_unit(labelled_in, True), True)
    assert plain.num_rows == labelled.num_rows == 6
    for col in ("key", "input_ids", "loss_mask", "num_tokens", "num_loss_tokens"):
        assert labelled.column(col).to_pylist() == plain.column(col).to_pylist(), col
    # and they did ride along (so the comparison above is between rows that differ)
    assert labelled.column("spec_verify_steps").to_pylist() == [5, 6] * 3
    assert plain.column("spec_verify_steps").to_pylist() == [None] * 6
    assert set(labelled.column("domain").to_pylist()) == {"math"}
    assert set(labelled.column("sampling").to_pylist()) == {'{"max_tokens": 64, "temperature": 0.6}'}


def test_heldout_rows_are_gone_before_rows_are_built(qwen_tokenizer: Path) -> None:
    tm = SimTokenModel(qwen_tokenizer)
    rows = [engine_row(tm, MESSAGES, ANSWERS, thinking=True, row_id=f"r{i}") for i in range(4)]
    kept, dropped = drop_heldout(_table(rows), HeldoutSplit(0.0, ids=frozenset({"r1", "r3"})))
    assert dropped == 2
    settings = TokenizeSettings(tokenizer=str(qwen_tokenizer), min_loss_tokens=1, max_length=1 << 20)
    out, conversations, _ = tokenize_table(kept, TrainingRowBuilder(
        load_recounter(str(qwen_tokenizer), _no_s3, enable_thinking=True), settings))
    assert {k.split("#")[0] for k in out.column("key").to_pylist()} <= {"r0", "r2"}
    assert set(out.column("id").to_pylist()) == {"r0", "r2"} and len(conversations) == out.num_rows
