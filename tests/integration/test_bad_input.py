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


def test_prompt_longer_than_every_context_is_an_error_row_never_retried(s3_client, bucket, sim_fleet) -> None:
    """One outlier prompt that no server can hold does not stop the run: preflight's proof request
    (the plan's longest prompt) finds it, warns in the log and the manifest, and the prompt becomes a
    permanent ContextLengthExceeded error row that later runs do not retry."""
    fleet = sim_fleet(1, token_time_s=0.0005, length_scale=0.05, context_length=400)
    rows = [{"id": f"ok{i}", "prompt": f"short question {i}"} for i in range(20)]
    rows.append({"id": "huge", "prompt": " ".join(["word"] * 500)})
    s3_client.put_object(Bucket=bucket, Key="p.jsonl", Body="\n".join(json.dumps(r) for r in rows).encode())
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/p.jsonl", "output_uri": f"s3://{bucket}/ctx",
                                 "servers": fleet.urls, "max_tokens": 64, "save_every": 10})
    outcomes = run_generation(s3_client, cfg, fleet.urls, "run1")
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    first = fleet.servers[0].stats()["generation_requests"]
    assert first == len(rows), "the context-length 400 was not retried"
    manifest = json.loads(s3_client.get_object(Bucket=bucket, Key="ctx/manifest.json")["Body"].read())
    warning = manifest["runs"]["run1"]["context_warning"]
    assert "longest prompt (huge" in warning and "context_length 400" in warning
    report = run_validation(s3_client, cfg.output_uri, thresholds=Thresholds(max_error_rate=0.1, max_truncation_rate=1.0))
    assert report["errors"] == 1 and report["errors_by_class"] == {"ContextLengthExceeded": 1}
    assert report["completions"] == 20 and report["missing"] == 0
    # A later run (default retry_failed_rows=transient) does not retry a permanent error.
    run_generation(s3_client, cfg, fleet.urls, "run2")
    assert fleet.servers[0].stats()["generation_requests"] == first


def test_preflight_refuses_the_server_with_a_smaller_context_than_the_fleet(s3_client, bucket) -> None:
    """The longest prompt fits one server but not another (a smaller --context-length): that server
    is refused before generation, with its name and figures, and nothing is generated."""
    from dflash_pipeline.config import ConfigError
    from dflash_pipeline.dev.sim import SimConfig, SimFleet

    fast = {"token_time_s": 0.0005, "length_scale": 0.05}
    with SimFleet([SimConfig(context_length=4000, **fast), SimConfig(context_length=400, **fast)]).start() as fleet:
        rows = [{"id": f"ok{i}", "prompt": f"short question {i}"} for i in range(20)]
        rows.append({"id": "huge", "prompt": " ".join(["word"] * 500)})
        s3_client.put_object(Bucket=bucket, Key="p.jsonl", Body="\n".join(json.dumps(r) for r in rows).encode())
        cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/p.jsonl", "output_uri": f"s3://{bucket}/ctx2",
                                     "servers": fleet.urls, "max_tokens": 64, "save_every": 10})
        with pytest.raises(ConfigError) as exc:
            run_generation(s3_client, cfg, fleet.urls, "run1")
        text = str(exc.value)
        assert f"server {fleet.urls[1]}" in text and f"server {fleet.urls[0]}:" not in text
        assert "longest prompt (huge" in text and "context_length 400" in text
        assert sum(s.stats()["generation_requests"] for s in fleet.servers) == 0


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
