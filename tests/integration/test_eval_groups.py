"""dflash_eval refuses groups that cannot be compared, at prepare, before any proof or generation request
(issue 37 item 7): every group must serve one target model, a drafter group one speculative method and
draft length on every server, and the baseline must not speculate. Simulated SGLang and vLLM servers over
real sockets, moto S3."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dflash_pipeline.config import ConfigError, EvalConfig
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.steps.evaluate import prepare

FAST = dict(length_scale=0.02, token_time_s=0.0005, max_running_requests=4)


@pytest.fixture(scope="module")
def fleet():
    made = {
        "eagle_k3": SimServer(SimConfig(**FAST, spec_algorithm="EAGLE3", spec_num_draft_tokens=3)).start(),
        "eagle_k3b": SimServer(SimConfig(**FAST, spec_algorithm="EAGLE3", spec_num_draft_tokens=3)).start(),
        "eagle_k5": SimServer(SimConfig(**FAST, spec_algorithm="EAGLE3", spec_num_draft_tokens=5)).start(),
        "dflash": SimServer(SimConfig(**FAST, spec_algorithm="DFLASH", spec_num_draft_tokens=3)).start(),
        "plain": SimServer(SimConfig(**FAST)).start(),
        "other_model": SimServer(SimConfig(**FAST, model_path="Qwen/Qwen3-32B", spec_algorithm="EAGLE3")).start(),
        "vllm_ngram": SimServer(SimConfig(**FAST, engine="vllm", spec_algorithm="ngram")).start(),
    }
    yield made
    for s in made.values():
        s.stop()


def _prepare(s3_client: Any, bucket: str, fleet: dict[str, SimServer], drafters: dict[str, list[str]],
             baseline: list[str] | None) -> Any:
    s3_client.put_object(Bucket=bucket, Key="p.jsonl", Body=b'{"id": "q1", "prompt": "hello"}\n')
    conf: dict[str, Any] = {"prompts_uri": f"s3://{bucket}/p.jsonl", "output_uri": f"s3://{bucket}/ev",
                            "drafters": [{"name": n, "servers": [fleet[s].url for s in ss]} for n, ss in drafters.items()],
                            "greedy": False, "concurrency": [1], "max_tokens": 20}
    if baseline:
        conf["baseline"] = {"name": "base", "servers": [fleet[s].url for s in baseline]}
    return prepare(s3_client, EvalConfig.from_params(conf), "run1", lambda s: ServerSpec(s, s))


@pytest.mark.parametrize(("drafters", "baseline", "reason"), [
    ({"eagle": ["eagle_k3", "eagle_k5"]}, ["plain"], "drafter eagle mixes speculative configurations"),
    ({"eagle": ["eagle_k3", "dflash"]}, ["plain"], "drafter eagle mixes speculative configurations"),
    ({"eagle": ["eagle_k3", "plain"]}, None, "drafter eagle mixes speculative configurations"),
    ({"eagle": ["eagle_k3"]}, ["eagle_k3b"], "the baseline base speculates"),
    ({"eagle": ["eagle_k3"], "big": ["other_model"]}, ["plain"], "the groups serve different target models"),
    ({"eagle": ["eagle_k3", "vllm_ngram"]}, ["plain"], "drafter eagle mixes speculative configurations"),
])
def test_incomparable_groups_are_refused_before_any_request(s3_client: Any, bucket: str, fleet: dict[str, SimServer],
                                                            drafters: dict[str, list[str]], baseline: list[str] | None,
                                                            reason: str) -> None:
    for s in fleet.values():
        s.reset_stats()
    with pytest.raises(ConfigError, match=reason) as refused:
        _prepare(s3_client, bucket, fleet, drafters, baseline)
    text = str(refused.value)
    assert all(fleet[s].url in text for ss in drafters.values() for s in ss if s != "eagle_k3") or "baseline" in text
    assert sum(s.stats()["proof_requests"] + s.stats()["generation_requests"] for s in fleet.values()) == 0
    assert "Contents" not in s3_client.list_objects_v2(Bucket=bucket, Prefix="ev/")


def test_comparable_groups_pass(s3_client: Any, bucket: str, fleet: dict[str, SimServer]) -> None:
    out = _prepare(s3_client, bucket, fleet, {"eagle": ["eagle_k3", "eagle_k3b"], "dflash": ["dflash"]}, ["plain"])
    assert [a["group"] for a in out] == ["eagle", "eagle", "dflash", "base"]
    assert json.loads(s3_client.get_object(Bucket=bucket, Key="ev/eagle/sampled_think-on_c1/manifest.json")["Body"].read())
