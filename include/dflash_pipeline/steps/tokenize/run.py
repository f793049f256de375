"""dflash_tokenize's work: plan the parts per worker, tokenize them exactly once, sum the report.

Exactly once and resumable with the same tools as generate: every output key is a function of the
dataset root and the completions part's index; a part's outputs are written with `If-None-Match: *`
in the order export JSONL → stats → tokenized Parquet, and the Parquet is the commit point. A worker
skips a part whose Parquet exists (checked on S3 before the work), and a write that loses a race
(412) means another worker wrote the same deterministic bytes: nothing to do. The settings are
pinned in the tokenization's `settings.json` by its first run, so a rerun cannot mix shards made with
other settings; other settings make another, named tokenization beside it (`tokenized/<name>/`, the
first one, 'default', directly under `tokenized/`), never a rewrite. Memory holds one part and the next one being fetched, whatever the dataset's size.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from dflash_pipeline.config import TOKENIZE_PARAM_SCHEMAS, ConfigError, TokenizeConfig
from dflash_pipeline.config.tokenize import ANSWERS_ORIGINAL, ORIGINAL_TOKENIZATION, PROMPT_QUALITY_FLAGS
from dflash_pipeline.dataset.layout import DEFAULT_TOKENIZATION, TOKENIZED_RESERVED, DatasetLayout, chunk_of_key
from dflash_pipeline.dataset.store import PreconditionFailed, Store, with_retries
from dflash_pipeline.steps.tokenize.card import dataset_card
from dflash_pipeline.dataset.heldout import HeldoutSplit
from dflash_pipeline.steps.tokenize.exact import PartStats, TokenizeSettings, TrainingRowBuilder, tokenize_table
from dflash_pipeline.steps.tokenize.gates import add_breakdown, breakdown_lines, failure_message, gate, sorted_breakdown
from dflash_pipeline.steps.tokenize.heldout import DROP_HELDOUT, load_heldout, split_summary
from dflash_pipeline.steps.quality.near_dup import load_near_duplicates
from dflash_pipeline.steps.quality.signals import SIGNAL_COLUMNS
from dflash_pipeline.steps.tokenize.exact import RowFilter
from dflash_pipeline.steps.tokenize.profiles import build_profile_files, profile_globs
from dflash_pipeline.steps.tokenize.qualityfilter import NEAR_DUPLICATE, quality_filter
from dflash_pipeline.steps.tokenize.rowlabels import LABEL_COLUMNS, labels_by_unit, with_labels
from dflash_pipeline.steps.tokenize.turns import DROP_OTHER_SAMPLE
from dflash_pipeline.steps.tokenize.provenance import manifest_provenance, specforge_template_name, tokenizer_provenance
from dflash_pipeline.steps.validate import mix as mixreport
from dflash_pipeline.steps.validate.tokencount import load_recounter

logger = logging.getLogger(__name__)

REPORT_FORMAT = "dflash-pipeline/tokenized/2"
READ_COLUMNS = ("id", "sample", "messages", "reasoning", "content", "finish_reason", "error_class", "conversation",
                "turns", "prompt_tokens", "completion_tokens", "prompt_token_ids", "output_token_ids", *LABEL_COLUMNS,
                *SIGNAL_COLUMNS)
ORIGINAL_COLUMNS = ("original_messages",)
"""Read too with answers 'original' only (old answers can be long; a regenerated tokenization never needs them)."""


class TokenizeFailed(Exception):
    """Parts are missing after every worker ran, a part cannot be read, or the run kept fewer rows than
    `min_kept_share` of them (gates.py): the report says which, with the reasons."""


def _get_json(store: Store, key: str) -> dict[str, Any] | None:
    got = with_retries(lambda: store.get(key), what=f"read {key}")
    return None if got is None else json.loads(got[0])


def _put_once(store: Store, key: str, data: bytes, content_type: str) -> bool:
    """Create `key` unless it exists; False when it already did (another writer, same bytes)."""
    try:
        with_retries(lambda: store.put(key, data, if_none_match=True, content_type=content_type), what=f"write {key}")
        return True
    except PreconditionFailed:
        return False


def s3_getter(client: Any) -> Any:
    def get(bucket: str, key: str) -> bytes | None:
        res = with_retries(lambda: Store(client, bucket).get(key), what=f"read tokenizer {key}")
        return None if res is None else res[0]

    return get


def load_tokenizer(client: Any, settings: TokenizeSettings) -> TrainingRowBuilder:
    """The recount's loader (local or S3 tokenizer + chat template), wrapped for training rows. Files
    fetched from S3 go to a temporary folder removed once loaded (the tokenizer is then in memory); the
    tokenizer file's and template's hashes are kept for provenance."""
    with tempfile.TemporaryDirectory(prefix="dflash-tokenize-") as tmp:
        rec = load_recounter(settings.tokenizer, s3_getter(client), enable_thinking=settings.enable_thinking,
                             workdir=Path(tmp))
        builder = TrainingRowBuilder(rec, settings)
        builder.provenance = tokenizer_provenance(rec.files.tokenizer_json.read_bytes(), rec.files.chat_template,
                                                  settings.tokenizer)
        return builder


def manifest_tokenizer(manifest: dict[str, Any]) -> str | None:
    """The tokenizer the generate run was planned with (plan checked it and recorded it in the manifest), as
    a spec that loads the same files: a Hugging Face id pinned to the snapshot's commit."""
    rec = manifest.get("tokenizer") or {}
    source = rec.get("source")
    if not source:
        return None
    if rec.get("kind") == "huggingface" and rec.get("revision") and "@" not in source:
        return f"{source}@{rec['revision']}"
    return str(source)


def resolve_settings(store: Store, layout: DatasetLayout, cfg: TokenizeConfig) -> TokenizeSettings:
    """The settings for one dataset: the params, the manifest's enable_thinking, and, when the tokenizer param
    is null, the generate run's tokenizer (the manifest's record, else the one validation recounted with)."""
    manifest = _get_json(store, layout.manifest_key)
    if manifest is None:
        raise ConfigError(f"{layout.uri}/manifest.json does not exist: not a dflash_generate dataset")
    thinking = bool(manifest.get("pinned", {}).get("sampling", {}).get("enable_thinking", True))
    tokenizer = cfg.tokenizer or manifest_tokenizer(manifest)
    if not tokenizer:
        report = _get_json(store, layout.report_key) or {}
        tokenizer = (report.get("token_recount") or {}).get("tokenizer")
        if not tokenizer:
            raise ConfigError(f"{layout.uri}: the generate run had no tokenizer param (none in its manifest, no "
                              "recount in its report), so there is no default; give the tokenizer param (a Hugging "
                              "Face id, a tokenizer.json, a model directory or an s3:// prefix)")
    drop_quality = cfg.drop_quality
    if cfg.answers == ANSWERS_ORIGINAL:  # the other flags are signals of the regenerated answers
        drop_quality = tuple(f for f in drop_quality if f in PROMPT_QUALITY_FLAGS)
    return TokenizeSettings(tokenizer=tokenizer, max_length=cfg.max_length, train_turns=cfg.train_turns,
                            loss_on_reasoning=cfg.loss_on_reasoning, drop_truncated=cfg.drop_truncated,
                            enable_thinking=thinking, train_eot_newline=cfg.train_eot_newline,
                            keep_unverified=cfg.keep_unverified, profiles=cfg.profiles,
                            min_loss_tokens=cfg.min_loss_tokens,
                            require_consecutive_loss_tokens=cfg.require_consecutive_loss_tokens,
                            heldout_uri=cfg.heldout_uri, drop_quality=drop_quality,
                            quality=cfg.quality_params(), answers=cfg.answers)


def check_against_manifest(manifest: dict[str, Any], settings: TokenizeSettings, builder: TrainingRowBuilder) -> None:
    """The generate run's tokenizer, taken by default, must still be the file plan checked: a tokenizer.json
    replaced since (same path or key, other bytes) would make ids the engine's counts were not made with."""
    rec = manifest.get("tokenizer") or {}
    if settings.tokenizer != manifest_tokenizer(manifest) or not rec.get("tokenizer_json_sha256"):
        return
    now = builder.provenance.get("tokenizer_json_sha256")
    if now != rec["tokenizer_json_sha256"]:
        raise ConfigError(f"tokenizer {settings.tokenizer!r} changed since the generate run was planned (tokenizer.json "
                          f"sha256 {rec['tokenizer_json_sha256'][:12]}… then, {str(now)[:12]}… now); give the "
                          "tokenizer param to tokenize with this one")


def _differ(pinned: dict[str, Any], settings: TokenizeSettings, builder: TrainingRowBuilder) -> dict[str, Any]:
    """What a pinned settings.json and these settings (with this tokenizer file) disagree on; {} = the same.
    A tokenization with a planted defect (dev/data_defects.py) differs from anything a tokenize run asks for."""
    differ: dict[str, Any] = {}
    pinned_settings = TokenizeSettings.from_dict(pinned)
    if pinned_settings != settings:
        old = pinned_settings.to_dict()  # defaults filled in for keys pinned before they existed
        differ = {k: (old.get(k), v) for k, v in settings.to_dict().items() if old.get(k) != v}
    if pinned.get("defect"):
        differ["defect"] = ((pinned["defect"] or {}).get("name"), None)
    sha = "tokenizer_json_sha256"
    was = ((pinned.get("provenance") or {}).get("tokenizer") or {}).get(sha)
    if was is not None and was != builder.provenance.get(sha):
        differ[sha] = (was, builder.provenance.get(sha))
    return differ


def existing_tokenizations(store: Store, layout: DatasetLayout) -> dict[str, dict[str, Any]]:
    """{name: its pinned settings.json} of every tokenization of the dataset: 'default' (directly under
    tokenized/) and each tokenized/<name>/ holding a settings.json."""
    base = layout.tokenized_as(None)
    out: dict[str, dict[str, Any]] = {}
    doc = _get_json(store, base.tokenized_settings_key)
    if doc is not None:
        out[DEFAULT_TOKENIZATION] = doc
    for name in with_retries(lambda: store.folders(base.tokenizations_prefix), what="list tokenizations"):
        if name in TOKENIZED_RESERVED:
            continue
        doc = _get_json(store, base.tokenized_as(name).tokenized_settings_key)
        if doc is not None:
            out[name] = doc
    return out


def free_name(settings: TokenizeSettings, builder: TrainingRowBuilder, taken: set[str]) -> str:
    """A name for a new tokenization with these settings: s-<8 hex of their sha256> (-2, -3... if taken)."""
    blob = json.dumps({**settings.to_dict(), "tokenizer_json_sha256": builder.provenance.get("tokenizer_json_sha256")},
                      sort_keys=True)
    name = "s-" + hashlib.sha256(blob.encode()).hexdigest()[:8]
    n, candidate = 2, name
    while candidate in taken:
        candidate, n = f"{name}-{n}", n + 1
    return candidate


def choose_tokenization(store: Store, layout: DatasetLayout, settings: TokenizeSettings, builder: TrainingRowBuilder,
                        requested: str | None) -> str:
    """The tokenization this run writes: the name asked for; else the one already made with these settings
    (resumed), else 'default' when free, else a new name (`free_name`). Never rewrites another's files.
    Original answers never take 'default' (the regenerated answers' tokenization): 'original' when free."""
    original = settings.answers == ANSWERS_ORIGINAL
    if original and requested == DEFAULT_TOKENIZATION:
        raise ConfigError(f"{layout.uri}: answers 'original' cannot be the {DEFAULT_TOKENIZATION!r} tokenization (it "
                          f"holds the regenerated answers): give another name, e.g. {ORIGINAL_TOKENIZATION!r}")
    if requested is not None:
        return requested
    existing = existing_tokenizations(store, layout)
    for name, doc in existing.items():
        if not _differ(doc, settings, builder):
            return name
    first = ORIGINAL_TOKENIZATION if original else DEFAULT_TOKENIZATION
    if first not in existing:
        return first
    name = free_name(settings, builder, set(existing))
    logger.info("%s: tokenized/ holds %s made with other settings; this tokenization is %r (tokenized/%s/)",
                layout.uri, sorted(existing), name, name)
    return name


def pin_settings(store: Store, layout: DatasetLayout, settings: TokenizeSettings, builder: TrainingRowBuilder) -> None:
    """Write the tokenization's settings.json once (the settings, its name, plus provenance: the tokenizer
    file's and chat template's sha256, the model and engines from the manifest, SpecForge's template name); a
    later run of the same tokenization must ask for the same settings with the same tokenizer file, and is
    refused otherwise with a free name to write a new tokenization beside it."""
    manifest = _get_json(store, layout.manifest_key) or {}
    name = layout.tokenization or DEFAULT_TOKENIZATION
    doc = {**settings.to_dict(), "tokenization": name, "tokenized_dir": layout.tokenized_dir,
           "provenance": {"tokenizer": builder.provenance, "generation": manifest_provenance(manifest)},
           "specforge_template": specforge_template_name(builder.generation_prompt, settings.enable_thinking),
           # A run may mix modes per row (each row's `thinking` label); SpecForge takes one template per run.
           "specforge_templates": {mode: specforge_template_name(builder.generation_prompt_for(on), on)
                                   for mode, on in (("on", True), ("off", False))}}
    body = json.dumps(doc, indent=1, sort_keys=True).encode()
    if _put_once(store, layout.tokenized_settings_key, body, "application/json"):
        return
    differ = _differ(_get_json(store, layout.tokenized_settings_key) or {}, settings, builder)
    if differ:
        free = free_name(settings, builder, set(existing_tokenizations(store, layout)))
        raise ConfigError(
            f"tokenization {name!r} of {layout.uri} ({layout.tokenized_dir}/) was made with other settings (pinned, "
            f"asked): {differ}. Its files stay as they are: ask for its settings to resume it, or give another "
            f"tokenization name to write a new one beside it, e.g. tokenization={free!r} (free: "
            f"{layout.tokenized_as(free).tokenized_dir}/)"
        )


def list_parts(store: Store, prefix: str) -> list[int]:
    return sorted(c for c in (chunk_of_key(o.key, prefix) for o in store.list(prefix)) if c is not None)


def plan(client: Any, output_uris: list[str], cfg: TokenizeConfig) -> dict[str, Any]:
    """Check each dataset and the tokenizer, pin the settings, split the parts still to do among
    `cfg.workers`. Small result (part indices only) for XCom."""
    datasets: list[dict[str, Any]] = []
    per_worker: list[list[dict[str, Any]]] = [[] for _ in range(cfg.workers)]
    slot = 0
    for uri in dict.fromkeys(output_uris):
        layout = DatasetLayout.from_uri(uri)
        store = Store(client, layout.bucket)
        settings = resolve_settings(store, layout, cfg)
        ct = load_tokenizer(client, settings)  # fail here, before any worker, on a bad tokenizer/template
        check_against_manifest(_get_json(store, layout.manifest_key) or {}, settings, ct)
        load_heldout(client, layout, _get_json(store, layout.manifest_key), settings.heldout_uri)  # and a bad split
        name = choose_tokenization(store, layout, settings, ct, cfg.tokenization)
        layout = layout.tokenized_as(name)
        pin_settings(store, layout, settings, ct)
        parts = list_parts(store, layout.completions_prefix)
        done = set(list_parts(store, layout.tokenized_stats_prefix))
        todo = [c for c in parts if c not in done]
        logger.info("%s: %d parts, %d already tokenized, %d to do; tokenizer %s (template from %s, generation "
                    "prompt %r, end of turn %r then %r)", layout.uri, len(parts), len(parts) - len(todo), len(todo),
                    settings.tokenizer, ct.rec.template_source, ct.generation_prompt, ct.eot, ct.after_eot)
        jobs: list[list[int]] = [[] for _ in range(cfg.workers)]
        for c in todo:
            jobs[slot % cfg.workers].append(c)
            slot += 1
        for w, chunk_list in enumerate(jobs):
            if chunk_list:
                per_worker[w].append({"output_uri": layout.uri, "tokenization": name, "parts": chunk_list,
                                      "settings": settings.to_dict()})
        datasets.append({"output_uri": layout.uri, "tokenization": name, "parts": len(parts),
                         "already_done": len(parts) - len(todo), "settings": settings.to_dict()})
    return {
        "assignments": [{"worker": w, "jobs": jobs} for w, jobs in enumerate(per_worker)],
        "datasets": datasets,
    }


def _read_part(store: Store, key: str, extra: tuple[str, ...] = ()) -> Any:
    got = with_retries(lambda: store.get(key), what=f"read {key}")
    if got is None:
        raise TokenizeFailed(f"s3://{store.bucket}/{key} disappeared")
    pf = pq.ParquetFile(io.BytesIO(got[0]))
    cols = [c for c in (*READ_COLUMNS, *extra) if c in pf.schema_arrow.names]
    return pf.read(columns=cols)


_CONTENT_TYPES = {"parquet": "application/vnd.apache.parquet", "jsonl": "application/x-ndjson"}


def tokenize_part(store: Store, layout: DatasetLayout, chunk: int, ct: TrainingRowBuilder, table: Any,
                  split: HeldoutSplit | None = None, quality: RowFilter | None = None) -> tuple[str, PartStats]:
    """Build one completions part's training rows (held-out conversations refused first, then rows with a
    quality flag of drop_quality; the input rows' labels carried onto them) and write every profile's file,
    then its stats (the part's commit point). Returns ("written" | "lost_race", stats)."""
    s = ct.settings
    filters: list[RowFilter] = []
    if split is not None and split.active:
        filters.append(lambda row: DROP_HELDOUT if split.holds(row["id"]) else None)
    if s.answers == ANSWERS_ORIGINAL:  # every sample of a prompt carries the same original answers: train them once
        filters.append(lambda row: DROP_OTHER_SAMPLE if row.get("sample") else None)
    out, conversations, stats = tokenize_table(table, ct, row_filters=filters, quality_filter=quality,
                                               extra_columns=SIGNAL_COLUMNS if quality is not None else ())
    out = with_labels(out, labels_by_unit(table, s.enable_thinking), s.enable_thinking)
    files = build_profile_files(out, chunk, s.profiles, thinking=s.enable_thinking, conversations=conversations)
    stats.profiles = files.to_dict()
    for rel, data in sorted(files.files.items()):
        _put_once(store, layout.key(rel), data, _CONTENT_TYPES.get(rel.rsplit(".", 1)[-1], "application/octet-stream"))
    doc = {**stats.to_dict(), "mix": mixreport.kept_counts(table, out, s.enable_thinking)}  # the mix after filters
    won = _put_once(store, layout.tokenized_stats_key(chunk), json.dumps(doc).encode(), "application/json")
    return ("written" if won else "lost_race"), stats


def run_assignment(client: Any, assignment: dict[str, Any]) -> dict[str, Any]:
    """One mapped task: tokenize the parts assigned to it (skipping any that exist), part by part."""
    started = time.monotonic()
    summary: dict[str, Any] = {"worker": assignment.get("worker"), "written": 0, "present": 0, "lost_race": 0,
                               "rows": 0, "tokens": 0}
    for job in assignment.get("jobs", []):
        layout = DatasetLayout.from_uri(job["output_uri"]).tokenized_as(job.get("tokenization"))
        store = Store(client, layout.bucket)
        settings = TokenizeSettings.from_dict(job["settings"])
        ct = load_tokenizer(client, settings)
        split = load_heldout(client, layout, _get_json(store, layout.manifest_key), settings.heldout_uri)
        duplicates = load_near_duplicates(store, layout) if NEAR_DUPLICATE in settings.drop_quality else {}
        quality = quality_filter(settings.drop_quality, settings.quality, duplicates)

        def fetch(c: int) -> Any:
            if with_retries(lambda: store.head(layout.tokenized_stats_key(c)), what="head part") is not None:
                return None
            return _read_part(store, layout.part_key(c), ORIGINAL_COLUMNS if settings.answers == ANSWERS_ORIGINAL else ())

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-fetch") as pool:
            chunks = list(job["parts"])
            pending: Future[Any] | None = pool.submit(fetch, chunks[0]) if chunks else None
            for i, c in enumerate(chunks):
                assert pending is not None
                table = pending.result()
                pending = pool.submit(fetch, chunks[i + 1]) if i + 1 < len(chunks) else None
                if table is None:
                    summary["present"] += 1
                    logger.info("part %d of %s is already tokenized; skipped", c, layout.uri)
                    continue
                status, stats = tokenize_part(store, layout, c, ct, table, split, quality)
                summary[status] += 1
                summary["rows"] += stats.rows_out
                summary["tokens"] += stats.tokens
                logger.info("part %d of %s: %s, %d rows in, %d out, %d tokens (%d trained)", c, layout.uri, status,
                            stats.rows_in, stats.rows_out, stats.tokens, stats.loss_tokens)
    summary["elapsed_s"] = round(time.monotonic() - started, 2)
    return summary


STATUS_GATE_FAILED = "kept_too_few"
DEFAULT_MIN_KEPT_SHARE: float = TOKENIZE_PARAM_SCHEMAS["min_kept_share"]["default"]

_SUM_KEYS = ("rows_in", "rows_out", "tokens", "loss_tokens", "truncated_to_max_length", "trained_turns",
             "rows_with_engine_ids", "rows_without_engine_ids", "unverified", "prompt_template_differs",
             "ids_not_canonical")
_COUNT_KEYS = ("dropped", "conversations_by_assistant_turns", "ids_source", "original_answers")
EXAMPLES_IN_REPORT = 100


def build_report(client: Any, dataset: dict[str, Any], target_mix: dict[str, dict[str, float]] | None = None,
                 ) -> dict[str, Any]:
    """Sum the parts' stats; check every completions part has its tokenized part. The mix of the
    completions kept is set against validation's (before filters) and `target_mix`."""
    layout = DatasetLayout.from_uri(dataset["output_uri"]).tokenized_as(dataset.get("tokenization"))
    store = Store(client, layout.bucket)
    parts = list_parts(store, layout.completions_prefix)
    done = set(list_parts(store, layout.tokenized_stats_prefix))
    total: dict[str, Any] = {k: 0 for k in _SUM_KEYS}
    profiles: dict[str, dict[str, Any]] = {}
    counts: dict[str, dict[str, int]] = {k: {} for k in _COUNT_KEYS}
    examples: dict[str, list[str]] = {"unverified_examples": [], "prompt_template_differs_examples": []}
    max_tokens = max_turn = defect_changed = 0
    missing_stats = []
    breakdown: dict[str, Any] = {}
    kept_mix, mix_parts = mixreport.MixTally(), 0
    for c in parts:
        if c not in done:
            continue
        st = _get_json(store, layout.tokenized_stats_key(c))
        if st is None:
            missing_stats.append(c)
            continue
        for k in _SUM_KEYS:
            total[k] += int(st.get(k, 0))
        for name, target in counts.items():
            for k, v in (st.get(name) or {}).items():
                target[k] = target.get(k, 0) + int(v)
        for name, target_list in examples.items():
            room = EXAMPLES_IN_REPORT - len(target_list)
            target_list.extend((st.get(name) or [])[:max(0, room)])
        defect_changed += int(st.get("defect_rows_changed", 0))
        max_tokens = max(max_tokens, int(st.get("max_tokens", 0)))
        max_turn = max(max_turn, int(st.get("max_loss_tokens_per_turn", 0)))
        _add_profiles(profiles, st.get("profiles") or {})
        add_breakdown(breakdown, st)
        if "mix" in st:
            kept_mix.add_counts(st["mix"])
            mix_parts += 1
    missing = [c for c in parts if c not in done]
    rows_out = total["rows_out"]
    dropped = counts["dropped"]
    pinned = _get_json(store, layout.tokenized_settings_key) or {}
    manifest = _get_json(store, layout.manifest_key) or {}
    tok_heldout_uri = (dataset.get("settings") or pinned).get("heldout_uri")
    heldout_split = HeldoutSplit(0.0, uri=tok_heldout_uri) if tok_heldout_uri else HeldoutSplit()
    report: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "output_uri": layout.uri,
        "tokenization": layout.tokenization or DEFAULT_TOKENIZATION,
        "answers": pinned.get("answers", "regenerated"),
        "status": "complete" if not missing and not missing_stats else "incomplete",
        "settings": dataset.get("settings"),
        "provenance": pinned.get("provenance"),
        "specforge_template": pinned.get("specforge_template"),
        "specforge_templates": pinned.get("specforge_templates"),
        "parts": len(parts),
        "parts_tokenized": len(parts) - len(missing),
        "missing_parts": missing[:100],
        "parts_without_stats": missing_stats[:100],
        **total,
        "rows_dropped": sum(dropped.values()),
        "dropped_by_reason": dict(sorted(dropped.items())),
        **sorted_breakdown(breakdown),
        "heldout": split_summary(heldout_split, manifest),
        "ids_source": dict(sorted(counts["ids_source"].items())),
        "original_answers": dict(sorted(counts["original_answers"].items())),
        **examples,
        "tokens_per_row_mean": round(total["tokens"] / rows_out, 1) if rows_out else 0.0,
        "tokens_per_row_max": max_tokens,
        "loss_token_share": round(total["loss_tokens"] / total["tokens"], 4) if total["tokens"] else 0.0,
        "turns": {
            "conversations_by_assistant_turns": dict(sorted(counts["conversations_by_assistant_turns"].items(),
                                                            key=lambda kv: int(kv[0]))),
            "trained_turns": total["trained_turns"],
            "loss_tokens_per_trained_turn_mean": round(total["loss_tokens"] / total["trained_turns"], 1)
            if total["trained_turns"] else 0.0,
            "loss_tokens_per_trained_turn_max": max_turn,
        },
        "profiles": profiles,
        "files": {p: {k: layout.key(g) for k, g in profile_globs(p).items()} for p in profiles},
        "tokenized_prefix": layout.tokenized_prefix,
        "card_key": layout.dataset_card_key,
        "report_key": layout.tokenized_report_key,
    }
    if pinned.get("defect"):  # a planted defect (dev/data_defects.py): what it is and how many rows it changed
        report["defect"] = {**pinned["defect"], "rows_changed": defect_changed}
    validated_mix = (_get_json(store, layout.report_key) or {}).get("mix") or {}
    before = validated_mix.get("counts")
    # A run set off by generate's asset event has no target of its own: the dataset's is the one to meet.
    target_from = "tokenize's target_mix" if target_mix else None
    if not target_mix and validated_mix.get("target"):
        target_mix, target_from = validated_mix["target"], "dflash_generate's target_mix (validation report)"
    report["mix"] = {**mixreport.mix_report(kept_mix.to_counts(), target_mix, before=before,
                                            basis="completions kept by tokenize"), "parts_counted": mix_parts,
                     "target_from": target_from}
    if set((kept_mix.to_counts()["by"].get("language") or {})) <= {mixreport.UNKNOWN}:
        report["mix"]["dimensions"]["language"]["note"] = (
            "tokenize identifies no language unless drop_quality has 'language' with `languages` set; "
            "validation's mix has the languages of every completion")
    return report


def _add_profiles(total: dict[str, dict[str, Any]], part: dict[str, Any]) -> None:
    """Sum one part's profile figures (ProfileOutput.to_dict) into {profile: {rows, conversations...}}."""
    for name, rows in (part.get("rows") or {}).items():
        if name == "specforge_conversations":
            continue
        total.setdefault(name, {"rows": 0})["rows"] += int(rows)
    conv = part.get("specforge_conversations")
    if conv:
        agg = total.setdefault("specforge", {"rows": 0}).setdefault(
            "specforge_conversations", {"rows": 0, "skipped": {}, "without_system_message": 0})
        agg["rows"] += int(conv.get("rows", 0))
        agg["without_system_message"] += int(conv.get("without_system_message", 0))
        for k, v in (conv.get("skipped") or {}).items():
            agg["skipped"][k] = agg["skipped"].get(k, 0) + int(v)


def report_markdown(r: dict[str, Any]) -> str:
    s = r.get("settings") or {}
    src = r.get("ids_source") or {}
    lines = [
        f"# tokenized: {r['output_uri']} (tokenization `{r.get('tokenization', 'default')}`)", "",
        f"Status **{r['status']}**: {r['parts_tokenized']} of {r['parts']} parts. Tokenizer `{s.get('tokenizer')}`, "
        f"max_length {s.get('max_length')}, train_turns `{s.get('train_turns')}`, loss_on_reasoning "
        f"{s.get('loss_on_reasoning')}, drop_truncated {s.get('drop_truncated')}, train_eot_newline "
        f"{s.get('train_eot_newline')}, keep_unverified {s.get('keep_unverified')}.", "",
        *answers_lines(r), "",
        "| figure | value |", "|---|---:|",
        f"| completions rows in | {r['rows_in']:,} |",
        *([] if r.get("answers") == ANSWERS_ORIGINAL else [
            f"| ... with the engine's token ids / without | {r['rows_with_engine_ids']:,} / "
            f"{r['rows_without_engine_ids']:,} |"]),
        f"| training rows out | {r['rows_out']:,} |",
        f"| ... ids from the engine | {src.get('engine', 0):,} |",
        f"| ... re-encoded and checked against the engine's counts | {src.get('retokenized', 0):,} |",
        *([f"| ... original answers, encoded from their text (not token-exact) | {src['original']:,} |"]
          if "original" in src else []),
        *(f"| dropped: {k} | {v:,} |" for k, v in r["dropped_by_reason"].items()),
        f"| re-encoded turns whose counts differ from the engine's | {r['unverified']:,} |",
        f"| engine prompts that differ from this tokenizer + template | {r['prompt_template_differs']:,} |",
        f"| total tokens | {r['tokens']:,} |",
        f"| loss tokens | {r['loss_tokens']:,} ({r['loss_token_share']:.1%}) |",
        f"| rows cut at max_length | {r['truncated_to_max_length']:,} |",
        f"| tokens per row (mean / max) | {r['tokens_per_row_mean']:,} / {r['tokens_per_row_max']:,} |",
        f"| loss tokens per training row (mean / max) | {r['turns']['loss_tokens_per_trained_turn_mean']:,} / "
        f"{r['turns']['loss_tokens_per_trained_turn_max']:,} |",
        "", "Conversations by assistant turns: "
        + ", ".join(f"{k}: {v:,}" for k, v in r["turns"]["conversations_by_assistant_turns"].items()),
    ]
    g = r.get("gate")
    if g:
        verdict = "passed" if g["passed"] else "**FAILED**: the run fails and no dataset card is written"
        lines += ["", f"Gate: kept {g['rows_kept']:,} of {g['rows_counted']:,} training rows ({g['kept_share']:.1%}; "
                  f"held-out rows not counted), min_kept_share {g['min_kept_share']}: {verdict}."]
    table = breakdown_lines(r)
    if table:
        lines += ["", *table]
    split = r.get("heldout")
    if split:
        lines += ["", f"Held-out split: fraction {split.get('fraction', 0.0)}, salt `{split.get('salt', 'n/a')}`, "
                  f"{split.get('count', 0):,} prompts in `{split.get('key', 'n/a')}`; tokenize heldout_uri "
                  f"`{split.get('tokenize_heldout_uri') or 'none'}`; rows refused: {r['dropped_by_reason'].get('heldout', 0):,}."]
    if r["unverified_examples"]:
        lines += ["", f"Re-encoded turns that differ from the engine's counts (first {len(r['unverified_examples'])}):", ""]
        lines += [f"- `{e}`" for e in r["unverified_examples"]]
    if r["prompt_template_differs_examples"]:
        lines += ["", "Engine prompts that differ from this tokenizer + template (their engine ids were used; "
                  "a tokenizer or template that is not the served model's shows here):", ""]
        lines += [f"- `{e}`" for e in r["prompt_template_differs_examples"]]
    if r["missing_parts"]:
        lines += ["", f"Missing parts (first 100): {r['missing_parts']}"]
    mix = r.get("mix")
    if mix and mix.get("parts_counted", 0) < r["parts_tokenized"]:
        lines += ["", f"Mix: {r['parts_tokenized'] - mix.get('parts_counted', 0)} part(s) were tokenized before the "
                  "mix was recorded and are not in it."]
    return "\n".join(lines) + "\n" + mixreport.markdown(mix, "mix after filters")


def answers_lines(r: dict[str, Any]) -> list[str]:
    """What the rows train, for report.md: the regenerated answers, the input's original ones, or a planted defect."""
    lines = ["One training row per regenerated assistant turn; loss only on the tokens the model generated."]
    if r.get("answers") == ANSWERS_ORIGINAL:
        notes = r.get("original_answers") or {}
        lines = [
            "**answers: original**: the input's own answers (`original_messages`) at the regenerated turns' places, "
            "as a user who did not regenerate would train on them; loss on the answers' tokens. **Not token-exact**: "
            "no engine ids, the text encoded with this tokenizer and chat template in each row's thinking mode. "
            "Quality flags of the regenerated answers were not applied (only the prompt's: near_duplicate).", "",
            f"Thinking-on rows whose original answer had no reasoning (the template's empty think block is trained, "
            f"as SpecForge trains it on the raw data): {notes.get('thinking_on_without_reasoning', 0):,}; "
            f"thinking-off rows whose original reasoning was left out: {notes.get('thinking_off_reasoning_left_out', 0):,}.",
        ]
    defect = r.get("defect")
    if defect:
        lines = [f"**PLANTED DEFECT `{defect.get('name')}`** (dev tooling, for the data-sensitivity experiment; never "
                 f"train a drafter for use on it): {defect.get('what')} Derived from tokenization "
                 f"`{defect.get('source_tokenization')}`; rows changed: {defect.get('rows_changed', 0):,}.", "", *lines]
    return lines


def write_report(client: Any, dataset: dict[str, Any], min_kept_share: float = DEFAULT_MIN_KEPT_SHARE,
                 target_mix: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """Build and write tokenized/report.json + .md and the dataset card (README.md at the dataset root);
    raise TokenizeFailed (after writing the report, before the card) when incomplete or when the rows kept
    are fewer than `min_kept_share` of those counted (gates.py). `target_mix` is set next to the mix kept."""
    report = build_report(client, dataset, target_mix)
    if report["status"] == "complete":
        report["gate"] = gate(report, min_kept_share)
        if not report["gate"]["passed"]:
            report["status"] = STATUS_GATE_FAILED
    layout = DatasetLayout.from_uri(dataset["output_uri"]).tokenized_as(dataset.get("tokenization"))
    store = Store(client, layout.bucket)
    with_retries(lambda: store.put(layout.tokenized_report_key, json.dumps(report, indent=1).encode(),
                                   content_type="application/json"), what="write tokenized report")
    md = report_markdown(report)
    with_retries(lambda: store.put(layout.tokenized_report_md_key, md.encode(), content_type="text/markdown"),
                 what="write tokenized report.md")
    logger.info("tokenized report for %s:\n%s", layout.uri, md)
    if report["status"] == STATUS_GATE_FAILED:
        raise TokenizeFailed(failure_message(report))
    if report["status"] != "complete":
        raise TokenizeFailed(
            f"{layout.uri}: {len(parts_missing := report['missing_parts'])} part(s) not tokenized (first: "
            f"{parts_missing[:10]}), {len(report['parts_without_stats'])} without stats; rerun the failed tokenize "
            "tasks or trigger dflash_tokenize again with this output_uri (done parts are skipped)"
        )
    pinned = _get_json(store, layout.tokenized_settings_key) or dataset.get("settings") or {}
    manifest = _get_json(store, layout.manifest_key) or {}
    card = dataset_card(report, pinned, manifest, tokenizations=existing_tokenizations(store, layout))
    with_retries(lambda: store.put(layout.dataset_card_key, card.encode(), content_type="text/markdown"),
                 what="write the dataset card")
    return report
