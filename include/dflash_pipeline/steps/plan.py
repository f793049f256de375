"""The plan step: read and check the prompt files once, split them into chunks, pin the run.

The input is every file `prompts_uri` resolves to (dataset/sources.py: a key, prefix, glob or weighted
list), read in order, each at the ETag the manifest pins. Rows that cannot be used are rejects counted
by code; plan fails when they exceed max(max_rejects, max_reject_share x rows read).

A chunk is the unit of work a generate task claims and the unit of output it commits (one Parquet
part per chunk). Chunks are `save_every` prompts, except near the end, where they shrink
(guided self-scheduling), so the last pieces of work are small and no server is left finishing a
big chunk while the others idle.

`manifest.json` is written last and only once (If-None-Match): it is the plan's commit point. A
rerun into the same root finds it, checks that this run asks for the same thing, and reuses it
without reading the input again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.sampling import ThinkingQuota
from dflash_pipeline.dataset.heldout import HeldoutError, HeldoutWriter, load_split, write_heldout
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.prompts import R_ID_CONFLICT, Prompt, PromptFileError, Reject, iter_prompt_file
from dflash_pipeline.dataset.sources import InputFile, SourceError, copies, is_single_plain, parse_sources, resolve
from dflash_pipeline.dataset.records import encode_inputs
from dflash_pipeline.dataset.store import PreconditionFailed, Store, with_retries
from dflash_pipeline.dataset.tokenizer_source import TokenizerError, check_tokenizer_spec

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = "dflash-pipeline/manifest/1"
MAX_REJECTS_KEPT = 10_000
TAIL_CAP = 65_536


class PlanError(ValueError):
    """The prompt file or the dataset root refuses this plan; retrying cannot fix it."""


def min_chunk_size(save_every: int) -> int:
    return max(1, min(save_every, 16))


def tail_threshold(save_every: int, n_servers: int) -> int:
    """Below this many remaining prompts chunks start to shrink."""
    return min(TAIL_CAP, 2 * max(1, n_servers) * save_every)


def next_chunk_size(remaining: int, save_every: int, n_servers: int) -> int:
    if remaining >= tail_threshold(save_every, n_servers):
        return min(save_every, remaining)
    size = -(-remaining // (2 * max(1, n_servers)))
    return min(remaining, save_every, max(min_chunk_size(save_every), size))


def chunk_sizes(n: int, save_every: int, n_servers: int) -> list[int]:
    """The whole layout for n prompts (what the streaming planner produces)."""
    sizes: list[int] = []
    remaining = n
    while remaining > 0:
        size = next_chunk_size(remaining, save_every, n_servers)
        sizes.append(size)
        remaining -= size
    return sizes


T = TypeVar("T")


def chunk_stream(prompts: Iterable[T], save_every: int, n_servers: int) -> Iterator[list[T]]:
    """Cut a stream into the chunks `chunk_sizes` describes, holding only the tail in memory."""
    hold = tail_threshold(save_every, n_servers) + save_every
    buf: deque[T] = deque()
    for p in prompts:
        buf.append(p)
        if len(buf) >= hold:
            yield [buf.popleft() for _ in range(save_every)]
    remaining = len(buf)
    while remaining:
        size = next_chunk_size(remaining, save_every, n_servers)
        yield [buf.popleft() for _ in range(size)]
        remaining -= size


@dataclass
class PlanStats:
    rows_read: int = 0
    accepted: int = 0
    duplicates_dropped: int = 0
    rejects: int = 0
    limited: bool = False
    heldout: int = 0
    # Prompts a source weight below 1 left out, and extra copies a weight above 1 added (as samples).
    weighted_out: int = 0
    weight_copies: int = 0
    rejects_by_reason: Counter[str] = dataclasses.field(default_factory=Counter)


def thinking_modes(prompts: Iterable[Prompt], fraction: float | None) -> Iterator[tuple[Prompt, bool | None]]:
    """(prompt, thinking mode) in plan order: the row's own mode, else the quota's when a fraction is
    set (dataset/sampling.ThinkingQuota), else None (the run's enable_thinking at request time)."""
    if fraction is None:
        for p in prompts:
            yield p, p.thinking
        return
    quota = ThinkingQuota(fraction)
    for p, mode in quota.stream(prompts, lambda q: q.id if q.thinking is None else None):
        yield p, (p.thinking if p.thinking is not None else mode)


@dataclass
class MixStats:
    """What plan decided about the mix, for the manifest."""

    fraction: float | None = None
    on: int = 0
    off: int = 0
    run_flag: int = 0
    from_rows: int = 0
    from_fraction: int = 0
    rows_with_sampling: int = 0
    sampling_keys: set[str] = field(default_factory=set)

    def count(self, p: Prompt, thinking: bool | None) -> None:
        if thinking is None:
            self.run_flag += 1
        else:
            self.on += thinking
            self.off += not thinking
            if p.thinking is not None:
                self.from_rows += 1
            else:
                self.from_fraction += 1
        if p.sampling:
            self.rows_with_sampling += 1
            self.sampling_keys.update(p.sampling)

    def to_dict(self, enable_thinking: bool) -> dict[str, Any]:
        on = self.on + (self.run_flag if enable_thinking else 0)
        off = self.off + (0 if enable_thinking else self.run_flag)
        return {"conversations_on": on, "conversations_off": off, "from_rows": self.from_rows,
                "from_fraction": self.from_fraction, "from_enable_thinking": self.run_flag,
                "fraction_requested": self.fraction,
                "share_on": round(on / (on + off), 6) if on + off else None,
                "rows_with_sampling": self.rows_with_sampling}


@dataclass
class RowSettings:
    """The rows' own `enable_thinking` / `sampling` under row_settings="record": taken off the row
    (so the run's settings are sent), kept in its metadata (`row_enable_thinking`, `row_sampling`,
    carried into every completion row) and counted for the manifest (`input.row_settings`)."""

    thinking_on: int = 0
    thinking_off: int = 0
    with_sampling: int = 0
    sampling_keys: set[str] = field(default_factory=set)
    temperatures: set[float] = field(default_factory=set)

    def take(self, p: Prompt) -> Prompt:
        if p.thinking is None and not p.sampling:
            return p
        self.thinking_on += p.thinking is True
        self.thinking_off += p.thinking is False
        kept: dict[str, Any] = {}
        if p.thinking is not None:
            kept["row_enable_thinking"] = p.thinking
        if p.sampling:
            self.with_sampling += 1
            self.sampling_keys.update(p.sampling)
            if isinstance(p.sampling.get("temperature"), (int, float)) and len(self.temperatures) < 32:
                self.temperatures.add(float(p.sampling["temperature"]))
            kept["row_sampling"] = p.sampling
        return dataclasses.replace(p, thinking=None, sampling=None, metadata={**(p.metadata or {}), **kept})

    def to_dict(self) -> dict[str, Any]:
        return {"mode": "record", "rows_thinking_on": self.thinking_on, "rows_thinking_off": self.thinking_off,
                "rows_with_sampling": self.with_sampling, "sampling_keys": sorted(self.sampling_keys),
                "temperatures": sorted(self.temperatures)}


class _Deduper:
    """Drops repeated prompts, rejects one id used for different content.

    Backed by a temporary SQLite file with a small page cache, so memory stays flat however many
    prompts the file has (in memory this was ~190 bytes per prompt: 313 MB at 902k prompts).
    """

    def __init__(self, cache_mb: int = 16) -> None:
        import sqlite3
        import tempfile

        self._dir = tempfile.TemporaryDirectory(prefix="dflash-plan-")
        self._db = sqlite3.connect(f"{self._dir.name}/dedupe.sqlite", isolation_level=None)
        self._db.executescript(
            f"PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; PRAGMA cache_size=-{cache_mb * 1000};"
            "CREATE TABLE ids(id TEXT PRIMARY KEY, h BLOB NOT NULL) WITHOUT ROWID;"
            "CREATE TABLE contents(h BLOB PRIMARY KEY) WITHOUT ROWID;"
            "BEGIN;"
        )

    def check(self, p: Prompt) -> str | None:
        """None = keep; 'duplicate' = drop silently (counted); anything else = reject reason."""
        row = self._db.execute("SELECT h FROM ids WHERE id = ?", (p.id,)).fetchone()
        if row is not None:
            if row[0] == p.content_hash:
                return "duplicate"
            return f"id {p.id!r} was already used by an earlier row with different content"
        if self._db.execute("SELECT 1 FROM contents WHERE h = ?", (p.content_hash,)).fetchone():
            return "duplicate"
        self._db.execute("INSERT INTO ids VALUES (?, ?)", (p.id, p.content_hash))
        self._db.execute("INSERT INTO contents VALUES (?)", (p.content_hash,))
        return None

    def close(self) -> None:
        self._db.close()
        self._dir.cleanup()


def heldout_pins(cfg: RunConfig, heldout_etag: str | None) -> dict[str, Any] | None:
    """The split's pin (None without a split, so roots planned before it existed still match): it
    decides which prompts are planned, so it sits with the input and can never change under a root."""
    if cfg.heldout_fraction <= 0 and cfg.heldout_uri is None:
        return None
    return {"fraction": cfg.heldout_fraction, "salt": cfg.heldout_salt, "uri": cfg.heldout_uri, "etag": heldout_etag}


def input_pins(cfg: RunConfig, input_etag: str | None, input_size: int | None,
               files: list[InputFile] | None = None) -> dict[str, Any]:
    """The input's pin: one plain key keeps the form roots planned before multi-file inputs have
    (uri, etag, size); anything else pins every file's key, ETag, size, weight and source label."""
    if files is None or is_single_plain(cfg.prompts_uri, files):
        if files is not None:
            input_etag, input_size = files[0].etag, files[0].size
        return {"uri": cfg.prompts_uri, "etag": input_etag, "size": input_size, "limit": cfg.limit}
    return {"uri": cfg.prompts_uri, "files": [f.pin() for f in files], "limit": cfg.limit}


def pinned_settings(cfg: RunConfig, input_etag: str | None, input_size: int | None, heldout_etag: str | None = None,
                    files: list[InputFile] | None = None) -> dict[str, Any]:
    """What makes rows under one root comparable. A rerun must match (or accept_pin_changes)."""
    s = cfg.sampling
    pins: dict[str, Any] = {
        "input": input_pins(cfg, input_etag, input_size, files),
        "model": cfg.model,
        "sampling": {
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "enable_thinking": s.enable_thinking,
            "seed": s.seed,
        },
    }
    # Pinned only when not the default, so roots planned before these params existed still match.
    # samples_per_prompt shapes the plan (rows per chunk) and can never change under a root;
    # regenerate also decides which input rows plan accepts, so it is pinned with the input too.
    if s.samples_per_prompt != 1:
        pins["input"]["samples_per_prompt"] = s.samples_per_prompt
    if s.regenerate != "last_turn":
        pins["input"]["regenerate"] = s.regenerate
    # The mix: thinking_fraction decides the modes plan writes into the inputs, so it is pinned with
    # the input; extras and the ladder are applied per request (changeable with accept_pin_changes).
    if s.thinking_fraction is not None:
        pins["input"]["thinking_fraction"] = s.thinking_fraction
    if s.row_settings != "apply":  # decides what plan writes into the inputs
        pins["input"]["row_settings"] = s.row_settings
    if s.extra:
        pins["sampling"]["extra"] = dict(s.extra)
    if s.ladder:
        pins["sampling"]["ladder"] = [dict(e) for e in s.ladder]
    split = heldout_pins(cfg, heldout_etag)
    if split is not None:
        pins["input"]["heldout"] = split
    return pins


def manifest_sampling(manifest: dict[str, Any]) -> dict[str, Any]:
    """regenerate and samples_per_prompt of a manifest (defaults for roots planned before them)."""
    pinned = manifest.get("pinned", {}).get("input", {})
    return {"regenerate": pinned.get("regenerate", "last_turn"),
            "samples_per_prompt": int(pinned.get("samples_per_prompt", 1))}


def diff_pins(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(diff_pins(a, b, name + "."))
        elif key == "files" and isinstance(a, list) and isinstance(b, list) and a != b:
            out.append(f"{name}: {_files_diff(a, b)}")
        elif a != b:
            out.append(f"{name}: the dataset has {a!r}, this run asks for {b!r}")
    return out


def _files_diff(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
    """What changed between two pinned file lists, briefly (a prefix may hold thousands of files)."""
    a = {f.get("uri"): f for f in old}
    b = {f.get("uri"): f for f in new}
    parts = []
    for label, keys in (("added", [k for k in b if k not in a]), ("gone", [k for k in a if k not in b]),
                        ("changed", [k for k in a if k in b and a[k] != b[k]])):
        if keys:
            parts.append(f"{len(keys)} {label} ({', '.join(map(str, keys[:3]))}{', ...' if len(keys) > 3 else ''})")
    if not parts:
        parts.append("the same files in another order")
    return "the input files differ: " + "; ".join(parts)


def check_pins(existing: dict[str, Any], new_pins: dict[str, Any], cfg: RunConfig) -> list[str]:
    """Refuse a rerun that would mix incomparable rows; returns accepted differences."""
    old = existing["pinned"]
    diffs = diff_pins(old, new_pins)
    if not diffs:
        return []
    layout_diffs = [d for d in diffs if d.startswith("input.")]
    if layout_diffs or not cfg.accept_pin_changes:
        how = (
            "Use a new output_uri for a new dataset"
            + ("" if layout_diffs else ", or set accept_pin_changes=true to continue this one with the new settings")
            + "."
        )
        raise PlanError(
            f"output_uri {cfg.output_uri} already holds a dataset planned differently:\n  - "
            + "\n  - ".join(diffs)
            + f"\n{how}"
        )
    return diffs


def reject_budget(max_rejects: int, max_reject_share: float, rows_read: int) -> int:
    """How many bad rows a plan may drop: the larger of the absolute budget and the share of the rows read."""
    return max(max_rejects, math.floor(max_reject_share * rows_read))


def plan_id_for(pins: dict[str, Any], save_every: int, n_servers: int) -> str:
    blob = json.dumps({"pins": pins["input"], "save_every": save_every, "n_servers": n_servers}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def load_manifest(store: Store, layout: DatasetLayout) -> tuple[dict[str, Any], str] | None:
    got = with_retries(lambda: store.get(layout.manifest_key), what="read manifest")
    if got is None:
        return None
    body, etag = got
    return json.loads(body), etag


def update_manifest(store: Store, layout: DatasetLayout, mutate: Any, attempts: int = 20) -> dict[str, Any]:
    """Read-modify-write the manifest with If-Match, so concurrent writers never lose an update."""
    for _ in range(attempts):
        got = load_manifest(store, layout)
        if got is None:
            raise PlanError(f"{layout.uri}/manifest.json is missing; run plan first")
        manifest, etag = got
        mutate(manifest)
        try:
            with_retries(
                lambda: store.put(
                    layout.manifest_key,
                    json.dumps(manifest, indent=1, sort_keys=True).encode(),
                    if_match=etag,
                    content_type="application/json",
                ),
                what="update manifest",
            )
            return manifest
        except PreconditionFailed:
            continue
    raise PlanError("manifest.json kept changing under us; another run is writing the same root")


def plan_summary(manifest: dict[str, Any], layout: DatasetLayout, resumed: bool) -> dict[str, Any]:
    """The small dict that goes to XCom."""
    return {
        "output_uri": layout.uri,
        "manifest_key": layout.manifest_key,
        "plan_id": manifest["plan_id"],
        "prompts": manifest["input"]["prompts"],
        "chunks": len(manifest["chunks"]["sizes"]),
        "rejects": manifest["input"]["rejects"],
        # Counts per reject code (a few keys at most), so the task log and XCom say why.
        "rejects_by_reason": manifest["input"].get("rejects_by_reason", {}),
        "files": len(manifest["input"].get("files") or [None]),
        "heldout": (manifest.get("heldout") or {}).get("count", 0),
        "resumed": resumed,
    }


def check_run_tokenizer(client: Any, cfg: RunConfig) -> dict[str, Any] | None:
    """The `tokenizer` param found, loaded and its chat template rendered (thinking on and off) before any
    request is sent, so a wrong id or path fails the run here, not at validation hours later. Returns the
    record the manifest keeps (`manifest["tokenizer"]`: source, kind, revision or ETag, sha256 of the
    tokenizer file and template), which the asset-triggered tokenize run takes; None without the param."""
    if not cfg.tokenizer:
        return None
    try:
        return check_tokenizer_spec(cfg.tokenizer, client)
    except TokenizerError as exc:
        raise PlanError(f"{exc}. Nothing was sent to the servers.") from exc


def run_plan(client: Any, cfg: RunConfig, run_id: str) -> dict[str, Any]:
    """Plan the dataset root `cfg.output_uri` (or check and reuse an existing plan)."""
    layout = DatasetLayout.from_uri(cfg.output_uri)
    out_store = Store(client, layout.bucket)
    out_store.check_bucket()
    try:
        files = resolve(client, parse_sources(cfg.prompts_uri))
    except SourceError as exc:
        raise PlanError(str(exc)) from exc
    single = is_single_plain(cfg.prompts_uri, files)
    try:
        split, heldout_etag = load_split(client, cfg.heldout_uri, cfg.heldout_fraction, cfg.heldout_salt)
    except HeldoutError as exc:
        raise PlanError(str(exc)) from exc
    pins = pinned_settings(cfg, None, None, heldout_etag, files=files)
    tokenizer = check_run_tokenizer(client, cfg)

    existing = load_manifest(out_store, layout)
    if existing is not None:
        manifest, _ = existing
        accepted = check_pins(manifest, pins, cfg)
        if tokenizer is not None and manifest.get("tokenizer") != tokenizer:
            manifest = update_manifest(out_store, layout, lambda m: m.update(tokenizer=tokenizer))
        if accepted:
            logger.warning("accept_pin_changes: continuing %s with changed settings: %s", layout.uri, accepted)

            def repin(m: dict[str, Any]) -> None:
                m.setdefault("pin_history", []).append({"run_id": run_id, "previous": m["pinned"], "changes": accepted})
                m["pinned"] = pins

            manifest = update_manifest(out_store, layout, repin)
        if manifest["chunks"]["save_every"] != cfg.save_every:
            logger.warning(
                "save_every=%s ignored: this dataset root was planned with save_every=%s",
                cfg.save_every,
                manifest["chunks"]["save_every"],
            )
        logger.info(
            "resuming %s: %s prompts in %s chunks already planned", layout.uri, manifest["input"]["prompts"],
            len(manifest["chunks"]["sizes"]),
        )
        return plan_summary(manifest, layout, resumed=True)

    n_servers = len(cfg.servers)
    plan_id = plan_id_for(pins, cfg.save_every, n_servers)
    stats = PlanStats()
    rejects: list[Reject] = []
    dedupe = _Deduper()
    heldout = HeldoutWriter()

    file_stats: list[dict[str, Any]] = []
    label = cfg.prompts_uri if isinstance(cfg.prompts_uri, str) else "prompts_uri"

    def reject(r: Reject, f: InputFile) -> None:
        stats.rejects += 1
        stats.rejects_by_reason[r.code] += 1
        file_stats[-1]["rejects"] += 1
        if len(rejects) < MAX_REJECTS_KEPT:
            rejects.append(r if single else dataclasses.replace(r, file=f.uri))

    def rows_of(f: InputFile) -> Iterator[Prompt | Reject]:
        try:  # exactly the version whose ETag the manifest pins, never a file replaced meanwhile
            body = Store(client, f.bucket).open(f.key, if_match=f.etag)
        except PreconditionFailed as exc:
            raise PlanError(
                f"prompts_uri {f.uri} was replaced after planning started (ETag {f.etag} is gone); "
                "the plan pins one version of the input: trigger again"
            ) from exc
        sha = hashlib.sha256()
        file_stats.append({**f.pin(), "sha256": None, "rows_read": 0, "prompts": 0, "rejects": 0, "weighted_out": 0})
        try:
            yield from iter_prompt_file(_HashingReader(body, sha), f.key, cfg.sampling.regenerate)
        except PromptFileError as exc:
            raise PlanError(f"{f.uri}: {exc}") from exc
        file_stats[-1]["sha256"] = sha.hexdigest()

    def accepted_prompts() -> Iterator[tuple[Prompt, int]]:
        """(prompt, copies its source's weight gives it), in file order."""
        for f in files:
            for item in rows_of(f):
                stats.rows_read += 1
                file_stats[-1]["rows_read"] += 1
                if isinstance(item, Reject):
                    reject(item, f)
                    continue
                if item.source is None and f.source is not None:
                    item = dataclasses.replace(item, source=f.source)
                verdict = dedupe.check(item)
                if verdict == "duplicate":
                    stats.duplicates_dropped += 1
                    continue
                if verdict is not None:
                    reject(Reject(item.line, verdict, code=R_ID_CONFLICT), f)
                    continue
                if split.holds(item.id):  # never generated here: kept for the eval, outside `limit`
                    stats.heldout += 1
                    heldout.add(item)
                    continue
                n = copies(item.id, f.weight)
                if n == 0:
                    stats.weighted_out += 1
                    file_stats[-1]["weighted_out"] += 1
                    continue
                if cfg.limit is not None and stats.accepted >= cfg.limit:
                    stats.limited = True
                    return
                stats.accepted += 1
                stats.weight_copies += n - 1
                file_stats[-1]["prompts"] += 1
                yield item, n

    mix = MixStats(fraction=cfg.sampling.thinking_fraction)
    own = RowSettings() if cfg.sampling.row_settings == "record" else None

    def units() -> Iterator[tuple[Prompt, int, bool | None]]:
        # One planned row per (id, sample); a prompt's samples are neighbours, so they usually share
        # a chunk (and a server, whose radix cache then holds the prompt already). Each conversation's
        # thinking mode is its row's, else the quota's (thinking_fraction), else null (the run's flag);
        # all its samples share it. A source weight above 1 multiplies the samples (each with its own
        # seed, as samples_per_prompt's); the quota may hold a few prompts back, so their copy counts
        # wait in `copies` (ids are unique after the deduper) until their mode is known.
        copies: dict[str, int] = {}

        def prompts_only() -> Iterator[Prompt]:
            for prompt, n in accepted_prompts():
                copies[prompt.id] = n
                yield prompt if own is None else own.take(prompt)

        for prompt, thinking in thinking_modes(prompts_only(), cfg.sampling.thinking_fraction):
            mix.count(prompt, thinking)
            for sample in range(copies.pop(prompt.id) * cfg.sampling.samples_per_prompt):
                yield prompt, sample, thinking

    sizes: list[int] = []
    # The longest prompt (by UTF-8 bytes of its messages): preflight sends it to every server as
    # its proof request, so the server's own tokenizer says whether max_tokens still fits.
    longest: dict[str, Any] = {"bytes": -1}
    try:
        for index, chunk in enumerate(chunk_stream(units(), cfg.save_every, n_servers)):
            for p, k, _ in chunk:
                size = sum(len(str(m.get("content") or "").encode()) for m in p.messages)
                if k == 0 and size > longest["bytes"]:
                    longest = {"id": p.id, "chunk": index, "bytes": size}
            data = encode_inputs([{"id": p.id, "messages": p.messages, "sample": k, "original_messages": p.original,
                                   "source": p.source, "domain": p.domain, "metadata": p.metadata,
                                   "thinking": t, "sampling_override": p.sampling}
                                  for p, k, t in chunk])
            key = layout.input_key(plan_id, index)
            with_retries(lambda: out_store.put(key, data), what=f"write {key}")
            sizes.append(len(chunk))
    finally:
        dedupe.close()

    if rejects or stats.rejects:
        blob = "\n".join(json.dumps(r.to_dict(), ensure_ascii=False) for r in rejects).encode() + b"\n"
        with_retries(lambda: out_store.put(layout.rejects_key, blob, content_type="application/x-ndjson"), what="rejects")
    allowed = reject_budget(cfg.max_rejects, cfg.max_reject_share, stats.rows_read)
    if stats.rejects > allowed:
        by_reason = ", ".join(f"{code} {n}" for code, n in stats.rejects_by_reason.most_common())
        shown = "\n".join(f"  {r.file + ' ' if r.file else ''}line {r.line}: {r.reason}" for r in rejects[:20])
        more = "" if stats.rejects <= 20 else f"\n  … and {stats.rejects - 20} more"
        raise PlanError(
            f"{label}: {stats.rejects} bad row(s) of {stats.rows_read} ({by_reason}); the budget is {allowed} "
            f"(max_rejects={cfg.max_rejects}, max_reject_share={cfg.max_reject_share}). "
            f"Nothing was sent to the servers. All reasons are in s3://{layout.bucket}/{layout.rejects_key}\n"
            f"{shown}{more}"
        )
    if stats.accepted == 0:
        raise PlanError(f"{label}: no usable prompts ({stats.rows_read} rows read, "
                        f"{stats.heldout} held out, {stats.weighted_out} left out by source weights)")
    try:
        heldout_entry = write_heldout(out_store, layout, split, heldout, stats.heldout)
    except HeldoutError as exc:
        raise PlanError(str(exc)) from exc

    manifest = {
        "format": MANIFEST_FORMAT,
        "plan_id": plan_id,
        "created_by_run": run_id,
        "pinned": pins,
        "input": {
            "uri": cfg.prompts_uri,
            "etag": files[0].etag if single else None,
            "size": sum(f.size for f in files),
            "sha256": None if stats.limited or not single else file_stats[0]["sha256"],
            **({} if single else {"files": file_stats}),
            "weighted_out": stats.weighted_out,
            "weight_copies": stats.weight_copies,
            "rejects_by_reason": dict(sorted(stats.rejects_by_reason.items())),
            "reject_budget": allowed,
            "rows_read": stats.rows_read,
            "prompts": stats.accepted,
            "samples_per_prompt": cfg.sampling.samples_per_prompt,
            "rows_planned": sum(sizes),
            "regenerate": cfg.sampling.regenerate,
            "duplicates_dropped": stats.duplicates_dropped,
            "rejects": stats.rejects,
            "limit": cfg.limit,
            "longest_prompt": longest if longest["bytes"] >= 0 else None,
            # Conversations by thinking mode and where it came from, and the sampling keys rows override
            # (preflight checks them against each server's engine).
            "thinking": mix.to_dict(cfg.sampling.enable_thinking),
            "sampling_keys": sorted(mix.sampling_keys),
            # row_settings="record": what the rows asked for themselves (not sent).
            **({} if own is None else {"row_settings": own.to_dict()}),
        },
        "chunks": {
            "save_every": cfg.save_every,
            "planned_for_servers": n_servers,
            "sizes": sizes,
            "inputs_prefix": f"{layout.inputs_prefix}{plan_id}/",
        },
        "heldout": heldout_entry,
        "tokenizer": tokenizer,
        "model_resolved": None,
        "runs": {},
    }
    try:
        with_retries(
            lambda: out_store.put(
                layout.manifest_key,
                json.dumps(manifest, indent=1, sort_keys=True).encode(),
                if_none_match=True,
                content_type="application/json",
            ),
            what="write manifest",
        )
    except PreconditionFailed:
        # Another run planned the same root at the same moment: theirs wins if it pins the same.
        got = load_manifest(out_store, layout)
        assert got is not None
        manifest = got[0]
        check_pins(manifest, pins, cfg)
        return plan_summary(manifest, layout, resumed=True)
    logger.info(
        "planned %s prompts in %s chunks from %s file(s) (rows read %s, duplicates dropped %s, rejects %s %s, "
        "held out %s, left out by weight %s, extra copies by weight %s) -> %s",
        stats.accepted, len(sizes), len(files), stats.rows_read, stats.duplicates_dropped, stats.rejects,
        dict(stats.rejects_by_reason), stats.heldout, stats.weighted_out, stats.weight_copies, layout.uri,
    )
    return plan_summary(manifest, layout, resumed=False)


class _HashingReader:
    """A read-through that hashes the bytes the parser consumes (the input's checksum for free)."""

    def __init__(self, body: Any, sha: Any) -> None:
        self._body = body
        self._sha = sha

    def read(self, n: int = -1) -> bytes:
        data = self._body.read(n) if n is not None and n >= 0 else self._body.read()
        self._sha.update(data)
        return data
