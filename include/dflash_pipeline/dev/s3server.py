"""The local S3-protocol server for the demo, tests and benchmarks: moto, with atomic conditional writes.

Why: the pipeline's claims and commits rely on S3's conditional writes (`If-None-Match: *`,
`If-Match: <etag>`), which AWS S3 (and MinIO) evaluate atomically: of two concurrent creates of
one key exactly one succeeds, the other gets 412. moto 5.2.x evaluates the condition and then
stores the object in two steps without a lock, so two concurrent conditional PUTs can both
succeed. Measured in `bench/dispatch_bench.py`: two workers each claimed chunk 93 within 30 ms and
both generated it (the second commit was refused, so the dataset stayed exact, but 100 requests
were wasted). A test server weaker than S3 hides nothing useful and shows problems S3 cannot have,
so this launcher serialises object writes and deletes, which gives S3's semantics; everything
else is stock moto. `tests/integration/test_s3server.py` races conditional PUTs to prove it.

    python -m dflash_pipeline.dev.s3server -H 127.0.0.1 -p 5055     # same flags as moto_server
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

_WRITE_LOCK = threading.Lock()
_PATCHED_ATTR = "_dflash_atomic_writes"


def _serialised(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _WRITE_LOCK:
            return fn(*args, **kwargs)

    return wrapper


def make_conditional_writes_atomic() -> None:
    """Patch moto's S3 PUT/DELETE object handlers so condition check and write happen under one lock."""
    from moto.s3.responses import S3Response

    if getattr(S3Response, _PATCHED_ATTR, False):
        return
    for name in ("put_object", "delete_object"):
        setattr(S3Response, name, _serialised(getattr(S3Response, name)))
    setattr(S3Response, _PATCHED_ATTR, True)


def main(argv: list[str] | None = None) -> None:
    """Run moto's server (its own CLI and flags) with atomic conditional writes."""
    make_conditional_writes_atomic()
    from moto.server import main as moto_main

    moto_main(argv)


if __name__ == "__main__":
    main()
