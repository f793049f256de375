"""Where the prompts come from: `prompts_uri` as one key, a prefix, a glob or a weighted list.

`prompts_uri` is a string or a list. A string is
- a key (`s3://b/prompts.jsonl`): that object; a key that does not exist but is a "folder" (objects
  under `key/`) reads as that prefix;
- a prefix (`s3://b/dir/`, ending in "/"): every object under it whose name ends in a prompt file
  suffix (.jsonl, .json, .ndjson, their .gz, .parquet), in key order; other objects (_SUCCESS, README)
  are skipped;
- a glob (`s3://b/dir/*.jsonl.gz`): `*` and `?` match within one path segment, `**` across segments,
  `[abc]` a character class; the bucket is never a glob.
A list item is such a string or an object `{"uri": ..., "weight": w, "source": label}`.

Weights, per conversation and deterministic (a rerun plans exactly the same rows): a prompt of a source
with weight w is planned `floor(w)` times plus once more when `u < w - floor(w)`, where
u = sha256("dflash-weight:" + id) / 2^256 (as a fraction of 1). So w = 0.25 keeps about a quarter of the
source's conversations (always the same ones), w = 1 keeps all, w = 2.5 plans every conversation twice and
half of them a third time. Extra copies are extra samples of the same id (sample index k), each with its own
seed, exactly as samples_per_prompt makes them; the two multiply.

`source` fills the row's `source` label when the row has none.

The resolved files (key, ETag, size, weight, source) are pinned in the manifest: the plan reads exactly
those versions, and a rerun into the same root must resolve to the same files.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from dflash_pipeline.dataset.layout import UriError, parse_s3_uri
from dflash_pipeline.dataset.prompts import PROMPT_FILE_SUFFIXES
from dflash_pipeline.dataset.store import Store, with_retries

logger = logging.getLogger(__name__)

GLOB_CHARS = "*?["
MAX_WEIGHT = 64.0
MAX_FILES = 100_000
WEIGHT_SALT = "dflash-weight:"


class SourceError(ValueError):
    """prompts_uri cannot be resolved to input files (bad form, nothing matched, missing key)."""


@dataclass(frozen=True)
class SourceSpec:
    """One entry of prompts_uri as given."""

    uri: str
    weight: float = 1.0
    source: str | None = None


@dataclass(frozen=True)
class InputFile:
    """One object plan reads, and the spec it came from."""

    bucket: str
    key: str
    etag: str
    size: int
    weight: float = 1.0
    source: str | None = None

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def pin(self) -> dict[str, Any]:
        return {"uri": self.uri, "etag": self.etag, "size": self.size, "weight": self.weight, "source": self.source}


def is_glob(uri: str) -> bool:
    return any(c in uri for c in GLOB_CHARS)


def parse_sources(value: Any) -> list[SourceSpec]:
    """The specs of a prompts_uri value (string or list), each URI checked; raises SourceError."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise SourceError("prompts_uri: the list is empty")
    specs = []
    for i, item in enumerate(items):
        where = "prompts_uri" if not isinstance(value, (list, tuple)) else f"prompts_uri[{i}]"
        if isinstance(item, str):
            spec = SourceSpec(item)
        elif isinstance(item, dict):
            unknown = sorted(set(item) - {"uri", "weight", "source"})
            if unknown:
                raise SourceError(f"{where}: unknown key(s) {unknown}; an item has uri, weight and source")
            uri, weight, source = item.get("uri"), item.get("weight", 1.0), item.get("source")
            if not isinstance(uri, str):
                raise SourceError(f"{where}: 'uri' must be a string")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or not 0 < weight <= MAX_WEIGHT:
                raise SourceError(f"{where}: 'weight' must be a number in (0, {MAX_WEIGHT:g}], got {weight!r}")
            if source is not None and (not isinstance(source, str) or not source or len(source) > 256):
                raise SourceError(f"{where}: 'source' must be a non-empty string of at most 256 characters")
            spec = SourceSpec(uri, float(weight), source)
        else:
            raise SourceError(f"{where}: must be an s3:// URI or an object with 'uri', got {type(item).__name__}")
        check_uri(spec.uri, where)
        specs.append(spec)
    return specs


def _split(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise SourceError(f"{uri!r} must look like s3://bucket/key, s3://bucket/prefix/ or s3://bucket/dir/*.jsonl")
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


def check_uri(uri: str, where: str = "prompts_uri") -> None:
    """Refuse what cannot name input objects (bad bucket, unsafe literal segments, empty key)."""
    bucket, key = _split(uri)
    literal = key[: min((key.find(c) for c in GLOB_CHARS if c in key), default=len(key))]
    literal = literal.rsplit("/", 1)[0] if is_glob(key) else literal
    if is_glob(bucket):
        raise SourceError(f"{where}: the bucket of {uri!r} cannot be a glob")
    try:
        parse_s3_uri(f"s3://{bucket}/{literal}", what=where, allow_empty_key=is_glob(key) or key.endswith("/"))
    except UriError as exc:
        raise SourceError(str(exc)) from exc
    if not key.strip("/") and not is_glob(key):
        raise SourceError(f"{where} must name a key, a prefix under the bucket or a glob, got {uri!r}")


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A key glob as a regex: `*` and `?` within a segment, `**` across, `[...]` a class."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 2)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end]
                body = "^" + body[1:] if body.startswith("!") else body
                out.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def _is_prompt_file(key: str) -> bool:
    return key.lower().endswith(PROMPT_FILE_SUFFIXES)


def _listed(store: Store, prefix: str, spec: SourceSpec, keep: Any) -> list[InputFile]:
    files = []
    skipped = 0
    for obj in with_retries(lambda: list(store.list(prefix)), what=f"list {prefix}"):
        if obj.key.endswith("/"):
            continue  # a "folder" marker
        if keep(obj.key):
            files.append(InputFile(store.bucket, obj.key, obj.etag, obj.size, spec.weight, spec.source))
        else:
            skipped += 1
        if len(files) > MAX_FILES:
            raise SourceError(f"{spec.uri}: more than {MAX_FILES} files")
    if skipped:
        logger.info("%s: %s object(s) that are not prompt files skipped", spec.uri, skipped)
    return files


def resolve_spec(client: Any, spec: SourceSpec) -> list[InputFile]:
    """The objects one spec names, in key order."""
    bucket, key = _split(spec.uri)
    store = Store(client, bucket)
    store.check_bucket()
    if is_glob(key):
        first = min(key.find(c) for c in GLOB_CHARS if c in key)
        rx = glob_regex(key)
        files = _listed(store, key[:first], spec, lambda k: rx.match(k) is not None)
        if not files:
            raise SourceError(f"prompts_uri {spec.uri}: no object matches the glob")
        return files
    if key.endswith("/"):
        files = _listed(store, key, spec, _is_prompt_file)
        if not files:
            raise SourceError(f"prompts_uri {spec.uri}: no prompt files (.jsonl, .jsonl.gz, .parquet, ...) under the prefix")
        return files
    head = with_retries(lambda: store.head(key), what="head prompts")
    if head is not None:
        return [InputFile(bucket, key, head.etag, head.size, spec.weight, spec.source)]
    files = _listed(store, key + "/", spec, _is_prompt_file)
    if not files:
        raise SourceError(f"prompts_uri {spec.uri} does not exist")
    return files


def resolve(client: Any, specs: list[SourceSpec]) -> list[InputFile]:
    """Every input file, specs in the order given; a file named by two specs is refused (its rows
    would be counted twice, under two weights)."""
    out: list[InputFile] = []
    seen: dict[str, str] = {}
    for spec in specs:
        for f in resolve_spec(client, spec):
            if f.uri in seen:
                raise SourceError(f"{f.uri} is named by both {seen[f.uri]!r} and {spec.uri!r} in prompts_uri")
            seen[f.uri] = spec.uri
            out.append(f)
    return out


def weight_draw(pid: str) -> float:
    """The id's uniform draw in [0, 1) for the fractional part of a weight."""
    return int.from_bytes(hashlib.sha256((WEIGHT_SALT + pid).encode()).digest()[:8], "big") / 2.0**64


def copies(pid: str, weight: float) -> int:
    """How many times a prompt of a source with this weight is planned (see the module docstring)."""
    whole = math.floor(weight)
    frac = weight - whole
    return whole + (1 if frac > 0 and weight_draw(pid) < frac else 0)


def is_single_plain(value: Any, files: list[InputFile]) -> bool:
    """prompts_uri is one plain key read as itself: its pins keep the form roots planned before
    multi-file inputs have (uri, etag, size), so those roots still match."""
    return isinstance(value, str) and len(files) == 1 and value == files[0].uri and files[0].weight == 1.0 \
        and files[0].source is None
