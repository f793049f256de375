"""DFlash-ready rows: cut at max_length as the trainers do, then keep only rows a DFlash trainer can train on.

Why: a row the trainer refuses or silently drops should be dropped here and counted by reason, so the
report's row count is what the drafter trains on. The rules, from the trainers' sources:

* longer than ``max_length``: **cut**, not dropped. SpecForge 0.2.0 cuts (specforge/data/prompt_builder.py
  ``_prompt_from_record``: ``input_ids[:max_length]``; its conversation parser encodes with
  ``truncation=True``) and so does speculators 0.9.0 (data_generation/preprocessing.py ``_append_row``). Cut
  here, the filters below judge the row the trainer will see, and the files hold exactly that row.
* no loss token left after the cut: dropped (speculators drops these as "unsupervised").
* fewer than ``min_loss_tokens`` loss tokens: dropped. SpecForge's offline preparation dropped rows with
  fewer than 2 x block_size (block_size 16: ``populate_dflash_generated_config``) until its commit
  7757409f (2026-07-30); SpecForge 0.2.0 asks only 2 (``dflash_min_loss_tokens``), and so does the default
  here: a higher floor drops short answers, which are mostly thinking-off ones, and skews the mix
  (measured in docs/quality.md, "Tokenize gates").
* no two consecutive loss tokens: dropped. DFlash anchors a block on a supervised token whose next token is
  supervised too; SpecForge raises on a batch without such a pair (``_sample_anchor_positions``) and filters
  pre-tokenized rows with ``has_consecutive_supervised_tokens`` (its DFlash ``loss_mask_filter``).

No packing: neither target trainer reads packed rows. SpecForge pads rows of a batch; speculators packs rows
itself at load time (MultipackDistributedBatchSamplerV2 + ``CollateFn``'s document_ids, position ids
``arange(seq_len)`` per row in ``BaseDataset.__getitem__``), so packed input would be packed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_pipeline.config import DFLASH_MIN_LOSS_TOKENS, TRAINER_PARAM_SCHEMAS

DFLASH_BLOCK_SIZE = 16
"""SpecForge 0.2.0's DFlash block size (specforge/algorithms/model_providers.py, generated draft configs)."""
DEFAULT_MIN_LOSS_TOKENS = DFLASH_MIN_LOSS_TOKENS
"""SpecForge 0.2.0's DFlash minimum, 2 (the `min_loss_tokens` param's default, in config/tokenize.py)."""
DEFAULT_MAX_LENGTH: int = TRAINER_PARAM_SCHEMAS["max_length"]["default"]
"""SpecForge's Qwen3.5/3.6 DFlash recipes (examples/configs/qwen3.6-27b-dflash-online.yaml,
qwen3.5-35b-a3b-dflash-online.yaml: data.max_length 4096)."""

DROP_NO_LOSS = "no_loss_tokens_within_max_length"
DROP_FEW_LOSS = "fewer_than_min_loss_tokens"
DROP_NO_PAIR = "no_two_consecutive_loss_tokens"
DROP_REASONS = (DROP_NO_LOSS, DROP_FEW_LOSS, DROP_NO_PAIR)


@dataclass
class FilterResult:
    """Rows kept (cut where needed), their indices in the input table, and drops counted by reason (a
    row counts once, under the first reason in DROP_REASONS that applies)."""

    table: pa.Table
    kept: np.ndarray
    dropped: dict[str, int] = field(default_factory=dict)
    cut: int = 0
    """Rows longer than max_length that were cut and kept."""
    dropped_rows: dict[str, np.ndarray] = field(default_factory=dict)
    """Per reason, the indices (in the input table) of the rows dropped for it."""

    def to_dict(self) -> dict[str, Any]:
        return {"rows_kept": int(len(self.kept)), "dropped": dict(self.dropped), "cut_to_max_length": self.cut}


def _flat(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column, as numpy, whatever its chunking and slicing."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    start = offsets[0]
    return offsets - start, values[start: offsets[-1]]


def dflash_ready(
    table: pa.Table,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    min_loss_tokens: int = DEFAULT_MIN_LOSS_TOKENS,
    require_consecutive: bool = True,
) -> FilterResult:
    """Cut rows to `max_length` (``truncated_to_max_length`` set, counts recomputed) and keep the rows with
    at least one loss token, `min_loss_tokens` of them, and (`require_consecutive`) two adjacent ones.

    `table` has the training-row columns (``input_ids``, ``loss_mask``, ``num_tokens``, ``num_loss_tokens``,
    ``truncated_to_max_length``); other columns (a ``conversation`` column, say) are carried along."""
    if max_length < 1 or min_loss_tokens < 0:
        raise ValueError(f"max_length must be >= 1 and min_loss_tokens >= 0, got {max_length}, {min_loss_tokens}")
    n = table.num_rows
    id_off, ids = _flat(table.column("input_ids"))
    m_off, mask = _flat(table.column("loss_mask"))
    lengths = np.diff(id_off)
    if not np.array_equal(lengths, np.diff(m_off)):
        bad = int(np.nonzero(lengths != np.diff(m_off))[0][0])
        raise ValueError(f"row {bad}: input_ids and loss_mask differ in length")
    new_len = np.minimum(lengths, max_length)
    row_of = np.repeat(np.arange(n), lengths)
    pos = np.arange(len(ids)) - np.repeat(id_off[:-1], lengths)
    inside = pos < np.repeat(new_len, lengths)
    m = (mask != 0) & inside
    loss = np.bincount(row_of[m], minlength=n)
    pair = np.zeros(n, dtype=np.int64)
    if len(m) > 1:
        both = m[:-1] & m[1:] & (row_of[:-1] == row_of[1:])
        pair = np.bincount(row_of[:-1][both], minlength=n)

    reason = np.full(n, -1)
    checks = [(DROP_NO_LOSS, loss == 0), (DROP_FEW_LOSS, loss < min_loss_tokens),
              (DROP_NO_PAIR, (pair == 0) if require_consecutive else np.zeros(n, dtype=bool))]
    for code, (_, failed) in enumerate(checks):
        reason[(reason == -1) & failed] = code
    dropped = {name: int(np.sum(reason == code)) for code, (name, _) in enumerate(checks) if np.any(reason == code)}
    dropped_rows = {name: np.nonzero(reason == code)[0] for code, (name, _) in enumerate(checks) if np.any(reason == code)}
    kept = np.nonzero(reason == -1)[0]
    cut_rows = lengths > max_length

    out = table
    if np.any(cut_rows):
        offsets = pa.array(np.concatenate([[0], np.cumsum(new_len)]).astype(np.int32))
        id_type = table.schema.field("input_ids").type
        mask_type = table.schema.field("loss_mask").type
        new_ids = pa.ListArray.from_arrays(offsets, pa.array(ids[inside], type=id_type.value_type), type=id_type)
        new_mask = pa.ListArray.from_arrays(offsets, pa.array(mask[inside], type=mask_type.value_type), type=mask_type)
        truncated = np.asarray(table.column("truncated_to_max_length").to_numpy(zero_copy_only=False), dtype=bool)
        replace = {
            "input_ids": new_ids, "loss_mask": new_mask,
            "num_tokens": pa.array(new_len.astype(np.int32), type=table.schema.field("num_tokens").type),
            "num_loss_tokens": pa.array(loss.astype(np.int32), type=table.schema.field("num_loss_tokens").type),
            "truncated_to_max_length": pa.array(truncated | cut_rows),
        }
        for name, arr in replace.items():
            out = out.set_column(out.schema.get_field_index(name), out.schema.field(name), arr)
    return FilterResult(table=out.take(pa.array(kept, type=pa.int64())), kept=kept, dropped=dropped,
                        cut=int(np.sum(cut_rows[kept])) if len(kept) else 0, dropped_rows=dropped_rows)
