"""validate_and_count: is every planned prompt present exactly once, and what did we get?

Validation is a merge of the parts' digests (digest.py: each part's counts, token figures and
quality signals without its text, written by the generate worker that committed the part). A part
without a usable digest (an older root, a crash between the part and its digest, a repaired part,
other settings) has its digest computed here from the part and its planned ids, and written, so
nothing depends on the happy path; `compute_digests` does that work for one shard of the chunks in a
mapped task beforehand when one worker is not enough. The near-duplicate prompts come from the plan's
prompts (near_dup.py: the DAG's near_duplicates task, or computed here when missing).

Memory holds a few digests in flight, fixed-size histograms and an 8-byte hash per row, whatever
the dataset's size; the id lists go to temporary files and then to S3 in full, signals.parquet is
streamed from a spool. The report is written even when validation fails, so the reason can be read
next to the data.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from dflash_pipeline.config.quality import QualitySettings
from dflash_pipeline.dataset.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.dataset.records import read_parquet, unit_keys
from dflash_pipeline.dataset.store import ObjectInfo, Store, upload_file, with_retries
from dflash_pipeline.steps.quality import near_dup
from dflash_pipeline.steps.quality import tally as quality_tally
from dflash_pipeline.steps.validate import acceptance
from dflash_pipeline.steps.validate import mix as mixreport
from dflash_pipeline.steps.validate.breakdown import LabelTally
from dflash_pipeline.steps.validate.breakdown import markdown as label_markdown
from dflash_pipeline.steps.validate.breakdown import report_fields as label_report_fields
from dflash_pipeline.steps.validate.checks import Validator
from dflash_pipeline.steps.validate.digest import (
    TEXT_COLUMNS,
    Digest,
    DigestContext,
    decode_digest,
    encode_digest,
    etag_md5,
    make_digest,
    missing_digest,
    part_md5,
    usable,
)
from dflash_pipeline.steps.validate.report import (
    VALIDATION_DIR,
    Thresholds,
    build_report,
    plot_keys,
    report_markdown,
    side_file_keys,
)
from dflash_pipeline.steps.validate.tally import LIST_LIMIT

logger = logging.getLogger(__name__)

PREFETCH = 16
"""Digests fetched (or computed) ahead: S3 latency overlaps with the merge; bounds memory."""
FETCH_THREADS = 8


class ValidationFailed(Exception):
    """The dataset is incomplete, has duplicates or breaks a threshold; the message names the figures."""


@dataclass
class Listing:
    """What S3 holds for the dataset now: parts, digests, retry flags, stray objects."""

    parts: dict[int, ObjectInfo] = field(default_factory=dict)
    digests: dict[int, ObjectInfo] = field(default_factory=dict)
    markers: set[int] = field(default_factory=set)
    stray: list[str] = field(default_factory=list)
    stray_count: int = 0


@dataclass
class Sources:
    """How each digest was had: read as stored, or computed here (and why)."""

    stored: int = 0
    computed: int = 0
    absent_parts: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"stored": self.stored, "computed": self.computed, "absent_parts": self.absent_parts,
                "computed_because": dict(sorted(self.reasons.items()))}


def read_manifest(store: Store, layout: DatasetLayout) -> dict[str, Any]:
    got = with_retries(lambda: store.get(layout.manifest_key), what="read manifest")
    if got is None:
        raise ValidationFailed(f"{layout.uri}: no manifest.json: plan did not finish (its own failure says why), so "
                               "nothing was generated and there is nothing to validate")
    return json.loads(got[0])


def list_dataset(store: Store, layout: DatasetLayout, n_chunks: int) -> Listing:
    """One listing of completions/, digests/ and retry/ (parts outside the plan are strays)."""
    out = Listing()
    for obj in store.list(layout.completions_prefix):
        c = chunk_of_key(obj.key, layout.completions_prefix)
        if c is None or c >= n_chunks:
            out.stray_count += 1
            if len(out.stray) < LIST_LIMIT:
                out.stray.append(obj.key)
        else:
            out.parts[c] = obj
    for obj in store.list(layout.digests_prefix):
        c = chunk_of_key(obj.key, layout.digests_prefix)
        if c is not None:
            out.digests[c] = obj
    out.markers = {c for c in (chunk_of_key(o.key, layout.retry_prefix) for o in store.list(layout.retry_prefix))
                   if c is not None}
    return out


def load_recounter_for(client: Any, tokenizer: str | None, thinking: bool) -> Any:
    """The training tokenizer's recounter (tokencount.py), or None without the `tokenizer` param."""
    if not tokenizer:
        return None
    from dflash_pipeline.steps.validate.tokencount import load_recounter

    def s3_get(bucket: str, key: str) -> bytes | None:
        res = with_retries(lambda: Store(client, bucket).get(key), what=f"read tokenizer {key}")
        return None if res is None else res[0]

    return load_recounter(tokenizer, s3_get, enable_thinking=thinking)


def digest_context(manifest: dict[str, Any], quality: QualitySettings | None, recounter: Any,
                   tokenizer: str | None) -> DigestContext:
    return DigestContext(plan_id=manifest["plan_id"], thinking=bool(manifest["pinned"]["sampling"]["enable_thinking"]),
                         quality=quality if quality is not None and quality.enabled else None,
                         recounter=recounter, tokenizer=tokenizer if recounter is not None else None)


def planned_ids(store: Store, layout: DatasetLayout, plan_id: str, c: int) -> list[str]:
    """Chunk c's planned unit keys, from inputs/."""
    data = with_retries(lambda: store.get(layout.input_key(plan_id, c)), what=f"read input {c}")
    if data is None:
        raise ValidationFailed(f"input of chunk {c} is missing; the plan under {layout.uri} is damaged")
    planned = read_parquet(data[0], _present(data[0], ["id", "sample"]))
    return unit_keys(planned.column("id").to_pylist(),
                     planned.column("sample").to_pylist() if "sample" in planned.column_names else None)


def _present(data: bytes, columns: list[str]) -> list[str]:
    """The wanted columns a Parquet file has (parts and inputs of older versions lack the new ones)."""
    import io

    import pyarrow.parquet as pq

    names = set(pq.read_schema(io.BytesIO(data)).names)
    return [c for c in columns if c in names]


PART_COLUMNS = (
    "id", "sample", "finish_reason", "prompt_tokens", "completion_tokens", "reasoning_tokens", "server", "latency_s",
    "error_class", "retryable", "turns", "cut_short", "cached_tokens", "source", "domain", "thinking",
    *TEXT_COLUMNS, *acceptance.READ_COLUMNS,
)
"""Part columns a digest is made from (older parts lack some: read when present)."""


def digest_of_part(data: bytes, planned: list[str], c: int, ctx: DigestContext) -> Digest:
    """A part's digest from its bytes (the worker's hook and validation call this one function)."""
    table = read_parquet(data, _present(data, list(dict.fromkeys(PART_COLUMNS))))
    return make_digest(table, planned, c, part_md5(data), ctx)


def stored_digest(store: Store, layout: DatasetLayout, listing: Listing, c: int, ctx: DigestContext) -> tuple[Digest | None, str]:
    """Chunk c's stored digest when it stands for the part listed now; else (None, why not)."""
    if c not in listing.digests:
        return None, "no digest"
    got = with_retries(lambda: store.get(layout.digest_key(c)), what=f"read digest {c}")
    if got is None:
        return None, "no digest"
    try:
        d = decode_digest(got[0])
    except Exception as exc:  # noqa: BLE001 - an unreadable digest is recomputed, never trusted
        logger.warning("digest of chunk %d unreadable (%s): recomputed", c, exc)
        return None, "unreadable digest"
    if usable(d, plan_id=ctx.plan_id, md5=etag_md5(listing.parts[c].etag), fp=ctx.fingerprint):
        return d, "stored"
    return None, "digest of another part or settings"


def digest_for(store: Store, layout: DatasetLayout, listing: Listing, c: int, ctx: DigestContext) -> tuple[Digest, str]:
    """Chunk c's digest: the stored one when usable, else computed from the part (and written)."""
    if c not in listing.parts:
        return missing_digest(planned_ids(store, layout, ctx.plan_id, c), c, ctx), "absent"
    d, why = stored_digest(store, layout, listing, c, ctx)
    if d is not None:
        return d, why
    blob = with_retries(lambda: store.get(listing.parts[c].key), what=f"read part {c}")
    if blob is None:  # deleted since the listing
        return missing_digest(planned_ids(store, layout, ctx.plan_id, c), c, ctx), "absent"
    d = digest_of_part(blob[0], planned_ids(store, layout, ctx.plan_id, c), c, ctx)
    write_digest(store, layout, d)
    return d, why


def write_digest(store: Store, layout: DatasetLayout, d: Digest) -> None:
    data = encode_digest(d)
    with_retries(lambda: store.put(layout.digest_key(d.chunk), data, content_type="application/vnd.apache.parquet"),
                 what=f"write digest {d.chunk}")


def iter_digests(store: Store, layout: DatasetLayout, listing: Listing, n_chunks: int, ctx: DigestContext,
                 sources: Sources) -> Iterator[Digest]:
    """Every chunk's digest in plan order, PREFETCH ahead on FETCH_THREADS threads."""
    with ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="validate-fetch") as pool:
        pending: deque[Future[tuple[Digest, str]]] = deque()
        chunks = iter(range(n_chunks))
        for c in chunks:
            pending.append(pool.submit(digest_for, store, layout, listing, c, ctx))
            if len(pending) >= PREFETCH:
                break
        while pending:
            d, why = pending.popleft().result()
            nxt = next(chunks, None)
            if nxt is not None:
                pending.append(pool.submit(digest_for, store, layout, listing, nxt, ctx))
            if why == "stored":
                sources.stored += 1
            elif why == "absent":
                sources.absent_parts += 1
            else:
                sources.computed += 1
                sources.reasons[why] = sources.reasons.get(why, 0) + 1
            yield d


def compute_digests(client: Any, output_uri: str, shard: int, shards: int, tokenizer: str | None = None,
                    quality: QualitySettings | None = None) -> dict[str, Any]:
    """The digests of chunks `shard`, `shard + shards`, ... that have a part but no usable digest: the
    remaining validation work, spread over mapped tasks (each on its own Airflow worker) before the merge."""
    layout = DatasetLayout.from_uri(output_uri)
    store = Store(client, layout.bucket)
    manifest = read_manifest(store, layout)
    n = len(manifest["chunks"]["sizes"])
    ctx = digest_context(manifest, quality or QualitySettings(), load_recounter_for(
        client, tokenizer, bool(manifest["pinned"]["sampling"]["enable_thinking"])), tokenizer)
    listing = list_dataset(store, layout, n)
    started = time.monotonic()
    done = computed = 0
    for c in range(shard, n, shards):
        if c not in listing.parts:
            continue
        _, why = digest_for(store, layout, listing, c, ctx)
        done += 1
        computed += why != "stored"
    logger.info("shard %d/%d: %d part(s), %d digest(s) computed in %.1fs", shard, shards, done, computed,
                time.monotonic() - started)
    return {"shard": shard, "shards": shards, "parts": done, "computed": computed}


def near_duplicates(store: Store, layout: DatasetLayout, manifest: dict[str, Any],
                    quality: QualitySettings) -> tuple[dict[str, tuple[str, float]], dict[str, Any], str]:
    """The plan's near-duplicate prompts: the stored list when it was made for this plan and settings,
    else computed from inputs/ now (and written)."""
    settings = near_dup.near_settings(quality.near_duplicate_threshold, quality.near_duplicate_num_perm,
                                      manifest["plan_id"])
    found = near_dup.load_near_duplicates_for(store, layout, settings)
    if found is not None:
        rows, summary = found
        return rows, dict(summary, computed="beside generation"), layout.near_duplicates_key
    logger.info("no near-duplicate list for this plan and settings: searching the plan's prompts now")
    listed, summary = near_dup.find_in_inputs(store, layout, manifest["plan_id"], len(manifest["chunks"]["sizes"]),
                                              quality.near_duplicate_threshold, quality.near_duplicate_num_perm)
    key = near_dup.write_near_duplicates_for(store, layout, listed, settings, summary)
    return {i: (d, s) for i, d, s in listed}, dict(summary, computed="at validation"), key


class Tallies:
    """Every fold of validation, fed one digest at a time, in plan order."""

    def __init__(self, thinking: bool, recounter: Any, quality: QualitySettings | None,
                 near: tuple[dict[str, tuple[str, float]], dict[str, Any], str] | None) -> None:
        self.thinking = thinking
        self.v = Validator(thinking, recounter)
        self.spec = acceptance.AcceptanceTally(thinking)
        self.labels = LabelTally()
        self.mix = mixreport.MixTally()
        self.signals = (quality_tally.QualityTally(quality, near[0], near[1]) if quality is not None and near
                        else None)
        self.near_key = near[2] if near else None

    def add(self, d: Digest) -> None:
        table = d.table
        if not d.meta.get("absent"):
            self.spec.add(table)
            self.labels.add(table)
            if self.signals is not None:
                self.signals.add_digest(table)
            # the mix counts languages from the signals' tally (use_languages: "undetermined" included), not
            # from the digest's per-row `language` column
            self.mix.add(table.drop_columns(["language"]) if "language" in table.column_names else table,
                         self.thinking)
        self.v.add_digest(d)

    def close(self) -> None:
        self.v.close()
        if self.signals is not None:
            self.signals.close()


def ensure_marker(store: Store, layout: DatasetLayout, d: Digest, flagged: bool) -> None:
    """Re-create the retry flag of a part with error rows if a killed worker never wrote it."""
    errs = d.meta.get("part_errors") or {}
    n = int(errs.get("errors", 0)) + int(errs.get("unfinished", 0))
    if flagged or d.meta.get("absent") or not n:
        return
    retryable = int(errs.get("retryable", 0)) + int(errs.get("unfinished", 0))
    body = {"run_id": "validation", "retryable": retryable, "permanent": n - retryable}
    with_retries(lambda: store.put(layout.retry_key(d.chunk), json.dumps(body).encode()), what="marker")
    logger.info("chunk %d has %d error row(s) without a retry flag; flagged for the next run", d.chunk, n)


def fold(store: Store, layout: DatasetLayout, listing: Listing, n_chunks: int, ctx: DigestContext, tallies: Tallies,
         sources: Sources, started: float) -> None:
    """Merge every chunk's digest into the tallies (plan order)."""
    t = tallies.v.t
    t.chunks = n_chunks
    t.stray_parts, t.stray_parts_count = list(listing.stray), listing.stray_count
    for d in iter_digests(store, layout, listing, n_chunks, ctx, sources):
        ensure_marker(store, layout, d, d.chunk in listing.markers)
        tallies.add(d)
        if d.chunk and d.chunk % 500 == 0:
            logger.info("merged %d of %d chunks (%d rows) in %.0fs", d.chunk, n_chunks, t.completions + t.errors,
                        time.monotonic() - started)
    tallies.v.finish()


def write_side_files(store: Store, layout: DatasetLayout, v: Validator) -> dict[str, Any]:
    """All missing / duplicate / unexpected ids, one per line."""
    files: dict[str, Any] = {}
    keys = side_file_keys(layout)
    for name, spool in (("missing_ids", v.missing), ("duplicate_ids", v.duplicates), ("unexpected_ids", v.unexpected)):
        upload_file(store, keys[name], spool.file(), "text/plain")
        files[name] = keys[name]
    return files


def write_plots(store: Store, layout: DatasetLayout, tallies: Tallies, manifest: dict[str, Any],
                thresholds: Thresholds, mix_section: dict[str, Any]) -> list[str]:
    from dflash_pipeline.steps.validate.plots import render_all

    t = tallies.v.t
    pre = build_report(t, manifest, layout, thresholds)
    pngs = render_all(t.by_finish, t.think_vs_answer, t.think_vs_answer_unit, t.think_vs_answer_skipped,
                      pre["per_server"], f"completion length by finish_reason: {layout.uri}")
    pkeys = plot_keys(layout)
    for name, png in pngs.items():
        with_retries(lambda: store.put(pkeys[name], png, content_type="image/png"), what=f"write {pkeys[name]}")
    out = [pkeys[n] for n in pngs]
    png = mixreport.render(mix_section, f"mix of the completions (before filters): {layout.uri}")
    if png is not None:
        key = f"{layout.root}/{mixreport.PLOT_FILE}"
        with_retries(lambda: store.put(key, png, content_type="image/png"), what=f"write {key}")
        out.append(key)
    return out


def assemble_report(tallies: Tallies, manifest: dict[str, Any], layout: DatasetLayout, thresholds: Thresholds,
                    files: dict[str, Any], mix_section: dict[str, Any], sources: Sources) -> dict[str, Any]:
    report = build_report(tallies.v.t, manifest, layout, thresholds, files)
    report["acceptance"] = tallies.spec.report()
    report.update(label_report_fields(tallies.labels, manifest))
    q = tallies.signals
    report["quality"] = q.report() if q is not None else quality_tally.disabled_report()
    if q is not None:
        files["near_duplicates"] = q.near_key
        files["quality_signals"] = q.signals_key
        report["files"] = files
    report["mix"] = mix_section
    report["digests"] = sources.to_dict()
    if thresholds.max_loop_rate is not None and q is not None:
        check_loops(report, q.rows_loop, q.rows, thresholds.max_loop_rate)
    return report


def check_loops(report: dict[str, Any], loops: int, rows: int, limit: float) -> None:
    """max_loop_rate: completions with a repetition loop (in the reasoning or the answer) / completions."""
    value = loops / rows if rows else 0.0
    check = {"name": "loop_rate", "value": round(value, 6), "threshold": "max_loop_rate", "limit": limit,
             "ok": value <= limit, "figure": f"loop rate {100 * value:.2f}% ({loops} of {rows} completions hold a "
                                             "repetition loop)"}
    report["checks"].append(check)
    if not check["ok"]:
        report["problems"].append(f"{check['figure']} is above max_loop_rate={100 * limit:.2f}%")
        report["status"] = "failed"


def write_report(store: Store, layout: DatasetLayout, report: dict[str, Any]) -> str:
    with_retries(
        lambda: store.put(layout.report_key, json.dumps(report, indent=1).encode(), content_type="application/json"),
        what="write report",
    )
    md = (report_markdown(report) + label_markdown(report) + quality_tally.markdown(report["quality"])
          + mixreport.markdown(report["mix"], "mix (before filters)", plot_key=mixreport.plot_key(report["files"]))
          + acceptance.markdown(report["acceptance"]))
    with_retries(lambda: store.put(layout.report_md_key, md.encode(), content_type="text/markdown"), what="write report.md")
    return md


def failure_message(layout: DatasetLayout, report: dict[str, Any]) -> str:
    return (
        f"{layout.uri} failed validation: " + "; ".join(report["problems"])
        + f". Details in s3://{layout.bucket}/{layout.report_key} (all ids under "
        f"s3://{layout.bucket}/{layout.root}/{VALIDATION_DIR}/). Missing rows or error rows: rerun the failed "
        "generate tasks (airflow dags clear dflash_generate --run-id <run> --only-failed -y) or trigger a new run "
        "into the same output_uri (only the missing work is done; retry_failed_rows='all' retries permanent errors). "
        "Truncation: raise max_tokens (into a new output_uri) or max_truncation_rate if truncated rows are acceptable. "
        "Missing reasoning: start the named servers with a reasoning parser (SGLang --reasoning-parser qwen3) "
        "and regenerate into a new output_uri."
    )


def run_validation(
    client: Any,
    output_uri: str,
    thresholds: Thresholds | None = None,
    tokenizer: str | None = None,
    plots: bool = True,
    quality: QualitySettings | None = None,
    target_mix: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Check the dataset under `output_uri` against its plan; write the report, side files and plots.

    Raises ValidationFailed (after writing everything) when the dataset is not complete and exact
    or breaks a threshold. The quality signals (`quality`, default settings when None) are counted in
    the report and never fail it. `target_mix` (config.mix) is shown next to the mix; it never fails validation.
    """
    started = time.monotonic()
    thresholds = thresholds or Thresholds()
    quality = quality or QualitySettings()
    layout = DatasetLayout.from_uri(output_uri)
    store = Store(client, layout.bucket)
    manifest = read_manifest(store, layout)
    n_chunks = len(manifest["chunks"]["sizes"])
    thinking = bool(manifest["pinned"]["sampling"]["enable_thinking"])
    recounter = load_recounter_for(client, tokenizer, thinking)
    ctx = digest_context(manifest, quality, recounter, tokenizer)
    listing = list_dataset(store, layout, n_chunks)
    near = near_duplicates(store, layout, manifest, quality) if quality.enabled else None
    tallies = Tallies(thinking, recounter, quality if quality.enabled else None, near)
    sources = Sources()
    try:
        fold(store, layout, listing, n_chunks, ctx, tallies, sources, started)
        if tallies.signals is not None:
            tallies.signals.finish(store, layout, tallies.near_key)
        files = write_side_files(store, layout, tallies.v)
    finally:
        tallies.close()
    files["report_md"] = layout.report_md_key
    if tallies.signals is not None:
        tallies.mix.use_languages(tallies.signals.languages)  # the answers' languages, from the signals
    mix_section = mixreport.mix_report(tallies.mix.to_counts(), target_mix)
    if plots:
        files["plots"] = write_plots(store, layout, tallies, manifest, thresholds, mix_section)
    report = assemble_report(tallies, manifest, layout, thresholds, files, mix_section, sources)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    md = write_report(store, layout, report)
    logger.info("report for %s (digests: %s):\n%s", layout.uri, sources.to_dict(), md)
    if report["problems"]:
        raise ValidationFailed(failure_message(layout, report))
    return report


__all__ = ["PART_COLUMNS", "ValidationFailed", "compute_digests", "digest_of_part", "run_validation"]
