"""Tokenize's gates (issue 32): the kept-share gate, drops by thinking mode and domain, quality drops, min_loss_tokens.

Rows are built by the simulator's token model with Qwen's real BPE (as tests/unit/test_tokenize_exact.py), so
the ids, counts and masks are what tokenize sees from an engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from dflash_pipeline.config import ConfigError, TokenizeConfig
from dflash_pipeline.config.tokenize import QUALITY_FLAG_NAMES, TOKENIZE_PARAM_SCHEMAS
from dflash_pipeline.dataset.records import PART_SCHEMA
from dflash_pipeline.dev.sim.rows import engine_row
from dflash_pipeline.dev.sim.tokens import SimTokenModel
from dflash_pipeline.steps.quality import QUALITY_FLAGS
from dflash_pipeline.steps.tokenize import TokenizeSettings, TrainingRowBuilder, tokenize_table
from dflash_pipeline.steps.tokenize.card import dataset_card
from dflash_pipeline.steps.tokenize.gates import breakdown_lines, failure_message, gate
from dflash_pipeline.steps.tokenize.qualityfilter import quality_filter
from dflash_pipeline.steps.validate.tokencount import load_recounter

GOOD = ("The user asks for a sum. Two plus two is four; I will say so and show the working briefly.",
        "Two plus two equals four, because adding two units to two units gives four units in total.")


def _builder(path: Path, thinking: bool = True, **kw: Any) -> TrainingRowBuilder:
    s = TokenizeSettings(tokenizer=str(path), enable_thinking=thinking, **kw)
    return TrainingRowBuilder(load_recounter(str(path), lambda b, k: None, enable_thinking=thinking), s)


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist([{c: r.get(c) for c in PART_SCHEMA.names} for r in rows], schema=PART_SCHEMA)


def _row(tm: SimTokenModel, i: int, answer: tuple[str | None, str], *, thinking: bool = True, domain: str | None = None,
         **kw: Any) -> dict[str, Any]:
    r = engine_row(tm, [{"role": "user", "content": f"Question number {i}?"}], [answer], thinking=thinking,
                   row_id=f"r{i}", **kw)
    r["thinking"], r["domain"] = thinking, domain
    return r


def _report(stats: Any, uri: str = "s3://b/ds") -> dict[str, Any]:
    """What build_report makes of one part's stats (the figures the gate and the tables read)."""
    d = stats.to_dict()
    return {"output_uri": uri, "rows_out": d["rows_out"], "rows_in": d["rows_in"], "dropped_by_reason": d["dropped"],
            "unverified_examples": d["unverified_examples"], "report_key": "ds/tokenized/report.json",
            **{k: d[k] for k in ("kept_by_thinking", "kept_by_domain", "dropped_by_thinking", "dropped_by_domain")}}


def test_a_run_that_keeps_0_of_200_fails_with_its_reasons(qwen_tokenizer: Path) -> None:
    """Issue 32's case: every re-encoded turn disagrees with the engine's counts (an engine whose ids are not this
    tokenizer's). Before the gate this was a "complete" report with 0 rows."""
    tm = SimTokenModel(str(qwen_tokenizer))
    rows = []
    for i in range(200):
        r = _row(tm, i, GOOD, ids=False, domain="math" if i % 2 else None)
        r["completion_tokens"] += 3  # the engine counted other tokens
        r["turns"] = [dict(t, completion_tokens=t["completion_tokens"] + 3) for t in r["turns"] or []] or None
        rows.append(r)
    out, _, stats = tokenize_table(_table(rows), _builder(qwen_tokenizer))
    assert out.num_rows == 0 and stats.dropped == {"ids_differ_from_engine_counts": 200}
    report = _report(stats)
    report["gate"] = gate(report, 0.5)
    assert report["gate"] == {"min_kept_share": 0.5, "kept_share": 0.0, "rows_kept": 0, "rows_counted": 200,
                              "passed": False}
    msg = failure_message(report)
    assert "kept 0 of 200 training rows (0.0%)" in msg and "ids_differ_from_engine_counts 200 (thinking on 200)" in msg
    assert "engine counted" in msg  # the first unverified turns say what differed
    assert gate(report, 0.0)["passed"] is False  # no row kept fails even with the gate off


def test_the_gate_counts_held_out_rows_as_not_lost() -> None:
    report = {"rows_out": 60, "dropped_by_reason": {"heldout": 500, "fewer_than_min_loss_tokens": 40}}
    assert gate(report, 0.6) == {"min_kept_share": 0.6, "kept_share": 0.6, "rows_kept": 60, "rows_counted": 100,
                                 "passed": True}
    assert not gate(report, 0.61)["passed"]


def test_drops_are_counted_by_thinking_mode_and_domain(qwen_tokenizer: Path) -> None:
    tm = SimTokenModel(str(qwen_tokenizer))
    rows = [_row(tm, 0, GOOD, domain="math"), _row(tm, 1, GOOD, domain="code"),
            _row(tm, 2, (None, "Yes."), thinking=False, domain="chat"),  # 3 loss tokens: under a floor of 8
            _row(tm, 3, (None, GOOD[1]), thinking=False, domain="chat"),
            _row(tm, 4, (None, "No."), thinking=False)]
    rows.append({"id": "r5", "messages": [{"role": "user", "content": "x"}], "error_class": "ContextLength",
                 "thinking": True, "domain": "math"})
    b = _builder(qwen_tokenizer, min_loss_tokens=8)
    out, _, stats = tokenize_table(_table(rows), b)
    assert out.num_rows == 3
    assert stats.kept_by_thinking == {"on": 2, "off": 1}
    assert stats.kept_by_domain == {"chat": 1, "code": 1, "math": 1}
    assert stats.dropped_by_thinking == {"error_row": {"on": 1}, "fewer_than_min_loss_tokens": {"off": 2}}
    assert stats.dropped_by_domain == {"error_row": {"math": 1}, "fewer_than_min_loss_tokens": {"(none)": 1, "chat": 1}}
    report = _report(stats)
    md = "\n".join(breakdown_lines(report))
    assert "| thinking | `off` | `on` |" in md
    assert "| dropped: fewer_than_min_loss_tokens | 2 (67%) | 0 (0%) |" in md
    assert "| domain |" in md and "| rows in | " in md
    report["gate"] = gate(report, 0.5)
    card = dataset_card(report, {"min_loss_tokens": 8}, {})
    assert "## What was dropped and why" in card and "fewer trained tokens than min_loss_tokens" in card
    assert "| dropped: fewer_than_min_loss_tokens | 2 (67%) | 0 (0%) |" in card and "Kept 3 of 6 training rows" in card


LOOP = "Let me check the sum again: two plus two is four, so the answer stays four. " * 40


def test_quality_flags_drop_known_rows(qwen_tokenizer: Path) -> None:
    tm = SimTokenModel(str(qwen_tokenizer))
    french = ("Je réfléchis.", "Bonjour, la réponse est quatre parce que deux plus deux font toujours quatre, "
              "comme on l'apprend à l'école primaire dès la première année.")
    rows = [
        _row(tm, 0, GOOD),  # kept
        _row(tm, 1, (GOOD[0], "I'm sorry, but I can't help with that request.")),  # refusal
        _row(tm, 2, (LOOP, GOOD[1])),  # loop_reasoning
        _row(tm, 3, (GOOD[0] * 4, GOOD[1]), max_tokens=20),  # cut inside the thinking: truncated_thinking
        _row(tm, 4, (GOOD[0], "")),  # empty_answer
        _row(tm, 5, GOOD),  # a near-duplicate of r0's prompt (by validation's file)
        _row(tm, 6, french),  # language, only when `languages` excludes French
    ]
    cfg = TokenizeConfig.from_params({"min_loss_tokens": 1, "languages": ["en"]})
    assert cfg.drop_quality == QUALITY_FLAGS
    qf = quality_filter(cfg.drop_quality, cfg.quality_params(), {"r5": "r0"})
    out, _, stats = tokenize_table(_table(rows), _builder(qwen_tokenizer, min_loss_tokens=1), quality_filter=qf)
    assert out.column("id").to_pylist() == ["r0"]
    assert stats.dropped == {"quality:empty_answer": 1, "quality:language": 1, "quality:loop_reasoning": 1,
                             "quality:near_duplicate": 1, "quality:refusal": 1, "quality:truncated_thinking": 1}
    assert stats.dropped_by_thinking["quality:refusal"] == {"on": 1}
    # without `languages` the language flag never rises; a narrower drop_quality keeps the rest
    default = TokenizeConfig.from_params({"drop_quality": ["refusal", "language"]})
    qf = quality_filter(default.drop_quality, default.quality_params(), {"r5": "r0"})
    out, _, stats = tokenize_table(_table(rows), _builder(qwen_tokenizer, min_loss_tokens=1), quality_filter=qf)
    assert stats.dropped == {"quality:refusal": 1} and out.num_rows == 6
    assert quality_filter((), cfg.quality_params(), {}) is None


def test_a_flagged_conversation_counts_once_per_turn_it_would_have_trained(qwen_tokenizer: Path) -> None:
    """rows kept + rows dropped = the training rows the run would make, whatever drops them."""
    tm = SimTokenModel(str(qwen_tokenizer))
    messages = [{"role": "user", "content": "First?"}, {"role": "assistant", "content": "old"},
                {"role": "user", "content": "Second?"}]
    refusing = engine_row(tm, messages, [GOOD, (GOOD[0], "I'm sorry, but I can't help with that.")], thinking=True,
                          row_id="multi")
    rows = [refusing, _row(tm, 1, GOOD)]
    cfg = TokenizeConfig()
    qf = quality_filter(cfg.drop_quality, cfg.quality_params(), {})
    out, _, stats = tokenize_table(_table(rows), _builder(qwen_tokenizer), quality_filter=qf)
    assert stats.dropped == {"quality:refusal": 2} and out.num_rows == 1
    assert out.num_rows + sum(stats.dropped.values()) == 3


def test_min_loss_tokens_default_is_specforge_dflash_rule(qwen_tokenizer: Path) -> None:
    """SpecForge 0.2.0 (specforge/algorithms/model_providers.py dflash_min_loss_tokens) keeps rows with 2 loss
    tokens and a consecutive pair; so does the default here: a short thinking-off answer is kept."""
    assert TokenizeConfig().min_loss_tokens == TOKENIZE_PARAM_SCHEMAS["min_loss_tokens"]["default"] == 2
    assert TokenizeSettings(tokenizer="t").min_loss_tokens == 2
    tm = SimTokenModel(str(qwen_tokenizer))
    rows = [_row(tm, 0, (None, "Yes."), thinking=False), _row(tm, 1, (None, "Four."), thinking=False)]
    out, _, stats = tokenize_table(_table(rows), _builder(qwen_tokenizer, thinking=False))
    assert out.num_rows == 2 and not stats.dropped
    assert all(2 <= n < 8 for n in out.column("num_loss_tokens").to_pylist())


def test_gate_and_quality_params() -> None:
    assert QUALITY_FLAG_NAMES == QUALITY_FLAGS
    assert TokenizeConfig.from_params({"min_kept_share": 0.2}).min_kept_share == 0.2
    for params, match in (({"min_kept_share": 1.5}, "maximum"), ({"drop_quality": ["loops"]}, "loops"),
                          ({"refusal_patterns": ["(unclosed"]}, "not a valid regular expression")):
        with pytest.raises(ConfigError, match=match):
            TokenizeConfig.from_params(params)
    # settings pinned before quality filtering existed filtered nothing: a rerun must ask for that
    old = TokenizeSettings(tokenizer="t").to_dict()
    del old["drop_quality"], old["quality"]
    assert TokenizeSettings.from_dict(old).drop_quality == ()
    cfg = TokenizeConfig.from_params({"refusal_patterns": ["^nope"]})
    assert cfg.quality_params()["refusal_patterns"] == ["^nope"] and cfg.quality_params()["loop_ngram"] == 8
