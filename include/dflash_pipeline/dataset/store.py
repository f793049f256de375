"""A thin, typed view of one S3 bucket with the conditional writes the claim protocol needs.

It wraps a boto3 S3 client (in the DAG: `S3Hook(aws_conn_id).get_conn()`, so credentials come only
from the Airflow connection). `If-None-Match: *` and `If-Match: <etag>` make "create once" and
"replace only what I read" atomic on AWS S3 and on moto/MinIO, which is what lets several generate
tasks share one dataset root without a lock server.
"""

from __future__ import annotations

import email.utils
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class PreconditionFailed(Exception):
    """A conditional write lost: the key exists (If-None-Match) or changed (If-Match).

    `retried` is true when botocore had re-sent the request: the first send may have succeeded
    and this 412 may be about our own write, so the caller must look (HEAD) before concluding.
    """

    def __init__(self, message: str = "", *, retried: bool = False) -> None:
        super().__init__(message)
        self.retried = retried


class KeyGone(PreconditionFailed):
    """A conditional write or delete on a key that no longer exists (404 NoSuchKey on AWS and moto)."""


class StoreConfigError(Exception):
    """The bucket is missing or access is denied: retrying will not help."""


class StoreUnavailable(Exception):
    """The S3 endpoint did not answer (connection, 5xx, throttling): worth retrying."""


class ConditionalConflict(StoreUnavailable):
    """409 ConditionalRequestConflict: a concurrent conditional write was in progress. AWS says
    retry, so it is a StoreUnavailable (with_retries retries it), never a lost race."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    etag: str
    size: int
    last_modified: datetime
    metadata: dict[str, str] | None = None


#: botocore settings for every S3 client of the pipeline (merged under the connection's own, which
#: win): no single call may block for minutes, since a stopping task has seconds and the lease
#: renewer must not stall. Our own retries (`with_retries`) sit on top, with deadlines.
CLIENT_CONFIG: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 30,
    "retries": {"max_attempts": 3, "mode": "standard"},
    "max_pool_connections": 32,
}


_CONFIG_CODES = {"NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}


def _translate(exc: Exception, conditional: bool = False) -> Exception:
    """Map botocore errors onto the outcomes callers act on (see the chunk protocol's table)."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        meta = exc.response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode", 0)
        retried = int(meta.get("RetryAttempts", 0) or 0) > 0
        if code == "ConditionalRequestConflict" or status == 409:
            return ConditionalConflict(f"S3 {code or status}: concurrent conditional write; retry")
        if code == "PreconditionFailed" or status == 412:
            return PreconditionFailed(code or str(status), retried=retried)
        if conditional and (code in ("NoSuchKey", "404") or status == 404):
            return KeyGone(f"{code or status}: the key no longer exists", retried=retried)
        if code in _CONFIG_CODES or status in (401, 403):
            return StoreConfigError(f"S3 refused the request: {code} (HTTP {status})")
        if status >= 500 or code in ("SlowDown", "RequestTimeout", "Throttling", "ServiceUnavailable"):
            return StoreUnavailable(f"S3 error {code} (HTTP {status})")
        return exc
    if isinstance(exc, BotoCoreError):
        return StoreUnavailable(f"S3 unreachable: {type(exc).__name__}: {exc}")
    return exc


class Store:
    """One bucket. All methods raise PreconditionFailed / StoreConfigError / StoreUnavailable."""

    def __init__(self, client: Any, bucket: str) -> None:
        self.client = client
        self.bucket = bucket
        self._last_server_time: datetime | None = None

    # -- helpers -------------------------------------------------------------------------------
    def _call(self, fn: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        try:
            resp = fn(Bucket=self.bucket, **kwargs)
        except Exception as exc:  # noqa: BLE001 - translated below
            translated = _translate(exc, conditional="IfMatch" in kwargs)
            if translated is exc:
                raise
            raise translated from exc
        date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        if date:
            try:
                self._last_server_time = email.utils.parsedate_to_datetime(date)
            except (TypeError, ValueError):
                pass
        return resp

    def server_time(self) -> datetime:
        """The S3 server's clock as of the last response (lease expiry uses it: no clock skew)."""
        return self._last_server_time or datetime.now(timezone.utc)

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: str) -> tuple[bytes, str] | None:
        """(body, etag), or None when the key does not exist."""
        from botocore.exceptions import ClientError

        try:
            resp = self._call(self.client.get_object, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        return self._read_body(resp, key), resp["ETag"]

    @staticmethod
    def _read_body(resp: dict[str, Any], key: str) -> bytes:
        """The whole body. A body cut short or not matching its checksum (the connection dropped mid-read,
        a truncated transfer) is StoreUnavailable, retried like any failed request, never a raw botocore
        error that ends the calling thread."""
        from botocore.exceptions import BotoCoreError

        try:
            return bytes(resp["Body"].read())
        except (BotoCoreError, OSError) as exc:
            raise StoreUnavailable(f"S3 reading {key}: {type(exc).__name__}: {exc}") from exc

    def open(self, key: str, *, if_match: str | None = None) -> Any:
        """A streaming body (file-like, `.read(n)` and line iteration) for large inputs; with
        if_match only that version (PreconditionFailed if the object was replaced since)."""
        kwargs: dict[str, Any] = {"Key": key}
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        return self._call(self.client.get_object, **kwargs)["Body"]

    def head(self, key: str) -> ObjectInfo | None:
        from botocore.exceptions import ClientError

        try:
            resp = self._call(self.client.head_object, Key=key)
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404 or exc.response.get(
                "Error", {}
            ).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return ObjectInfo(
            key, resp["ETag"], int(resp["ContentLength"]), resp["LastModified"], dict(resp.get("Metadata") or {})
        )

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Keys under `prefix` in key order, optionally only those after `start_after`."""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix, "MaxKeys": 1000}
            if start_after:
                kwargs["StartAfter"] = start_after
            if token:
                kwargs["ContinuationToken"] = token
            resp = self._call(self.client.list_objects_v2, **kwargs)
            for obj in resp.get("Contents", []):
                yield ObjectInfo(obj["Key"], obj["ETag"], int(obj["Size"]), obj["LastModified"])
            if not resp.get("IsTruncated"):
                return
            token = resp["NextContinuationToken"]

    def folders(self, prefix: str) -> list[str]:
        """Names of the folders directly under `prefix` (S3 common prefixes with delimiter '/'), sorted."""
        token: str | None = None
        out: list[str] = []
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix, "Delimiter": "/", "MaxKeys": 1000}
            if token:
                kwargs["ContinuationToken"] = token
            resp = self._call(self.client.list_objects_v2, **kwargs)
            out += [p["Prefix"][len(prefix):].rstrip("/") for p in resp.get("CommonPrefixes", [])]
            if not resp.get("IsTruncated"):
                return sorted(out)
            token = resp["NextContinuationToken"]

    # -- writes --------------------------------------------------------------------------------
    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        content_type: str = "application/octet-stream",
        metadata: dict[str, str] | None = None,
    ) -> str:
        """Write `data`; with if_none_match only if the key is absent, with if_match only if unchanged.

        `metadata` (x-amz-meta-*) lets a writer recognise its own object with one HEAD when the
        answer to a conditional write was lost."""
        kwargs: dict[str, Any] = {"Key": key, "Body": data, "ContentType": content_type}
        if metadata:
            kwargs["Metadata"] = metadata
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        return str(self._call(self.client.put_object, **kwargs)["ETag"])

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        """Delete `key`; with if_match only if it is still the object we wrote (a claim we hold).

        Raises KeyGone when a conditional delete finds no key, PreconditionFailed when it changed."""
        kwargs: dict[str, Any] = {"Key": key}
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        self._call(self.client.delete_object, **kwargs)

    def check_bucket(self) -> None:
        """Fail fast with a clear message when the bucket is missing or not ours."""
        from botocore.exceptions import ClientError

        try:
            self._call(self.client.head_bucket)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404:
                raise StoreConfigError(f"bucket {self.bucket!r} does not exist") from exc
            if status in (401, 403):
                raise StoreConfigError(f"access to bucket {self.bucket!r} denied") from exc
            raise


class StopCut(StoreUnavailable):
    """A call abandoned by the stop: the worker is stopping and this call's time is over (its
    request may still be in flight on a daemon thread; whatever it does is safe to lose, since every
    write of the protocol is conditional and idempotent)."""


#: How often main, waiting for a bounded call, looks at the stop and the clock.
BOUND_POLL_S = 0.05


def bounded_call(fn: Callable[[], T], *, stop: threading.Event, cut_at: Callable[[], float], what: str) -> T:
    """Run `fn` on a daemon thread and wait for it, or for the stop: once `stop` is set, the wait ends at
    `cut_at()` (monotonic, re-read: a stop arriving later brings it forward) with StopCut. A call
    that is slow but succeeding is cut as surely as one that fails; the thread it ran on is a daemon,
    so a task never waits for it at exit. Without a stop it waits as long as `fn` takes (botocore's
    own timeouts bound that: CLIENT_CONFIG)."""
    box: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting thread
            box.append((False, exc))
        done.set()

    threading.Thread(target=run, name=f"s3-{what}"[:40], daemon=True).start()
    while not done.wait(BOUND_POLL_S):
        if stop.is_set() and time.monotonic() >= cut_at():
            raise StopCut(f"{what}: abandoned, the worker is stopping")
    ok, value = box[0]
    if ok:
        return value  # type: ignore[no-any-return]
    raise value


class StopBoundStore(Store):
    """The same bucket, every call bounded by a stop (`bounded_call`): what a task's main thread uses,
    so no S3 call main makes, slow or failing, outlasts the stop's deadline. Calls made on the
    bounded call's own thread (a `get` reading its body, a listing's pages) run direct.

    Who uses it: the generate worker's Scanner (`Worker.main_store`), so the claimer thread's
    scans through the Scanner are bounded by the stop too. An abandoned call is not cancelled: its
    daemon thread runs on and its request may still land after StopCut, so what goes through this
    store must be safe to land late (the Scanner's writes are If-Match deletes of stray claims).
    State: `_inside` is per thread; `_last_server_time` is written by whichever call answered
    last (any thread, last writer wins) and copied to the wrapped store."""

    def __init__(self, store: Store, stop: threading.Event, cut_at: Callable[[], float]) -> None:
        super().__init__(store.client, store.bucket)
        self._base = store
        self._stop = stop
        self._cut_at = cut_at
        self._inside = threading.local()

    def _bounded(self, what: str, fn: Callable[[], T]) -> T:
        if getattr(self._inside, "on", False):
            return fn()

        def inside() -> T:
            self._inside.on = True
            return fn()

        return bounded_call(inside, stop=self._stop, cut_at=self._cut_at, what=what)

    def _call(self, fn: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        resp = self._bounded(f"{getattr(fn, '__name__', 's3')} {kwargs.get('Key', kwargs.get('Prefix', ''))}",
                             lambda: Store._call(self, fn, **kwargs))
        self._base._last_server_time = self._last_server_time or self._base._last_server_time
        return resp

    def server_time(self) -> datetime:
        return self._last_server_time or self._base.server_time()

    def get(self, key: str) -> tuple[bytes, str] | None:
        return self._bounded(f"get {key}", lambda: Store.get(self, key))

    def head(self, key: str) -> ObjectInfo | None:
        return self._bounded(f"head {key}", lambda: Store.head(self, key))


def stop_bound(store: Store, stop: threading.Event, cut_at: Callable[[], float]) -> Store:
    """`store` with every call bounded by the stop (StopBoundStore)."""
    return StopBoundStore(store, stop, cut_at)


#: How often a backoff sleep looks at `should_stop` (with_retries).
STOP_POLL_S = 0.1


def with_retries(
    fn: Callable[[], T],
    *,
    what: str,
    deadline_s: float = 300.0,
    base_s: float = 0.5,
    cap_s: float = 15.0,
    sleep: Callable[[float], None] = time.sleep,
    should_stop: Callable[[], bool] | None = None,
) -> T:
    """Retry `fn` on StoreUnavailable with capped exponential backoff and full jitter.

    S3 outages of tens of seconds happen in long runs; a part that cannot be written yet must wait
    rather than fail the task, and the caller stops taking new work while it waits. `should_stop`
    (a stopping task) ends the wait at the next failure or during a backoff sleep: the stop path
    has its own deadline.
    """
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except StoreUnavailable as exc:
            attempt += 1
            elapsed = time.monotonic() - start
            if elapsed >= deadline_s or (should_stop is not None and should_stop()):
                raise
            delay = min(cap_s, base_s * (2 ** min(attempt, 10))) * random.uniform(0.5, 1.0)
            logger.warning("%s: S3 unavailable (%s); retry %d in %.1fs", what, exc, attempt, delay)
            left = min(delay, max(0.0, deadline_s - elapsed))
            if should_stop is None:
                sleep(left)
                continue
            # A stop during the backoff ends it within STOP_POLL_S, not after the whole delay.
            while left > 0:
                if should_stop():
                    raise
                step = min(STOP_POLL_S, left)
                sleep(step)
                left -= step


SMALL_UPLOAD = 32 << 20
"""Files up to this size go in one PUT (with our retries); larger ones as a streamed multipart upload."""


def upload_file(store: Store, key: str, fh: Any, content_type: str) -> None:
    """Write an open binary file to `key`: small in one PUT (retried), large as a multipart upload."""
    size = fh.seek(0, 2)
    fh.seek(0)
    if size <= SMALL_UPLOAD:
        data = fh.read()
        with_retries(lambda: store.put(key, data, content_type=content_type), what=f"write {key}")
    else:
        store.client.upload_fileobj(fh, store.bucket, key, ExtraArgs={"ContentType": content_type})
