"""Each quality signal on known rows: positives and the negatives that look like them (long math reasoning
that re-checks itself vs a loop, an answer that says "cannot" vs a refusal, ...), per turn of all_turns rows,
and the params that drive them."""

from __future__ import annotations

from typing import Any

import pytest
import quality_texts as qt

from dflash_pipeline.config import PARAM_SCHEMAS, SECTION_VALIDATION, ConfigError, RunConfig
from dflash_pipeline.config.quality import DEFAULT_REFUSAL_PATTERNS, QUALITY_PARAM_SCHEMAS, SECTION_QUALITY, QualitySettings
from dflash_pipeline.steps.quality import QUALITY_FLAGS, SIGNAL_COLUMNS, flags_of, row_signals
from dflash_pipeline.steps.quality.signals import identify_language, is_loop, is_refusal, loop_stretches

S = QualitySettings()


def row(reasoning: str = "Let me think about it.", content: str = "The answer is 4.", finish: str = "stop",
        **kw: Any) -> dict[str, Any]:
    return {"id": "r1", "reasoning": reasoning, "content": content, "finish_reason": finish, **kw}


# -- loops -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(qt.NOT_LOOPS))
def test_normal_reasoning_and_answers_are_not_loops(name: str) -> None:
    assert not is_loop(qt.NOT_LOOPS[name], S)


@pytest.mark.parametrize("name", sorted(qt.LOOPS))
def test_loops_are_found(name: str) -> None:
    assert is_loop(qt.LOOPS[name], S)


def test_loop_in_reasoning_and_in_answer_are_separate_signals() -> None:
    sig = row_signals(row(reasoning=qt.LOOP_THINKING, content="", finish="length"), S)
    assert sig["q_loop_reasoning"] and not sig["q_loop_answer"]
    sig = row_signals(row(reasoning=qt.MATH_THINKING, content=qt.LOOP_ANSWER), S)
    assert sig["q_loop_answer"] and not sig["q_loop_reasoning"]
    assert flags_of(sig, S) == ["loop_answer"]


def test_loop_thresholds_copies_and_span() -> None:
    block = qt.PROBABILITY_THINKING  # ~340 words
    twice = qt.MATH_THINKING[:500] + "\n\n" + block + "\n\n" + block  # a block written out again: 1 repeat
    assert not is_loop(twice, S)
    thrice = twice + "\n\n" + block  # 2 repeats
    assert not is_loop(thrice, S)
    assert is_loop(thrice + "\n\n" + block, S)  # 3 repeats: the default loop_min_repeats
    assert is_loop(thrice, QualitySettings(loop_min_repeats=2.0))
    short = "Intro. " + "Wait, x = 2. " * 10  # 10 copies but only 40 words: below loop_min_span_tokens
    assert not is_loop(short, S) and is_loop(short, QualitySettings(loop_min_span_tokens=30))
    span, repeats = max(loop_stretches(qt.LOOP_THINKING, 8, 2048))
    assert span > 1400 and 25 <= repeats <= 30


def test_loop_with_a_period_longer_than_max_period_is_not_seen() -> None:
    assert not is_loop(qt.LOOP_LONG_PERIOD, QualitySettings(loop_max_period=100))


# -- truncation and empty answers ----------------------------------------------------------------------------
def test_thinking_cut_at_max_tokens() -> None:
    cut = row_signals(row(reasoning=qt.MATH_THINKING[:3000], content="", finish="length"), S)
    assert cut["q_truncated_thinking"] and not cut["q_empty_answer"]
    assert flags_of(cut, S) == ["truncated_thinking"]
    # cut inside the answer: the thinking ended, the answer is partial (drop_truncated's business, not this flag)
    in_answer = row_signals(row(reasoning=qt.MATH_THINKING, content="The roots are x = (5 ± sqrt(", finish="length"), S)
    assert not in_answer["q_truncated_thinking"]
    # no reasoning parser on the server: the answer holds an unclosed <think>
    raw = row_signals(row(reasoning="", content="<think>\nOkay, let's see. " + qt.MATH_THINKING[:2000], finish="length"), S)
    assert raw["q_truncated_thinking"]
    closed = row_signals(row(reasoning="", content="<think>\nshort</think>\n\nThe answer is 4, because", finish="length"), S)
    assert not closed["q_truncated_thinking"]
    # thinking off, cut in the answer
    assert not row_signals(row(reasoning=None, content="Here is a long answer", finish="length"), S)["q_truncated_thinking"]


def test_empty_answer_only_when_the_model_finished() -> None:
    assert row_signals(row(content="  \n", finish="stop"), S)["q_empty_answer"]
    assert row_signals(row(content=None, finish="stop"), S)["q_empty_answer"]
    assert not row_signals(row(content="4", finish="stop"), S)["q_empty_answer"]
    assert not row_signals(row(content="", finish="length"), S)["q_empty_answer"]


# -- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("answer", qt.REFUSALS)
def test_refusals_are_found(answer: str) -> None:
    assert is_refusal(answer, S)
    assert flags_of(row_signals(row(content=answer), S), S) == ["refusal"]


@pytest.mark.parametrize("answer", [qt.ANSWER_SAYING_CANNOT, qt.NOT_A_REFUSAL_MIDWAY, qt.ENGLISH_ANSWER, qt.CODE_ANSWER,
                                    qt.CHINESE_ANSWER, "I can't stress this enough: check the units first."])
def test_answers_that_say_cannot_are_not_refusals(answer: str) -> None:
    assert not is_refusal(answer, S)


def test_refusal_patterns_are_configurable_and_searched_in_the_head_only() -> None:
    custom = QualitySettings.from_params({"refusal_patterns": [r"^as a large language model"]})
    assert is_refusal("As a large language model, I prefer not to.", custom)
    assert not is_refusal(qt.REFUSALS[0], custom)
    assert not is_refusal(qt.REFUSALS[0], QualitySettings.from_params({"refusal_patterns": []}))
    late = "x" * 500 + "\nI'm sorry, but I can't help with that."
    assert not is_refusal(late, S) and is_refusal(late, QualitySettings(refusal_scan_chars=1000))


def test_a_bad_refusal_regex_is_refused_before_the_run() -> None:
    with pytest.raises(ConfigError, match="refusal_patterns.*not a valid regular expression"):
        QualitySettings.from_params({"refusal_patterns": ["(unclosed"]})
    base = {"prompts_uri": "s3://bkt/p.jsonl", "output_uri": "s3://bkt/out", "servers": ["http://h:1"]}
    with pytest.raises(ConfigError, match="refusal_patterns"):
        RunConfig.from_params({**base, "refusal_patterns": ["(unclosed"]})
    RunConfig.from_params({**base, "refusal_patterns": ["^nope"], "languages": ["en"]})


# -- language ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("answer", "lang"), [(qt.ENGLISH_ANSWER, "en"), (qt.CODE_ANSWER, "en"), (qt.FRENCH_ANSWER, "fr"),
                                              (qt.GERMAN_ANSWER, "de"), (qt.CHINESE_ANSWER, "zh")])
def test_language_of_the_answer(answer: str, lang: str) -> None:
    got, score = identify_language(answer, S)
    assert got == lang and score is not None and score >= S.language_min_score


@pytest.mark.parametrize("answer", ["42", "x = 4", "The answer is 4.", "$$x^2 + 1$$", qt.TABLE_ANSWER, qt.MATRIX_ANSWER])
def test_short_answers_formulas_and_tables_have_no_language(answer: str) -> None:
    assert identify_language(answer, S)[0] is None


def test_language_flag_only_against_the_allowed_list() -> None:
    fr = row_signals(row(content=qt.FRENCH_ANSWER), S)
    assert fr["language"] == "fr" and 0.8 < fr["language_score"] <= 1.0
    assert "language" not in flags_of(fr, S)  # languages null: recorded, never flagged
    assert flags_of(fr, QualitySettings(languages=("en",))) == ["language"]
    assert flags_of(fr, QualitySettings(languages=("en", "fr"))) == []
    undetermined = row_signals(row(content="42"), S)
    assert undetermined["language"] is None and flags_of(undetermined, QualitySettings(languages=("en",))) == []


# -- all_turns rows: each regenerated turn, never a copied one --------------------------------------------
def _conversation_row(turn1: dict[str, str], turn2: dict[str, str], turns: int = 2, finishes: tuple[str, ...] = ("stop", "stop"),
                      copied: str = "Sure.") -> dict[str, Any]:
    conv = [{"role": "user", "content": "q0", "reasoning": None},
            {"role": "assistant", "content": copied, "reasoning": None},  # the input's answer (copied when turns < 3)
            {"role": "user", "content": "q1", "reasoning": None},
            {"role": "assistant", **turn1},
            {"role": "user", "content": "q2", "reasoning": None},
            {"role": "assistant", **turn2}]
    last = conv[-1]
    return {"id": "c1", "conversation": conv, "turns": [{"finish_reason": f} for f in finishes[-turns:]],
            "reasoning": last.get("reasoning"), "content": last.get("content"), "finish_reason": finishes[-1]}


def test_all_turns_row_is_flagged_when_any_turn_is() -> None:
    good = {"reasoning": qt.PROBABILITY_THINKING, "content": qt.ENGLISH_ANSWER}
    looping = {"reasoning": qt.LOOP_THINKING, "content": "So x = 2."}
    r = _conversation_row(looping, good)
    assert row_signals(r, S)["q_loop_reasoning"]  # the first regenerated turn loops; the last is fine
    assert not row_signals({**r, "conversation": None, "turns": None}, S)["q_loop_reasoning"]  # last turn alone
    refusing = {"reasoning": "The user asks for malware.", "content": qt.REFUSALS[0]}
    assert row_signals(_conversation_row(refusing, good), S)["q_refusal"]
    assert row_signals(_conversation_row(good, {"reasoning": qt.MATH_THINKING[:900], "content": ""},
                                         finishes=("stop", "length")), S)["q_truncated_thinking"]
    # an assistant turn copied from the input (not regenerated) is never checked
    assert not row_signals(_conversation_row(good, good, copied=qt.REFUSALS[0]), S)["q_refusal"]
    three = _conversation_row(good, good, turns=3, finishes=("stop", "stop", "stop"), copied=qt.REFUSALS[0])
    assert row_signals(three, S)["q_refusal"]


# -- the interface ---------------------------------------------------------------------------------------------
def test_signal_columns_and_flag_names() -> None:
    sig = row_signals(row(), S)
    assert tuple(sig) == SIGNAL_COLUMNS
    assert QUALITY_FLAGS == ("loop_reasoning", "loop_answer", "truncated_thinking", "empty_answer", "refusal",
                             "near_duplicate", "language")
    everything = {"q_loop_reasoning": True, "q_loop_answer": True, "q_truncated_thinking": True, "q_empty_answer": True,
                  "q_refusal": True, "duplicate_of": "x", "language": "de"}
    assert flags_of(everything, QualitySettings(languages=("en",))) == list(QUALITY_FLAGS)
    assert flags_of({**everything, "duplicate_of": None}, S) == list(QUALITY_FLAGS[:5])


def test_params_are_in_the_generate_form_with_bounds_and_descriptions() -> None:
    assert SECTION_QUALITY == SECTION_VALIDATION
    for name, schema in QUALITY_PARAM_SCHEMAS.items():
        assert PARAM_SCHEMAS[name] is schema
        assert schema["description"] and "default" in schema and schema["section"] == SECTION_VALIDATION
    assert QUALITY_PARAM_SCHEMAS["refusal_patterns"]["default"] == list(DEFAULT_REFUSAL_PATTERNS)
    assert QUALITY_PARAM_SCHEMAS["languages"]["default"] is None
    s = QualitySettings.from_params({"languages": ["en", "zh"], "loop_ngram": 6, "prompts_uri": "ignored"})
    assert s.languages == ("en", "zh") and s.loop_ngram == 6
    assert QualitySettings.from_params({}) == QualitySettings()
    with pytest.raises(ConfigError, match="loop_ngram"):
        QualitySettings.from_params({"loop_ngram": 1})
    with pytest.raises(ConfigError, match="near_duplicate_threshold"):
        QualitySettings.from_params({"near_duplicate_threshold": 0.2})


def test_part_wise_signals_equal_the_row_wise_ones() -> None:
    """Issue 40: loop_flags (one vectorised pass over a part's texts) gives exactly is_loop's values, and
    part_row_signals row_signals', on every test text and on thinking-length rows."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from quality_bench import make_rows

    from dflash_pipeline.steps.quality import signals as sg

    s = QualitySettings()
    texts = [v for k, v in vars(qt).items() if isinstance(v, str) and not k.startswith("_")]
    texts += [x for v in vars(qt).values() if isinstance(v, (list, tuple)) for x in v if isinstance(x, str)]
    rows = make_rows(60, 3)
    texts += [r["reasoning"] for r in rows] + [r["content"] for r in rows]
    texts += ["", "a", "  leading  and trailing  ", "3" * 5000, "word " * 300, "x" * 13 + " y" * 200]
    import pyarrow as pa

    assert sg.loop_flags(texts, s).tolist() == [sg.is_loop(t, s) for t in texts]
    assert sg.loop_flags(pa.array(texts + [None]), s).tolist() == [sg.is_loop(t, s) for t in texts] + [False]
    assert sum(sg.is_loop(t, s) for t in texts) >= 10
    assert sg.part_row_signals(rows, s) == [sg.row_signals(r, s) for r in rows]
    columns = {"reasoning": pa.array([r["reasoning"] for r in rows]), "content": pa.array([r["content"] for r in rows])}
    assert sg.part_row_signals(rows, s, columns) == [sg.row_signals(r, s) for r in rows]
