"""Tokenize's quality filter: completion rows carrying a flag of `drop_quality` never become training rows.

Why: a drafter learns a repetition loop, thinking cut at max_tokens, an empty answer or a refusal as
readily as a good answer, and a near-duplicate prompt weighs its answer twice. Validation counts these
signals (steps/quality, helper of issue 32); tokenize drops the flagged rows, by default every flag
(`language` rises only when a `languages` list is given, so it is a no-op until then), and counts each
dropped row once under ``quality:<flag>`` (the first of its flags that `drop_quality` names, in
QUALITY_FLAGS order), by thinking mode and domain like every other drop (gates.py).

The signals are computed here with the pinned quality params (`row_signals`: the same function and
defaults validation uses) unless the row already carries them (a part with the SIGNAL_COLUMNS);
near-duplicates come from validation's ``quality/near_duplicates.parquet`` (`load_near_duplicates`).
The whole completion row goes: a conversation with one looping turn is not trained on at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from dflash_pipeline.config.quality import QualitySettings
from dflash_pipeline.steps.quality.signals import QUALITY_FLAGS, SIGNAL_COLUMNS, flags_of, row_signals
from dflash_pipeline.steps.tokenize.exact import RowFilter
from dflash_pipeline.steps.tokenize.gates import QUALITY_PREFIX

NEAR_DUPLICATE = "near_duplicate"


def quality_filter(drop_quality: Sequence[str], params: Mapping[str, Any],
                   duplicates: Mapping[str, str]) -> RowFilter | None:
    """The row filter for `drop_quality` (None when it is empty). `params`: the pinned quality params;
    `duplicates`: id -> duplicate_of."""
    wanted = [f for f in QUALITY_FLAGS if f in set(drop_quality)]
    if not wanted:
        return None
    settings = QualitySettings.from_params(params)
    if "language" not in wanted or settings.languages is None:
        # The language signal decides nothing here: identify no language (a text shorter than
        # language_min_chars has none), which saves py3langid's time, about 40% of the signals' cost.
        settings = dataclasses.replace(settings, language_min_chars=1 << 62)
    need_signals = any(f != NEAR_DUPLICATE and (f != "language" or settings.languages is not None) for f in wanted)

    def refuse(row: Mapping[str, Any]) -> str | None:
        if all(c in row and row[c] is not None for c in SIGNAL_COLUMNS[:5]):
            signals: dict[str, Any] = {c: row.get(c) for c in SIGNAL_COLUMNS}
        else:
            signals = row_signals(row, settings) if need_signals else {}
        dup = duplicates.get(row.get("id"))  # type: ignore[arg-type]
        if dup:
            signals["duplicate_of"] = dup
        flags = flags_of(signals, settings)
        hit = next((f for f in wanted if f in flags), None)
        return None if hit is None else QUALITY_PREFIX + hit

    return refuse
