"""validate_and_count: is every planned prompt present exactly once, and what did we get?

It streams chunk by chunk (the planned ids of one chunk, then its part, fetched a few chunks
ahead), and every per-row check is vectorised over the part with pyarrow/numpy. Memory holds a
few chunks, fixed-size histograms and an 8-byte hash per row (to tell a duplicate in another part
from an id that was never planned), whatever the dataset's size; the id lists (missing,
duplicate, unexpected) go to temporary files and then to S3 in full, the report keeps the first
few. The report is written even when validation fails, so the reason can be read next to the data.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

import pyarrow as pa
import pyarrow.compute as pc

from dflash_pipeline.config.quality import QualitySettings
from dflash_pipeline.dataset.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.dataset.records import read_parquet, unit_keys
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.steps.quality import tally as quality_tally
from dflash_pipeline.steps.validate import acceptance
from dflash_pipeline.steps.validate.checks import Validator, to_numpy, unfinished_mask
from dflash_pipeline.steps.validate.report import (
    VALIDATION_DIR,
    Thresholds,
    build_report,
    plot_keys,
    report_markdown,
    side_file_keys,
)
from dflash_pipeline.steps.validate.breakdown import READ_COLUMNS as LABEL_READ_COLUMNS
from dflash_pipeline.steps.validate.breakdown import LabelTally
from dflash_pipeline.steps.validate.breakdown import markdown as label_markdown
from dflash_pipeline.steps.validate.breakdown import report_fields as label_report_fields
from dflash_pipeline.steps.validate.tally import LIST_LIMIT
from dflash_pipeline.steps.validate import mix as mixreport

logger = logging.getLogger(__name__)


PREFETCH = 4
"""Chunks fetched ahead (input + part): S3 latency overlaps with the checks; bounds memory."""
SMALL_UPLOAD = 32 << 20
PART_READ_COLUMNS = [
    "id",
    "reasoning",
    "content",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "server",
    "latency_s",
    "error_class",
    "retryable",
    # Added with samples and all_turns; parts written before them lack these (read when present).
    "sample",
    "turns",
    "cut_short",
    "cached_tokens",
    # Kept since engine token ids: rows with / without them, and a check of their length against usage.
    "output_token_ids",
]


class ValidationFailed(Exception):
    """The dataset is incomplete, has duplicates or breaks a threshold; the message names the figures."""


def _ensure_marker(store: Store, layout: DatasetLayout, c: int, part: pa.Table, has: bool) -> None:
    """Re-create the retry flag of a part with error rows if a killed worker never wrote it."""
    if has:
        return
    is_err = to_numpy(pc.greater(pc.binary_length(part.column("error_class")), 0), False)
    unfinished = unfinished_mask(part) & ~is_err  # retryable "Unfinished" rows of older code
    if not (is_err.any() or unfinished.any()):
        return
    retryable = int(to_numpy(part.filter(pa.array(is_err)).column("retryable"), False).sum()) + int(unfinished.sum())
    n = int(is_err.sum()) + int(unfinished.sum())
    body = {"run_id": "validation", "retryable": retryable, "permanent": n - retryable}
    with_retries(lambda: store.put(layout.retry_key(c), json.dumps(body).encode()), what="marker")
    logger.info("chunk %d has %d error row(s) without a retry flag; flagged for the next run", c, n)


def _present(data: bytes, columns: list[str]) -> list[str]:
    """The wanted columns a Parquet file has (parts and inputs of older versions lack the new ones)."""
    import io

    import pyarrow.parquet as pq

    names = set(pq.read_schema(io.BytesIO(data)).names)
    return [c for c in columns if c in names]


def _upload(store: Store, key: str, fh: IO[bytes], content_type: str) -> None:
    """Small files in one PUT (with our retries), large ones as a streamed multipart upload."""
    size = fh.seek(0, 2)
    fh.seek(0)
    if size <= SMALL_UPLOAD:
        data = fh.read()
        with_retries(lambda: store.put(key, data, content_type=content_type), what=f"write {key}")
    else:
        store.client.upload_fileobj(fh, store.bucket, key, ExtraArgs={"ContentType": content_type})


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
    layout = DatasetLayout.from_uri(output_uri)
    store = Store(client, layout.bucket)
    got = with_retries(lambda: store.get(layout.manifest_key), what="read manifest")
    if got is None:
        raise ValidationFailed(f"{layout.uri}: manifest.json is missing")
    manifest = json.loads(got[0])
    sizes: list[int] = manifest["chunks"]["sizes"]
    plan_id = manifest["plan_id"]
    thinking = bool(manifest["pinned"]["sampling"]["enable_thinking"])

    recounter = None
    columns = list(PART_READ_COLUMNS) + [c for c in LABEL_READ_COLUMNS if c not in PART_READ_COLUMNS]
    labels = LabelTally()
    mix = mixreport.MixTally()
    columns += [c for c in mixreport.READ_COLUMNS if c not in columns]
    if tokenizer:
        from dflash_pipeline.steps.validate.tokencount import load_recounter

        def s3_get(bucket: str, key: str) -> bytes | None:
            res = with_retries(lambda: Store(client, bucket).get(key), what=f"read tokenizer {key}")
            return None if res is None else res[0]

        recounter = load_recounter(tokenizer, s3_get, enable_thinking=thinking)
        columns += ["messages", "conversation"]

    columns += [c for c in acceptance.READ_COLUMNS if c not in columns]
    quality = quality or QualitySettings()
    signals = (quality_tally.QualityTally(quality, workers=quality_tally.pool_size(quality, sum(sizes)))
               if quality.enabled else None)
    if signals is not None:
        columns += [c for c in quality_tally.READ_COLUMNS if c not in columns]
    spec = acceptance.AcceptanceTally(thinking)
    v = Validator(thinking, recounter)
    t = v.t
    t.chunks = len(sizes)
    parts: dict[int, str] = {}
    for obj in store.list(layout.completions_prefix):
        c = chunk_of_key(obj.key, layout.completions_prefix)
        if c is None or c >= len(sizes):
            t.stray_parts_count += 1
            if len(t.stray_parts) < LIST_LIMIT:
                t.stray_parts.append(obj.key)
        else:
            parts[c] = obj.key
    markers = {chunk_of_key(o.key, layout.retry_prefix) for o in store.list(layout.retry_prefix)}

    def fetch(c: int) -> tuple[int, list[str], pa.Table | None]:
        data = with_retries(lambda: store.get(layout.input_key(plan_id, c)), what=f"read input {c}")
        if data is None:
            raise ValidationFailed(f"input of chunk {c} is missing; the plan under {layout.uri} is damaged")
        planned = read_parquet(data[0], _present(data[0], ["id", "sample"]))
        planned_ids = unit_keys(planned.column("id").to_pylist(),
                                planned.column("sample").to_pylist() if "sample" in planned.column_names else None)
        table = None
        if c in parts:
            blob = with_retries(lambda: store.get(parts[c]), what=f"read part {c}")
            if blob is not None:
                table = read_parquet(blob[0], _present(blob[0], columns))
        return c, planned_ids, table

    try:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="validate-fetch") as pool:
            pending: deque[Future[tuple[int, list[str], pa.Table | None]]] = deque()
            chunk_iter = iter(range(len(sizes)))
            for c in chunk_iter:
                pending.append(pool.submit(fetch, c))
                if len(pending) >= PREFETCH:
                    break
            while pending:
                c, planned_ids, table = pending.popleft().result()
                nxt = next(chunk_iter, None)
                if nxt is not None:
                    pending.append(pool.submit(fetch, nxt))
                if table is not None:
                    _ensure_marker(store, layout, c, table, c in markers)
                    spec.add(table)
                    labels.add(table)
                    if signals is not None:
                        signals.add(table)
                    mix.add(table, thinking)
                v.add_chunk(planned_ids, table)
                if c and c % 500 == 0:
                    logger.info("validated %d of %d chunks (%d rows) in %.0fs", c, len(sizes), t.completions + t.errors,
                                time.monotonic() - started)
        v.finish()
        if signals is not None:
            signals.finish(store, layout)

        files: dict[str, Any] = {}
        keys = side_file_keys(layout)
        for name, spool in (("missing_ids", v.missing), ("duplicate_ids", v.duplicates), ("unexpected_ids", v.unexpected)):
            _upload(store, keys[name], spool.file(), "text/plain")
            files[name] = keys[name]
    finally:
        v.close()
        if signals is not None:
            signals.close()

    files["report_md"] = layout.report_md_key
    if plots:
        from dflash_pipeline.steps.validate.plots import render_all

        pre = build_report(t, manifest, layout, thresholds)
        pngs = render_all(t.by_finish, t.think_vs_answer, t.think_vs_answer_unit, t.think_vs_answer_skipped,
                          pre["per_server"], f"completion length by finish_reason: {layout.uri}")
        pkeys = plot_keys(layout)
        for name, png in pngs.items():
            with_retries(lambda: store.put(pkeys[name], png, content_type="image/png"), what=f"write {pkeys[name]}")
        files["plots"] = [pkeys[n] for n in pngs]
    if signals is not None:
        mix.use_languages(signals.languages)  # the answers' languages, identified once by the quality tally
    mix_section = mixreport.mix_report(mix.to_counts(), target_mix)
    if plots:
        png = mixreport.render(mix_section, f"mix of the completions (before filters): {layout.uri}")
        if png is not None:
            key = f"{layout.root}/{mixreport.PLOT_FILE}"
            with_retries(lambda: store.put(key, png, content_type="image/png"), what=f"write {key}")
            files["plots"].append(key)

    report = build_report(t, manifest, layout, thresholds, files)
    report["acceptance"] = spec.report()
    report.update(label_report_fields(labels, manifest))
    report["quality"] = signals.report() if signals is not None else quality_tally.disabled_report()
    if signals is not None:
        files["near_duplicates"] = signals.near_key
        files["quality_signals"] = signals.signals_key
        report["files"] = files
    report["mix"] = mix_section
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    with_retries(
        lambda: store.put(layout.report_key, json.dumps(report, indent=1).encode(), content_type="application/json"),
        what="write report",
    )
    md = (report_markdown(report) + label_markdown(report) + quality_tally.markdown(report["quality"])
          + mixreport.markdown(mix_section, "mix (before filters)", plot_key=mixreport.plot_key(files))
          + acceptance.markdown(report["acceptance"]))
    with_retries(lambda: store.put(layout.report_md_key, md.encode(), content_type="text/markdown"), what="write report.md")
    logger.info("report for %s:\n%s", layout.uri, md)
    logger.info(
        "written: s3://%s/%s, s3://%s/%s, side files %s, plots %s",
        layout.bucket, layout.report_key, layout.bucket, layout.report_md_key,
        [files.get(k) for k in ("missing_ids", "duplicate_ids", "unexpected_ids")], files.get("plots", []),
    )
    if report["problems"]:
        raise ValidationFailed(
            f"{layout.uri} failed validation: " + "; ".join(report["problems"])
            + f". Details in s3://{layout.bucket}/{layout.report_key} (all ids under "
            f"s3://{layout.bucket}/{layout.root}/{VALIDATION_DIR}/). Missing rows or error rows: rerun the failed "
            "generate tasks (airflow dags clear dflash_generate --run-id <run> --only-failed -y) or trigger a new run "
            "into the same output_uri (only the missing work is done; retry_failed_rows='all' retries permanent errors). "
            "Truncation: raise max_tokens (into a new output_uri) or max_truncation_rate if truncated rows are acceptable. "
            "Missing reasoning: start the named servers with a reasoning parser (SGLang --reasoning-parser qwen3) "
            "and regenerate into a new output_uri."
        )
    return report
