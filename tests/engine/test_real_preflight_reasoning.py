"""Preflight's thinking proof on a real vLLM 0.32 (CPU build, the tiny designed Qwen3, --reasoning-parser qwen3):
dflash_eval's prepare plans greedy and sampled conditions with thinking on and off and refuses none (issue 37
item 2: one answer that closed its thinking at once used to refuse the whole eval), and the server's
`/tokenize` gives the ids preflight looks for among an answer's generated ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dflash_pipeline.config import EvalConfig
from dflash_pipeline.dev.engine.tiny_qwen import THINK, THINK_END
from dflash_pipeline.serving.probe import think_token_ids
from dflash_pipeline.serving.sglang import ServerSpec, new_session
from dflash_pipeline.steps.evaluate import prepare

pytestmark = pytest.mark.slow


def test_eval_conditions_greedy_and_sampled_thinking_on_and_off_pass_preflight(
        vllm_server: Any, s3_client: Any, bucket: str) -> None:
    spec = ServerSpec(vllm_server.base_url, vllm_server.base_url)
    assert think_token_ids(new_session(), spec, vllm_server.model) == {"<think>": THINK, "</think>": THINK_END}
    rows = [{"id": f"q{i}", "prompt": f"What is {i} + {i * 3}?", "enable_thinking": False} for i in range(6)]
    s3_client.put_object(Bucket=bucket, Key="p.jsonl", Body="\n".join(map(json.dumps, rows)).encode())
    cfg = EvalConfig.from_params({"prompts_uri": f"s3://{bucket}/p.jsonl", "output_uri": f"s3://{bucket}/ev",
                                  "drafters": [{"name": "plain", "servers": [vllm_server.base_url]}],
                                  "model": vllm_server.model, "thinking_modes": ["on", "off"], "concurrency": [1],
                                  "max_tokens": 40})
    [assignment] = prepare(s3_client, cfg, "run1", lambda s: ServerSpec(s, s))
    names = [c["name"] for c in assignment["conditions"]]
    assert names == ["sampled_think-on_c1", "sampled_think-off_c1", "greedy_think-on_c1", "greedy_think-off_c1"]
    for cond in assignment["conditions"]:
        manifest = json.loads(s3_client.get_object(Bucket=bucket, Key=f"ev/plain/{cond['name']}/manifest.json")
                              ["Body"].read())
        proof = manifest["servers"][0]["proof"]
        settled = proof.get("reasoning_settled")
        print(cond["name"], proof["reasoning_shape"], proof["finish_reason"], proof["completion_tokens"],
              None if settled is None else [(a["temperature"], a["reasoning_chars"]) for a in settled["answers"]])
        if cond["thinking"]:
            assert proof["reasoning_shape"] == "field"
            assert settled is None or settled["verdict"] == "thinks"
        # the rows asked thinking off: the condition's mode was sent all the same (recorded in the manifest)
        assert manifest["input"]["row_settings"]["rows_thinking_off"] == 6
