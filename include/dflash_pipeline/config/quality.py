"""The quality signals' params (issue 32): JSON schemas merged into dflash_generate's params (validation
counts the signals) and dflash_tokenize's (the tokenize gate drops flagged rows), and QualitySettings.

This module imports nothing from config/run.py at load time: run.py merges QUALITY_PARAM_SCHEMAS into
its PARAM_SCHEMAS, so either module can be imported first. docs/quality.md explains every default and
the measurements behind them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.config.schema import ConfigError, check_schema as _check_schema

SECTION_QUALITY = "Validation"
"""The form section of these params (config.run.SECTION_VALIDATION; a test keeps them equal)."""

_A = "['’]"  # a straight or a typographic apostrophe
DEFAULT_REFUSAL_PATTERNS: tuple[str, ...] = (
    # Searched (Python `re`, case-insensitive, `^` at any line start) in the first refusal_scan_chars of
    # each answer: a refusal says so up front, while an answer may say "x cannot be negative" anywhere.
    rf"^\W*(?:I{_A}?m|I am) (?:so |very |really |truly )?sorry,? (?:but )?(?:I|we) (?:can(?:no|{_A})t|won{_A}?t|am unable|{_A}m unable|am not able|{_A}m not able|will not|must decline)",
    rf"^\W*(?:I{_A}?m|I am) (?:afraid|unable|not able) (?:I )?(?:can(?:no|{_A})t |to )?(?:help|assist|provide|comply|fulfil|do that|create|generate|write|answer|support|engage)",
    rf"^\W*(?:Sorry|Unfortunately|I apologi[sz]e),? (?:but )?(?:I|we) (?:can(?:no|{_A})t|won{_A}?t|am unable|{_A}m unable|am not able|will not)",
    rf"^\W*I (?:can(?:no|{_A})t|won{_A}?t|will not|must decline to|am not able to|{_A}m not able to|am unable to|{_A}m unable to) "
    r"(?:help|assist|provide|comply|fulfil|do that|do this|create|generate|write|answer|support|engage|share|give|produce|continue|participate)",
    rf"\bas an AI(?: language model| assistant)?,? I (?:can(?:no|{_A})t|don{_A}?t|do not|am not able|am unable|won{_A}?t)",
    r"\b(?:against|violates?|violating) my (?:guidelines|policies|programming|principles)\b",
    r"^\W*(?:抱歉|对不起|很抱歉|非常抱歉)[，,]?\s*(?:我|但我)?(?:不能|无法|不可以|没法)",
    r"^\W*我(?:不能|无法|不可以)(?:帮助|协助|提供|回答|满足|参与|生成)",
)

QUALITY_PARAM_SCHEMAS: dict[str, dict[str, Any]] = {
    "quality_signals": {
        "type": "boolean",
        "default": True,
        "description": "Compute the quality signals (repetition loops, thinking cut at max_tokens, empty answers, "
        "refusals, language, near-duplicate prompts) as parts are committed, show them live on the progress page "
        "and count them in the report. They fail nothing unless max_loop_rate is set; tokenize's drop_quality "
        "decides what is dropped. False skips them (their cost per part is in docs/quality.md).",
        "section": SECTION_QUALITY,
    },
    "quality_workers": {
        "type": "integer",
        "default": 1,
        "minimum": 0,
        "maximum": 64,
        "description": "No longer used (kept so that older confs still trigger): each part's signals are computed "
        "as it is committed, by the generate task, and validation merges them; the work validation still has is "
        "spread over validation_workers mapped tasks (docs/quality.md).",
        "section": SECTION_QUALITY,
    },
    "loop_ngram": {
        "type": "integer",
        "default": 8,
        "minimum": 3,
        "maximum": 64,
        "description": "Repetition loops: a text is cut into word/punctuation tokens (each CJK character a token); "
        "a position repeats when its n-gram of this many tokens occurred earlier within loop_max_period tokens.",
        "section": SECTION_QUALITY,
    },
    "loop_min_span_tokens": {
        "type": "integer",
        "default": 120,
        "minimum": 16,
        "maximum": 100000,
        "description": "A loop is an unbroken stretch of repeating n-grams at least this many tokens long that "
        "also holds at least loop_min_repeats copies of its period: normal reasoning re-states an equation or a "
        "line, a loop goes round until max_tokens.",
        "section": SECTION_QUALITY,
    },
    "loop_min_repeats": {
        "type": "number",
        "default": 3.0,
        "minimum": 1.0,
        "maximum": 1000,
        "description": "Copies of the repeating unit, beyond the first, that a stretch must hold to be a loop "
        "(3: the unit occurs 4 times in a row). A code block written out twice is not a loop.",
        "section": SECTION_QUALITY,
    },
    "loop_max_period": {
        "type": "integer",
        "default": 2048,
        "minimum": 1,
        "maximum": 100000,
        "description": "Longest repeating unit (tokens) a loop may have; an n-gram seen further back is not a repeat.",
        "section": SECTION_QUALITY,
    },
    "refusal_patterns": {
        "type": "array",
        "items": {"type": "string", "minLength": 1, "maxLength": 1000},
        "maxItems": 200,
        "default": list(DEFAULT_REFUSAL_PATTERNS),
        "description": "Refusals: Python regular expressions (case-insensitive, '^' matches at each line start) "
        "searched in the first refusal_scan_chars of each answer; a match flags the row. The default list catches "
        "English and Chinese refusals ('I'm sorry, but I can't help with that', 'As an AI I cannot', '抱歉，我无法') "
        "and not an answer that says 'x cannot be negative'. [] = no refusal flag.",
        "section": SECTION_QUALITY,
    },
    "refusal_scan_chars": {
        "type": "integer",
        "default": 400,
        "minimum": 1,
        "maximum": 1000000,
        "description": "How much of the start of each answer the refusal patterns are searched in (characters).",
        "section": SECTION_QUALITY,
    },
    "languages": {
        "type": ["null", "array"],
        "items": {"type": "string", "pattern": "^[a-z]{2,3}$"},
        "default": None,
        "description": "Allowed answer languages (ISO 639-1 codes as py3langid names them: en, zh, fr, ...). A "
        "completion whose answer is identified (py3langid) with at least language_min_score as another language "
        "is flagged 'language'. Null = the language is recorded and counted, never flagged.",
        "section": SECTION_QUALITY,
    },
    "language_min_score": {
        "type": "number",
        "default": 0.8,
        "minimum": 0,
        "maximum": 1,
        "description": "py3langid's normalised probability below which an answer's language counts as undetermined "
        "(recorded, never flagged).",
        "section": SECTION_QUALITY,
    },
    "language_min_chars": {
        "type": "integer",
        "default": 24,
        "minimum": 1,
        "maximum": 100000,
        "description": "Answers with fewer letters than this (after code blocks and LaTeX are taken out) have no "
        "language: '42' or a bare formula says nothing about it.",
        "section": SECTION_QUALITY,
    },
    "near_duplicate_threshold": {
        "type": "number",
        "default": 0.9,
        "minimum": 0.5,
        "maximum": 1,
        "description": "Near-duplicate prompts: MinHash (datasketch) estimated Jaccard similarity of the prompts' "
        "word 3-gram sets at or above which a later prompt (by id) is a duplicate of an earlier kept one.",
        "section": SECTION_QUALITY,
    },
    "near_duplicate_num_perm": {
        "type": "integer",
        "default": 128,
        "minimum": 16,
        "maximum": 512,
        "description": "MinHash permutations: more is a finer similarity estimate and more time and memory "
        "(measured per 100k prompts in docs/quality.md).",
        "section": SECTION_QUALITY,
    },
}


@dataclass(frozen=True)
class QualitySettings:
    """The quality params, checked, with the refusal patterns compiled once."""

    enabled: bool = True
    workers: int = 1
    loop_ngram: int = 8
    loop_min_span_tokens: int = 120
    loop_min_repeats: float = 3.0
    loop_max_period: int = 2048
    refusal_patterns: tuple[str, ...] = DEFAULT_REFUSAL_PATTERNS
    refusal_scan_chars: int = 400
    languages: tuple[str, ...] | None = None
    language_min_score: float = 0.8
    language_min_chars: int = 24
    near_duplicate_threshold: float = 0.9
    near_duplicate_num_perm: int = 128
    refusal_regexes: tuple[re.Pattern[str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.refusal_regexes and self.refusal_patterns:
            object.__setattr__(self, "refusal_regexes", compile_patterns(self.refusal_patterns))

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "QualitySettings":
        """The quality keys of a DAG's params (other keys are ignored); bad values raise ConfigError."""
        got = {k: params[k] for k in QUALITY_PARAM_SCHEMAS if k in params}
        for name, value in got.items():
            _check_schema(name, value, QUALITY_PARAM_SCHEMAS[name])
        values = {k: got.get(k, s.get("default")) for k, s in QUALITY_PARAM_SCHEMAS.items()}
        langs = values["languages"]
        return cls(
            enabled=bool(values["quality_signals"]),
            workers=int(values["quality_workers"]),
            loop_ngram=int(values["loop_ngram"]),
            loop_min_span_tokens=int(values["loop_min_span_tokens"]),
            loop_min_repeats=float(values["loop_min_repeats"]),
            loop_max_period=int(values["loop_max_period"]),
            refusal_patterns=tuple(values["refusal_patterns"]),
            refusal_scan_chars=int(values["refusal_scan_chars"]),
            languages=None if langs is None else tuple(str(x) for x in langs),
            language_min_score=float(values["language_min_score"]),
            language_min_chars=int(values["language_min_chars"]),
            near_duplicate_threshold=float(values["near_duplicate_threshold"]),
            near_duplicate_num_perm=int(values["near_duplicate_num_perm"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """As the report records them (the params' names)."""
        return {
            "quality_signals": self.enabled, "quality_workers": self.workers, "loop_ngram": self.loop_ngram,
            "loop_min_span_tokens": self.loop_min_span_tokens, "loop_min_repeats": self.loop_min_repeats,
            "loop_max_period": self.loop_max_period, "refusal_patterns": list(self.refusal_patterns),
            "refusal_scan_chars": self.refusal_scan_chars,
            "languages": None if self.languages is None else list(self.languages),
            "language_min_score": self.language_min_score, "language_min_chars": self.language_min_chars,
            "near_duplicate_threshold": self.near_duplicate_threshold,
            "near_duplicate_num_perm": self.near_duplicate_num_perm,
        }


def compile_patterns(patterns: tuple[str, ...] | list[str]) -> tuple[re.Pattern[str], ...]:
    """The refusal patterns compiled; a pattern that is not a valid regex is refused with its error."""
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p, re.IGNORECASE | re.MULTILINE))
        except re.error as exc:
            raise ConfigError(f"param refusal_patterns: {p!r} is not a valid regular expression: {exc}") from exc
    return tuple(out)
