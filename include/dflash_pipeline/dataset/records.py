"""The Parquet schemas of chunk inputs and completion parts, and their (de)serialisation.

One schema, written by the generate task and read by validation and by tokenization downstream.
A part holds exactly the rows of one planned chunk: one row per prompt, either a completion
(`error_class` null) or a request that failed for good (`error_class` set).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
# A turn of a conversation as a trainer reads it: the assistant's reasoning kept apart.
CONV_MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning", pa.string())])
# What one regenerated assistant turn cost (all_turns mode has several per row).
TURN_TYPE = pa.struct(
    [
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("reasoning_tokens", pa.int64()),
        ("cached_tokens", pa.int64()),
        ("latency_s", pa.float64()),
        # The turn's speculative decoding, null when its server does not speculate or does not say
        # (serving/specstats.py defines them; serving/specwire.py reads them from each engine).
        ("spec_verify_steps", pa.int64()),
        ("spec_accepted_tokens", pa.int64()),
        ("spec_draft_tokens", pa.int64()),
        ("spec_accept_histogram", pa.list_(pa.int64())),
    ]
)

TOKEN_IDS_TYPE = pa.list_(pa.int32())

# The input row's labels, carried from the prompt file through the chunk inputs to the completion rows
# and the training rows: `source`, `domain` (strings or null) and `metadata` (the row's metadata object
# JSON-encoded with sorted keys, null if none). Completion rows add `thinking`: the thinking mode the row
# was generated with.
ROW_LABEL_FIELDS = [("source", pa.string()), ("domain", pa.string()), ("metadata", pa.string())]
ROW_LABEL_COLUMNS = tuple(name for name, _ in ROW_LABEL_FIELDS)
THINKING_FIELD = ("thinking", pa.bool_())
# The sampling fields a completion row's request carried (config/sampling.py sampling_json: JSON, sorted
# keys: max_tokens, temperature, top_p, seed when set, and any extra); null on error rows.
SAMPLING_FIELD = ("sampling", pa.string())
# A planned row's mix, decided at plan (config/sampling.py): its thinking mode (null: the run's
# enable_thinking) and its input row's sampling overrides (JSON object, null: none).
INPUT_MIX_FIELDS = [THINKING_FIELD, ("sampling_override", pa.string())]
INPUT_MIX_COLUMNS = tuple(name for name, _ in INPUT_MIX_FIELDS)

INPUT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("prompt_chars", pa.int64()),
        # One planned row per (id, sample): plan expands samples_per_prompt into units.
        ("sample", pa.int32()),
        ("original_messages", pa.list_(CONV_MESSAGE_TYPE)),
        *ROW_LABEL_FIELDS,
        *INPUT_MIX_FIELDS,
    ]
)

PART_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("reasoning", pa.string()),
        ("content", pa.string()),
        ("finish_reason", pa.string()),
        ("matched_stop", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("reasoning_tokens", pa.int64()),
        ("model", pa.string()),
        ("server", pa.string()),
        ("attempts", pa.int32()),
        ("latency_s", pa.float64()),
        ("error_class", pa.string()),
        ("error_message", pa.string()),
        ("retryable", pa.bool_()),
        ("chunk", pa.int32()),
        ("run_id", pa.string()),
        ("sample", pa.int32()),
        ("conversation", pa.list_(CONV_MESSAGE_TYPE)),
        ("original_messages", pa.list_(CONV_MESSAGE_TYPE)),
        ("turns", pa.list_(TURN_TYPE)),
        ("cut_short", pa.string()),
        ("cached_tokens", pa.int64()),
        # The token ids the engine used, one list per regenerated turn (aligned with `turns`); a
        # turn's entry is null when its engine did not return ids (then tokenization re-encodes the
        # text and checks it against `turns`' token counts). Training rows are built from these.
        ("prompt_token_ids", pa.list_(TOKEN_IDS_TYPE)),
        ("output_token_ids", pa.list_(TOKEN_IDS_TYPE)),
        # Speculative decoding summed over the row's turns (null as for a turn) and its acceptance
        # length, 1 + accepted / verify steps (serving/specstats.py).
        ("spec_verify_steps", pa.int64()),
        ("spec_accepted_tokens", pa.int64()),
        ("spec_draft_tokens", pa.int64()),
        ("spec_accept_histogram", pa.list_(pa.int64())),
        ("acceptance_length", pa.float64()),
        *ROW_LABEL_FIELDS,
        THINKING_FIELD,
        SAMPLING_FIELD,
    ]
)

TOKEN_ID_COLUMNS = ("prompt_token_ids", "output_token_ids")

PART_COLUMNS = tuple(PART_SCHEMA.names)


def _to_parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def encode_metadata(value: Any) -> str | None:
    """A row's metadata as its column holds it: a JSON object with sorted keys (values JSON cannot hold,
    e.g. a Parquet timestamp, as their text), or null. An already encoded string passes through."""
    if value is None or isinstance(value, str):
        return value or None
    if not isinstance(value, dict):
        raise TypeError(f"metadata must be a dict, got {type(value).__name__}")
    if not value:
        return None
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def decode_metadata(value: str | None) -> dict[str, Any] | None:
    """The metadata column back as a dict (null: None)."""
    return None if not value else json.loads(value)


def row_labels(row: dict[str, Any]) -> dict[str, Any]:
    """The labels a planned row passes on to its completion or error row (`thinking` only when the
    planned row says, else the generate step fills in the mode it sent)."""
    out = {"source": row.get("source"), "domain": row.get("domain"), "metadata": encode_metadata(row.get("metadata"))}
    if row.get("thinking") is not None:
        out["thinking"] = bool(row["thinking"])
    return out


def encode_inputs(rows: Sequence[dict[str, Any]]) -> bytes:
    table = pa.Table.from_pylist(
        [
            {
                "id": r["id"],
                "messages": r["messages"],
                "prompt_chars": sum(len(m["content"]) for m in r["messages"]),
                "sample": int(r.get("sample") or 0),
                "original_messages": r.get("original_messages"),
                **{k: v for k, v in row_labels(r).items() if k in ROW_LABEL_COLUMNS},
                "thinking": r.get("thinking"),
                "sampling_override": encode_metadata(r.get("sampling_override")),
            }
            for r in rows
        ],
        schema=INPUT_SCHEMA,
    )
    return _to_parquet(table)


def read_parquet(data: bytes, columns: Sequence[str] | None = None) -> pa.Table:
    """One in-memory Parquet file (`ParquetFile`: `read_table` goes through pyarrow.dataset)."""
    return pq.ParquetFile(io.BytesIO(data)).read(columns=list(columns) if columns else None)


def warm_up() -> None:
    """Pay pyarrow's first-use costs now: its first conversion from Python imports pandas
    (0.2-0.3 s measured here). In a generate task that would otherwise stall the first claim
    and the first commit while the server's slots wait."""
    decode_part(encode_part([{"id": ""}]))
    decode_inputs(encode_inputs([{"id": "", "messages": [{"role": "user", "content": ""}]}]))


def decode_inputs(data: bytes) -> list[dict[str, Any]]:
    """The units of one chunk; inputs planned before samples existed read as sample 0."""
    pf = pq.ParquetFile(io.BytesIO(data))
    names = set(pf.schema_arrow.names)
    columns = [c for c in ("id", "messages", "sample", "original_messages", *ROW_LABEL_COLUMNS, *INPUT_MIX_COLUMNS)
               if c in names]
    rows = pf.read(columns=columns).to_pylist()
    for r in rows:
        r["sample"] = int(r.get("sample") or 0)
        if r.get("sampling_override") is not None:
            r["sampling_override"] = json.loads(r["sampling_override"])
        r.setdefault("original_messages", None)  # labels absent from older inputs stay absent (read as None)
    return rows


def unit_key(row: dict[str, Any]) -> str:
    """The key of one planned row: the id, with the sample index when it is not 0.

    Sample 0's key is the bare id, so datasets planned before samples existed keep their keys."""
    sample = int(row.get("sample") or 0)
    return row["id"] if sample == 0 else f"{row['id']}#sample={sample}"


def unit_keys(ids: Sequence[str], samples: Sequence[int | None] | None) -> list[str]:
    """`unit_key` over columns (samples None: a part or input without a sample column)."""
    if samples is None:
        return list(ids)
    return [i if not s else f"{i}#sample={s}" for i, s in zip(ids, samples)]


def encode_part(rows: Iterable[dict[str, Any]]) -> bytes:
    """Rows as dicts with PART_COLUMNS keys (missing keys become null)."""
    table = pa.Table.from_pylist([{c: r.get(c) for c in PART_COLUMNS} for r in rows], schema=PART_SCHEMA)
    return _to_parquet(table)


def decode_part(data: bytes, columns: Sequence[str] | None = None) -> pa.Table:
    return read_parquet(data, columns)
