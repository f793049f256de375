"""Talking to one OpenAI-compatible server (SGLang, vLLM or generic): building chat requests,
sending them, classifying what comes back. What differs between engines is in `serving/engines.py`;
probing a server and sampling its load is `serving/probe.py`.

Outcomes are sorted into the classes the retry policy acts on:
- transient (connection refused/reset, timeouts, 408/429/5xx, 503 queue full, a garbled body):
  retried with backoff by the caller;
- permanent for that prompt (400 context length, other 4xx a retry cannot fix): becomes an error row;
- configuration (401/403 API key, 404 wrong endpoint or model): the task fails at once.
`finish_reason == "length"` is a normal result, never an error.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import requests

from dflash_pipeline.config import Sampling
from dflash_pipeline.dataset.sampling import SAMPLING_KEYS, request_sampling
from dflash_pipeline.serving.engines import (
    Engine,
    adapter,
    error_code,
    error_message,
    is_error_body,
    reasoning_of,
    token_id_sources,
    token_ids_of,
)
from dflash_pipeline.serving.specstats import SpecStats
from dflash_pipeline.serving.specwire import spec_stats_of

logger = logging.getLogger(__name__)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ServerSpec:
    """A server as the user named it (`name`, safe to log and store) and how to reach it."""

    name: str
    base_url: str
    api_key: str | None = field(default=None, repr=False)

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass(frozen=True)
class ServerInfo:
    """What preflight learned; stored in the manifest (no secrets: SGLang redacts api_key)."""

    name: str
    base_url: str
    model_path: str | None
    served_model_name: str | None
    max_running_requests: int | None
    max_total_num_tokens: int | None
    context_length: int | None
    version: str | None
    engine: str = Engine.SGLANG.value
    # Set when the capacity is our default, not the server's figure (vLLM, generic servers).
    capacity_warning: str | None = None
    # The server's speculative decoding (specwire.SpecConfig.to_manifest()), None when it does not
    # speculate: recorded in the manifest's server entry as `speculative`.
    speculative: dict[str, Any] | None = None
    # The reasoning parser the server reports (SGLang's server args `reasoning_parser`; None there =
    # started without one). `reasoning_parser_reported` False: the engine does not say (vLLM's HTTP API
    # has no such field; /server_info exists only with VLLM_SERVER_DEV_MODE).
    reasoning_parser: str | None = None
    reasoning_parser_reported: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def serves(self, model: str) -> bool:
        return model in {self.served_model_name, self.model_path}


class RequestFailure(Exception):
    """One request's failure, with the class recorded in error rows."""

    def __init__(self, error_class: str, message: str, *, kind: str, status: int | None = None) -> None:
        super().__init__(f"{error_class}: {message}")
        self.error_class = error_class
        self.message = message[:2000]
        self.kind = kind  # "transient" | "permanent" | "config"
        self.status = status

    @property
    def transient(self) -> bool:
        return self.kind == "transient"


_CONTEXT_HINTS = (
    "context length", "context_length", "maximum context", "too long", "longer than the model",
    # vLLM 0.32: "max_tokens=X cannot be greater than max_model_len=N." (max_tokens alone exceeds the context)
    "than max_model_len",
    # vLLM 0.32 clamps max_tokens to the room left beside the prompt; a prompt that fills the whole
    # context leaves none: "max_tokens must be at least 1, got 0." (never sent by us: max_tokens >= 1)
    "must be at least 1, got 0",
)


def classify_http_error(status: int, body: str) -> RequestFailure:
    """Turn an HTTP error status and the engine's error JSON (SGLang's flat or vLLM's nested
    `{"error": {...}}` body) into a RequestFailure."""
    message = body
    try:
        message = error_message(json.loads(body)) or body
    except ValueError:
        pass
    message = message.strip() or f"HTTP {status}"
    lowered = message.lower()
    if status == 400 and any(h in lowered for h in _CONTEXT_HINTS):
        return RequestFailure("ContextLengthExceeded", message, kind="permanent", status=status)
    if status in (401, 403):
        return RequestFailure("Unauthorized", f"HTTP {status}: {message}", kind="config", status=status)
    if status == 404:
        return RequestFailure("NotFound", f"HTTP {status}: {message}", kind="config", status=status)
    if status in (408, 425, 429) or status >= 500:
        cls = {503: "ServiceUnavailable", 429: "RateLimited", 408: "RequestTimeout"}.get(status, "ServerError")
        return RequestFailure(cls, f"HTTP {status}: {message}", kind="transient", status=status)
    return RequestFailure("BadRequest", f"HTTP {status}: {message}", kind="permanent", status=status)


def request_seed(seed: int | None, prompt_id: str, sample: int = 0) -> int | None:
    """The seed of one (id, sample): sample 0 keeps the seed rows had before samples existed."""
    if seed is None:
        return None
    key = f"{seed}:{prompt_id}" if sample == 0 else f"{seed}:{prompt_id}:{sample}"
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def build_chat_body(
    messages: list[dict[str, str]], model: str, sampling: Sampling, prompt_id: str,
    engine: Engine | str | None = Engine.SGLANG, *, sample: int = 0,
    spec_fields: dict[str, Any] | None = None, thinking: bool | None = None,
    overrides: dict[str, Any] | None = None, max_tokens_cap: int | None = None,
) -> dict[str, Any]:
    """The chat body for `engine`: `chat_template_kwargs` top-level for all (SGLang and vLLM both
    read it there), `separate_reasoning` only for SGLang; the seed is the sample's. `spec_fields`:
    what makes a speculating server return each answer's statistics (specwire.request_fields).

    Sampling fields: the run's (with `sampling.extra`), then the sample's `sampling.ladder` entry,
    then the row's `overrides` (dataset/sampling.py). `thinking`: the row's mode (None: the run's
    enable_thinking). `max_tokens_cap` (probes, the preflight proof): a short answer whatever the
    overrides say, with `min_tokens` lowered to fit it."""
    fields = request_sampling(sampling.base_fields(), sampling.ladder, sample, overrides)
    if max_tokens_cap is not None:
        fields["max_tokens"] = min(int(fields["max_tokens"]), max_tokens_cap)
        if "min_tokens" in fields:
            fields["min_tokens"] = min(int(fields["min_tokens"]), fields["max_tokens"])
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        **fields,
        "stream": False,
        "chat_template_kwargs": {"enable_thinking": sampling.enable_thinking if thinking is None else thinking},
    }
    adapter(engine).chat_body(body)
    if spec_fields:
        body.update(spec_fields)
    seed = request_seed(sampling.seed, prompt_id, sample)
    if seed is not None:
        body["seed"] = seed
    return body


def sent_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields a request body carries (what a completion row's `sampling` column records)."""
    return {k: body[k] for k in sorted(body) if k in SAMPLING_KEYS or k == "seed"}


def split_reasoning(content: str | None, reasoning_content: str | None) -> tuple[str | None, str]:
    """(reasoning, answer) whether the server split them or returned `<think>…</think>` inline.

    Truncated thinking (no closing tag) is all reasoning with an empty answer. A close tag with no
    open tag is the Qwen3 template's shape, where `<think>` was part of the prompt.
    """
    if reasoning_content:
        return reasoning_content, content or ""
    text = content or ""
    start = text.find(THINK_OPEN)
    end = text.find(THINK_CLOSE)
    if start == -1 and end == -1:
        return None, text
    if end == -1:
        return text[start + len(THINK_OPEN) :].strip("\n"), ""
    begin = start + len(THINK_OPEN) if -1 < start < end else 0
    return text[begin:end].strip("\n"), text[end + len(THINK_CLOSE) :].lstrip("\n")


@dataclass(frozen=True)
class Completion:
    reasoning: str | None
    content: str
    finish_reason: str | None
    matched_stop: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None
    model: str | None
    # usage.prompt_tokens_details.cached_tokens: SGLang with --enable-cache-report, vLLM with
    # --enable-prompt-tokens-details (which leaves it out when 0); None when not reported.
    cached_tokens: int | None = None
    # Where the thinking came from: "field" (reasoning_content/reasoning), "inline" (<think> in content).
    reasoning_source: str | None = None
    # The token ids the engine used, when it returned them (serving/engines.py token_ids_of): the
    # rendered prompt as the engine encoded it, and every token it generated (the stop token included
    # when the engine returns it). int32 arrays: a held row costs 4 bytes per token, not a Python int.
    prompt_token_ids: np.ndarray | None = field(default=None, repr=False, compare=False)
    output_token_ids: np.ndarray | None = field(default=None, repr=False, compare=False)
    # The request's speculative-decoding statistics when the server gave them (serving/specwire.py).
    spec: SpecStats | None = None
    # Where the answer carried its prompt ids and generated ids (engines.token_id_sources), None where
    # it had none: what preflight records as the server's token-id mechanism.
    token_id_sources: tuple[str | None, str | None] = field(default=(None, None), compare=False)


def parse_chat_response(data: Any) -> Completion:
    """Parse a /v1/chat/completions body (SGLang, vLLM, generic); a malformed one raises a
    transient failure. The thinking is `reasoning_content` or `reasoning` (vLLM >= 0.17); vLLM's
    `content` is null when the answer is empty.

    An error object sent with HTTP 200 (`{"object": "error", "code": 400, ...}`, which SGLang's
    OpenAI layer can return) is classified by its own code, not retried as a bad shape."""
    if is_error_body(data):
        raise classify_http_error(error_code(data) or 500, json.dumps(data))
    try:
        choice = data["choices"][0]
        message = choice["message"] or {}
        usage = data.get("usage") or {}
    except (KeyError, IndexError, TypeError) as exc:
        raise RequestFailure("BadResponse", f"unexpected response shape: {exc!r}", kind="transient") from exc
    separated = reasoning_of(message)
    reasoning, answer = split_reasoning(message.get("content"), separated)
    details = usage.get("completion_tokens_details") or {}
    reasoning_tokens = usage.get("reasoning_tokens", details.get("reasoning_tokens"))
    matched = choice.get("matched_stop")
    prompt_details = usage.get("prompt_tokens_details")
    cached = prompt_details.get("cached_tokens") if isinstance(prompt_details, dict) else None
    prompt_ids, output_ids = token_ids_of(data, choice) if isinstance(choice, dict) else (None, None)
    return Completion(
        reasoning=reasoning,
        content=answer,
        finish_reason=choice.get("finish_reason"),
        matched_stop=None if matched is None else str(matched),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        reasoning_tokens=reasoning_tokens,
        model=data.get("model"),
        cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) else None,
        reasoning_source=None if reasoning is None else ("field" if separated else "inline"),
        prompt_token_ids=None if prompt_ids is None else np.asarray(prompt_ids, dtype=np.int32),
        output_token_ids=None if output_ids is None else np.asarray(output_ids, dtype=np.int32),
        spec=spec_stats_of(data),
        token_id_sources=token_id_sources(data, choice) if isinstance(choice, dict) else (None, None),
    )


def new_session() -> requests.Session:
    """A keep-alive session with no retries of its own: our caller is the one retry layer."""
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=4, max_retries=0)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


class ChatClient:
    """One keep-alive HTTP/1.1 connection for one request thread; no pool and no retries of its own.

    Why not requests or urllib3: at the rates a fleet reaches, the client's CPU per request is what
    limits a worker, and most of it went into the pool managers' per-call URL parsing, connection
    lookup and retry bookkeeping. A request thread only ever talks to one server, one request at a
    time, so a bare `http.client` connection is all it needs. An idle connection the server has
    closed is detected before reuse (the socket reads as ready) and replaced, as urllib3 does.
    """

    def __init__(self) -> None:
        self._conn: http.client.HTTPConnection | None = None
        self._target: tuple[str, str, int] | None = None
        self._paths: dict[str, tuple[tuple[str, str, int], str]] = {}

    def _split(self, url: str) -> tuple[tuple[str, str, int], str]:
        cached = self._paths.get(url)
        if cached is None:
            parts = urlsplit(url)
            scheme = parts.scheme or "http"
            port = parts.port or (443 if scheme == "https" else 80)
            path = parts.path or "/"
            if parts.query:
                path = f"{path}?{parts.query}"
            cached = self._paths[url] = ((scheme, parts.hostname or "", port), path)
        return cached

    def _connection(self, target: tuple[str, str, int], connect_timeout: float) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is not None and (self._target != target or conn.sock is None or _dropped(conn.sock)):
            self.close()
            conn = None
        if conn is None:
            scheme, host, port = target
            cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = cls(host, port, timeout=connect_timeout)
            conn.connect()
            self._conn, self._target = conn, target
        return conn

    def post(self, url: str, body: bytes, headers: dict[str, str], connect_timeout: float,
             read_timeout: float, keep_waiting: Any = None) -> tuple[int, bytes]:
        """POST `body`; (status, response body). Transport errors propagate; the connection is dropped.

        With `keep_waiting` (a callable of the seconds waited, with `slice_s` and `quiet_s`
        attributes; see serving/deadline.py), the wait for the answer is not bounded by
        `read_timeout` but by the callback. The common case costs nothing extra: the answer is
        awaited plainly for `quiet_s`; only if no byte came by then (so http.client consumed
        nothing and the connection is intact) is the callback asked every `slice_s` while poll()
        waits for the first byte (False raises TimeoutError)."""
        target, path = self._split(url)
        try:
            conn = self._connection(target, connect_timeout)
            assert conn.sock is not None
            if keep_waiting is None:
                conn.sock.settimeout(read_timeout)
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
            else:
                quiet = keep_waiting.quiet_s
                conn.sock.settimeout(quiet)
                conn.request("POST", path, body=body, headers=headers)
                try:
                    resp = conn.getresponse()
                except TimeoutError:
                    _wait_readable(conn.sock, keep_waiting, quiet)
                    conn.sock.settimeout(read_timeout)
                    resp = conn.getresponse()
                conn.sock.settimeout(read_timeout)
            data = resp.read()
            if resp.will_close:
                self.close()
            return resp.status, data
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None


def _wait_readable(sock: socket.socket, keep_waiting: Any, waited: float = 0.0) -> None:
    """Block until `sock` has data, asking `keep_waiting(elapsed)` every `keep_waiting.slice_s`
    (`waited`: seconds already waited for this answer)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    t0 = time.monotonic() - waited
    slice_ms = max(1, int(keep_waiting.slice_s * 1000))
    while not poller.poll(slice_ms):
        if not keep_waiting(time.monotonic() - t0):
            raise TimeoutError(getattr(keep_waiting, "why", "") or "deadline passed")


def _dropped(sock: socket.socket) -> bool:
    """An idle keep-alive socket that reads as ready has been closed (or sent junk): do not reuse it."""
    try:
        poller = select.poll()  # not select(): file descriptors above 1024 are fine
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def new_chat_client() -> ChatClient:
    """The HTTP client of one request thread (see ChatClient)."""
    return ChatClient()


def chat_once(client: ChatClient, server: ServerSpec, body: dict[str, Any], timeout_s: float,
              keep_waiting: Any = None, headers: dict[str, str] | None = None) -> tuple[Completion, float]:
    """One POST to /v1/chat/completions; returns (completion, latency) or raises RequestFailure.

    Without `keep_waiting` the whole request is bounded by `timeout_s`; with it (a
    serving.deadline.RequestWait) the wait for the answer follows the request's deadline."""
    t0 = time.monotonic()
    try:
        status, data = client.post(
            f"{server.base_url}/v1/chat/completions",
            json.dumps(body).encode(),
            {**server.headers(), **headers} if headers else server.headers(),
            connect_timeout=min(10.0, timeout_s),
            read_timeout=timeout_s,
            keep_waiting=keep_waiting,
        )
    except TimeoutError as exc:  # socket.timeout is TimeoutError
        waited = time.monotonic() - t0
        why = getattr(keep_waiting, "why", "") or f"no response within {timeout_s:g}s"
        raise RequestFailure("Timeout", f"{why} (waited {waited:.0f}s)", kind="transient") from exc
    except ConnectionError as exc:  # refused, reset, aborted, broken pipe, RemoteDisconnected
        raise RequestFailure("ConnectionError", _short(exc), kind="transient") from exc
    except (http.client.HTTPException, OSError) as exc:
        raise RequestFailure("TransportError", _short(exc), kind="transient") from exc
    latency = time.monotonic() - t0
    if status != 200:
        raise classify_http_error(status, data[:4000].decode("utf-8", "replace"))
    try:
        parsed = json.loads(data)
    except ValueError as exc:
        raise RequestFailure("BadResponse", "response is not JSON", kind="transient") from exc
    return parse_chat_response(parsed), latency


def _short(exc: Exception) -> str:
    text = str(exc)
    if isinstance(exc, ConnectionRefusedError):
        return "Connection refused"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "RemoteDisconnected"
    if isinstance(exc, ConnectionResetError):
        return "Connection reset"
    for marker in ("Connection refused", "Connection reset", "RemoteDisconnected", "Connection aborted", "Connection broken"):
        if marker in text:
            return marker
    return text[:300]


def check_health(session: requests.Session, server: ServerSpec, timeout_s: float = 5.0) -> bool:
    try:
        return session.get(f"{server.base_url}/health", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


