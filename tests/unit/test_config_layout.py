"""RunConfig and the S3 layout: bounds, unknown keys, unsafe paths, deterministic keys."""

from __future__ import annotations

import pytest

from dflash_pipeline.config import PARAM_SCHEMAS, ConfigError, RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout, UriError, chunk_of_key, parse_s3_uri, safe_run_id

BASE = {"prompts_uri": "s3://in-bucket/p.jsonl", "output_uri": "s3://out-bucket/ds/v1", "servers": ["http://h:30000"]}


def test_defaults_match_the_job_our_users_run() -> None:
    cfg = RunConfig.from_params(BASE)
    assert cfg.sampling.max_tokens == 4096
    assert cfg.sampling.temperature == 0.6
    assert cfg.sampling.top_p == 0.95
    assert cfg.sampling.enable_thinking is True
    assert cfg.save_every == 500
    assert cfg.request_timeout_s == 300
    assert cfg.concurrency_per_server is None
    assert cfg.aws_conn_id == "aws_default"


def test_every_param_has_a_description_and_section() -> None:
    for name, schema in PARAM_SCHEMAS.items():
        assert schema.get("description"), name
        assert schema.get("section"), name


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": "4096"}, "max_tokens"),
        ({"servers": []}, "servers"),
        ({"max_token": 10}, "unknown conf key"),
        ({"top_p": 0}, "top_p"),
        ({"output_uri": "s3://out-bucket/../x"}, "not allowed"),
        ({"output_uri": "/local/path"}, "s3://"),
        ({"prompts_uri": "s3://out-bucket/ds/v1/p.jsonl"}, "inside output_uri"),
    ],
)
def test_bad_conf_is_refused_with_the_param_name(extra: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        RunConfig.from_params({**BASE, **extra})


def test_missing_required_param() -> None:
    with pytest.raises(ConfigError, match="prompts_uri"):
        RunConfig.from_params({"output_uri": "s3://b-b/x", "servers": ["a"]})


def test_layout_keys_are_deterministic() -> None:
    lay = DatasetLayout.from_uri("s3://out-bucket/ds/v1/")
    assert lay.root == "ds/v1"
    assert lay.part_key(7) == "ds/v1/completions/part-000007.parquet"
    assert lay.claim_key(7) == "ds/v1/claims/chunk-000007.json"
    assert lay.input_key("abc", 7) == "ds/v1/inputs/abc/chunk-000007.parquet"
    assert chunk_of_key(lay.part_key(123), lay.completions_prefix) == 123
    assert chunk_of_key(lay.claim_key(5), lay.claims_prefix) == 5
    assert chunk_of_key("ds/v1/completions/readme.txt", lay.completions_prefix) is None
    # Anchored: a part in a sub-folder, a backup copy or another prefix is not a chunk.
    assert chunk_of_key("ds/v1/completions/old/part-000003.parquet", lay.completions_prefix) is None
    assert chunk_of_key("ds/v1/completions/part-000003.parquet.bak", lay.completions_prefix) is None
    assert chunk_of_key("ds/v1/completions/xpart-000003.parquet", lay.completions_prefix) is None
    assert chunk_of_key(lay.part_key(3), lay.claims_prefix) is None


@pytest.mark.parametrize("uri", ["s3://Bad_Bucket/x", "s3://bucket", "s3://bucket/a//b", "s3://bucket/a/./b", "http://x/y"])
def test_unsafe_uris_refused(uri: str) -> None:
    with pytest.raises(UriError):
        parse_s3_uri(uri)


def test_run_id_is_one_safe_segment() -> None:
    rid = safe_run_id("manual__2026-12-02T10:00:00+00:00/../x")
    assert "/" not in rid and ":" not in rid and "+" not in rid
