"""A fault-injecting HTTP front for an S3 server (moto): the S3 faults AWS really produces, seeded.

Put between the pipeline's boto3 client and moto, it answers each request, by one seeded draw:
- `slowdown`: 503 SlowDown without forwarding (AWS under load), on any call;
- `conflict`: 409 ConditionalRequestConflict without forwarding, on conditional writes and
  deletes (If-Match / If-None-Match), which AWS documents as "retry";
- `lost`: forwards a write (PUT/DELETE), lets it take effect, then closes the connection without
  an answer, so botocore re-sends it and sees the outcome of its own first write (412 on a
  conditional create, a changed ETag on If-Match);
- `outage(seconds)`: every connection closed unanswered for a while (the endpoint unreachable).
Everything else is forwarded unchanged, so moto's state stays the one truth.
"""

from __future__ import annotations

import http.client
import logging
import random
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade", "expect"}


def _error_xml(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>s3faults</RequestId></Error>").encode()


class S3FaultProxy:
    """Start with `.start()`, point clients at `.url`, change rates at any time, `.stop()`."""

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
        self._server.shutdown()
        self._server.server_close()

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

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = self._read_body(h)
        method = h.command
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
            payload = b"" if method == "HEAD" else _error_xml(code, msg)
            h.send_response(status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
            return
        conn = http.client.HTTPConnection(*self.target, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            if body or method in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(method, h.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
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
