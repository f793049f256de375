"""The plan step: read and check the prompt file once, split it into chunks, pin the run.

A chunk is the unit of work a generate task claims and the unit of output it commits (one Parquet
part per chunk). Chunks are `save_every` prompts, except near the end, where they shrink
(guided self-scheduling), so the last pieces of work are small and no server is left finishing a
big chunk while the others idle.

`manifest.json` is written last and only once (If-None-Match): it is the plan's commit point. A
rerun into the same root finds it, checks that this run asks for the same thing, and reuses it
without reading the input again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.heldout import HeldoutError, HeldoutWriter, load_split, write_heldout
from dflash_pipeline.dataset.layout import DatasetLayout, parse_s3_uri
from dflash_pipeline.dataset.prompts import Prompt, PromptFileError, Reject, iter_prompt_file
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


def pinned_settings(cfg: RunConfig, input_etag: str, input_size: int, heldout_etag: str | None = None) -> dict[str, Any]:
    """What makes rows under one root comparable. A rerun must match (or accept_pin_changes)."""
    s = cfg.sampling
    pins: dict[str, Any] = {
        "input": {"uri": cfg.prompts_uri, "etag": input_etag, "size": input_size, "limit": cfg.limit},
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
        elif a != b:
            out.append(f"{name}: the dataset has {a!r}, this run asks for {b!r}")
    return out


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
    src = parse_s3_uri(cfg.prompts_uri, what="prompts_uri")
    out_store = Store(client, layout.bucket)
    in_store = Store(client, src.bucket)
    out_store.check_bucket()
    in_store.check_bucket()
    head = with_retries(lambda: in_store.head(src.key), what="head prompts")
    if head is None:
        raise PlanError(f"prompts_uri {cfg.prompts_uri} does not exist")
    try:
        split, heldout_etag = load_split(client, cfg.heldout_uri, cfg.heldout_fraction, cfg.heldout_salt)
    except HeldoutError as exc:
        raise PlanError(str(exc)) from exc
    pins = pinned_settings(cfg, head.etag, head.size, heldout_etag)
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
    sha = hashlib.sha256()
    heldout = HeldoutWriter()

    def accepted_prompts() -> Iterator[Prompt]:
        try:  # exactly the version whose ETag the manifest pins, never a file replaced meanwhile
            body = in_store.open(src.key, if_match=head.etag)
        except PreconditionFailed as exc:
            raise PlanError(
                f"prompts_uri {cfg.prompts_uri} was replaced after planning started (ETag {head.etag} is gone); "
                "the plan pins one version of the input: trigger again"
            ) from exc
        stream = _HashingReader(body, sha)
        try:
            for item in iter_prompt_file(stream, src.key, cfg.sampling.regenerate):
                stats.rows_read += 1
                if isinstance(item, Reject):
                    stats.rejects += 1
                    if len(rejects) < MAX_REJECTS_KEPT:
                        rejects.append(item)
                    continue
                verdict = dedupe.check(item)
                if verdict == "duplicate":
                    stats.duplicates_dropped += 1
                    continue
                if verdict is not None:
                    stats.rejects += 1
                    if len(rejects) < MAX_REJECTS_KEPT:
                        rejects.append(Reject(item.line, verdict))
                    continue
                if split.holds(item.id):  # never generated here: kept for the eval, outside `limit`
                    stats.heldout += 1
                    heldout.add(item)
                    continue
                if cfg.limit is not None and stats.accepted >= cfg.limit:
                    stats.limited = True
                    return
                stats.accepted += 1
                yield item
        except PromptFileError as exc:
            raise PlanError(f"{cfg.prompts_uri}: {exc}") from exc

    def units() -> Iterator[tuple[Prompt, int]]:
        # One planned row per (id, sample); a prompt's samples are neighbours, so they usually share
        # a chunk (and a server, whose radix cache then holds the prompt already).
        for prompt in accepted_prompts():
            for sample in range(cfg.sampling.samples_per_prompt):
                yield prompt, sample

    sizes: list[int] = []
    # The longest prompt (by UTF-8 bytes of its messages): preflight sends it to every server as
    # its proof request, so the server's own tokenizer says whether max_tokens still fits.
    longest: dict[str, Any] = {"bytes": -1}
    try:
        for index, chunk in enumerate(chunk_stream(units(), cfg.save_every, n_servers)):
            for p, k in chunk:
                size = sum(len(str(m.get("content") or "").encode()) for m in p.messages)
                if k == 0 and size > longest["bytes"]:
                    longest = {"id": p.id, "chunk": index, "bytes": size}
            data = encode_inputs([{"id": p.id, "messages": p.messages, "sample": k, "original_messages": p.original,
                                   "source": p.source, "domain": p.domain, "metadata": p.metadata}
                                  for p, k in chunk])
            key = layout.input_key(plan_id, index)
            with_retries(lambda: out_store.put(key, data), what=f"write {key}")
            sizes.append(len(chunk))
    finally:
        dedupe.close()

    if rejects or stats.rejects:
        blob = "\n".join(json.dumps(r.to_dict(), ensure_ascii=False) for r in rejects).encode() + b"\n"
        with_retries(lambda: out_store.put(layout.rejects_key, blob, content_type="application/x-ndjson"), what="rejects")
    if stats.rejects > cfg.max_rejects:
        shown = "\n".join(f"  line {r.line}: {r.reason}" for r in rejects[:20])
        more = "" if stats.rejects <= 20 else f"\n  … and {stats.rejects - 20} more"
        raise PlanError(
            f"{cfg.prompts_uri}: {stats.rejects} bad row(s), max_rejects={cfg.max_rejects}. "
            f"Nothing was sent to the servers. All reasons are in s3://{layout.bucket}/{layout.rejects_key}\n"
            f"{shown}{more}"
        )
    if stats.accepted == 0:
        raise PlanError(f"{cfg.prompts_uri}: no usable prompts ({stats.rows_read} rows read, "
                        f"{stats.heldout} held out)")
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
            "etag": head.etag,
            "size": head.size,
            "sha256": None if stats.limited else sha.hexdigest(),
            "rows_read": stats.rows_read,
            "prompts": stats.accepted,
            "samples_per_prompt": cfg.sampling.samples_per_prompt,
            "rows_planned": sum(sizes),
            "regenerate": cfg.sampling.regenerate,
            "duplicates_dropped": stats.duplicates_dropped,
            "rejects": stats.rejects,
            "limit": cfg.limit,
            "longest_prompt": longest if longest["bytes"] >= 0 else None,
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
        "planned %s prompts in %s chunks (rows read %s, duplicates dropped %s, rejects %s, held out %s) -> %s",
        stats.accepted, len(sizes), stats.rows_read, stats.duplicates_dropped, stats.rejects, stats.heldout,
        layout.uri,
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
