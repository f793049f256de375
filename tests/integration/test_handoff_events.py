"""A consumer run's asset events, checked against a real S3 protocol server (moto): events of datasets
deleted since are skipped, so they do not stop the others being tokenized (a run may carry several
events; CI's real-engine run once got one of a dataset a finished test had deleted)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.steps.handoff import DatasetGone, HandoffError, check_events


def _dataset(s3: Any, bucket: str, root: str, status: str = "passed") -> str:
    layout = DatasetLayout(bucket, root)
    s3.put_object(Bucket=bucket, Key=layout.manifest_key, Body=json.dumps({"plan_id": "p"}).encode())
    s3.put_object(Bucket=bucket, Key=layout.report_key, Body=json.dumps({"status": status, "completions": 3}).encode())
    s3.put_object(Bucket=bucket, Key=layout.part_key(0), Body=b"x")
    return layout.uri


def test_events_of_deleted_datasets_are_skipped_and_the_rest_checked(s3_client: Any, bucket: str) -> None:
    good = _dataset(s3_client, bucket, "ds/good")
    events = [{"output_uri": f"s3://{bucket}/ds/deleted"}, {"output_uri": good},
              {"output_uri": "s3://dflash-no-such-bucket-0/ds/x"}]
    checked = check_events(s3_client, events)
    assert [c["output_uri"] for c in checked] == [good] and checked[0]["parts"] == 1


def test_every_dataset_gone_or_one_not_validated_fails_the_run(s3_client: Any, bucket: str) -> None:
    with pytest.raises(DatasetGone, match="every dataset the asset events name is gone"):
        check_events(s3_client, [{"output_uri": f"s3://{bucket}/ds/deleted"}])
    failed = _dataset(s3_client, bucket, "ds/failed", status="failed")
    with pytest.raises(HandoffError, match="not 'passed'"):
        check_events(s3_client, [{"output_uri": _dataset(s3_client, bucket, "ds/ok")}, {"output_uri": failed}])
