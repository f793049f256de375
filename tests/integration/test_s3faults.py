"""The fault-injecting S3 front (dev/s3faults.py) produces the faults it claims, over real sockets."""

from __future__ import annotations

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
