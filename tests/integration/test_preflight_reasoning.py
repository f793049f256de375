"""Preflight's proof that a thinking-on server splits thinking, settled before a refusal (issue 37 item 2),
against simulated SGLang and vLLM servers over real sockets and moto S3.

A model that closes its thinking at once on the proof prompt (always, greedily: `skip_thinking_greedy`,
as the tiny designed checkpoint did on real vLLM 0.32) is not refused: another answer, sampled with
another seed, thinks. Refusals remain where no answer thinks, and say what was seen: each answer, the
parser the server reports (SGLang) or that it reports none (vLLM), and whether `</think>` was among the
answers' generated token ids (vLLM `/tokenize` + `return_token_ids`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.config import ConfigError, EvalConfig, RunConfig
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.steps.evaluate import prepare
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import run_preflight

FAST = dict(length_scale=0.02, token_time_s=0.0005, max_running_requests=4)


def _serve(**knobs: Any) -> SimServer:
    return SimServer(SimConfig(**FAST, **knobs)).start()


def _preflight(s3_client: Any, bucket: str, server: SimServer, root: str, **params: Any) -> dict[str, Any]:
    body = "\n".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}: name {i} birds"}) for i in range(4))
    s3_client.put_object(Bucket=bucket, Key="p.jsonl", Body=body.encode())
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/p.jsonl", "output_uri": f"s3://{bucket}/{root}",
                                 "servers": [server.url], "max_tokens": 64, **params})
    run_plan(s3_client, cfg, "r1")
    run_preflight(s3_client, cfg, [ServerSpec(server.url, server.url)], "r1")
    manifest = json.loads(s3_client.get_object(Bucket=bucket, Key=f"{root}/manifest.json")["Body"].read())
    return manifest["servers"][0]["proof"]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_model_that_does_not_think_greedily_is_not_refused(s3_client: Any, bucket: str, engine: str) -> None:
    server = _serve(engine=engine, skip_thinking_greedy=True)
    try:
        proof = _preflight(s3_client, bucket, server, f"greedy-{engine}", temperature=0.0)
        proofs = [r for r in server.requests.rows() if r["request_id"].startswith("preflight-proof")]
    finally:
        server.stop()
    settled = proof["reasoning_settled"]
    assert settled["verdict"] == "thinks", settled
    first, second = settled["answers"]
    assert (first["temperature"], first["reasoning_chars"]) == (0.0, 0)
    assert second["temperature"] == 0.6 and second["reasoning_chars"] > 0 and second["seed"] == 101
    assert [r["sampling"]["temperature"] for r in proofs] == [0.0, 0.6]
    assert proof["reasoning_shape"] == "field"


def test_an_eval_with_greedy_and_sampled_thinking_conditions_passes_preflight(
        s3_client: Any, bucket: str) -> None:
    """The issue's case: the greedy condition's proof answer closes its thinking at once."""
    server = _serve(engine="vllm", skip_thinking_greedy=True, spec_algorithm="ngram")
    try:
        body = "\n".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) for i in range(6))
        s3_client.put_object(Bucket=bucket, Key="bench.jsonl", Body=body.encode())
        cfg = EvalConfig.from_params({"prompts_uri": f"s3://{bucket}/bench.jsonl", "output_uri": f"s3://{bucket}/ev",
                                      "drafters": [{"name": "d", "servers": [server.url]}],
                                      "thinking_modes": ["on", "off"], "concurrency": [1], "max_tokens": 40})
        [assignment] = prepare(s3_client, cfg, "run1", lambda s: ServerSpec(s, s))
    finally:
        server.stop()
    assert [c["name"] for c in assignment["conditions"]] == [
        "sampled_think-on_c1", "sampled_think-off_c1", "greedy_think-on_c1", "greedy_think-off_c1"]


def _refusal(s3_client: Any, bucket: str, root: str, **knobs: Any) -> str:
    server = _serve(**knobs)
    try:
        with pytest.raises(ConfigError) as refused:
            _preflight(s3_client, bucket, server, root, temperature=0.0)
        assert server.stats()["generation_requests"] == 0
        assert len([r for r in server.requests.rows() if r["request_id"].startswith("preflight-proof")]) == 4
    finally:
        server.stop()
    text = str(refused.value)
    assert "thinking cannot be split" in text
    assert "plan prompt at temperature 0: stop" in text and "tiny prompt at temperature 0.6 seed 303" in text
    return text


def test_refusals_name_what_they_saw(s3_client: Any, bucket: str, qwen_tokenizer: Path, tmp_path: Path) -> None:
    from dflash_pipeline.dev.qwen_tokenizer import copy_with_template

    # SGLang reports its parser: a model that never thinks is not a missing parser
    text = _refusal(s3_client, bucket, "r-sg", engine="sglang", thinks=False)
    assert "reports reasoning parser 'qwen3', yet the model did not think in any of 4 answers" in text
    text = _refusal(s3_client, bucket, "r-sg0", engine="sglang", thinks=False, reasoning_parser=None)
    assert "reports no reasoning parser" in text
    # vLLM says nothing of its parser; the answers' token ids do (`</think>` found with /tokenize)
    opened = str(copy_with_template(tmp_path / "tok", "qwen3.6"))
    text = _refusal(s3_client, bucket, "r-vl", engine="vllm", tokenizer_dir=opened, skip_thinking_greedy=True,
                    skip_thinking_rate=1.0)
    assert "4 answer(s) generated </think> (token id 151668) that their text does not hold" in text
    assert "</think> among its token ids" in text
    text = _refusal(s3_client, bucket, "r-vl0", engine="vllm", tokenizer_dir=opened, thinks=False)
    assert "The server (vllm) does not report its reasoning parser; no </think> among their generated token ids" in text
