"""dflash_eval's prompt source against a real S3-protocol server: a dataset's held-out file named by its
manifest (the split dflash_generate's plan writes), or a clear refusal."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dflash_pipeline.config import ConfigError, EvalConfig
from dflash_pipeline.steps.evaluate import resolve_prompts


def _cfg(bucket: str, **extra: Any) -> EvalConfig:
    return EvalConfig.from_params({"output_uri": f"s3://{bucket}/evals/e1",
                                   "drafters": [{"name": "a", "servers": ["http://127.0.0.1:1"]}], **extra})


def test_dataset_uri_takes_the_held_out_prompts_and_the_thinking_mode(s3_client: Any, bucket: str) -> None:
    manifest = {"pinned": {"sampling": {"enable_thinking": False}},
                "heldout": {"fraction": 0.02, "count": 17, "key": "ds/d1/heldout/prompts.jsonl.gz"}}
    s3_client.put_object(Bucket=bucket, Key="ds/d1/manifest.json", Body=json.dumps(manifest).encode())
    uri, thinking, source = resolve_prompts(s3_client, _cfg(bucket, dataset_uri=f"s3://{bucket}/ds/d1"))
    assert uri == f"s3://{bucket}/ds/d1/heldout/prompts.jsonl.gz"
    assert thinking is False
    assert source["kind"] == "heldout" and source["heldout"]["count"] == 17
    cfg = _cfg(bucket, dataset_uri=f"s3://{bucket}/ds/d1")
    assert [c.name for c in cfg.conditions(thinking)] == ["sampled_think-off_c1", "sampled_think-off_cprod",
                                                         "greedy_think-off_c1", "greedy_think-off_cprod"]


def test_a_dataset_without_a_split_or_manifest_is_refused_with_the_way_out(s3_client: Any, bucket: str) -> None:
    s3_client.put_object(Bucket=bucket, Key="ds/d2/manifest.json", Body=json.dumps({"pinned": {}}).encode())
    with pytest.raises(ConfigError, match="has no held-out split.*prompts_uri"):
        resolve_prompts(s3_client, _cfg(bucket, dataset_uri=f"s3://{bucket}/ds/d2"))
    with pytest.raises(ConfigError, match="no manifest.json there"):
        resolve_prompts(s3_client, _cfg(bucket, dataset_uri=f"s3://{bucket}/ds/none"))


def test_prompts_uri_is_taken_as_given(s3_client: Any, bucket: str) -> None:
    uri, thinking, source = resolve_prompts(s3_client, _cfg(bucket, prompts_uri=f"s3://{bucket}/bench/p.jsonl"))
    assert (uri, thinking, source["kind"]) == (f"s3://{bucket}/bench/p.jsonl", None, "prompts_uri")
