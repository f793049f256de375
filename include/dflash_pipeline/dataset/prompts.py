"""Reading and checking prompt files: JSONL, .jsonl.gz and Parquet, streamed row by row.

Every row is either a `Prompt` (normalised messages and a stable id) or a `Reject` carrying the line
(JSONL) or row number (Parquet) and a reason a person can act on. Nothing here talks to S3 or Airflow;
`plan` feeds it a byte stream.

Row metadata: a row may carry `source` and `domain` (strings) and `metadata` (a JSON object); every other
top-level key of the row (anything but `id`, `messages`, `prompt`) is kept inside the metadata too (the
`metadata` object's own value wins on a clash), so nothing a user put in a row is lost on its way to the
completions and the training rows. The row's domain is its `domain`, else `metadata["domain"]` when that
is a string, else null.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from dflash_pipeline.config.sampling import parse_row_mix, row_mix_keys

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# Keys of an input row that are not row metadata: the conversation and its id.
CONVERSATION_KEYS = ("id", "messages", "prompt")
MAX_LABEL_LEN = 256
MAX_ID_LEN = 512
REGENERATE_MODES = ("last_turn", "all_turns")


class PromptFileError(ValueError):
    """The file as a whole cannot be read (wrong format, wrong Parquet columns)."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, str]]
    content_hash: bytes
    line: int
    # The row's messages exactly as read (role, content, reasoning), old answers included.
    original: list[dict[str, Any]] | None = None
    source: str | None = None
    domain: str | None = None
    # The row's `metadata` object plus its other extra keys; None when it has neither.
    metadata: dict[str, Any] | None = None
    # The row's own thinking mode (`enable_thinking`, or `thinking` when a bool) and sampling overrides
    # (its `sampling` object); None when it gives none (config/sampling.py parse_row_mix).
    thinking: bool | None = None
    sampling: dict[str, Any] | None = None


@dataclass(frozen=True)
class Reject:
    line: int
    reason: str
    excerpt: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "reason": self.reason, "excerpt": self.excerpt}


def canonical_messages(messages: list[dict[str, str]]) -> bytes:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def derive_id(messages: list[dict[str, str]]) -> str:
    """A stable id from the content, so reruns and resumes agree without an id column."""
    return "h" + hashlib.sha256(canonical_messages(messages)).hexdigest()[:24]


def detect_format(key: str, head: bytes) -> str:
    """'parquet', 'jsonl.gz' or 'jsonl', from magic bytes first, then the key's suffix."""
    if head[:4] == b"PAR1":
        return "parquet"
    if head[:2] == b"\x1f\x8b":
        return "jsonl.gz"
    lowered = key.lower()
    if lowered.endswith(".parquet"):
        return "parquet"
    if lowered.endswith((".jsonl", ".json", ".ndjson", ".jsonl.gz")):
        return "jsonl"
    raise PromptFileError(f"cannot tell the format of {key!r}: use .jsonl, .jsonl.gz or .parquet")


def parse_labels(row: dict[str, Any]) -> tuple[str | None, str | None, dict[str, Any] | None] | str:
    """(source, domain, metadata) of a decoded row, or the reason they cannot be used."""
    labels: list[str | None] = []
    for name in ("source", "domain"):
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            return f"'{name}' must be a string, got {type(value).__name__}"
        if isinstance(value, str) and len(value) > MAX_LABEL_LEN:
            return f"'{name}' is longer than {MAX_LABEL_LEN} characters"
        labels.append(value if value else None)
    given = row.get("metadata")
    if isinstance(given, str):  # a JSON-encoded object, as our own Parquet files carry it
        try:
            given = json.loads(given) if given.strip() else None
        except json.JSONDecodeError:
            return "'metadata' is a string that is not a JSON object"
    if given is not None and not isinstance(given, dict):
        return f"'metadata' must be a JSON object, got {type(given).__name__}"
    # A null extra key carries nothing (a Parquet file has every column in every row).
    extra = {k: v for k, v in row.items()
             if k not in CONVERSATION_KEYS and k not in ("source", "domain", "metadata") and v is not None}
    metadata: dict[str, Any] | None = {**extra, **(given or {})} or None
    domain = labels[1]
    if domain is None and metadata is not None and isinstance(metadata.get("domain"), str) and metadata["domain"]:
        domain = metadata["domain"]
    return labels[0], domain, metadata


def _original(msg: dict[str, Any]) -> dict[str, Any]:
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    return {"role": msg.get("role"), "content": msg.get("content"),
            "reasoning": reasoning if isinstance(reasoning, str) else None}


def normalize_row(row: Any, line: int, regenerate: str = "last_turn") -> Prompt | Reject:
    """Check one decoded row and turn it into a Prompt, or say exactly what is wrong with it.

    `regenerate="all_turns"` replays every assistant turn, so it also refuses what it cannot replay:
    tool turns and tool calls (their outputs belong to the original answers), and an assistant turn
    that does not answer a user turn."""
    if not isinstance(row, dict):
        return Reject(line, f"row is a JSON {type(row).__name__}, expected an object")
    has_messages = row.get("messages") is not None
    has_prompt = row.get("prompt") is not None
    if has_messages and has_prompt:
        return Reject(line, "row has both 'messages' and 'prompt'; give one")
    if not has_messages and not has_prompt:
        return Reject(line, "row has neither 'messages' nor 'prompt'")
    if has_prompt:
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            return Reject(line, f"'prompt' must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            return Reject(line, "'prompt' is empty")
        messages = [{"role": "user", "content": prompt}]
        original = [{"role": "user", "content": prompt, "reasoning": None}]
    else:
        raw = row["messages"]
        if not isinstance(raw, list) or not raw:
            return Reject(line, "'messages' must be a non-empty list")
        messages = []
        for i, msg in enumerate(raw):
            if not isinstance(msg, dict):
                return Reject(line, f"messages[{i}] is not an object")
            role = msg.get("role")
            content = msg.get("content")
            if regenerate == "all_turns":
                if role in ("tool", "function", "ipython"):
                    return Reject(line, f"messages[{i}].role is {role!r}: regenerate=all_turns cannot replay "
                                        "tool turns (their output answers the original assistant's tool call)")
                if role == "assistant" and msg.get("tool_calls"):
                    return Reject(line, f"messages[{i}] has tool_calls: regenerate=all_turns cannot replay them")
                if role == "assistant" and (not messages or messages[-1]["role"] != "user"):
                    return Reject(line, f"messages[{i}] is an assistant turn that does not follow a user turn: "
                                        "regenerate=all_turns has nothing to answer")
            if role not in ROLES:
                return Reject(line, f"messages[{i}].role is {role!r}; must be one of {list(ROLES)}")
            if not isinstance(content, str):
                return Reject(line, f"messages[{i}].content must be a string")
            if not content.strip():
                return Reject(line, f"messages[{i}].content is empty")
            messages.append({"role": role, "content": content})
        original = [_original(m) for m in raw]
        # The old completion being regenerated is dropped: we answer the last user turn anew.
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages or messages[-1]["role"] != "user":
            return Reject(line, "the conversation must end with a user message (after dropping the old answer)")
    raw_id = row.get("id")
    if raw_id is None:
        pid = derive_id(messages)
    elif isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        return Reject(line, f"'id' must be a string or integer, got {type(raw_id).__name__}")
    else:
        pid = str(raw_id)
        if not pid.strip():
            return Reject(line, "'id' is empty")
        if len(pid) > MAX_ID_LEN:
            return Reject(line, f"'id' is longer than {MAX_ID_LEN} characters")
    # Thinking and sampling mix (owner: config/sampling.py); these keys are settings, not metadata.
    mix = parse_row_mix(row)
    if isinstance(mix, str):
        return Reject(line, mix)
    mix_keys = row_mix_keys(row)
    labels = parse_labels({k: v for k, v in row.items() if k not in mix_keys} if mix_keys else row)
    if isinstance(labels, str):
        return Reject(line, labels)
    content = canonical_messages(messages)
    if mix != (None, None):  # the same prompt in another mode is another conversation, not a duplicate
        content += json.dumps({"thinking": mix[0], "sampling": mix[1]}, sort_keys=True).encode()
        if raw_id is None:
            pid = "h" + hashlib.sha256(content).hexdigest()[:24]
    digest = hashlib.sha256(content).digest()[:16]
    return Prompt(pid, messages, digest, line, original, *labels, thinking=mix[0], sampling=mix[1])


def _excerpt(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return text[:200]


def iter_jsonl(stream: IO[bytes], regenerate: str = "last_turn") -> Iterator[Prompt | Reject]:
    """Rows of a JSONL byte stream; blank lines are skipped, line numbers are 1-based."""
    for lineno, raw in enumerate(stream, start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield Reject(lineno, f"invalid UTF-8 at byte {exc.start}", _excerpt(raw))
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            yield Reject(lineno, f"malformed JSON: {exc.msg} at column {exc.colno}", _excerpt(text))
            continue
        result = normalize_row(row, lineno, regenerate)
        if isinstance(result, Reject):
            result = Reject(result.line, result.reason, _excerpt(text))
        yield result


def iter_parquet(path_or_file: Any, batch_rows: int = 10_000, regenerate: str = "last_turn") -> Iterator[Prompt | Reject]:
    """Rows of a Parquet file, one record batch at a time (memory bounded by the batch)."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path_or_file)
    except Exception as exc:  # noqa: BLE001 - any reader failure is a file-level error
        raise PromptFileError(f"not a readable Parquet file: {exc}") from exc
    names = set(pf.schema_arrow.names)
    if "messages" not in names and "prompt" not in names:
        raise PromptFileError(
            f"Parquet columns are {sorted(names)}; a prompt file needs a 'messages' or 'prompt' column"
        )
    rowno = 0
    # Every column: the ones that are not the conversation are the rows' metadata.
    for batch in pf.iter_batches(batch_size=batch_rows):
        for row in batch.to_pylist():
            rowno += 1
            yield normalize_row(row, rowno, regenerate)


def iter_prompt_file(stream: IO[bytes], key: str, regenerate: str = "last_turn") -> Iterator[Prompt | Reject]:
    """Dispatch on the file's format. Parquet needs seeking, so it is spooled to a temp file."""
    head = stream.read(4)
    fmt = detect_format(key, head)
    rest = _Prepend(head, stream)
    if fmt == "parquet":
        import tempfile

        with tempfile.TemporaryFile() as tmp:
            while chunk := rest.read(1 << 20):
                tmp.write(chunk)
            tmp.seek(0)
            yield from iter_parquet(tmp, regenerate=regenerate)
        return
    if fmt == "jsonl.gz":
        try:
            yield from iter_jsonl(io.BufferedReader(gzip.GzipFile(fileobj=rest)), regenerate)  # type: ignore[arg-type]
        except (OSError, EOFError) as exc:
            raise PromptFileError(f"broken gzip stream: {exc}") from exc
        return
    yield from iter_jsonl(io.BufferedReader(rest), regenerate)  # type: ignore[arg-type]


class _Prepend(io.RawIOBase):
    """Put the sniffed bytes back in front of a non-seekable stream."""

    def __init__(self, head: bytes, stream: IO[bytes]) -> None:
        self._head = head
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._stream.read(len(b))
        if not data:
            return 0
        b[: len(data)] = data
        return len(data)
