"""Output profiles: the training rows of one completions part as the files each trainer reads as they are.

Why: SpecForge, vLLM speculators and Hugging Face `datasets` each read one on-disk format; a user should
point the trainer at our files, not write a converter. Every function here is pure: (training-row table,
conversations) → {key relative to the dataset root: bytes}, the same bytes for the same rows, so the
tokenize step writes each file exactly once with If-None-Match and a retry rewrites identical bytes.

Profiles and what reads them (checked against the installed packages, see docs/trainers.md):

* ``parquet``: ``tokenized/parquet/part-NNNNNN.parquet``, every column of the training rows, with the
  Hugging Face features in the schema metadata: ``datasets.load_dataset("parquet", data_files=...)`` or the
  dataset card's ``parquet`` config restores them.
* ``specforge``: two files per part.
  ``tokenized/specforge/part-NNNNNN.jsonl``: ``{"id", "input_ids", "loss_mask"}`` per row, SpecForge 0.2.0's
  pre-tokenized path (``data.prompts_path``; specforge/data/prompt_builder.py ``prepare_prompt_tasks`` takes
  a file whose first record has ``input_ids`` and ``loss_mask`` as pre-tokenized, cuts at ``max_length`` and
  keeps rows with ``min_loss_tokens`` and the algorithm's loss-mask filter).
  ``tokenized/specforge-conversations/part-NNNNNN.jsonl``: one generation event per training row in the shape
  SpecForge's ``scripts/expand_reasoning_conversations.py`` writes (``id``, ``source_id``,
  ``assistant_turn_index``, ``status: success``, ``conversations``: the history as the request carried it,
  earlier answers without reasoning, then the trained turn with its ``reasoning_content``), for
  ``data.train_data_path`` with ``data.train_only_last_turn: true``. Rows SpecForge cannot re-render as
  generated are left out and counted by reason (`ConversationStats`).
* ``speculators``: ``tokenized/speculators/part-NNNNNN.jsonl``: speculator-format rows (``id``,
  ``primary_id``, ``input_ids``, ``loss_mask``, ``metadata``) as its ``regenerate-responses`` writes them;
  ``speculators prepare-data --data tokenized/speculators/`` passes them through (its
  ``_passthrough_pretokenized``: cut at ``--seq-length``, drop rows without supervised tokens).

Nothing is re-tokenized here: the token files carry the training rows' ids and masks unchanged.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.config import TOKENIZE_PROFILES, ConfigError
from dflash_pipeline.dataset.layout import CHUNK_DIGITS
from dflash_pipeline.dataset.records import unit_key
from dflash_pipeline.steps.tokenize.exact import TOKENIZED_SCHEMA
from dflash_pipeline.steps.tokenize.rowlabels import LABEL_FIELDS, ensure_label_columns, jsonl_labels

PROFILES = TOKENIZE_PROFILES

TRAINING_ROW_SCHEMA = pa.schema([*TOKENIZED_SCHEMA, *LABEL_FIELDS])
"""The training rows the tokenizer produces per completions part (one row per trained assistant turn;
exact.py says what each column is), with the input row's labels (rowlabels.py: source, domain, metadata,
thinking, sampling)."""

_HF_DTYPES = {"bool": "bool", "double": "float64"}  # pyarrow's names where `datasets` spells them differently

# Hugging Face `datasets` features of TRAINING_ROW_SCHEMA, in the form datasets 5.x writes
# (`Features.to_dict()`); the Parquet profile's schema metadata and the dataset card declare them.
HF_FEATURES: dict[str, Any] = {
    name: ({"feature": {"dtype": str(t.value_type), "_type": "Value"}, "_type": "List"}
           if pa.types.is_list(t) else {"dtype": _HF_DTYPES.get(str(t), str(t)), "_type": "Value"})
    for name, t in zip(TRAINING_ROW_SCHEMA.names, TRAINING_ROW_SCHEMA.types)
}

# (profile, file kind) → folder under the dataset root and file extension.
_FILES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "parquet": (("rows", "tokenized/parquet", "parquet"),),
    "specforge": (("tokens", "tokenized/specforge", "jsonl"),
                  ("conversations", "tokenized/specforge-conversations", "jsonl")),
    "speculators": (("tokens", "tokenized/speculators", "jsonl"),),
}

STATUS_SUCCESS = "success"
# Why a training row is not in the SpecForge conversations export (it still is in every token file).
SKIP_LENGTH = "finish_reason_length"
SKIP_EMPTY_CONTENT = "empty_message_content"
SKIP_EMPTY_REASONING = "empty_reasoning"
SKIP_ROLE_ORDER = "role_order"
SKIP_NOT_CANONICAL = "engine_ids_not_canonical"
SKIP_NO_CONVERSATION = "no_conversation"


def check_profiles(profiles: Sequence[str]) -> tuple[str, ...]:
    """The profiles in canonical order; an unknown or repeated name is refused with the valid ones."""
    unknown = sorted(set(profiles) - set(PROFILES))
    if unknown or not profiles or len(set(profiles)) != len(profiles):
        raise ConfigError(f"profiles must be distinct names from {list(PROFILES)} (at least one), got {list(profiles)}")
    return tuple(p for p in PROFILES if p in profiles)


def profile_keys(profile: str, chunk: int) -> dict[str, str]:
    """{file kind: key relative to the dataset root} of one completions part's files of `profile`."""
    if profile not in _FILES:
        raise ConfigError(f"unknown profile {profile!r}; valid: {list(PROFILES)}")
    return {kind: f"{folder}/part-{chunk:0{CHUNK_DIGITS}d}.{ext}" for kind, folder, ext in _FILES[profile]}


def profile_globs(profile: str) -> dict[str, str]:
    """{file kind: glob relative to the dataset root}, for the dataset card's data_files and the docs."""
    return {kind: f"{folder}/part-*.{ext}" for kind, folder, ext in _FILES[profile]}


@dataclass
class ConversationStats:
    """The SpecForge conversations export of one part: rows written, rows left out by reason, and rows
    without a system message (SpecForge adds its template's default system prompt to those unless the
    template's is empty, e.g. ``qwen3.5``)."""

    rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    without_system_message: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "skipped": dict(sorted(self.skipped.items())),
                "without_system_message": self.without_system_message}


@dataclass
class ProfileOutput:
    """One part's files (relative key → bytes) and per-profile figures for the part's stats."""

    files: dict[str, bytes]
    rows: dict[str, int]
    conversations: ConversationStats | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": dict(self.rows), "files": sorted(self.files)}
        if self.conversations is not None:
            out["specforge_conversations"] = self.conversations.to_dict()
        return out


def _check_table(table: pa.Table) -> None:
    """The rows exact.py builds must be there; the label columns are added as null when absent."""
    missing = [n for n in TOKENIZED_SCHEMA.names if n not in table.column_names]
    if missing:
        raise ValueError(f"training-row table lacks column(s) {missing}")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def parquet_bytes(table: pa.Table) -> bytes:
    """The training rows as Parquet (zstd) with TRAINING_ROW_SCHEMA and the Hugging Face features in the
    schema metadata (``huggingface`` key, read by `datasets`)."""
    _check_table(table)
    rows = ensure_label_columns(table).select(TRAINING_ROW_SCHEMA.names).cast(TRAINING_ROW_SCHEMA)
    meta = {b"huggingface": _dumps({"info": {"features": HF_FEATURES}}).encode()}
    rows = rows.replace_schema_metadata(meta)
    buf = io.BytesIO()
    pq.write_table(rows, buf, compression="zstd")
    return buf.getvalue()


def specforge_tokens_jsonl(table: pa.Table, *, thinking: bool = True) -> bytes:
    """SpecForge's pre-tokenized records: ``{"id", "input_ids", "loss_mask"}`` plus the row's labels
    (``source``, ``domain``, ``thinking``, ``metadata``) and the trained turn's ``acceptance_length`` when
    its server reported it (left out otherwise); SpecForge 0.2.0's prompt_builder reads only
    ``input_ids`` and ``loss_mask`` of a pre-tokenized record. One line per row."""
    _check_table(table)
    keys = table.column("key").to_pylist()
    ids = table.column("input_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    labels = jsonl_labels(table, thinking)
    accept = table.column("acceptance_length").to_pylist()
    return "".join(_dumps({"id": k, "input_ids": i, "loss_mask": m, **lab, **_spec_keys(al)}) + "\n"
                   for k, i, m, lab, al in zip(keys, ids, masks, labels, accept)).encode()


def _spec_keys(acceptance_length: float | None, verify_steps: int | None = None) -> dict[str, Any]:
    """The spec keys a JSONL row carries: none when its turn has no statistics (files stay as before)."""
    if acceptance_length is None:
        return {}
    out: dict[str, Any] = {"acceptance_length": acceptance_length}
    if verify_steps is not None:
        out["spec_verify_steps"] = verify_steps
    return out


def speculators_jsonl(table: pa.Table, *, thinking: bool = True) -> bytes:
    """speculators' speculator-format rows (as `regenerate-responses` writes them, without its review-only
    ``text``): ``id`` (the row key), ``primary_id`` (the conversation: id + sample), ``input_ids``,
    ``loss_mask`` and ``metadata`` (ours, with the row's labels; speculators keeps only the ids and mask)."""
    _check_table(table)
    cols = {n: table.column(n).to_pylist() for n in TOKENIZED_SCHEMA.names}
    labels = jsonl_labels(table, thinking)
    lines = []
    for i, key in enumerate(cols["key"]):
        sample = cols["sample"][i]
        lines.append(_dumps({
            "id": key,
            "primary_id": unit_key({"id": cols["id"][i], "sample": sample}),
            "input_ids": cols["input_ids"][i],
            "loss_mask": cols["loss_mask"][i],
            "metadata": {"sample": sample, "turn": cols["turn"][i], "finish_reason": cols["finish_reason"][i],
                         "ids_source": cols["ids_source"][i],
                         "truncated_to_max_length": cols["truncated_to_max_length"][i],
                         "num_tokens": cols["num_tokens"][i], "num_loss_tokens": cols["num_loss_tokens"][i],
                         **labels[i], **_spec_keys(cols["acceptance_length"][i], cols["spec_verify_steps"][i])},
        }) + "\n")
    return "".join(lines).encode()


def _conversation_problem(conv: Sequence[Mapping[str, Any]], thinking: bool) -> str | None:
    """Why SpecForge cannot take this conversation as one generation event, or None.

    The rules are those of SpecForge's scripts/conversation_validation.py ``validate_conversation`` (every
    message's content a non-empty string; system messages only before the first user; then user and
    assistant alternate) plus what expand_reasoning_conversations.py demands of the turn it trains
    (an assistant turn last, with a non-empty ``reasoning_content`` when the row was generated with thinking:
    `thinking` is the row's own mode, a run may mix them)."""
    if not conv:
        return SKIP_NO_CONVERSATION
    expected, saw_user = "user", False
    for msg in conv:
        role = msg.get("role")
        if not isinstance(msg.get("content"), str) or not msg["content"].strip():
            return SKIP_EMPTY_CONTENT
        if role == "system" and not saw_user:
            continue
        if role != expected:
            return SKIP_ROLE_ORDER
        saw_user = True
        expected = "assistant" if role == "user" else "user"
    if conv[-1].get("role") != "assistant":
        return SKIP_ROLE_ORDER
    reasoning = conv[-1].get("reasoning")
    if thinking and (not isinstance(reasoning, str) or not reasoning.strip()):
        return SKIP_EMPTY_REASONING
    return None


def specforge_conversations_jsonl(
    table: pa.Table, conversations: Sequence[Sequence[Mapping[str, Any]] | None], *, thinking: bool
) -> tuple[bytes, ConversationStats]:
    """One generation event per training row that SpecForge can re-render as it was generated.

    `conversations[i]` is row i's conversation as generated (``role``, ``content``, ``reasoning``): system
    and user turns as given, earlier assistant answers without reasoning, the trained turn last with its
    reasoning. Left out, counted by reason: rows that stopped at ``length`` (re-rendering appends closers
    the model never produced, and a cut inside the thinking has no answer), rows the validator above
    refuses, and rows whose engine ids are not the canonical encoding of their text (when the table has a
    boolean ``ids_canonical`` column) since SpecForge re-tokenizes text. Each row is judged in its own thinking
    mode (its ``thinking`` label); `thinking` (the dataset's pinned mode) stands for a row whose label is null."""
    _check_table(table)
    if len(conversations) != table.num_rows:
        raise ValueError(f"{len(conversations)} conversations for {table.num_rows} training rows")
    keys = table.column("key").to_pylist()
    ids = table.column("id").to_pylist()
    samples = table.column("sample").to_pylist()
    turns = table.column("turn").to_pylist()
    finish = table.column("finish_reason").to_pylist()
    canonical = table.column("ids_canonical").to_pylist() if "ids_canonical" in table.column_names else None
    labels = jsonl_labels(table, thinking)
    stats = ConversationStats()
    skipped: Counter[str] = Counter()
    lines = []
    for i, conv in enumerate(conversations):
        conv = list(conv or [])
        problem = SKIP_LENGTH if finish[i] == "length" else _conversation_problem(conv, labels[i]["thinking"])
        if problem is None and canonical is not None and canonical[i] is False:
            problem = SKIP_NOT_CANONICAL
        if problem is not None:
            skipped[problem] += 1
            continue
        messages = []
        for j, msg in enumerate(conv):
            out = {"role": msg["role"], "content": msg["content"]}
            if j == len(conv) - 1 and msg.get("reasoning"):
                out["reasoning_content"] = msg["reasoning"]
            messages.append(out)
        stats.without_system_message += conv[0].get("role") != "system"
        lines.append(_dumps({
            "id": keys[i],
            "source_id": unit_key({"id": ids[i], "sample": samples[i]}),
            "assistant_turn_index": turns[i],
            "status": STATUS_SUCCESS,
            "conversations": messages,
            **labels[i],  # SpecForge drops every column but the conversation (build_eagle3_dataset)
        }) + "\n")
    stats.rows = len(lines)
    stats.skipped = dict(skipped)
    return "".join(lines).encode(), stats


def _conversation_column(table: pa.Table) -> list[Any] | None:
    if "conversation" not in table.column_names:
        return None
    return table.column("conversation").to_pylist()


def build_profile_files(
    table: pa.Table,
    chunk: int,
    profiles: Sequence[str],
    *,
    thinking: bool,
    conversations: Sequence[Sequence[Mapping[str, Any]] | None] | None = None,
) -> ProfileOutput:
    """Every file of completions part `chunk` for the chosen `profiles`, from its (filtered) training rows.

    `conversations` (aligned with `table`'s rows) is needed by the ``specforge`` profile; when None, the
    table's ``conversation`` column (list<struct<role, content, reasoning>>) is used."""
    chosen = check_profiles(profiles)
    _check_table(table)
    files: dict[str, bytes] = {}
    rows: dict[str, int] = {}
    conv_stats = None
    for profile in chosen:
        keys = profile_keys(profile, chunk)
        if profile == "parquet":
            files[keys["rows"]] = parquet_bytes(table)
        elif profile == "speculators":
            files[keys["tokens"]] = speculators_jsonl(table, thinking=thinking)
        else:
            files[keys["tokens"]] = specforge_tokens_jsonl(table, thinking=thinking)
            convs = conversations if conversations is not None else _conversation_column(table)
            if convs is None:
                raise ValueError("the specforge profile needs the rows' conversations (argument or column)")
            files[keys["conversations"]], conv_stats = specforge_conversations_jsonl(table, convs, thinking=thinking)
            rows["specforge_conversations"] = conv_stats.rows
        rows[profile] = table.num_rows
    return ProfileOutput(files=files, rows=rows, conversations=conv_stats)
