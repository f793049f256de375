"""A fault-injecting HTTP front for an S3 server (moto): the S3 faults AWS really produces, seeded.

Put between the pipeline's boto3 client and moto, it answers each request, by one seeded draw:
- `slowdown`: 503 SlowDown without forwarding (AWS under load), on any call;
- `conflict`: 409 ConditionalRequestConflict without forwarding, on conditional writes and
  deletes (If-Match / If-None-Match), which AWS documents as "retry";
- `lost`: forwards a write (PUT/DELETE), lets it take effect, then closes the connection without
  an answer, so botocore re-sends it and sees the outcome of its own first write (412 on a
  conditional create, a changed ETag on If-Match);
- `outage(seconds)`: every connection closed unanswered for a while (the endpoint unreachable);
- rules (`add_rule`): aimed faults for one kind of request, e.g. every part PUT answered 503, or
  every partial PUT held 5 s before it is forwarded, for the next N matches or until a time.
Everything else is forwarded unchanged, so moto's state stays the one truth.
"""

from __future__ import annotations

import http.client
import logging
import random
import re
import socket
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade", "expect"}


def _error_xml(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>s3faults</RequestId></Error>").encode()


#: S3's error code for the statuses a rule may answer with (others: "InjectedFault").
_CODES = {
    400: "BadRequest", 403: "AccessDenied", 404: "NoSuchKey", 409: "ConditionalRequestConflict",
    412: "PreconditionFailed", 500: "InternalError", 503: "SlowDown",
}


@dataclass
class FaultRule:
    """One aimed fault (`S3FaultProxy.add_rule`). A request matches when its method is `method`
    (None: any) and `key_regex` is found in its path `/bucket/key` (URL-decoded, no query string;
    None: any path), while the rule is live: fewer than `times` matches so far (None: no limit),
    `until` not reached (a `time.monotonic()` value, or a callable that returns True once the rule
    should end; None: never) and not `end()`ed. A matched request is held `delay_s` seconds, then
    answered `status` (with S3's error XML; `code` overrides the error code) without being
    forwarded, or forwarded unchanged when `status` is None (with `lose_answer`, forwarded and its
    answer dropped once the write took effect, as the seeded `lost` fault). `hits` counts matches,
    `first_hit_t` is when the first one arrived (monotonic; None: none yet), `in_flight`
    the matched requests not answered yet (held by the delay, or forwarded and not back from the
    target); it drops before the answer is sent, so a client that has its answer sees it settled."""

    method: str | None = None
    key_regex: str | None = None
    status: int | None = None
    code: str | None = None
    delay_s: float = 0.0
    times: int | None = None
    until: float | Callable[[], bool] | None = None
    lose_answer: bool = False
    hits: int = 0
    first_hit_t: float | None = None
    in_flight: int = 0
    ended: bool = False
    _pattern: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._pattern = re.compile(self.key_regex) if self.key_regex is not None else None

    def end(self) -> None:
        """Stop matching new requests (those already matched finish as decided)."""
        self.ended = True

    def live(self, now: float) -> bool:
        if self.ended or (self.times is not None and self.hits >= self.times):
            return False
        if self.until is None:
            return True
        return not self.until() if callable(self.until) else now < self.until

    def matches(self, method: str, path: str) -> bool:
        if self.method is not None and self.method.upper() != method:
            return False
        return self._pattern is None or self._pattern.search(path) is not None


class S3FaultProxy:
    """Start with `.start()`, point clients at `.url`, change rates and add rules at any time, `.stop()`."""

    def __init__(self, target_port: int, *, seed: int = 0, slowdown: float = 0.0, conflict: float = 0.0,
                 lost: float = 0.0, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.host = host
        self.slowdown = slowdown
        self.conflict = conflict
        self.lost = lost
        self._rng = random.Random(f"s3faults:{seed}")
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._rules: list[FaultRule] = []
        self._stopping = threading.Event()
        self.counts: Counter[str] = Counter()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
                return

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                logger.debug("s3faults: connection from %s ended abruptly", client_address)

        self._server = Server((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3faults", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._server.server_address[1]}"

    def start(self) -> S3FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # requests held by a rule's delay are dropped at once
        self._server.shutdown()
        self._server.server_close()

    def add_rule(self, *, method: str | None = None, key_regex: str | None = None, status: int | None = None,
                 code: str | None = None, delay_s: float = 0.0, times: int | None = None,
                 until: float | Callable[[], bool] | None = None, lose_answer: bool = False) -> FaultRule:
        """Aim a fault at matching requests (FaultRule has the semantics) and return the rule (its
        `hits`, `in_flight`, `end()`). Rules come before the seeded draws and an outage; when
        several match, the one added last decides, so a later rule overrides an earlier one for
        requests that arrive after it (e.g. part PUTs slowed, then refused from some moment)."""
        if status is None and delay_s <= 0 and not lose_answer:
            raise ValueError("a rule needs a status to answer, a delay_s to hold requests or lose_answer")
        if status is not None and lose_answer:
            raise ValueError("lose_answer forwards the request: it takes no status")
        rule = FaultRule(method=method, key_regex=key_regex, status=status, code=code, delay_s=delay_s,
                         times=times, until=until, lose_answer=lose_answer)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear_rules(self) -> None:
        """End and forget every rule."""
        with self._lock:
            for rule in self._rules:
                rule.end()
            self._rules = []

    def _match_rule(self, method: str, raw_path: str) -> FaultRule | None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(raw_path).path)
        now = time.monotonic()
        with self._lock:
            for rule in reversed(self._rules):
                if rule.live(now) and rule.matches(method, path):
                    rule.hits += 1
                    if rule.first_hit_t is None:
                        rule.first_hit_t = now
                    rule.in_flight += 1
                    self.counts["rule"] += 1
                    return rule
        return None

    def outage(self, seconds: float) -> None:
        """The endpoint is unreachable (connections closed unanswered) for `seconds` from now; an
        outage already under way is extended, never shortened. `outage(0)` ends any outage."""
        with self._lock:
            self._down_until = 0.0 if seconds <= 0 else max(self._down_until, time.monotonic() + seconds)

    def set_rates(self, *, slowdown: float | None = None, conflict: float | None = None,
                  lost: float | None = None) -> None:
        with self._lock:
            if slowdown is not None:
                self.slowdown = slowdown
            if conflict is not None:
                self.conflict = conflict
            if lost is not None:
                self.lost = lost

    def _draw(self, conditional: bool, write: bool) -> str | None:
        with self._lock:
            if time.monotonic() < self._down_until:
                return "outage"
            u = self._rng.random()
            edge = self.slowdown
            if u < edge:
                return "slowdown"
            if conditional:
                edge += self.conflict
                if u < edge:
                    return "conflict"
            if write:
                edge += self.lost
                if u < edge:
                    return "lost"
        return None

    @staticmethod
    def _read_body(h: BaseHTTPRequestHandler) -> bytes:
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += h.rfile.read(size)
                h.rfile.readline()
        length = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(length) if length else b""

    def _drop(self, h: BaseHTTPRequestHandler) -> None:
        h.close_connection = True
        try:
            h.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _answer_error(self, h: BaseHTTPRequestHandler, method: str, status: int, code: str, msg: str) -> None:
        payload = b"" if method == "HEAD" else _error_xml(code, msg)
        h.send_response(status)
        h.send_header("Content-Type", "application/xml")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = self._read_body(h)
        method = h.command
        rule = self._match_rule(method, h.path)
        if rule is None:
            self._handle_drawn(h, method, body)
            return
        settled = False

        def settle() -> None:  # before the answer goes out: a client never sees its own request in flight
            nonlocal settled
            if not settled:
                settled = True
                with self._lock:
                    rule.in_flight -= 1

        try:
            if rule.delay_s > 0 and self._stopping.wait(rule.delay_s):
                settle()
                self._drop(h)  # the proxy is stopping: nothing is forwarded late
                return
            if rule.status is None:
                self._forward(h, method, body, fault="lost" if rule.lose_answer else None, before_reply=settle)
            else:
                code = rule.code or _CODES.get(rule.status, "InjectedFault")
                settle()
                self._answer_error(h, method, rule.status, code, "Injected by an s3faults rule.")
        finally:
            settle()

    def _handle_drawn(self, h: BaseHTTPRequestHandler, method: str, body: bytes) -> None:
        conditional = method in ("PUT", "DELETE") and ("If-Match" in h.headers or "If-None-Match" in h.headers)
        fault = self._draw(conditional, method in ("PUT", "DELETE"))
        if fault is not None:
            with self._lock:
                self.counts[fault] += 1
        if fault == "outage":
            self._drop(h)
            return
        if fault in ("slowdown", "conflict"):
            status, code, msg = ((503, "SlowDown", "Please reduce your request rate.") if fault == "slowdown" else
                                 (409, "ConditionalRequestConflict", "A conflicting operation is in progress."))
            self._answer_error(h, method, status, code, msg)
            return
        self._forward(h, method, body, fault)

    def _forward(self, h: BaseHTTPRequestHandler, method: str, body: bytes, fault: str | None,
                 before_reply: Callable[[], None] | None = None) -> None:
        conn = http.client.HTTPConnection(*self.target, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            if body or method in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(method, h.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            if before_reply is not None:
                before_reply()
            if fault == "lost" and 200 <= resp.status < 300:
                self._drop(h)  # the write took effect; its answer never arrives
                return
            h.send_response(resp.status)  # adds Date and Server (this host's clock, as moto's)
            length = resp.getheader("Content-Length") if method == "HEAD" else str(len(data))
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and k.lower() not in ("content-length", "date", "server"):
                    h.send_header(k, v)
            h.send_header("Content-Length", length or "0")
            h.end_headers()
            if method != "HEAD":
                h.wfile.write(data)
        except (OSError, http.client.HTTPException) as exc:
            logger.debug("s3faults: forwarding failed: %s", exc)
            self._drop(h)
        finally:
            conn.close()
