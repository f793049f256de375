"""Token-exact training rows: the ids the target model saw and produced, loss only on what it produced.

Why: a drafter learns to predict the target's next token given exactly what the target saw. A
token we train on that the model did not produce (a template's `<think>\\n`, the empty think block
of `enable_thinking=false`, the `\\n</think>\\n\\n<|im_end|>` a template appends to a turn cut at
`max_tokens`) or a context it was not given (reasoning re-inlined into later turns) teaches the
drafter something the target never does, and costs acceptance rate.

One training row per regenerated assistant turn (turns.py says which turns and their contexts):

    input_ids = prompt ids ++ generated ids [++ the template's text after the end-of-turn token]
    loss_mask =     0      ++       1       [++ 1 when `train_eot_newline`]

* **Engine ids** (`ids_source` "engine"): the prompt and generated ids the engine returned
  (vLLM `return_token_ids`), used as they are: never re-encoded, so a sampled sequence that is
  not the canonical BPE encoding of its text stays what the model produced. The prompt is also
  rendered and encoded here, only to count rows whose engine prompt differs from this tokenizer
  and template (a tokenizer that is not the served model's shows up there).
* **Re-encoded** (`ids_source` "retokenized", engines that return no ids): the prompt is the chat
  template rendered with the generation prompt, as the engine renders it; the generated text is
  what the template writes for the turn after that prompt, cut where the model stopped: through
  the end-of-turn token when it finished, after its last generated text when `max_tokens` cut it
  (no closers the model never wrote). Each is encoded and **checked** against the engine's own
  counts (`usage.prompt_tokens`, `usage.completion_tokens`); a turn whose counts differ is counted,
  named in the report and kept out of the shards unless `keep_unverified`.
* `loss_on_reasoning` false trains only the tokens after the generated `</think>`.
* The end-of-turn token the model emitted is trained; the template's text after it (ChatML's
  `\\n`) is appended and trained when `train_eot_newline` (SpecForge's mask covers `<|im_end|>\\n`),
  left out otherwise. A turn cut at `max_tokens` has neither.
* Rows longer than `max_length` are cut there (`truncated_to_max_length`); a row left with no
  trained token is dropped.
* **Original answers** (`answers: original`, `ids_source` "original"): the input's own answers at the
  regenerated turns' places (turns.original_turns_of), rendered and encoded as a re-encoded turn is, in the
  row's thinking mode, with nothing to check them against (no engine ids, no engine counts): what a user who
  did not regenerate trains on, not token-exact.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_pipeline.config import DFLASH_MIN_LOSS_TOKENS, TOKENIZE_PROFILES, ConfigError
from dflash_pipeline.config.tokenize import ANSWERS, ANSWERS_ORIGINAL, QUALITY_FLAG_NAMES
from dflash_pipeline.dataset.records import unit_key
from dflash_pipeline.serving.specstats import SPEC_COLUMNS, SpecStats
from dflash_pipeline.steps.tokenize.dflash import dflash_ready
from dflash_pipeline.steps.tokenize.gates import DropTally, domain_of, mode_of
from dflash_pipeline.steps.tokenize.turns import (
    DROP_NO_ORIGINAL,
    ORIGIN_ORIGINAL,
    TurnSource,
    is_empty,
    original_turns_of,
    turns_of,
)
from dflash_pipeline.steps.validate.tokencount import THINK_CLOSE, Recounter, text_variants

logger = logging.getLogger(__name__)

TRAIN_TURNS = ("all", "last")
SETTINGS_FORMAT = 2
"""1: one row per conversation, earlier reasoning re-inlined (before engine ids); 2: this module."""

IDS_ENGINE = "engine"
IDS_RETOKENIZED = "retokenized"
IDS_ORIGINAL = "original"
"""An original answer's text, encoded here: no engine ids and no engine counts to check it against."""

TOKENIZED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("sample", pa.int32()),
        ("turn", pa.int32()),
        ("key", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("truncated_to_max_length", pa.bool_()),
        ("finish_reason", pa.string()),
        ("ids_source", pa.string()),
        ("ids_canonical", pa.bool_()),
        # The trained turn's speculative decoding as its server reported it (null when it did not):
        # a trainer can weight or select rows by how hard the serving drafter found them.
        ("spec_verify_steps", pa.int64()),
        ("spec_accepted_tokens", pa.int64()),
        ("spec_draft_tokens", pa.int64()),
        ("spec_accept_histogram", pa.list_(pa.int64())),
        ("acceptance_length", pa.float64()),
    ]
)
"""The training rows of one completions part (the `parquet` profile writes them as they are). `ids_canonical`:
the generated ids are the canonical encoding of their text, so a trainer that re-tokenizes the text (SpecForge's
conversations path) gets the same ids; null when not checked (no profile needs it)."""

TURN_SPEC_COLUMNS = (*SPEC_COLUMNS, "acceptance_length")


def turn_spec_columns(spec: dict[str, Any] | None) -> dict[str, Any]:
    """A training row's spec columns from its turn's (all null when the turn has none)."""
    stats = SpecStats.from_columns(spec or {})
    if stats is None:
        return dict.fromkeys(TURN_SPEC_COLUMNS)
    return {**stats.to_columns(), "acceptance_length": stats.acceptance_length}


DROP_ERROR = "error_row"
DROP_TRUNCATED = "finish_reason_length"
DROP_NO_TURN = "no_regenerated_turn"
DROP_TEMPLATE = "turn_not_found_in_rendered_text"
DROP_UNVERIFIED = "ids_differ_from_engine_counts"
DROP_NO_LOSS = "no_loss_tokens_within_max_length"

EXAMPLES_KEPT = 20
"""Keys of rows named per problem in a part's stats (the report keeps the first 100 overall)."""


@dataclass(frozen=True)
class TokenizeSettings:
    """What decides the shards' content; pinned under tokenized/ so a rerun cannot mix settings."""

    tokenizer: str
    max_length: int = 4096
    train_turns: str = "all"
    loss_on_reasoning: bool = True
    drop_truncated: bool = False
    enable_thinking: bool = True
    train_eot_newline: bool = True
    keep_unverified: bool = False
    profiles: tuple[str, ...] = TOKENIZE_PROFILES
    min_loss_tokens: int = DFLASH_MIN_LOSS_TOKENS
    require_consecutive_loss_tokens: bool = True
    format: int = SETTINGS_FORMAT
    heldout_uri: str | None = None  # ids refused on top of the manifest's split (steps/tokenize/heldout.py)
    drop_quality: tuple[str, ...] = QUALITY_FLAG_NAMES
    """Quality flags whose rows are dropped (steps/tokenize/qualityfilter.py)."""
    quality: dict[str, Any] = field(default_factory=dict)
    """The row-signal quality params (config.tokenize.ROW_QUALITY_PARAMS) the flags are computed with."""
    answers: str = "regenerated"
    """Whose answers the rows train: the target model's ('regenerated') or the input's ('original')."""

    def __post_init__(self) -> None:
        if self.train_turns not in TRAIN_TURNS:
            raise ConfigError(f"train_turns must be one of {TRAIN_TURNS}, got {self.train_turns!r}")
        if self.answers not in ANSWERS:
            raise ConfigError(f"answers must be one of {ANSWERS}, got {self.answers!r}")
        if self.max_length < 1:
            raise ConfigError(f"max_length must be at least 1, got {self.max_length}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["profiles"] = list(self.profiles)
        out["drop_quality"] = list(self.drop_quality)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TokenizeSettings":
        values = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        values.setdefault("format", 1)  # pinned before this field existed: the old method
        if "profiles" in values:
            values["profiles"] = tuple(values["profiles"])
        values["drop_quality"] = tuple(values.get("drop_quality", ()))  # pinned before quality filtering: none
        values["quality"] = dict(values.get("quality") or {})
        return cls(**values)


def row_key(row_id: str, sample: int, turn: int, assistant_turns: int) -> str:
    """A training row's key: the pipeline's unit key (`id`, `#sample=k` for k > 0), plus `#turn=t`
    when its conversation has more than one assistant turn."""
    key = unit_key({"id": row_id, "sample": sample})
    return key if assistant_turns <= 1 else f"{key}#turn={turn}"


@dataclass
class Built:
    """One training row (ids None: dropped, `drop` says why)."""

    key: str
    turn: TurnSource
    input_ids: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    truncated: bool = False
    source: str = IDS_ENGINE
    drop: str | None = None
    template_differs: bool = False
    unverified: str = ""
    """Why re-made ids disagree with the engine's counts (empty: they agree, or the ids are the engine's)."""


@dataclass
class _Plan:
    """A turn's prompt and generated text where ids must be (re)made here."""

    built: Built
    prompt_text: str | None = None
    generated_texts: tuple[str, ...] = ()
    """What the model may have written (one candidate, or several for a turn cut by max_tokens)."""


class TrainingRowBuilder:
    """Builds training rows with one tokenizer and chat template (the recount's loader and renderer), each
    row's texts rendered in its own thinking mode (`thinking_of`)."""

    def __init__(self, recounter: Recounter, settings: TokenizeSettings) -> None:
        self.rec = recounter
        self.settings = settings
        self.tokenizer = recounter.tokenizer
        shape = recounter.shape
        if shape is None or not shape.tail:
            raise ConfigError("chat template: cannot find where an assistant turn ends (no text after the answer)")
        added = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        hits = [t for t in added if t and shape.tail.startswith(t)]
        self.eot = max(hits, key=len) if hits else (shape.tail.rstrip() or shape.tail)
        self.eot_id = added.get(self.eot)
        self.after_eot = shape.tail[len(self.eot):]
        self.after_eot_ids = np.asarray(self._encode([self.after_eot])[0] if self.after_eot else [], dtype=np.int32)
        close = self.tokenizer.token_to_id(THINK_CLOSE)
        self.think_close_id = None if close is None else int(close)
        self.generation_prompt = self.generation_prompt_for(settings.enable_thinking)
        """The generation prompt in the dataset's pinned mode (rows may differ: `thinking_of`)."""
        self.provenance: dict[str, Any] = {}
        """The tokenizer file's and template's hashes (set by the loader, which has the files)."""

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [e.ids for e in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)]

    # -- texts -------------------------------------------------------------------------------------
    def thinking_of(self, turn: TurnSource) -> bool:
        """The mode `turn` was generated in: its row's `thinking`, else the dataset's pinned flag. A run may mix
        modes per row, and the template renders each mode's generation prompt differently (Qwen3's
        thinking-off prompt ends in an empty think block), so every text is rendered in the row's mode."""
        return self.settings.enable_thinking if turn.thinking is None else bool(turn.thinking)

    def generation_prompt_for(self, thinking: bool) -> str:
        """What the template appends for `add_generation_prompt` in mode `thinking`."""
        probe = [{"role": "user", "content": "probe question"}]
        return self.rec.render_messages(probe, add_generation_prompt=True, enable_thinking=thinking)[
            len(self.rec.render_messages(probe, enable_thinking=thinking)):]

    def prompt_text(self, turn: TurnSource) -> str:
        return self.rec.render_messages([dict(m) for m in turn.context], add_generation_prompt=True,
                                        enable_thinking=self.thinking_of(turn))

    def generated_texts(self, turn: TurnSource, prompt: str) -> tuple[str, ...]:
        """What the model wrote after `prompt`, as the template writes the turn; empty when the template's
        rendering of the turn does not extend the prompt or the turn's texts cannot be found in it.

        A turn cut by `max_tokens` with an empty answer may have been cut inside its thinking, or just
        after `</think>` or the newlines after it (the parsed fields look the same): each is a candidate,
        and the one whose token count is the engine's is taken (none: the turn is unverified)."""
        msg: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.reasoning:
            msg["reasoning_content"] = turn.reasoning
        full = self.rec.render_messages([*(dict(m) for m in turn.context), msg], enable_thinking=self.thinking_of(turn))
        if not full.startswith(prompt):
            return ()
        text = full[len(prompt):]
        if turn.finish_reason != "length":
            end = text.find(self.eot)
            return () if end < 0 else (text[: end + len(self.eot)],)
        # Cut by max_tokens: the model stopped inside the last text it wrote, before any closer the
        # template adds (`\n</think>\n\n`, the end-of-turn token).
        last = turn.content if turn.content else (turn.reasoning or "")
        limit = text.rfind(self.eot)
        limit = len(text) if limit < 0 else limit
        for variant in text_variants(last):
            if variant:
                pos = text.rfind(variant, 0, limit)
                if pos >= 0:
                    cut = pos + len(variant)
                    out = [text[:cut]]
                    close = text.find(THINK_CLOSE, cut, limit)
                    if not turn.content and close >= 0:
                        out.append(text[: close + len(THINK_CLOSE)])
                        if limit > close + len(THINK_CLOSE):
                            out.append(text[:limit])
                    return tuple(out)
        return ()

    # -- rows --------------------------------------------------------------------------------------
    def build(self, rows: Sequence[tuple[str, int, TurnSource]]) -> list[Built]:
        """Training rows for (id, sample, turn) triples, in order; texts encoded in one batch."""
        out: list[Built] = []
        plans: list[_Plan] = []
        for row_id, sample, turn in rows:
            b = Built(row_key(row_id, sample, turn.index, turn.assistant_turns), turn)
            out.append(b)
            prompt = self.prompt_text(turn)
            if turn.output_ids is not None:
                b.source = IDS_ENGINE
                plans.append(_Plan(b, prompt))
                continue
            b.source = IDS_ORIGINAL if turn.origin == ORIGIN_ORIGINAL else IDS_RETOKENIZED
            generated = self.generated_texts(turn, prompt)
            if not generated:
                b.drop = DROP_TEMPLATE
                continue
            plans.append(_Plan(b, prompt, generated))
        # An engine prompt is checked against the template by its text: decoding its ids costs a fraction
        # of encoding the rendered prompt. Only a prompt whose text differs is encoded, and then compared id
        # for id (a tokenizer whose decoder is not byte-exact, e.g. a Metaspace one, differs in text only).
        same_text = self._prompts_decode_to(plans)
        texts: list[str] = []
        for p, same in zip(plans, same_text):
            if not same:
                texts.append(p.prompt_text or "")
            texts.extend(p.generated_texts)
        encoded = iter(self._encode(texts))
        for p, same in zip(plans, same_text):
            b, t = p.built, p.built.turn
            rendered = None if same else np.asarray(next(encoded), dtype=np.int32)
            if b.source == IDS_ENGINE:
                assert t.output_ids is not None
                if t.prompt_ids is not None:
                    prompt_ids = t.prompt_ids
                    b.template_differs = rendered is not None and not np.array_equal(prompt_ids, rendered)
                else:
                    assert rendered is not None
                    prompt_ids = rendered
                    if t.prompt_tokens is not None and len(rendered) != t.prompt_tokens:
                        b.unverified = f"prompt {len(rendered)} tokens, engine counted {t.prompt_tokens}"
                output_ids = t.output_ids
            elif b.source == IDS_ORIGINAL:  # nothing to check it against: the input's text, encoded
                assert rendered is not None
                prompt_ids = rendered
                output_ids = np.asarray(next(encoded), dtype=np.int32)
            else:
                assert rendered is not None
                prompt_ids = rendered
                candidates = [next(encoded) for _ in p.generated_texts]
                chosen = next((c for c in candidates if len(c) == t.completion_tokens), candidates[0])
                output_ids = np.asarray(chosen, dtype=np.int32)
                problems = []
                if t.prompt_tokens is not None and len(prompt_ids) != t.prompt_tokens:
                    problems.append(f"prompt {len(prompt_ids)} tokens, engine counted {t.prompt_tokens}")
                if t.completion_tokens is None or len(output_ids) != t.completion_tokens:
                    problems.append(f"generated {len(output_ids)} tokens, engine counted {t.completion_tokens}")
                b.unverified = "; ".join(problems)
            if b.unverified and not self.settings.keep_unverified:
                b.drop = DROP_UNVERIFIED
                continue
            self._assemble(b, prompt_ids, output_ids)
        return out

    def _prompts_decode_to(self, plans: Sequence[_Plan]) -> list[bool]:
        """Per plan: the engine's prompt ids decode exactly to the prompt the template renders (then they
        need no encoding here). One batch decode."""
        todo = [i for i, p in enumerate(plans) if p.built.source == IDS_ENGINE and p.built.turn.prompt_ids is not None]
        out = [False] * len(plans)
        if not todo:
            return out
        decoded = self.tokenizer.decode_batch([plans[i].built.turn.prompt_ids.tolist() for i in todo],  # type: ignore[union-attr]
                                              skip_special_tokens=False)
        for i, text in zip(todo, decoded):
            out[i] = text == plans[i].prompt_text
        return out

    def canonical(self, generated: Sequence[np.ndarray | None]) -> list[bool]:
        """Per row: its generated ids are the canonical encoding of their text (a re-encoded row is, by
        construction). One batch decode + encode of the engine-id rows' outputs."""
        todo = [i for i, g in enumerate(generated) if g is not None]
        out = [True] * len(generated)
        if not todo:
            return out
        texts = self.tokenizer.decode_batch([generated[i].tolist() for i in todo], skip_special_tokens=False)
        for i, ids in zip(todo, self._encode(texts)):
            out[i] = bool(np.array_equal(np.asarray(ids, dtype=np.int32), generated[i]))
        return out

    def _assemble(self, b: Built, prompt_ids: np.ndarray, output_ids: np.ndarray) -> None:
        s = self.settings
        train_from = 0
        if not s.loss_on_reasoning:
            hits = np.flatnonzero(output_ids == self.think_close_id) if self.think_close_id is not None else []
            if len(hits):
                train_from = int(hits[0]) + 1
            elif b.turn.reasoning:
                train_from = len(output_ids)  # cut inside the thinking: nothing but reasoning
        tail = self.after_eot_ids if (s.train_eot_newline and self.eot_id is not None and len(output_ids)
                                      and int(output_ids[-1]) == self.eot_id) else np.zeros(0, dtype=np.int32)
        ids = np.concatenate([prompt_ids, output_ids, tail]).astype(np.int32, copy=False)
        mask = np.zeros(len(ids), dtype=np.int8)
        mask[len(prompt_ids) + train_from:] = 1
        if len(ids) > s.max_length:
            ids, mask, b.truncated = ids[: s.max_length], mask[: s.max_length], True
        b.input_ids, b.loss_mask = ids, mask
        if not mask.any():
            b.drop = DROP_NO_LOSS


@dataclass
class PartStats:
    """What one part contributed; summed by the report.

    Units: `rows_in` counts completions rows; every other figure counts training rows (one per
    regenerated assistant turn), an error row counting as one dropped training row."""

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
    ids_source: dict[str, int] = field(default_factory=dict)
    """Training rows written by where their ids came from (engine, retokenized)."""
    rows_with_engine_ids: int = 0
    rows_without_engine_ids: int = 0
    """Completions rows (not error rows) whose turns all carry / none carry the engine's ids."""
    unverified: int = 0
    """Re-encoded turns whose token counts differ from the engine's (kept only with keep_unverified)."""
    unverified_examples: list[str] = field(default_factory=list)
    prompt_template_differs: int = 0
    """Engine-id rows whose prompt ids differ from this tokenizer + template's encoding of the prompt."""
    prompt_template_differs_examples: list[str] = field(default_factory=list)
    ids_not_canonical: int = 0
    """Rows kept whose engine ids are not the canonical encoding of their text (checked when a profile
    whose trainer re-tokenizes text, SpecForge's conversations, is written; they are left out of it)."""
    profiles: dict[str, Any] = field(default_factory=dict)
    """Per profile: rows written, files, and the SpecForge conversations export's figures."""
    original_answers: dict[str, int] = field(default_factory=dict)
    """answers 'original': training rows kept whose answer had no reasoning in a thinking-on row
    (ORIGINAL_WITHOUT_REASONING: the template's empty think block is trained) and whose reasoning was left out
    in a thinking-off row (ORIGINAL_REASONING_LEFT_OUT)."""
    kept_by_thinking: dict[str, int] = field(default_factory=dict)
    kept_by_domain: dict[str, int] = field(default_factory=dict)
    dropped_by_thinking: dict[str, dict[str, int]] = field(default_factory=dict)
    dropped_by_domain: dict[str, dict[str, int]] = field(default_factory=dict)
    """Training rows kept, and dropped per reason, by thinking mode ("on" / "off") and domain (gates.py)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ORIGINAL_WITHOUT_REASONING = "thinking_on_without_reasoning"
ORIGINAL_REASONING_LEFT_OUT = "thinking_off_reasoning_left_out"


def _original_note(turn: TurnSource, thinking: bool) -> str | None:
    """How an original answer was rendered against its row's thinking mode (PartStats.original_answers)."""
    if turn.origin != ORIGIN_ORIGINAL:
        return None
    if turn.reasoning_left_out:
        return ORIGINAL_REASONING_LEFT_OUT
    return ORIGINAL_WITHOUT_REASONING if thinking and not turn.reasoning else None


RowFilter = Callable[[Mapping[str, Any]], "str | None"]
"""A completion row → the reason to drop it (counted once, before its turns are built), or None to keep it."""


def tokenize_table(
    table: pa.Table, builder: TrainingRowBuilder, batch_rows: int = 256,
    row_filters: Sequence[RowFilter] = (), extra_columns: Sequence[str] = (),
    quality_filter: RowFilter | None = None,
) -> tuple[pa.Table, list[list[dict[str, Any]]], PartStats]:
    """One completions part → (training rows, each row's conversation as generated, stats).

    The rows are DFlash-ready (dflash.py: cut at max_length, at least `min_loss_tokens` trained tokens,
    two adjacent); the conversations (role, content, reasoning: the context as the request carried it,
    then the trained turn with its reasoning) are aligned with the rows, for the conversations exports.
    `row_filters` (the held-out split) drop whole completion rows first, in order, each counted once under
    the first filter's reason; `quality_filter` drops a row with turns, counted once per turn it would
    have trained (so rows kept + dropped stays the training rows a run would make); `extra_columns` are
    what the filters read besides the usual. Every drop is also counted by the row's thinking mode and
    domain (stats.dropped_by_*)."""
    s = builder.settings
    original = s.answers == ANSWERS_ORIGINAL
    stats = PartStats(rows_in=table.num_rows)
    dropped: Counter[str] = Counter()
    tally = DropTally()

    def drop(reason: str, label: tuple[str, str]) -> None:
        dropped[reason] += 1
        tally.drop(reason, *label)

    built_labels: list[tuple[str, str]] = []
    by_turns: Counter[str] = Counter()
    cols: dict[str, list[Any]] = {n: [] for n in ("id", "sample", "turn", "key", "finish_reason", "ids_source")}
    id_arrays: list[np.ndarray] = []
    mask_arrays: list[np.ndarray] = []
    truncated: list[bool] = []
    generated: list[np.ndarray | None] = []
    conversations: list[list[dict[str, Any]]] = []
    spec_rows: list[dict[str, Any]] = []
    notes: list[str | None] = []
    wanted = ("id", "sample", "messages", "reasoning", "content", "finish_reason", "error_class", "conversation",
              "turns", "prompt_tokens", "completion_tokens", "prompt_token_ids", "output_token_ids", "thinking",
              "domain", *(("original_messages",) if original else ()), *extra_columns)
    wanted = tuple(dict.fromkeys(wanted))
    for batch in table.select([c for c in wanted if c in table.column_names]).to_batches(max_chunksize=batch_rows):
        todo: list[tuple[str, int, TurnSource]] = []
        labels: list[tuple[str, str]] = []
        for row in batch.to_pylist():
            label = (mode_of(row.get("thinking"), s.enable_thinking), domain_of(row.get("domain")))
            if row.get("error_class"):
                drop(DROP_ERROR, label)
                continue
            refused = next((r for r in (f(row) for f in row_filters) if r), None)
            if refused:
                drop(refused, label)
                continue
            turns = original_turns_of(row, s.enable_thinking) if original else turns_of(row)
            if not turns:
                drop(DROP_NO_ORIGINAL if original else DROP_NO_TURN, label)
                continue
            if not original:  # the engine's ids are the regenerated turns'
                with_ids = sum(1 for t in turns if t.output_ids is not None)
                stats.rows_with_engine_ids += with_ids == len(turns)
                stats.rows_without_engine_ids += with_ids == 0
            by_turns[str(turns[-1].assistant_turns)] += 1
            chosen = turns if s.train_turns == "all" else turns[-1:]
            flagged = quality_filter(row) if quality_filter is not None else None
            if flagged:
                for _ in chosen:
                    drop(flagged, label)
                continue
            sample = int(row.get("sample") or 0)
            for t in chosen:
                if s.drop_truncated and t.finish_reason == "length":
                    drop(DROP_TRUNCATED, label)
                elif original and is_empty(t):
                    drop(DROP_NO_ORIGINAL, label)
                else:
                    todo.append((row["id"], sample, t))
                    labels.append(label)
        for (row_id, sample, _), label, b in zip(todo, labels, builder.build(todo)):
            if b.template_differs:
                stats.prompt_template_differs += 1
                if len(stats.prompt_template_differs_examples) < EXAMPLES_KEPT:
                    stats.prompt_template_differs_examples.append(b.key)
            if b.unverified:
                stats.unverified += 1
                if len(stats.unverified_examples) < EXAMPLES_KEPT:
                    stats.unverified_examples.append(f"{b.key}: {b.unverified}")
            if b.drop is not None:
                drop(b.drop, label)
                continue
            built_labels.append(label)
            assert b.input_ids is not None and b.loss_mask is not None
            cols["id"].append(row_id)
            cols["sample"].append(sample)
            cols["turn"].append(b.turn.index)
            cols["key"].append(b.key)
            cols["finish_reason"].append(b.turn.finish_reason)
            cols["ids_source"].append(b.source)
            id_arrays.append(b.input_ids)
            mask_arrays.append(b.loss_mask)
            truncated.append(b.truncated)
            generated.append(b.turn.output_ids if b.source == IDS_ENGINE else None)
            conversations.append(conversation_of(b.turn))
            spec_rows.append(turn_spec_columns(b.turn.spec))
            notes.append(_original_note(b.turn, builder.thinking_of(b.turn)))
    canonical = builder.canonical(generated) if "specforge" in s.profiles else [None] * len(generated)
    lengths = np.fromiter((len(a) for a in id_arrays), dtype=np.int64, count=len(id_arrays))
    loss = np.fromiter((int(m.sum(dtype=np.int64)) for m in mask_arrays), dtype=np.int64, count=len(mask_arrays))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), type=pa.int32())
    flat_ids = np.concatenate(id_arrays) if id_arrays else np.zeros(0, dtype=np.int32)
    flat_mask = np.concatenate(mask_arrays) if mask_arrays else np.zeros(0, dtype=np.int8)
    built = pa.Table.from_arrays(
        [
            pa.array(cols["id"], type=pa.string()),
            pa.array(cols["sample"], type=pa.int32()),
            pa.array(cols["turn"], type=pa.int32()),
            pa.array(cols["key"], type=pa.string()),
            pa.ListArray.from_arrays(offsets, pa.array(flat_ids, type=pa.int32())),
            pa.ListArray.from_arrays(offsets, pa.array(flat_mask, type=pa.int8())),
            pa.array(lengths.astype(np.int32), type=pa.int32()),
            pa.array(loss.astype(np.int32), type=pa.int32()),
            pa.array(truncated, type=pa.bool_()),
            pa.array(cols["finish_reason"], type=pa.string()),
            pa.array(cols["ids_source"], type=pa.string()),
            pa.array(canonical, type=pa.bool_()),
            *(pa.array([r[c] for r in spec_rows], type=TOKENIZED_SCHEMA.field(c).type) for c in TURN_SPEC_COLUMNS),
        ],
        schema=TOKENIZED_SCHEMA,
    )
    ready = dflash_ready(built, max_length=s.max_length, min_loss_tokens=s.min_loss_tokens,
                         require_consecutive=s.require_consecutive_loss_tokens)
    out = ready.table.select(TOKENIZED_SCHEMA.names).cast(TOKENIZED_SCHEMA)
    conversations = [conversations[i] for i in ready.kept.tolist()]
    dropped.update(ready.dropped)
    for reason, rows in ready.dropped_rows.items():
        for i in rows.tolist():
            tally.drop(reason, *built_labels[i])
    for i in ready.kept.tolist():
        tally.keep(*built_labels[i])
    stats.original_answers = dict(sorted(Counter(n for n in (notes[i] for i in ready.kept.tolist()) if n).items()))
    for name, value in tally.to_dict().items():
        setattr(stats, name, value)
    n_tokens = out.column("num_tokens").to_numpy().astype(np.int64) if out.num_rows else np.zeros(0, np.int64)
    n_loss = out.column("num_loss_tokens").to_numpy().astype(np.int64) if out.num_rows else np.zeros(0, np.int64)
    stats.rows_out = out.num_rows
    stats.trained_turns = out.num_rows
    stats.dropped = dict(sorted(dropped.items()))
    stats.tokens = int(n_tokens.sum())
    stats.loss_tokens = int(n_loss.sum())
    stats.truncated_to_max_length = int(sum(out.column("truncated_to_max_length").to_pylist()))
    stats.max_tokens = int(n_tokens.max()) if len(n_tokens) else 0
    stats.max_loss_tokens_per_turn = int(n_loss.max()) if len(n_loss) else 0
    stats.conversations_by_assistant_turns = dict(sorted(by_turns.items(), key=lambda kv: int(kv[0])))
    stats.ids_source = dict(sorted(Counter(out.column("ids_source").to_pylist()).items()))
    stats.ids_not_canonical = sum(1 for c in out.column("ids_canonical").to_pylist() if c is False)
    return out, conversations, stats


def conversation_of(turn: TurnSource) -> list[dict[str, Any]]:
    """A training row's conversation as generated: its context as the request carried it (no reasoning),
    then the trained turn with its reasoning."""
    return [*({"role": m["role"], "content": m["content"], "reasoning": None} for m in turn.context),
            {"role": "assistant", "content": turn.content, "reasoning": turn.reasoning}]
