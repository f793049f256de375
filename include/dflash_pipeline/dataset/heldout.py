"""The held-out split: which conversations never reach a training shard, decided by id alone.

Why by id: every sample of a prompt, every turn of its conversation and every rerun must go the same
way, and a reader that has only the id (tokenize, the eval) must be able to tell. A prompt id is held
out when it is named in the held-out file (`heldout_uri`), or when

    int(sha256(f"{salt}:{id}")[:8 bytes]) / 2**64 < fraction

so the split is a pure function of (id, salt, fraction): no state, the same on every machine, and
a different salt draws an independent split. Plan writes the held-out prompts to
`heldout/prompts.jsonl.gz` under the dataset root (in the input format, readable back as a
`prompts_uri`) and records the split in the manifest; tokenize refuses any held-out id it meets.

`load_split` and `write_heldout` are plan's S3 reads and writes of the split; the rest is pure.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from dflash_pipeline.dataset.layout import DatasetLayout, parse_s3_uri
from dflash_pipeline.dataset.prompts import (
    Prompt,
    PromptFileError,
    Reject,
    detect_format,
    iter_prompt_file,
    normalize_row,
)
from dflash_pipeline.dataset.store import PreconditionFailed, Store, with_retries

DEFAULT_SALT = "dflash-heldout"


class HeldoutError(ValueError):
    """The held-out file cannot be used (missing, unreadable, names no id)."""
MAX_FRACTION = 0.5
_SCALE = float(1 << 64)


def heldout_score(pid: str, salt: str = DEFAULT_SALT) -> float:
    """Where an id falls in [0, 1): uniform over ids, fixed for (salt, id)."""
    digest = hashlib.sha256(f"{salt}:{pid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE


@dataclass(frozen=True)
class HeldoutSplit:
    """A split: a fraction drawn by hash, plus ids named in a file. `holds(id)` is the whole rule."""

    fraction: float = 0.0
    salt: str = DEFAULT_SALT
    ids: frozenset[str] = field(default_factory=frozenset)
    uri: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= MAX_FRACTION:
            raise ValueError(f"heldout_fraction must be within 0..{MAX_FRACTION}, got {self.fraction}")

    @property
    def active(self) -> bool:
        return self.fraction > 0 or bool(self.ids) or self.uri is not None

    def holds(self, pid: str) -> bool:
        return pid in self.ids or (self.fraction > 0 and heldout_score(pid, self.salt) < self.fraction)


def ids_sha256(ids: Iterable[str]) -> str:
    """A checksum of a set of ids (sorted, one per line), so two splits can be compared by a glance."""
    sha = hashlib.sha256()
    for pid in sorted(ids):
        sha.update(pid.encode())
        sha.update(b"\n")
    return sha.hexdigest()


def _line_id(raw: bytes, lineno: int) -> str | None:
    text = raw.decode("utf-8").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text  # a plain-text file of ids, one per line
    if isinstance(value, bool) or value is None:
        raise PromptFileError(f"line {lineno}: {text[:80]!r} is neither an id nor a prompt row")
    if isinstance(value, (str, int)):
        return str(value)
    if isinstance(value, dict):
        if value.get("id") is not None:
            return str(value["id"])
        got = normalize_row(value, lineno)
        if isinstance(got, Reject):
            raise PromptFileError(f"line {lineno}: a row without an id and no usable prompt ({got.reason})")
        return got.id  # the id plan derives from the same content
    raise PromptFileError(f"line {lineno}: a JSON {type(value).__name__} is neither an id nor a prompt row")


def read_heldout_ids(stream: IO[bytes], key: str) -> frozenset[str]:
    """The ids of a held-out file: one id per line (plain text or JSON strings/numbers), or prompt rows
    (JSONL, .jsonl.gz or Parquet) whose `id` is taken, or derived from the content when absent as plan
    derives it. A line that is neither is a file error: a held-out file must not be half-read."""
    head = stream.read(4)
    rest = head + stream.read()
    try:
        fmt = detect_format(key, head)
    except PromptFileError:
        fmt = "text"
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(io.BytesIO(rest))
        if "id" in pf.schema_arrow.names:
            return frozenset(str(v) for v in pf.read(columns=["id"]).column("id").to_pylist() if v is not None)
        out: set[str] = set()
        for item in iter_prompt_file(io.BytesIO(rest), key):
            if isinstance(item, Reject):
                raise PromptFileError(f"row {item.line}: no id and no usable prompt ({item.reason})")
            out.add(item.id)
        return frozenset(out)
    if fmt == "jsonl.gz":
        try:
            rest = gzip.decompress(rest)
        except (OSError, EOFError) as exc:
            raise PromptFileError(f"broken gzip stream: {exc}") from exc
    ids: set[str] = set()
    for lineno, raw in enumerate(rest.splitlines(), start=1):
        try:
            pid = _line_id(raw, lineno)
        except UnicodeDecodeError as exc:
            raise PromptFileError(f"line {lineno}: invalid UTF-8 at byte {exc.start}") from exc
        if pid is not None:
            ids.add(pid)
    return frozenset(ids)


def heldout_row(p: Prompt) -> dict[str, Any]:
    """A held-out prompt in the input format (what `prompts.normalize_row` reads back to the same Prompt)."""
    row: dict[str, Any] = {"id": p.id, "messages": p.messages}
    if p.source is not None:
        row["source"] = p.source
    if p.domain is not None:
        row["domain"] = p.domain
    if p.metadata:
        row["metadata"] = p.metadata
    if p.thinking is not None:  # the row's own mix settings (dataset/sampling.py), so the eval sees them too
        row["enable_thinking"] = p.thinking
    if p.sampling:
        row["sampling"] = p.sampling
    return row


class HeldoutWriter:
    """Collects the held-out prompts of one plan as gzip'd JSONL with fixed bytes for the same input
    (gzip mtime 0), so a retried or concurrent plan writes the identical object. Owned by the plan's
    one thread; memory is the compressed file plus the ids."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._gz = gzip.GzipFile(fileobj=self._buf, mode="wb", mtime=0)
        self.ids: list[str] = []

    def add(self, p: Prompt) -> None:
        line = json.dumps(heldout_row(p), ensure_ascii=False, sort_keys=True, default=str) + "\n"
        self._gz.write(line.encode())
        self.ids.append(p.id)

    def finish(self) -> bytes:
        self._gz.close()
        return self._buf.getvalue()


def iter_heldout_prompts(data: bytes, key: str) -> Iterator[Prompt | Reject]:
    """The held-out file read back with the prompt reader (the eval's way in)."""
    yield from iter_prompt_file(io.BytesIO(data), key)


def load_split(client: Any, heldout_uri: str | None, fraction: float, salt: str) -> tuple[HeldoutSplit, str | None]:
    """A run's held-out split and the ETag of its held-out file (None without one)."""
    if heldout_uri is None:
        return HeldoutSplit(fraction, salt), None
    src = parse_s3_uri(heldout_uri, what="heldout_uri")
    store = Store(client, src.bucket)
    got = with_retries(lambda: store.get(src.key), what="read heldout_uri")
    if got is None:
        raise HeldoutError(f"heldout_uri {heldout_uri} does not exist")
    try:
        ids = read_heldout_ids(io.BytesIO(got[0]), src.key)
    except (PromptFileError, UnicodeDecodeError) as exc:
        raise HeldoutError(f"heldout_uri {heldout_uri}: {exc}") from exc
    if not ids:
        raise HeldoutError(f"heldout_uri {heldout_uri} names no id")
    return HeldoutSplit(fraction, salt, ids, heldout_uri), got[1]


def write_heldout(store: Store, layout: DatasetLayout, split: HeldoutSplit, writer: HeldoutWriter,
                  count: int) -> dict[str, Any] | None:
    """Write the held-out prompts (before the manifest, whose entry points at them); None without a split.

    The bytes are a function of the input and the split, so a retried or racing plan of the same split
    finds the same object; one of another split is refused; `named_not_found` counts ids of the held-out file the input did not have (or had only as a
    duplicate of an earlier row, whose content is then in the training data: see docs/architecture.md)."""
    data = writer.finish()
    if not split.active:
        return None
    key = layout.heldout_prompts_key
    try:  # If-None-Match: a racing plan of another split must not replace the file its manifest names
        with_retries(lambda: store.put(key, data, if_none_match=True, content_type="application/gzip"),
                     what="write held-out prompts")
    except PreconditionFailed:
        got = with_retries(lambda: store.get(key), what="read held-out prompts")
        if got is not None and got[0] != data:
            raise HeldoutError(
                f"s3://{layout.bucket}/{key} already holds other held-out prompts (another plan of this root with "
                "another split, or one that stopped before writing its manifest). Use a new output_uri, or delete "
                "that object if no manifest.json names it") from None
    found = set(writer.ids)
    return {
        "fraction": split.fraction,
        "salt": split.salt,
        "heldout_uri": split.uri,
        "count": count,
        "key": layout.heldout_prompts_key,
        "uri": f"s3://{layout.bucket}/{layout.heldout_prompts_key}",
        "ids_sha256": ids_sha256(writer.ids),
        "named_ids": len(split.ids),
        "named_not_found": sum(1 for i in split.ids if i not in found),
    }
