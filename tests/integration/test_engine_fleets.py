"""The generate worker on all-vLLM and mixed SGLang/vLLM simulated fleets, and on a slow server.

Real sockets throughout: moto for S3, in-process simulators speaking SGLang's or vLLM's wire
(dev/sim/vllm_wire.py), the library's plan / preflight / Worker / validation as the DAG calls them
(dev/faultlab.run_generation). Outcomes are asserted: every row exactly once, the thinking split
on every engine, the engine recorded in the manifest, proof requests not counted as generation.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from dflash_pipeline.config import ConfigError, RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dev.faultlab import run_generation
from dflash_pipeline.dev.sim import SimConfig, SimFleet
from dflash_pipeline.steps.validate import run_validation

FAST = {"token_time_s": 0.0005, "length_scale": 0.05, "max_running_requests": 6}


def _prompts(n: int) -> bytes:
    return "\n".join(json.dumps({"id": f"q{i:04d}", "prompt": f"how many primes are below {100 + 3 * i}?"})
                     for i in range(n)).encode()


def _rows(s3: Any, cfg: RunConfig) -> list[dict[str, Any]]:
    layout = DatasetLayout.from_uri(cfg.output_uri)
    rows: list[dict[str, Any]] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=layout.bucket, Prefix=layout.completions_prefix):
        for obj in page.get("Contents", []):
            rows += decode_part(s3.get_object(Bucket=layout.bucket, Key=obj["Key"])["Body"].read()).to_pylist()
    return rows


def _manifest(s3: Any, cfg: RunConfig) -> dict[str, Any]:
    layout = DatasetLayout.from_uri(cfg.output_uri)
    return json.loads(s3.get_object(Bucket=layout.bucket, Key=layout.manifest_key)["Body"].read())


def _run(s3: Any, bucket: str, fleet: SimFleet, tag: str, n: int, **params: Any) -> tuple[RunConfig, list[Any]]:
    s3.put_object(Bucket=bucket, Key=f"{tag}/p.jsonl", Body=_prompts(n))
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/{tag}/p.jsonl", "output_uri": f"s3://{bucket}/{tag}/ds",
                                 "servers": fleet.urls, "save_every": 20, **params})
    outcomes = run_generation(s3, cfg, fleet.urls, f"{tag}-run1")
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    return cfg, outcomes


@pytest.mark.parametrize("engines", [["vllm", "vllm", "vllm"], ["sglang", "vllm", "vllm"]], ids=["all-vllm", "mixed"])
def test_fleet_every_row_once_with_thinking_split(s3_client, bucket, engines) -> None:
    n = 300
    with SimFleet([SimConfig(engine=e, **FAST) for e in engines]).start() as fleet:
        cfg, _ = _run(s3_client, bucket, fleet, "-".join(engines), n)
        report = run_validation(s3_client, cfg.output_uri)  # includes the missing-reasoning threshold
        stats = fleet.stats()
    assert report["completions"] == n and report["missing"] == 0 and report["duplicates"] == 0
    rows = _rows(s3_client, cfg)
    assert sorted(r["id"] for r in rows) == [f"q{i:04d}" for i in range(n)]
    by_server: dict[str, int] = {}
    for row in rows:
        assert row["reasoning"] and row["content"] and "<think>" not in row["content"], row
        by_server[row["server"]] = by_server.get(row["server"], 0) + 1
    assert set(by_server) == set(fleet.urls), "every server generated rows"
    manifest = _manifest(s3_client, cfg)
    assert [s["engine"] for s in manifest["servers"]] == engines
    assert all(s["proof"]["reasoning_shape"] == "field" for s in manifest["servers"])
    vllm_entries = [s for s in manifest["servers"] if s["engine"] == "vllm"]
    assert all(s["capacity_warning"] and s["version"] == "0.32.0+sim" for s in vllm_entries)
    # The proof requests are tagged and not counted: exactly one generation request per prompt.
    assert sum(s["generation_requests"] for s in stats) == n
    assert [s["proof_requests"] for s in stats] == [1, 1, 1]


def test_vllm_server_whose_context_cannot_hold_max_tokens_plus_longest_prompt_is_refused(s3_client, bucket) -> None:
    with SimFleet([SimConfig(engine="vllm", **FAST), SimConfig(engine="vllm", context_length=4100, **FAST)]).start() as fleet:
        with pytest.raises(ConfigError) as exc:
            _run(s3_client, bucket, fleet, "ctx", 10, max_tokens=4096)
        assert sum(s["generation_requests"] for s in fleet.stats()) == 0
    text = str(exc.value)
    assert f"server {fleet.urls[1]}:" in text and f"server {fleet.urls[0]}:" not in text
    assert "context_length 4100" in text and "cannot hold max_tokens 4096" in text and "longest prompt" in text
    assert f"which {fleet.urls[0]} can" in text


@pytest.mark.slow
def test_slow_server_32k_max_tokens_no_false_timeouts(s3_client, bucket) -> None:
    """Time scaled by 100: decode at 3000 tokens/s per request is ~30 tokens/s, request_timeout_s=3
    is 300 s, min_decode_tok_s=500 is 5. Thinking generations up to 32k tokens take up to ~11 s (18
    minutes unscaled), longer than request_timeout_s: none may time out."""
    configs = [SimConfig(engine=e, token_time_s=1 / 3000, mean_tokens=24000, context_length=40000,
                         max_running_requests=8) for e in ("vllm", "sglang")]
    n = 32
    with SimFleet(configs).start() as fleet:
        s3_client.put_object(Bucket=bucket, Key="slow/p.jsonl", Body=_prompts(n))
        cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/slow/p.jsonl", "output_uri": f"s3://{bucket}/slow/ds",
                                     "servers": fleet.urls, "save_every": 8, "max_tokens": 32768,
                                     "request_timeout_s": 3})
        outcomes = run_generation(s3_client, cfg, fleet.urls, "slow-run1",
                                  settings_overrides={"min_decode_tok_s": 500.0})
        assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
        stats = fleet.stats()
    rows = _rows(s3_client, cfg)
    assert sorted(r["id"] for r in rows) == [f"q{i:04d}" for i in range(n)]
    errors = [r for r in rows if r.get("error_class")]
    assert errors == [], errors[:3]
    assert all(r["attempts"] == 1 for r in rows), "a request was cut and sent again"
    assert sum(s["generation_requests"] for s in stats) == n
    long_ones = [r for r in rows if r["latency_s"] > cfg.request_timeout_s]
    assert len(long_ones) >= n // 2, "the test must have generations longer than request_timeout_s"
    assert max(r["completion_tokens"] for r in rows) == 32768


def test_a_timeout_is_retried_once_then_an_error_row(s3_client, bucket) -> None:
    """Two prompts hang on a server that answers the others: each is cut after request_timeout_s,
    sent once more, then stored as a Timeout error row with attempts=2 (not max_attempts=5). (A
    server on which *every* request hangs is failing instead: it hands its chunks over, is probed
    and ends ServerLost, tests/integration/test_protocol_review.py.)"""
    poison = {"poison_text": "below 103?", "poison_fault": "hang"}  # q0001 (and no other: 100 + 3i)
    with SimFleet([SimConfig(engine="vllm", hang_s=60.0, **poison, **FAST)]).start() as fleet:
        s3_client.put_object(Bucket=bucket, Key="hang/p.jsonl", Body=_prompts(4))
        cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/hang/p.jsonl", "output_uri": f"s3://{bucket}/hang/ds",
                                     "servers": fleet.urls, "save_every": 4, "request_timeout_s": 1,
                                     "max_attempts": 5})
        outcomes = run_generation(s3_client, cfg, fleet.urls, "hang-run1", settings_overrides={"backoff_base_s": 0.05})
        stats = fleet.stats()
    rows = _rows(s3_client, cfg)
    assert len(rows) == 4, outcomes
    errors = [r for r in rows if r.get("error_class")]
    assert [r["id"] for r in errors] == ["q0001"], errors
    assert errors[0]["error_class"] == "Timeout" and errors[0]["attempts"] == 2
    # _do_request sends a timed-out prompt twice, not max_attempts=5 times; the worker may put it
    # back (MAX_REQUEUES) while nothing else succeeded since, each time for two more sends after
    # one 1-token probe has shown the server generating (steps/generate/failing.py).
    from dflash_pipeline.steps.generate.state import MAX_REQUEUES

    assert 3 + 2 <= stats[0]["generation_requests"] <= 3 + 2 * (1 + MAX_REQUEUES) + MAX_REQUEUES
    assert stats[0]["generation_requests"] % 2 == 0


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_server_whose_answers_carry_no_thinking_is_refused(s3_client, bucket, engine) -> None:
    """With enable_thinking, a server whose proof answer has neither a reasoning field nor <think>
    in its content (a model or template that ignores the flag) is refused before generation, named."""
    with SimFleet([SimConfig(engine=engine, **FAST), SimConfig(engine=engine, thinks=False, **FAST)]).start() as fleet:
        with pytest.raises(ConfigError) as exc:
            _run(s3_client, bucket, fleet, f"nothink-{engine}", 10)
        assert sum(s["generation_requests"] for s in fleet.stats()) == 0
    text = str(exc.value)
    assert f"server {fleet.urls[1]}" in text and f"server {fleet.urls[0]}" not in text
    assert "thinking cannot be split" in text
