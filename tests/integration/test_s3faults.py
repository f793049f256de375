"""The fault-injecting S3 front (dev/s3faults.py) produces the faults it claims, over real sockets."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dflash_pipeline.dataset.store import PreconditionFailed, Store, StoreUnavailable
from dflash_pipeline.dev.s3faults import S3FaultProxy
from dflash_pipeline.dev.stack import s3_client as make_client


@pytest.fixture
def proxy(moto_server: Any) -> Any:
    p = S3FaultProxy(moto_server.port, seed=1).start()
    yield p
    p.stop()


def test_forwards_unchanged_and_injects_each_fault(proxy: S3FaultProxy, bucket: str, s3_client: Any) -> None:
    store = Store(make_client(proxy.url), bucket)
    etag = store.put("a/k.json", b"x" * 100, if_none_match=True, metadata={"nonce": "n"})
    info = store.head("a/k.json")
    assert info is not None and info.size == 100 and info.etag == etag and info.metadata == {"nonce": "n"}
    assert store.get("a/k.json") == (b"x" * 100, etag)

    proxy.set_rates(slowdown=1.0)
    with pytest.raises(StoreUnavailable, match="SlowDown"):
        store.get("a/k.json")
    proxy.set_rates(slowdown=0.0, conflict=1.0)
    assert store.get("a/k.json") is not None  # reads are never conditional-write conflicts
    with pytest.raises(StoreUnavailable, match="Conditional"):
        store.put("a/k.json", b"y", if_match=etag)
    proxy.set_rates(conflict=0.0, lost=1.0)
    # The create takes effect, its answer is lost, botocore re-sends it and gets 412 for its own write.
    with pytest.raises(PreconditionFailed) as lost:
        store.put("a/new.json", b"z", if_none_match=True, metadata={"nonce": "mine"})
    assert lost.value.retried
    proxy.set_rates(lost=0.0)
    truth = Store(s3_client, bucket).head("a/new.json")
    assert truth is not None and truth.metadata == {"nonce": "mine"}
    assert proxy.counts["slowdown"] >= 1 and proxy.counts["conflict"] >= 1 and proxy.counts["lost"] >= 1

    proxy.outage(60)
    with pytest.raises(StoreUnavailable):
        store.get("a/k.json")
    proxy.outage(0)
    assert store.get("a/k.json") is not None


def _single_attempt_client(url: str) -> Any:
    """A client whose every call is one request (botocore re-sends nothing), so counts are exact."""
    import boto3
    from botocore.config import Config

    from dflash_pipeline.dev.stack.s3 import MOTO_ACCESS_KEY, MOTO_SECRET_KEY

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=MOTO_ACCESS_KEY,
                        aws_secret_access_key=MOTO_SECRET_KEY,
                        config=Config(retries={"total_max_attempts": 1, "mode": "standard"}, read_timeout=10))


def test_rules_aim_a_status_or_a_delay_at_matching_requests(proxy: S3FaultProxy, bucket: str, s3_client: Any) -> None:
    store = Store(_single_attempt_client(proxy.url), bucket)
    truth = Store(s3_client, bucket)
    etag = store.put("ds/completions/part-000001.parquet", b"p", if_none_match=True)

    # A status rule answers without forwarding, only for its method and path, only `times` times.
    refuse = proxy.add_rule(method="PUT", key_regex=r"/completions/part-", status=503, times=2)
    for _ in range(2):
        with pytest.raises(StoreUnavailable, match="SlowDown"):
            store.put("ds/completions/part-000002.parquet", b"q", if_none_match=True)
    assert refuse.hits == 2 and truth.head("ds/completions/part-000002.parquet") is None
    assert store.get("ds/completions/part-000001.parquet") == (b"p", etag)  # a GET does not match
    store.put("ds/partials/chunk-000002.parquet", b"r")  # another path does not match
    store.put("ds/completions/part-000002.parquet", b"q", if_none_match=True)  # `times` used up
    assert refuse.hits == 2 and truth.get("ds/completions/part-000002.parquet") is not None

    # A later rule overrides an earlier one; a delay rule holds the request, then forwards it.
    slow = proxy.add_rule(method="PUT", key_regex=r"/partials/", delay_s=0.6)
    gone = proxy.add_rule(method="PUT", key_regex=r"/partials/chunk-000009", status=412)
    with pytest.raises(PreconditionFailed):
        store.put("ds/partials/chunk-000009.parquet", b"x", if_match='"0"')
    assert gone.hits == 1 and slow.hits == 0
    started = time.monotonic()
    store.put("ds/partials/chunk-000003.parquet", b"s")
    assert time.monotonic() - started >= 0.6 and slow.hits == 1 and slow.in_flight == 0
    assert truth.get("ds/partials/chunk-000003.parquet") is not None

    # `until` (a monotonic time or a predicate) and end() retire a rule.
    until_now = proxy.add_rule(method="HEAD", status=500, until=time.monotonic() - 1)
    assert store.head("ds/partials/chunk-000003.parquet") is not None and until_now.hits == 0
    flag = {"over": False}
    pred = proxy.add_rule(method="HEAD", status=500, until=lambda: flag["over"])
    with pytest.raises(StoreUnavailable):
        store.head("ds/partials/chunk-000003.parquet")
    flag["over"] = True
    assert store.head("ds/partials/chunk-000003.parquet") is not None and pred.hits >= 1
    slow.end()
    started = time.monotonic()
    store.put("ds/partials/chunk-000004.parquet", b"t")
    assert time.monotonic() - started < 0.5 and slow.hits == 1
    proxy.clear_rules()
    store.put("ds/partials/chunk-000009.parquet", b"y")
    assert gone.hits == 1 and proxy.counts["rule"] == refuse.hits + gone.hits + slow.hits + pred.hits
