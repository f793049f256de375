"""Conversations → `input_ids` + `loss_mask`: render once with the chat template, encode once with offsets.

Why this way: a mask built by tokenizing pieces separately disagrees with the sequence the trainer
sees wherever a token merges across a piece boundary, and a template that rewrites earlier turns
(Qwen3 drops their reasoning) breaks masks built from the messages. Here the mask is read off the
rendered text itself: each trained assistant turn is a character span of the rendered conversation,
from the end of the assistant header (`<|im_start|>assistant\\n`, learnt from the template's
generation prompt) to the end of its end-of-turn token (`<|im_end|>`, learnt from the template's
text after an answer). A token is trained when its *start* offset lies in a span, so a token that
straddles a boundary is counted once, on the side where it starts.

Reasoning of earlier turns (`train_turns="all"`): Qwen3's template renders the reasoning only for
assistant turns after the last user turn. With `loss_on_reasoning` (default) every trained turn
keeps its reasoning: a trained turn whose reasoning the template dropped is rendered with it
written into its content (`<think>\\n…\\n</think>\\n\\n` + answer, the template's own markers),
so the drafter learns the thinking of every turn. SpecForge's ThinkingParser instead renders
the conversation once with the model's template and masks header → end-of-turn, so with
Qwen3's template its earlier turns train on answers only. Untrained turns are rendered as the
template renders them (what the model sees at inference).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_pipeline.config import ConfigError
from dflash_pipeline.dataset.records import unit_key
from dflash_pipeline.steps.validate.tokencount import THINK_CLOSE, THINK_OPEN, Recounter, first_token_at, text_variants

logger = logging.getLogger(__name__)

TRAIN_TURNS = ("all", "last")

TOKENIZED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("sample", pa.int32()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("truncated_to_max_length", pa.bool_()),
    ]
)

DROP_ERROR = "error_row"
DROP_TRUNCATED = "finish_reason_length"
DROP_NO_ASSISTANT = "no_assistant_turn"
DROP_TEMPLATE = "turn_not_found_in_rendered_text"
DROP_NO_LOSS = "no_loss_tokens_within_max_length"


@dataclass(frozen=True)
class TokenizeSettings:
    """What decides the shards' content; pinned under tokenized/ so a rerun cannot mix settings."""

    tokenizer: str
    max_length: int = 8192
    train_turns: str = "all"
    loss_on_reasoning: bool = True
    drop_truncated: bool = False
    enable_thinking: bool = True

    def __post_init__(self) -> None:
        if self.train_turns not in TRAIN_TURNS:
            raise ConfigError(f"train_turns must be one of {TRAIN_TURNS}, got {self.train_turns!r}")
        if self.max_length < 1:
            raise ConfigError(f"max_length must be at least 1, got {self.max_length}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TokenizeSettings":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class Turn:
    role: str
    content: str
    reasoning: str | None = None


@dataclass(frozen=True)
class TurnSpan:
    """Character offsets of one assistant turn in the rendered text."""

    body_start: int
    """Right after the assistant header: reasoning markup, reasoning, answer follow."""
    content_start: int
    end: int
    """Right after the end-of-turn token."""
    reasoning_rendered: bool


@dataclass
class Encoded:
    """One conversation's result (None fields: dropped, `drop` says why)."""

    text: str = ""
    input_ids: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    truncated: bool = False
    turn_loss_tokens: list[int] = field(default_factory=list)
    reinlined: int = 0
    reasoning_missing: int = 0
    spans: list[tuple[int, int]] = field(default_factory=list)
    drop: str | None = None


def conversation_of(row: dict[str, Any]) -> list[Turn]:
    """The conversation to train on: the `conversation` column when the part has it, else the
    prompt's messages plus the regenerated answer (`reasoning`, `content`)."""
    conv = row.get("conversation")
    if conv:
        return [Turn(t["role"], t.get("content") or "", t.get("reasoning") or None) for t in conv]
    turns = [Turn(m["role"], m.get("content") or "") for m in row.get("messages") or []]
    turns.append(Turn("assistant", row.get("content") or "", row.get("reasoning") or None))
    return turns


class ConversationTokenizer:
    """Renders and encodes conversations with one tokenizer/template (the recount's loader and renderer)."""

    def __init__(self, recounter: Recounter, settings: TokenizeSettings) -> None:
        self.rec = recounter
        self.settings = settings
        self.tokenizer = recounter.tokenizer
        probe = [{"role": "user", "content": "probe question"}]
        base = recounter.render_messages(probe)
        with_prompt = recounter.render_messages(probe, add_generation_prompt=True)
        if not with_prompt.startswith(base) or len(with_prompt) == len(base):
            raise ConfigError("chat template: the generation prompt is not an extension of the conversation; "
                              "cannot find the assistant header")
        header = with_prompt[len(base):]
        # enable_thinking=false makes Qwen3's generation prompt end in an empty think block: the header
        # is the part before it (that block is then inside the trained span, as the model emits it).
        if THINK_OPEN in header:
            header = header[: header.index(THINK_OPEN)]
        self.header = header
        shape = recounter.shape
        if shape is None or not shape.tail:
            raise ConfigError("chat template: cannot find where an assistant turn ends (no text after the answer)")
        self.eot = self._end_of_turn(shape.tail)
        self.gap = shape.gap if shape.gap else f"\n{THINK_CLOSE}\n\n"

    def _end_of_turn(self, tail: str) -> str:
        """The end-of-turn token: the longest added token the template's tail starts with, else the tail
        without trailing whitespace."""
        added = [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
        hits = [t for t in added if t and tail.startswith(t)]
        return max(hits, key=len) if hits else (tail.rstrip() or tail)

    # -- rendering ---------------------------------------------------------------------------------
    def _messages(self, conv: Sequence[Turn], inline: set[int]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, t in enumerate(conv):
            if t.role != "assistant":
                out.append({"role": t.role, "content": t.content})
            elif t.reasoning and (i in inline or self.rec.inline_reasoning):
                body = f"{THINK_OPEN}\n{t.reasoning.strip(chr(10))}{self.gap}{t.content.lstrip(chr(10))}"
                out.append({"role": "assistant", "content": body, "reasoning_content": ""})
            else:
                m: dict[str, Any] = {"role": "assistant", "content": t.content}
                if t.reasoning:
                    m["reasoning_content"] = t.reasoning
                out.append(m)
        return out

    def _locate(self, text: str, conv: Sequence[Turn]) -> list[TurnSpan] | None:
        """Spans of every assistant turn, in order; None when one cannot be found."""
        spans: list[TurnSpan] = []
        cursor = 0
        for t in conv:
            if t.role != "assistant":
                continue
            h = text.find(self.header, cursor)
            if h < 0:
                return None
            body = h + len(self.header)
            found = None
            for cv in text_variants(t.content):
                pos = text.find(cv + self.eot, body)
                if pos >= 0 and (found is None or pos < found[0]):
                    found = (pos, cv)
            if found is None:
                return None
            pos, cv = found
            end = pos + len(cv) + len(self.eot)
            # A stripped answer can also match with the template's own newlines in front of it: the
            # answer starts no earlier than the end of the reasoning block's closing gap.
            g = text.rfind(self.gap, body, end - len(self.eot))
            if g >= 0:
                pos = max(pos, g + len(self.gap))
            rendered = not t.reasoning or not t.reasoning.strip() or any(
                rv and text.find(rv, body, pos) >= 0 for rv in text_variants(t.reasoning))
            spans.append(TurnSpan(body, pos, end, rendered))
            cursor = end
        return spans

    def trained(self, conv: Sequence[Turn]) -> list[int]:
        """Indices (among assistant turns) of the turns to train."""
        n = sum(1 for t in conv if t.role == "assistant")
        if n == 0:
            return []
        return list(range(n)) if self.settings.train_turns == "all" else [n - 1]

    def render(self, conv: Sequence[Turn]) -> tuple[str, list[TurnSpan] | None, int, int]:
        """(text, spans of all assistant turns, turns re-inlined, trained turns whose reasoning is missing)."""
        text = self.rec.render_messages(self._messages(conv, set()))
        spans = self._locate(text, conv)
        if spans is None or not self.settings.loss_on_reasoning:
            return text, spans, 0, 0
        trained = self.trained(conv)
        asst = [i for i, t in enumerate(conv) if t.role == "assistant"]
        dropped = {asst[k] for k in trained if not spans[k].reasoning_rendered}
        if not dropped:
            return text, spans, 0, 0
        text = self.rec.render_messages(self._messages(conv, dropped))
        spans = self._locate(text, conv)
        missing = 0 if spans is None else sum(1 for k in trained if not spans[k].reasoning_rendered)
        return text, spans, len(dropped), missing

    # -- encoding ----------------------------------------------------------------------------------
    def encode(self, convs: Sequence[Sequence[Turn]]) -> list[Encoded]:
        """Render each conversation, encode them all in one parallel batch, read the masks off the offsets."""
        results: list[Encoded] = []
        texts: list[str] = []
        for conv in convs:
            trained = self.trained(conv)
            if not trained:
                results.append(Encoded(drop=DROP_NO_ASSISTANT))
                continue
            text, spans, reinlined, missing = self.render(conv)
            if spans is None:
                results.append(Encoded(text=text, drop=DROP_TEMPLATE))
                continue
            chosen = [spans[k] for k in trained]
            char_spans = [(s.body_start if self.settings.loss_on_reasoning else s.content_start, s.end) for s in chosen]
            results.append(Encoded(text=text, spans=char_spans, reinlined=reinlined, reasoning_missing=missing))
            texts.append(text)
        encs = iter(self.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else [])
        limit = self.settings.max_length
        for r in results:
            if r.drop is not None:
                continue
            enc = next(encs)
            n = len(enc)
            keep = min(n, limit)
            mask = np.zeros(keep, dtype=np.int8)
            lo = 0
            for s, e in r.spans:
                a = first_token_at(enc, s, lo, n)
                b = first_token_at(enc, e, a, n)
                lo = b
                a, b = min(a, keep), min(b, keep)
                mask[a:b] = 1
                r.turn_loss_tokens.append(b - a)
            ids = np.array(enc.ids, dtype=np.int32)
            r.input_ids = ids[:keep] if n > keep else ids
            r.loss_mask = mask
            r.truncated = n > keep
            if not mask.any():
                r.drop = DROP_NO_LOSS
        return results


@dataclass
class PartStats:
    """What one part contributed; summed by the report."""

    rows_in: int = 0
    rows_out: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    loss_tokens: int = 0
    truncated_to_max_length: int = 0
    max_tokens: int = 0
    conversations_by_assistant_turns: dict[str, int] = field(default_factory=dict)
    trained_turns: int = 0
    max_loss_tokens_per_turn: int = 0
    reasoning_reinlined_turns: int = 0
    reasoning_missing_turns: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tokenize_table(
    table: pa.Table, ct: ConversationTokenizer, batch_rows: int = 256
) -> tuple[pa.Table, list[dict[str, Any]], PartStats]:
    """One completions part → (tokenized rows, SpecForge export records, stats). Error rows are dropped."""
    s = ct.settings
    stats = PartStats(rows_in=table.num_rows)
    dropped: Counter[str] = Counter()
    by_turns: Counter[str] = Counter()
    cols = [c for c in ("id", "sample", "messages", "reasoning", "content", "finish_reason", "error_class", "conversation")
            if c in table.column_names]
    out_ids: list[str] = []
    out_samples: list[int] = []
    id_arrays: list[np.ndarray] = []
    mask_arrays: list[np.ndarray] = []
    truncated: list[bool] = []
    export: list[dict[str, Any]] = []
    for batch in table.select(cols).to_batches(max_chunksize=batch_rows):
        rows = batch.to_pylist()
        keep_rows: list[dict[str, Any]] = []
        convs: list[list[Turn]] = []
        for row in rows:
            if row.get("error_class"):
                dropped[DROP_ERROR] += 1
            elif s.drop_truncated and row.get("finish_reason") == "length":
                dropped[DROP_TRUNCATED] += 1
            else:
                keep_rows.append(row)
                convs.append(conversation_of(row))
        for row, conv, enc in zip(keep_rows, convs, ct.encode(convs)):
            if enc.drop is not None:
                dropped[enc.drop] += 1
                continue
            assert enc.input_ids is not None and enc.loss_mask is not None
            sample = int(row.get("sample") or 0)
            out_ids.append(row["id"])
            out_samples.append(sample)
            id_arrays.append(enc.input_ids)
            mask_arrays.append(enc.loss_mask)
            truncated.append(enc.truncated)
            by_turns[str(sum(1 for t in conv if t.role == "assistant"))] += 1
            stats.trained_turns += len(enc.turn_loss_tokens)
            stats.max_loss_tokens_per_turn = max(stats.max_loss_tokens_per_turn, *enc.turn_loss_tokens)
            stats.reasoning_reinlined_turns += enc.reinlined
            stats.reasoning_missing_turns += enc.reasoning_missing
            export.append(export_record(row["id"], sample, conv))
    lengths = np.fromiter((len(a) for a in id_arrays), dtype=np.int64, count=len(id_arrays))
    loss = np.fromiter((int(m.sum(dtype=np.int64)) for m in mask_arrays), dtype=np.int64, count=len(mask_arrays))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), type=pa.int32())
    flat_ids = np.concatenate(id_arrays) if id_arrays else np.zeros(0, dtype=np.int32)
    flat_mask = np.concatenate(mask_arrays) if mask_arrays else np.zeros(0, dtype=np.int8)
    out = pa.Table.from_arrays(
        [
            pa.array(out_ids, type=pa.string()),
            pa.array(out_samples, type=pa.int32()),
            pa.ListArray.from_arrays(offsets, pa.array(flat_ids, type=pa.int32())),
            pa.ListArray.from_arrays(offsets, pa.array(flat_mask, type=pa.int8())),
            pa.array(lengths.astype(np.int32), type=pa.int32()),
            pa.array(loss.astype(np.int32), type=pa.int32()),
            pa.array(truncated, type=pa.bool_()),
        ],
        schema=TOKENIZED_SCHEMA,
    )
    stats.rows_out = out.num_rows
    stats.dropped = dict(sorted(dropped.items()))
    stats.tokens = int(lengths.sum())
    stats.loss_tokens = int(loss.sum())
    stats.truncated_to_max_length = int(sum(truncated))
    stats.max_tokens = int(lengths.max()) if len(lengths) else 0
    stats.conversations_by_assistant_turns = dict(sorted(by_turns.items(), key=lambda kv: int(kv[0])))
    return out, export, stats


def export_id(row_id: str, sample: int) -> str:
    """SpecForge's `id`: the row's key in the whole pipeline (`records.unit_key`: the prompt id, with
    `#sample=<k>` for samples after the first), unique per row."""
    return unit_key({"id": row_id, "sample": sample})


def export_record(row_id: str, sample: int, conv: Sequence[Turn]) -> dict[str, Any]:
    """SpecForge's conversations JSONL record: {"id", "conversations": [{"role", "content", "reasoning_content"?}]}."""
    turns = []
    for t in conv:
        m: dict[str, Any] = {"role": t.role, "content": t.content}
        if t.role == "assistant" and t.reasoning:
            m["reasoning_content"] = t.reasoning
        turns.append(m)
    return {"id": export_id(row_id, sample), "conversations": turns}
