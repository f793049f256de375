"""Planted data defects: a named tokenization derived from a clean one with exactly one real bug in its rows.

Dev tooling for issue 38's sensitivity check (never a `dflash_tokenize` param): a drafter trained on data
broken the way real bugs break it must accept fewer tokens than one trained on the clean data, or the
experiment could not catch a data defect. Each defect is exactly one bug users report, nothing more:

* ``shifted_loss_mask``: every row's loss mask shifted one token **right** (``mask'[i] = mask[i-1]``,
  ``mask'[0] = 0``), ids unchanged. The SpecForge "unshifted masks" bug class (SpecForge #885, fix #895):
  EAGLE-3's ``TargetHead.preprocess`` shifts ``input_ids`` and the targets left by one and leaves
  ``loss_mask`` where it was, so the mask the trainer applies lags the labels by one position. A correct
  trainer fed a mask shifted right trains exactly what that buggy one trains on the clean mask: the first
  generated token (the one predicted from the prompt, the one a drafter is asked for right after prefill)
  loses its loss and the position after the generated run gains it. Our rows end with the generated run, so
  that stale position falls past the row's end: each row loses its first trained token, and DFlash can no
  longer anchor a block on it (SpecForge anchors on a supervised token followed by a supervised one). The
  other direction (trainer shifts the mask, data already shifted) would train the last prompt token, a
  template token; no report describes it.
* ``thinking_off_as_on``: every thinking-off row gets the prompt the thinking-on template renders, its
  generated ids (the thinking-off generation) and their loss unchanged: the generation/tokenization thinking
  mismatch users report (SpecForge), where the context the drafter trains with differs from the one the
  model was given. With Qwen's templates the two prompts differ only in the generation prompt (thinking off
  ends in the empty ``<think>\\n\\n</think>\\n\\n`` block), so the prompt ids are the clean row's with the
  thinking-off generation prompt's ids replaced by the thinking-on one's; a template whose modes render the
  context itself differently is refused (the clean rows do not carry the context to re-render). Thinking-on
  rows are unchanged. A row cut at max_length keeps the generated ids the clean row kept.

The result is written exactly as dflash_tokenize writes a tokenization, under ``tokenized/<name>/``: the
source's formats per completions part (``parquet``, ``specforge``, ``speculators``), ``stats/`` (the commit
point, written last), ``settings.json`` = the source's settings plus ``defect`` (name, what it is, source
tokenization and the sha256 of its settings.json), then ``report.json`` / ``report.md`` and the dataset card
(steps/tokenize/run.write_report), so ``dflash_train`` trains on it by name and the cards show the defect.
The same DFlash gates as the source (``max_length``, ``min_loss_tokens``, two adjacent trained tokens) drop
what the defect leaves untrainable, counted. SpecForge's conversations file is written empty (every row
counted under ``planted_defect``): that path re-renders text, which can carry neither defect, and a run
trained from it must not pass for the defect. Rerunning with the same arguments resumes (parts with stats are
skipped); the same name with another defect or source is refused.

    python -m dflash_pipeline.dev.data_defects s3://bucket/datasets/x --defect shifted_loss_mask \\
        [--source default] [--name default-shifted_loss_mask] [--endpoint-url http://127.0.0.1:9000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.dataset.layout import (
    DEFAULT_TOKENIZATION,
    TOKENIZATION_NAME_RE,
    TOKENIZED_RESERVED,
    DatasetLayout,
    chunk_of_key,
)
from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.steps.tokenize.dflash import dflash_ready
from dflash_pipeline.steps.tokenize.exact import TokenizeSettings, TrainingRowBuilder
from dflash_pipeline.steps.tokenize.gates import DropTally, domain_of, mode_of
from dflash_pipeline.steps.tokenize.profiles import TRAINING_ROW_SCHEMA, ConversationStats, build_profile_files, profile_keys
from dflash_pipeline.steps.tokenize.run import (  # the tokenization's own S3 reads and once-only writes
    DEFAULT_MIN_KEPT_SHARE,
    _get_json,
    _put_once,
    load_tokenizer,
    write_report,
)
from dflash_pipeline.steps.validate import mix as mixreport

logger = logging.getLogger(__name__)

SHIFTED_LOSS_MASK = "shifted_loss_mask"
THINKING_OFF_AS_ON = "thinking_off_as_on"
DEFECTS: dict[str, str] = {
    SHIFTED_LOSS_MASK: "Every row's loss_mask shifted one token right (mask'[i] = mask[i-1]), ids unchanged: the mask "
    "lags the labels by one, as in a trainer that shifts the targets and not the mask (SpecForge #885): each row's "
    "first generated token loses its loss.",
    THINKING_OFF_AS_ON: "Thinking-off rows rendered with the thinking-on template: their prompt ends in the "
    "thinking-on generation prompt (no empty think block), their generated ids (the thinking-off answer) and loss "
    "unchanged: the context the drafter trains with is not the one the model was given.",
}
SKIP_PLANTED = "planted_defect"
"""Why every row is out of a defect tokenization's SpecForge conversations file."""
DEFECT_FORMAT = 1


class DefectError(Exception):
    """The defect cannot be planted exactly (no such source, a source not complete, a template or row it does not
    fit, a name taken by something else)."""


# -- the defects, on a table of training rows (TRAINING_ROW_SCHEMA) -------------------------------------------


@dataclass(frozen=True)
class Planted:
    """Training rows with a defect planted: the rows (same columns, counts recomputed) and which ones changed."""

    table: pa.Table
    changed: np.ndarray


def _with_rows(table: pa.Table, ids: list[list[int]], masks: list[list[int]], truncated: list[bool]) -> pa.Table:
    """`table` with new input_ids / loss_mask (and num_tokens, num_loss_tokens, truncated_to_max_length)."""
    replace = {
        "input_ids": pa.array(ids, type=TRAINING_ROW_SCHEMA.field("input_ids").type),
        "loss_mask": pa.array(masks, type=TRAINING_ROW_SCHEMA.field("loss_mask").type),
        "num_tokens": pa.array([len(i) for i in ids], type=pa.int32()),
        "num_loss_tokens": pa.array([int(sum(m)) for m in masks], type=pa.int32()),
        "truncated_to_max_length": pa.array(truncated, type=pa.bool_()),
    }
    for name, arr in replace.items():
        table = table.set_column(table.schema.get_field_index(name), table.schema.field(name), arr)
    return table


def shift_loss_mask(table: pa.Table) -> Planted:
    """Every row's mask shifted one token right: mask'[0] = 0, mask'[i] = mask[i-1] (the last entry falls off)."""
    masks = [[0, *m[:-1]] if m else [] for m in table.column("loss_mask").to_pylist()]
    old = table.column("loss_mask").to_pylist()
    changed = np.array([a != b for a, b in zip(masks, old)], dtype=bool)
    return Planted(_with_rows(table, table.column("input_ids").to_pylist(), masks,
                              table.column("truncated_to_max_length").to_pylist()), changed)


@dataclass(frozen=True)
class GenerationPrompts:
    """The template's generation prompt ids with thinking off and on (each opens with a special token, so a
    prompt's ids end with them exactly)."""

    off: tuple[int, ...]
    on: tuple[int, ...]


def generation_prompts(builder: TrainingRowBuilder) -> GenerationPrompts:
    """The two generation prompts of the tokenizer's chat template, refused when the template renders a
    conversation differently per mode (then the context itself would have to be re-rendered) or when a
    generation prompt does not open with an added token (then its ids depend on the text before it)."""
    probe = [{"role": "system", "content": "probe system"}, {"role": "user", "content": "probe question"},
             {"role": "assistant", "content": "probe answer"}, {"role": "user", "content": "probe follow-up"}]
    if builder.rec.render_messages(probe, enable_thinking=True) != builder.rec.render_messages(probe, enable_thinking=False):
        raise DefectError("the chat template renders the conversation itself differently with thinking on and off; "
                          f"{THINKING_OFF_AS_ON} can only swap the generation prompt")
    added = [t.content for t in builder.tokenizer.get_added_tokens_decoder().values() if t.content]
    texts = {on: builder.generation_prompt_for(on) for on in (False, True)}
    for on, text in texts.items():
        if not any(text.startswith(a) for a in added):
            raise DefectError(f"the thinking-{'on' if on else 'off'} generation prompt {text!r} does not open with a "
                              "special token: its ids would depend on the prompt before it")
    enc = builder.tokenizer.encode_batch([texts[False], texts[True]], add_special_tokens=False)
    off, on_ids = tuple(enc[0].ids), tuple(enc[1].ids)
    if off == on_ids:
        raise DefectError("the chat template's generation prompt is the same with thinking on and off: nothing to plant")
    return GenerationPrompts(off=off, on=on_ids)


def thinking_off_as_on(table: pa.Table, prompts: GenerationPrompts, *, default_thinking: bool,
                       max_length: int) -> Planted:
    """Thinking-off rows (the `thinking` label; none: `default_thinking`) with their prompt's thinking-off
    generation prompt replaced by the thinking-on one; generated ids and their mask kept; cut at max_length."""
    ids_col = table.column("input_ids").to_pylist()
    mask_col = table.column("loss_mask").to_pylist()
    truncated = table.column("truncated_to_max_length").to_pylist()
    modes = table.column("thinking").to_pylist() if "thinking" in table.column_names else [None] * table.num_rows
    keys = table.column("key").to_pylist()
    changed = np.zeros(table.num_rows, dtype=bool)
    off, on = list(prompts.off), list(prompts.on)
    for i, (ids, mask) in enumerate(zip(ids_col, mask_col)):
        if mode_of(modes[i], default_thinking) == "on":
            continue
        start = mask.index(1) if 1 in mask else len(mask)  # the prompt: every token before the first trained one
        if ids[max(0, start - len(off)):start] != off:
            raise DefectError(f"row {keys[i]!r}: its prompt does not end with the thinking-off generation prompt "
                              f"{off}; {THINKING_OFF_AS_ON} cannot be planted exactly")
        new_ids = ids[: start - len(off)] + on + ids[start:]
        new_mask = [0] * (start - len(off) + len(on)) + mask[start:]
        if len(new_ids) > max_length:
            new_ids, new_mask, truncated[i] = new_ids[:max_length], new_mask[:max_length], True
        ids_col[i], mask_col[i], changed[i] = new_ids, new_mask, True
    return Planted(_with_rows(table, ids_col, mask_col, truncated), changed)


def plant(defect: str, table: pa.Table, settings: TokenizeSettings,
          prompts: GenerationPrompts | None = None) -> Planted:
    """`defect` planted in one part's training rows (before the DFlash gates)."""
    if defect == SHIFTED_LOSS_MASK:
        return shift_loss_mask(table)
    if defect == THINKING_OFF_AS_ON:
        if prompts is None:
            raise DefectError(f"{THINKING_OFF_AS_ON} needs the template's generation prompts")
        return thinking_off_as_on(table, prompts, default_thinking=settings.enable_thinking,
                                  max_length=settings.max_length)
    raise DefectError(f"unknown defect {defect!r}; known: {sorted(DEFECTS)}")


# -- one part: its files and stats, as tokenize writes them ------------------------------------------------------


def _labels(table: pa.Table, default_thinking: bool) -> list[tuple[str, str]]:
    n = table.num_rows
    modes = table.column("thinking").to_pylist() if "thinking" in table.column_names else [None] * n
    domains = table.column("domain").to_pylist() if "domain" in table.column_names else [None] * n
    return [(mode_of(m, default_thinking), domain_of(d)) for m, d in zip(modes, domains)]


def part_stats(source: dict[str, Any], planted: Planted, out: pa.Table, dropped: dict[str, np.ndarray],
               settings: TokenizeSettings) -> dict[str, Any]:
    """The part's stats: the source's (rows in, what tokenize dropped and why, examples) with the rows the defect
    left untrainable added to the drops and every figure of the rows kept recomputed."""
    labels = _labels(planted.table, settings.enable_thinking)
    tally = DropTally()
    for name in ("dropped_by_thinking", "dropped_by_domain"):
        for reason, per in (source.get(name) or {}).items():
            for key, n in per.items():
                getattr(tally, name).setdefault(reason, Counter())[key] += int(n)
    drops = Counter({k: int(v) for k, v in (source.get("dropped") or {}).items()})
    for reason, rows in dropped.items():
        drops[reason] += len(rows)
        for i in rows.tolist():
            tally.drop(reason, *labels[i])
    for mode, domain in _labels(out, settings.enable_thinking):
        tally.keep(mode, domain)
    n_tokens = [len(x) for x in out.column("input_ids").to_pylist()]
    n_loss = [int(sum(m)) for m in out.column("loss_mask").to_pylist()]
    return {
        **source, **tally.to_dict(),
        "rows_out": out.num_rows, "trained_turns": out.num_rows, "dropped": dict(sorted(drops.items())),
        "tokens": sum(n_tokens), "loss_tokens": sum(n_loss), "max_tokens": max(n_tokens, default=0),
        "max_loss_tokens_per_turn": max(n_loss, default=0),
        "truncated_to_max_length": int(sum(out.column("truncated_to_max_length").to_pylist())),
        "ids_source": dict(sorted(Counter(out.column("ids_source").to_pylist()).items())),
        "ids_not_canonical": sum(1 for c in out.column("ids_canonical").to_pylist() if c is False),
        "defect_rows_changed": int(planted.changed.sum()),
    }


def part_files(out: pa.Table, chunk: int, settings: TokenizeSettings) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The source's formats for the rows kept; SpecForge's conversations file empty (SKIP_PLANTED)."""
    files = build_profile_files(out, chunk, settings.profiles, thinking=settings.enable_thinking,
                                conversations=[None] * out.num_rows)
    if files.conversations is not None:
        files.conversations = ConversationStats(rows=0, skipped={SKIP_PLANTED: out.num_rows} if out.num_rows else {})
        files.rows["specforge_conversations"] = 0
    return files.files, files.to_dict()


# -- the tokenization ---------------------------------------------------------------------------------------------


def _source(store: Store, layout: DatasetLayout, source: str) -> tuple[dict[str, Any], bytes]:
    """The source tokenization's settings (doc and bytes): it must exist, be complete, clean, with Parquet files."""
    src = layout.tokenized_as(source)
    got = with_retries(lambda: store.get(src.tokenized_settings_key), what="read the source settings")
    if got is None:
        raise DefectError(f"{layout.uri}: no tokenization {source!r} ({src.tokenized_settings_key} does not exist)")
    doc = json.loads(got[0])
    if doc.get("defect"):
        raise DefectError(f"tokenization {source!r} already has a planted defect ({doc['defect'].get('name')}): plant "
                          "on a clean one")
    report = _get_json(store, src.tokenized_report_key) or {}
    if report.get("status") != "complete":
        raise DefectError(f"tokenization {source!r} is not complete (report status {report.get('status')!r}): run "
                          "dflash_tokenize to its end first")
    if "parquet" not in (doc.get("profiles") or []):
        raise DefectError(f"tokenization {source!r} has no parquet files (formats {doc.get('profiles')}): the defect "
                          "is derived from them")
    return doc, got[0]


def _pin(store: Store, layout: DatasetLayout, doc: dict[str, Any]) -> None:
    """Write the defect tokenization's settings.json once; an existing one must be this defect of this source."""
    body = json.dumps(doc, indent=1, sort_keys=True).encode()
    if _put_once(store, layout.tokenized_settings_key, body, "application/json"):
        return
    pinned = _get_json(store, layout.tokenized_settings_key) or {}
    was, want = pinned.get("defect") or {}, doc["defect"]
    keys = ("name", "source_tokenization", "source_settings_sha256")
    if any(was.get(k) != want[k] for k in keys):
        raise DefectError(f"tokenization {layout.tokenization!r} of {layout.uri} exists with "
                          f"{ {k: was.get(k) for k in keys} }, asked { {k: want[k] for k in keys} }: give another name")


def plant_defect(client: Any, output_uri: str, defect: str, *, source: str = DEFAULT_TOKENIZATION,
                 name: str | None = None, min_kept_share: float = DEFAULT_MIN_KEPT_SHARE) -> dict[str, Any]:
    """Derive tokenization `name` (default ``<source>-<defect>``) of the dataset at `output_uri` from tokenization
    `source` with `defect` planted in every part; returns its report (report.json)."""
    if defect not in DEFECTS:
        raise DefectError(f"unknown defect {defect!r}; known: {sorted(DEFECTS)}")
    name = name or f"{source}-{defect}"
    if not TOKENIZATION_NAME_RE.match(name) or name in TOKENIZED_RESERVED or name == DEFAULT_TOKENIZATION:
        raise DefectError(f"tokenization name {name!r}: 1-63 lower-case letters, digits, '_' or '-', not "
                          f"{DEFAULT_TOKENIZATION!r} nor {sorted(TOKENIZED_RESERVED)}")
    base = DatasetLayout.from_uri(output_uri)
    store = Store(client, base.bucket)
    src_doc, src_bytes = _source(store, base, source)
    settings = TokenizeSettings.from_dict(src_doc)
    prompts = None
    if defect == THINKING_OFF_AS_ON:
        builder = load_tokenizer(client, settings)
        was = ((src_doc.get("provenance") or {}).get("tokenizer") or {}).get("tokenizer_json_sha256")
        if was and builder.provenance.get("tokenizer_json_sha256") not in (None, was):
            raise DefectError(f"tokenizer {settings.tokenizer!r} changed since tokenization {source!r} was made")
        prompts = generation_prompts(builder)
    src, layout = base.tokenized_as(source), base.tokenized_as(name)
    doc = {**src_doc, "tokenization": name, "tokenized_dir": layout.tokenized_dir,
           "defect": {"name": defect, "what": DEFECTS[defect], "source_tokenization": source,
                      "source_tokenized_dir": src.tokenized_dir,
                      "source_settings_sha256": hashlib.sha256(src_bytes).hexdigest(),
                      "tool": __name__, "format": DEFECT_FORMAT}}
    _pin(store, layout, doc)
    parts = sorted(c for c in (chunk_of_key(o.key, src.tokenized_stats_prefix) for o in store.list(src.tokenized_stats_prefix))
                   if c is not None)
    changed = 0
    for c in parts:
        if with_retries(lambda: store.head(layout.tokenized_stats_key(c)), what="head part") is not None:
            continue
        changed += _plant_part(store, src, layout, c, defect, settings, prompts)
    logger.info("%s: tokenization %r = %r with %s planted: %d part(s), %d row(s) changed in the parts written now",
                base.uri, name, source, defect, len(parts), changed)
    return write_report(client, {"output_uri": base.uri, "tokenization": name, "settings": doc}, min_kept_share)


def _plant_part(store: Store, src: DatasetLayout, layout: DatasetLayout, c: int, defect: str,
                settings: TokenizeSettings, prompts: GenerationPrompts | None) -> int:
    """One part: read the source's rows and stats, plant, gate, write the files and then the stats (commit)."""
    source_stats = _get_json(store, src.tokenized_stats_key(c))
    got = with_retries(lambda: store.get(src.key(profile_keys("parquet", c)["rows"])), what="read source rows")
    if source_stats is None or got is None:
        raise DefectError(f"part {c} of tokenization {src.tokenization or DEFAULT_TOKENIZATION!r} is missing")
    planted = plant(defect, pq.read_table(pa.BufferReader(got[0])), settings, prompts)
    ready = dflash_ready(planted.table, max_length=settings.max_length, min_loss_tokens=settings.min_loss_tokens,
                         require_consecutive=settings.require_consecutive_loss_tokens)
    out = ready.table
    files, profiles = part_files(out, c, settings)
    stats = {**part_stats(source_stats, planted, out, ready.dropped_rows, settings), "profiles": profiles}
    part = with_retries(lambda: store.get(src.part_key(c)), what="read completions part")
    if part is not None and "mix" in source_stats:
        stats["mix"] = mixreport.kept_counts(decode_part(part[0]), out, settings.enable_thinking)
    for rel, data in sorted(files.items()):
        _put_once(store, layout.key(rel), data, "application/vnd.apache.parquet" if rel.endswith(".parquet")
                  else "application/x-ndjson")
    _put_once(store, layout.tokenized_stats_key(c), json.dumps(stats).encode(), "application/json")
    return int(planted.changed.sum())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_uri", help="s3://bucket/prefix of the dataset")
    parser.add_argument("--defect", required=True, choices=sorted(DEFECTS))
    parser.add_argument("--source", default=DEFAULT_TOKENIZATION, help="the clean tokenization (default: default)")
    parser.add_argument("--name", default=None, help="the new tokenization's name (default: <source>-<defect>)")
    parser.add_argument("--min-kept-share", type=float, default=DEFAULT_MIN_KEPT_SHARE)
    parser.add_argument("--endpoint-url", default=None, help="an S3-compatible endpoint (MinIO, moto); credentials "
                        "as boto3 finds them")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import boto3

    client = boto3.client("s3", endpoint_url=args.endpoint_url)
    report = plant_defect(client, args.output_uri, args.defect, source=args.source, name=args.name,
                          min_kept_share=args.min_kept_share)
    logger.info("%s", json.dumps({k: report.get(k) for k in ("tokenization", "status", "rows_out", "defect",
                                                             "dropped_by_reason", "report_key")}, indent=1))


if __name__ == "__main__":
    main()
