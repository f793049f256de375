"""The test S3 server evaluates conditional writes atomically, as S3 does.

Claims and commits are only as safe as `If-None-Match` / `If-Match` are atomic. Stock moto 5.2.x
checks the condition and then stores in two unlocked steps, so concurrent creates of one key can
all succeed; `dflash_pipeline.dev.s3server` closes that gap. These tests race real PUTs over HTTP.
The race window is short, so the decisive test runs the server in a child process with a tiny
GIL switch interval: there stock moto let 2+ creators win in 4 of 100 rounds (measured with
`RACE_VARIANT=stock`), the patched server in none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

RACERS = 16
ROUNDS = 20
HERE = Path(__file__).resolve()


def _clients(endpoint: str, n: int) -> list[Any]:
    cfg = Config(retries={"max_attempts": 1, "mode": "standard"}, max_pool_connections=4)
    session = boto3.session.Session()
    return [
        session.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                       aws_secret_access_key="testing", region_name="us-east-1", config=cfg)
        for _ in range(n)
    ]


def _race(clients: list[Any], put: Any) -> list[str]:
    """Run `put(client, i)` on all clients at once; return 'ok' or the error code of each."""
    barrier = threading.Barrier(len(clients))
    results = [""] * len(clients)

    def go(i: int) -> None:
        barrier.wait()
        try:
            put(clients[i], i)
            results[i] = "ok"
        except ClientError as exc:
            results[i] = str(exc.response.get("Error", {}).get("Code"))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_if_none_match_creates_exactly_one(moto_server: Any, bucket: str) -> None:
    clients = _clients(moto_server.endpoint_url, RACERS)
    winners_per_round = []
    for r in range(ROUNDS):
        key = f"claims/chunk-{r:06d}.json"
        results = _race(clients, lambda c, i: c.put_object(Bucket=bucket, Key=key, Body=f"{i}".encode(), IfNoneMatch="*"))
        winners = [i for i, res in enumerate(results) if res == "ok"]
        assert all(res in ("ok", "PreconditionFailed") for res in results), results
        winners_per_round.append(len(winners))
        body = clients[0].get_object(Bucket=bucket, Key=key)["Body"].read().decode()
        assert [body] == [str(w) for w in winners], (r, winners, body)
    assert winners_per_round == [1] * ROUNDS


def test_concurrent_if_match_renewals_exactly_one(moto_server: Any, bucket: str) -> None:
    clients = _clients(moto_server.endpoint_url, RACERS)
    key = "claims/renewed.json"
    etag = clients[0].put_object(Bucket=bucket, Key=key, Body=b"start")["ETag"]
    for r in range(ROUNDS):
        results = _race(clients, lambda c, i: c.put_object(Bucket=bucket, Key=key, Body=f"{r}-{i}".encode(), IfMatch=etag))
        winners = [i for i, res in enumerate(results) if res == "ok"]
        assert len(winners) == 1, (r, results)
        got = clients[0].get_object(Bucket=bucket, Key=key)
        assert got["Body"].read().decode() == f"{r}-{winners[0]}"
        etag = got["ETag"]


def _race_in_child(variant: str, rounds: int) -> int:
    """Rounds (of `rounds`) in which more than one concurrent If-None-Match create succeeded."""
    sys.setswitchinterval(1e-5)  # switch threads often, so a check-then-act window gets interleaved
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    if variant == "patched":
        from dflash_pipeline.dev.s3server import make_conditional_writes_atomic

        make_conditional_writes_atomic()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        clients = _clients(f"http://{host}:{port}", RACERS)
        clients[0].create_bucket(Bucket="race")
        multi = 0
        for r in range(rounds):
            key = f"claims/chunk-{r:06d}.json"
            results = _race(clients, lambda c, i: c.put_object(Bucket="race", Key=key, Body=b"x" * (i + 1), IfNoneMatch="*"))
            multi += results.count("ok") > 1
        return multi
    finally:
        server.stop()


def test_no_double_create_under_heavy_interleaving() -> None:
    variant = os.environ.get("RACE_VARIANT", "patched")
    out = subprocess.run(
        [sys.executable, str(HERE), variant, "100"], capture_output=True, text=True, timeout=300, check=True
    )
    multi = int(out.stdout.strip().splitlines()[-1])
    assert multi == 0, f"{multi} of 100 rounds had more than one winner ({variant})"


if __name__ == "__main__":
    print(_race_in_child(sys.argv[1], int(sys.argv[2])))
