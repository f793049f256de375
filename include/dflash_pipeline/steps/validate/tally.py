"""What validation counts: per-dataset, per-server and recount tallies (plain dataclasses).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.steps.validate.histogram import Histogram, Histogram2D

LIST_LIMIT = 50
"""Ids of missing/duplicate/unexpected rows kept in report.json (all of them go to side files)."""
SAMPLE_LIMIT = 10
"""Ids kept per row-level defect (markers, empty answers, token mismatches...)."""
MAX_FINISH_KEYS = 8


@dataclass
class ServerTally:
    rows: int = 0
    completions: int = 0
    errors: int = 0
    truncated: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    latency_sum: float = 0.0
    reasoning_missing: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "completions": self.completions,
            "errors": self.errors,
            "truncated": self.truncated,
            "reasoning_missing": self.reasoning_missing,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "mean_latency_s": round(self.latency_sum / self.completions, 3) if self.completions else None,
            "output_tokens_per_request_s": round(self.output_tokens / self.latency_sum, 1) if self.latency_sum > 0 else None,
        }


@dataclass
class RecountTally:
    """The training tokenizer's view of the completions (see tokencount.py)."""

    tokenizer: str = ""
    chat_template: str = ""
    rows: int = 0
    compared: int = 0
    output_tokens: int = 0
    output_tokens_server: int = 0
    reasoning_tokens: int = 0
    content_tokens: int = 0
    mismatches: int = 0
    max_abs_delta: int = 0
    mismatch_ids: list[str] = field(default_factory=list)
    training: Histogram = field(default_factory=Histogram)
    rows_encoded_alone: int = 0
    seconds: float = 0.0

    def _per_s(self, tokens: int) -> int | None:
        return round(tokens / self.seconds) if self.seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokenizer": self.tokenizer,
            "chat_template": self.chat_template,
            "rows": self.rows,
            "compared": self.compared,
            "output_tokens": self.output_tokens,
            "output_tokens_server": self.output_tokens_server,
            "reasoning_tokens": self.reasoning_tokens,
            "answer_tokens": self.content_tokens,
            "mismatches": self.mismatches,
            "mismatch_ids_sample": self.mismatch_ids,
            "max_abs_delta": self.max_abs_delta,
            "rule": "a row matches when 0 <= server completion_tokens - (tokens(reasoning) + tokens(answer)) "
            "<= tokens('<think>\\n') + tokens('\\n</think>\\n\\n') (rows with reasoning) + 1 (stop token)",
            "training_tokens": self.training.total,
            "training_tokens_stats": self.training.summary(),
            "rows_encoded_alone": self.rows_encoded_alone,
            # each conversation is encoded once: tokens encoded per second = training tokens per second
            "tokens_per_s": self._per_s(self.training.total),
            "output_tokens_per_s": self._per_s(self.output_tokens),
            "training_tokens_per_s": self._per_s(self.training.total),
        }


@dataclass
class Tally:
    prompts: int = 0
    completions: int = 0
    errors: int = 0
    retryable_errors: int = 0
    # Rows stored as completions whose finish_reason is not stop/length (an aborted request, by
    # code older than the chunk protocol): counted as retryable errors, never as training data.
    unfinished_as_completions: int = 0
    missing: int = 0
    duplicates: int = 0
    unexpected: int = 0
    truncated: int = 0
    truncated_in_thinking: int = 0
    truncated_in_answer: int = 0
    empty_content: int = 0
    empty_content_not_truncated: int = 0
    reasoning_missing: int = 0
    reasoning_unexpected: int = 0
    # Completions generated with thinking on (the row's `thinking`, else the run's flag): the
    # denominator of the missing-reasoning rate in a mixed run.
    completions_thinking: int = 0
    think_markers_in_content: int = 0
    think_markers_in_reasoning: int = 0
    reasoning_tokens_unreported: int = 0
    usage_missing: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    reasoning_tokens_reported: int = 0
    chunks: int = 0
    parts_present: int = 0
    stray_parts: list[str] = field(default_factory=list)
    stray_parts_count: int = 0
    missing_ids: list[str] = field(default_factory=list)
    duplicate_ids: list[str] = field(default_factory=list)
    unexpected_ids: list[str] = field(default_factory=list)
    defect_ids: dict[str, list[str]] = field(default_factory=dict)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    errors_by_class: Counter[str] = field(default_factory=Counter)
    per_server: dict[str, ServerTally] = field(default_factory=dict)
    prompt_hist: Histogram = field(default_factory=Histogram)
    output_hist: Histogram = field(default_factory=Histogram)
    reasoning_hist: Histogram = field(default_factory=Histogram)
    by_finish: dict[str, Histogram] = field(default_factory=dict)
    think_vs_answer: Histogram2D = field(default_factory=Histogram2D)
    think_vs_answer_unit: str = "tokens (server usage)"
    think_vs_answer_skipped: int = 0
    recount: RecountTally | None = None
    # Conversations (rows) and what their turns cost; a row without a `turns` column is one turn.
    turns_generated: int = 0
    multi_turn_rows: int = 0
    cut_short: Counter[str] = field(default_factory=Counter)
    cached_prompt_tokens: int = 0
    cached_tokens_reported: int = 0
    samples: Counter[int] = field(default_factory=Counter)
    # The engine's token ids (tokenization builds training rows from them where present).
    rows_with_engine_ids: int = 0
    rows_without_engine_ids: int = 0
    engine_ids_disagree: int = 0

    def sample(self, check: str, ids: Iterable[str]) -> None:
        kept = self.defect_ids.setdefault(check, [])
        for pid in ids:
            if len(kept) >= SAMPLE_LIMIT:
                return
            kept.append(pid)


