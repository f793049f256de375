"""The held-out split: which conversations never reach a training shard, decided by id alone.

Why by id: every sample of a prompt, every turn of its conversation and every rerun must go the same
way, and a reader that has only the id (tokenize, the eval) must be able to tell. A prompt id is held
out when it is named in the held-out file (`heldout_uri`), or when

    int(sha256(f"{salt}:{id}")[:8 bytes]) / 2**64 < fraction

so the split is a pure function of (id, salt, fraction): no state, the same on every machine, and
a different salt draws an independent split. Plan writes the held-out prompts to
`heldout/prompts.jsonl.gz` under the dataset root (in the input format, readable back as a
`prompts_uri`) and records the split in the manifest; tokenize refuses any held-out id it meets.

Nothing here talks to S3: callers hand in byte streams.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from dflash_pipeline.dataset.prompts import (
    Prompt,
    PromptFileError,
    Reject,
    detect_format,
    iter_prompt_file,
    normalize_row,
)

DEFAULT_SALT = "dflash-heldout"
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
