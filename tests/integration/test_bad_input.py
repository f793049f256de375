"""Bad input that is not fatal: tolerated rejects, and prompts the server refuses become error rows."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dev.faultlab import run_generation
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.validate import Thresholds, run_validation


def test_max_rejects_lets_plan_continue_and_records_the_rejects(s3_client, bucket) -> None:
    lines = [json.dumps({"prompt": f"q{i}"}) for i in range(8)]
    lines.insert(2, '{"messages": "not a list"}')
    lines.insert(5, "{broken")
    s3_client.put_object(Bucket=bucket, Key="p.jsonl", Body="\n".join(lines).encode())
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/p.jsonl", "output_uri": f"s3://{bucket}/ds",
                                 "servers": ["http://127.0.0.1:9"], "max_rejects": 2})
    summary = run_plan(s3_client, cfg, "r1")
    assert summary["prompts"] == 8 and summary["rejects"] == 2
    rejects = [json.loads(x) for x in s3_client.get_object(Bucket=bucket, Key="ds/rejects/rejects.jsonl")["Body"].read().splitlines()]
    assert [r["line"] for r in rejects] == [3, 6]
    assert "non-empty list" in rejects[0]["reason"] and "malformed JSON" in rejects[1]["reason"]


def test_preflight_refuses_a_server_that_cannot_hold_the_longest_prompt(s3_client, bucket, sim_fleet) -> None:
    """Preflight's proof request is the plan's longest prompt: a server whose context cannot hold it
    plus max_tokens is refused before generation, with its name and the figures (issue 15); before,
    every such prompt became a ContextLengthExceeded error row."""
    from dflash_pipeline.config import ConfigError

    fleet = sim_fleet(1, token_time_s=0.0005, length_scale=0.05, context_length=400)
    rows = [{"id": f"ok{i}", "prompt": f"short question {i}"} for i in range(20)]
    rows.append({"id": "huge", "prompt": " ".join(["word"] * 500)})
    s3_client.put_object(Bucket=bucket, Key="p.jsonl", Body="\n".join(json.dumps(r) for r in rows).encode())
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/p.jsonl", "output_uri": f"s3://{bucket}/ctx",
                                 "servers": fleet.urls, "max_tokens": 64, "save_every": 10})
    with pytest.raises(ConfigError) as exc:
        run_generation(s3_client, cfg, fleet.urls, "run1")
    text = str(exc.value)
    assert f"server {fleet.urls[0]}" in text and "longest prompt (huge" in text and "context_length 400" in text
    stats = fleet.servers[0].stats()
    assert stats["generation_requests"] == 0 and stats["proof_requests"] == 1


def test_preflight_refuses_a_server_whose_context_cannot_hold_max_tokens(s3_client, bucket, sim_fleet) -> None:
    from dflash_pipeline.config import ConfigError
    from dflash_pipeline.serving.sglang import ServerSpec
    from dflash_pipeline.steps.plan import run_plan
    from dflash_pipeline.steps.preflight import run_preflight

    fleet = sim_fleet(2, token_time_s=0.0005, length_scale=0.05)
    fleet.servers[1].update_config(context_length=2048)
    s3_client.put_object(Bucket=bucket, Key="p2.jsonl", Body=b'{"prompt": "hello"}\n')
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/p2.jsonl", "output_uri": f"s3://{bucket}/ctx2",
                                 "servers": fleet.urls, "max_tokens": 4096})
    run_plan(s3_client, cfg, "r1")
    with pytest.raises(ConfigError) as exc:
        run_preflight(s3_client, cfg, [ServerSpec(u, u) for u in fleet.urls], "r1")
    assert f"server {fleet.urls[1]}: context_length 2048 cannot hold max_tokens 4096" in str(exc.value)
    assert fleet.urls[0] not in str(exc.value)
    assert sum(s.stats()["generation_requests"] for s in fleet.servers) == 0
