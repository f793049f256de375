"""Reading and checking prompt files: JSONL, .jsonl.gz and Parquet, streamed row by row.

Every row is either a `Prompt` (normalised messages and a stable id) or a `Reject` carrying the line
(JSONL) or row number (Parquet), a reason a person can act on and a short `code` (the reason's kind,
what plan counts rejects by). Nothing here talks to S3 or Airflow; `plan` feeds it a byte stream.

Formats (docs/inputs.md has examples):
- `prompt`: a string, one user turn.
- `messages` (OpenAI chat): roles system, developer, user, assistant, tool (and the legacy `function`);
  content a string, null (an assistant turn that only calls tools) or a list of parts.
- `conversations` (ShareGPT): turns with `from`/`value` (human, gpt, system, observation,
  function_call, ...), or with `role`/`content` as SpecForge writes them; a top-level `system` string
  (LLaMA-Factory's column) is the system turn when the conversation has none.

Normalised messages are `{"role", "content"}` strings with roles system, user, assistant and tool,
which is what every later step (requests, tokenize, trainers' files) carries:
- `developer` becomes `system`: OpenAI made it the successor of `system`; Qwen3's chat template has no
  branch for it (it would render nothing of it), and SGLang before its `developer` support refuses it.
- list-of-parts content: text parts joined with "\n", as vLLM joins them for a string-content
  template (renderers/chat_utils.py); any other part (image, audio, file) is a reject: the servers
  here are text-only and dropping the part would change the question.
- an assistant turn's `tool_calls` are folded into its content as Qwen3 / Hermes templates render
  them (`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, "\n" between): for those
  templates the rendered prompt is byte for byte what the structured call renders. `tool` turns keep
  their role (the template wraps them in `<tool_response>`); their `tool_call_id` is not sent
  (Qwen3 templates ignore it, SGLang and vLLM accept a tool turn without it).
- trailing assistant turns are the old answer and are dropped (an empty one too); the conversation
  must then end with a user or tool turn (the model answers the tool's output).

Row metadata: a row may carry `source` and `domain` (strings) and `metadata` (a JSON object); every other
top-level key of the row (anything but `id`, `messages`, `conversations`, `prompt`) is kept inside the
metadata too (the `metadata` object's own value wins on a clash), so nothing a user put in a row is lost
on its way to the completions and the training rows. The row's domain is its `domain`, else
`metadata["domain"]` when that is a string, else null.
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

from dflash_pipeline.dataset.sampling import JsonTextError, decode_json_text, parse_row_mix, row_mix_keys

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
# Keys of an input row that are not row metadata: the conversation and its id.
CONVERSATION_KEYS = ("id", "messages", "conversations", "prompt")
MAX_LABEL_LEN = 256
MAX_ID_LEN = 512
REGENERATE_MODES = ("last_turn", "all_turns")

# Every spelling of a role the common formats use (lower-cased), to the role we send.
ROLE_ALIASES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant",
    "bot": "assistant",
    "tool": "tool", "function": "tool", "ipython": "tool", "observation": "tool",
    "function_response": "tool", "tool_response": "tool",
}
# ShareGPT's (LLaMA-Factory's) turn holding one tool call as JSON text: an assistant turn.
SHAREGPT_CALL_ROLES = ("function_call", "tool_call")
TEXT_PART_TYPES = ("text", "input_text", "output_text")

# Reject codes (the kind of a reject; plan counts by them). Reasons carry the detail.
R_JSON = "malformed_json"
R_UTF8 = "invalid_utf8"
R_ROW = "not_an_object"
R_NO_CONVERSATION = "no_conversation"
R_TWO_CONVERSATIONS = "two_conversations"
R_PROMPT = "bad_prompt"
R_MESSAGES = "bad_messages"
R_ROLE = "unknown_role"
R_CONTENT = "bad_content"
R_NON_TEXT = "non_text_content"
R_EMPTY = "empty_content"
R_TOOL_CALL = "bad_tool_call"
R_ENDING = "no_turn_to_answer"
R_ALL_TURNS = "cannot_replay"
R_ID = "bad_id"
R_LABELS = "bad_labels"
R_ID_CONFLICT = "id_conflict"
R_MIX = "bad_thinking_or_sampling"


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
    # (its `sampling` object); None when it gives none (dataset/sampling.py parse_row_mix).
    thinking: bool | None = None
    sampling: dict[str, Any] | None = None


@dataclass(frozen=True)
class Reject:
    line: int
    reason: str
    excerpt: str = ""
    code: str = "invalid"
    # The input object the row came from (plan sets it when it reads several).
    file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"line": self.line, "code": self.code, "reason": self.reason, "excerpt": self.excerpt}
        if self.file is not None:
            out["file"] = self.file
        return out


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
    if lowered.endswith(PROMPT_FILE_SUFFIXES):
        return "jsonl"
    raise PromptFileError(f"cannot tell the format of {key!r}: use .jsonl, .jsonl.gz or .parquet")


PROMPT_FILE_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz", ".parquet")


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
    given = decode_json_text(row.get("metadata"), "metadata")  # our own Parquet files carry it as JSON text
    if isinstance(given, JsonTextError):
        return str(given)
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


class _Bad(Exception):
    """One row's problem while normalising it: (code, reason)."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _text(content: Any, where: str) -> str:
    """A message's content as one string: a string, null (empty) or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):  # a single part, as some exports write it
        content = [content]
    if not isinstance(content, list):
        raise _Bad(R_CONTENT, f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise _Bad(R_CONTENT, f"{where}[{j}] is a {type(part).__name__}, expected a content part object")
        kind = part.get("type")
        if kind is None and isinstance(part.get("text"), str):
            kind = "text"
        if kind not in TEXT_PART_TYPES:
            raise _Bad(R_NON_TEXT, f"{where}[{j}] is a {kind!r} part: only text parts can be sent "
                                   "(the servers are text-only; dropping the part would change the question)")
        text = part.get("text")
        if not isinstance(text, str):
            raise _Bad(R_CONTENT, f"{where}[{j}] is a text part without a string 'text'")
        texts.append(text)
    return "\n".join(texts)


def _tool_call_text(call: Any, where: str) -> str:
    """One tool call as Qwen3 / Hermes chat templates render it."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except json.JSONDecodeError:
            raise _Bad(R_TOOL_CALL, f"{where} is a string that is not JSON") from None
    if not isinstance(call, dict):
        raise _Bad(R_TOOL_CALL, f"{where} must be an object, got {type(call).__name__}")
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise _Bad(R_TOOL_CALL, f"{where} has no function name")
    args = fn.get("arguments", fn.get("parameters", {}))
    if args is None:
        args = {}
    rendered = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + rendered + "}\n</tool_call>"


def fold_tool_calls(content: str, calls: list[Any], where: str) -> str:
    """An assistant turn's text followed by its tool calls, as the Qwen3 template writes them."""
    out = content
    for k, call in enumerate(calls):
        if k > 0 or content:
            out += "\n"
        out += _tool_call_text(call, f"{where}.tool_calls[{k}]")
    return out


def _turns(row: dict[str, Any]) -> tuple[str, list[Any]]:
    """(which key, the raw turns) of a chat row."""
    key = "messages" if row.get("messages") is not None else "conversations"
    raw = row[key]
    if not isinstance(raw, list) or not raw:
        raise _Bad(R_MESSAGES, f"'{key}' must be a non-empty list")
    return key, raw


def _message(msg: Any, key: str, i: int) -> tuple[str, str, list[Any] | None, Any]:
    """(role, text, tool calls or None, reasoning) of one turn in any of the chat formats."""
    if not isinstance(msg, dict):
        raise _Bad(R_MESSAGES, f"{key}[{i}] is not an object")
    sharegpt = "from" in msg and "role" not in msg
    raw_role = msg.get("from") if sharegpt else msg.get("role")
    raw_content = msg.get("value") if sharegpt else msg.get("content")
    if sharegpt and raw_content is None and "content" in msg:
        raw_content = msg.get("content")
    role = ROLE_ALIASES.get(raw_role) if isinstance(raw_role, str) else None  # the usual spelling: fast
    if role is None:
        lowered = raw_role.strip().lower() if isinstance(raw_role, str) else None
        if lowered in SHAREGPT_CALL_ROLES:  # the value is the call itself
            return "assistant", "", [_text(raw_content, f"{key}[{i}].value")], None
        role = ROLE_ALIASES.get(lowered) if lowered is not None else None
        if role is None:
            known = sorted({*ROLE_ALIASES, *SHAREGPT_CALL_ROLES})
            raise _Bad(R_ROLE, f"{key}[{i}].{'from' if sharegpt else 'role'} is {raw_role!r}; must be one of {known}")
    where = ""
    if type(raw_content) is str:
        content = raw_content
    else:
        where = f"{key}[{i}]"
        content = _text(raw_content, f"{where}.{'value' if sharegpt else 'content'}")
    calls = msg.get("tool_calls")
    if calls is None and isinstance(msg.get("function_call"), dict):  # OpenAI's legacy single call
        calls = [msg["function_call"]]
    if calls is not None and calls != []:
        where = where or f"{key}[{i}]"
        if role != "assistant":
            raise _Bad(R_TOOL_CALL, f"{where} is a {role} turn with tool_calls")
        if not isinstance(calls, list):
            raise _Bad(R_TOOL_CALL, f"{where}.tool_calls must be a list")
    else:
        calls = None
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    return role, content, calls, reasoning


def _as_read(role: str, content: str, calls: list[Any] | None, reasoning: Any) -> dict[str, Any]:
    """One original turn (old answers included): its calls folded in when they can be."""
    if calls:
        try:
            content = fold_tool_calls(content, calls, "")
        except _Bad:
            pass  # a broken call in an old answer that is dropped anyway
    return {"role": role, "content": content, "reasoning": reasoning if isinstance(reasoning, str) else None}


def _chat(row: dict[str, Any], regenerate: str) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """(messages to send, the original turns) of a `messages` / `conversations` row."""
    key, raw = _turns(row)
    turns = [_message(m, key, i) for i, m in enumerate(raw)]
    system = row.get("system")
    if key == "conversations" and isinstance(system, str) and system.strip() and turns[0][0] != "system":
        turns.insert(0, ("system", system, None, None))  # LLaMA-Factory's ShareGPT keeps it in a column
    original = [_as_read(*t) for t in turns]
    # The old completion being regenerated is dropped (an empty one too): we answer anew.
    end = len(turns)
    while end and turns[end - 1][0] == "assistant":
        end -= 1
    messages: list[dict[str, str]] = []
    for i, (role, content, calls, _) in enumerate(turns[:end]):
        if regenerate == "all_turns":
            if role == "tool":
                raise _Bad(R_ALL_TURNS, f"{key}[{i}] is a tool turn: regenerate=all_turns cannot replay tool turns "
                                        "(their output answers the original assistant's tool call)")
            if calls:
                raise _Bad(R_ALL_TURNS, f"{key}[{i}] has tool_calls: regenerate=all_turns cannot replay them")
            if role == "assistant" and (not messages or messages[-1]["role"] != "user"):
                raise _Bad(R_ALL_TURNS, f"{key}[{i}] is an assistant turn that does not follow a user turn: "
                                        "regenerate=all_turns has nothing to answer")
        if calls:
            content = fold_tool_calls(content, calls, f"{key}[{i}]")
        if not content.strip():
            raise _Bad(R_EMPTY, f"{key}[{i}] has empty content")
        messages.append({"role": role, "content": content})
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise _Bad(R_ENDING, "the conversation must end with a user (or tool) turn after dropping the old answer")
    if not any(m["role"] == "user" for m in messages):
        raise _Bad(R_ENDING, "the conversation has no user turn")
    return messages, original


def normalize_row(row: Any, line: int, regenerate: str = "last_turn") -> Prompt | Reject:
    """Check one decoded row and turn it into a Prompt, or say exactly what is wrong with it.

    `regenerate="all_turns"` replays every assistant turn, so it also refuses what it cannot replay:
    tool turns and tool calls (their outputs belong to the original answers), and an assistant turn
    that does not answer a user turn."""
    if not isinstance(row, dict):
        return Reject(line, f"row is a JSON {type(row).__name__}, expected an object", code=R_ROW)
    given = [k for k in ("messages", "conversations", "prompt") if row.get(k) is not None]
    if len(given) > 1:
        return Reject(line, f"row has {' and '.join(repr(k) for k in given)}; give only one", code=R_TWO_CONVERSATIONS)
    if not given:
        return Reject(line, "row has none of 'messages', 'conversations' (ShareGPT) or 'prompt'", code=R_NO_CONVERSATION)
    if given[0] == "prompt":
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            return Reject(line, f"'prompt' must be a string, got {type(prompt).__name__}", code=R_PROMPT)
        if not prompt.strip():
            return Reject(line, "'prompt' is empty", code=R_EMPTY)
        messages = [{"role": "user", "content": prompt}]
        original = [{"role": "user", "content": prompt, "reasoning": None}]
    else:
        try:
            messages, original = _chat(row, regenerate)
        except _Bad as bad:
            return Reject(line, bad.reason, code=bad.code)
    raw_id = row.get("id")
    if raw_id is None:
        pid = derive_id(messages)
    elif isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        return Reject(line, f"'id' must be a string or integer, got {type(raw_id).__name__}", code=R_ID)
    else:
        pid = str(raw_id)
        if not pid.strip():
            return Reject(line, "'id' is empty", code=R_ID)
        if len(pid) > MAX_ID_LEN:
            return Reject(line, f"'id' is longer than {MAX_ID_LEN} characters", code=R_ID)
    # Thinking and sampling mix (owner: dataset/sampling.py); these keys are settings, not metadata.
    mix = parse_row_mix(row)
    if isinstance(mix, str):
        return Reject(line, mix, code=R_MIX)
    mix_keys = row_mix_keys(row)
    labels = parse_labels({k: v for k, v in row.items() if k not in mix_keys} if mix_keys else row)
    if isinstance(labels, str):
        return Reject(line, labels, code=R_LABELS)
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
            yield Reject(lineno, f"invalid UTF-8 at byte {exc.start}", _excerpt(raw), code=R_UTF8)
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            yield Reject(lineno, f"malformed JSON: {exc.msg} at column {exc.colno}", _excerpt(text), code=R_JSON)
            continue
        result = normalize_row(row, lineno, regenerate)
        if isinstance(result, Reject):
            result = Reject(result.line, result.reason, _excerpt(text), code=result.code)
        yield result


def iter_parquet(path_or_file: Any, batch_rows: int = 10_000, regenerate: str = "last_turn") -> Iterator[Prompt | Reject]:
    """Rows of a Parquet file, one record batch at a time (memory bounded by the batch)."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path_or_file)
    except Exception as exc:  # noqa: BLE001 - any reader failure is a file-level error
        raise PromptFileError(f"not a readable Parquet file: {exc}") from exc
    names = set(pf.schema_arrow.names)
    if not names & {"messages", "conversations", "prompt"}:
        raise PromptFileError(
            f"Parquet columns are {sorted(names)}; a prompt file needs a 'messages', 'conversations' or "
            "'prompt' column"
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
