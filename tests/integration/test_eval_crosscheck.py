"""The /metrics cross-check on real sockets, without Airflow: prepare, one server's conditions and the
report (steps/evaluate) against moto and a simulated vLLM drafter. Clean: the rows' counters equal the
server's /metrics delta, speculative counters and generated tokens. Shared: another client's requests
reach the server inside the measured window (sent from the worker's own progress callback, so they land
between the two scrapes), and the report flags the mismatch with both figures, says what causes one,
and marks the condition untrusted."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from dflash_pipeline.config import EvalConfig
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.steps.evaluate import prepare, run_report, run_server

N = 16


@pytest.fixture(params=["vllm", "sglang"])
def drafter(request: pytest.FixtureRequest):
    """vLLM (per-request metrics, four /metrics counters) or SGLang (EAGLE3, --enable-metrics: verify steps)."""
    spec = (dict(spec_algorithm="draft_model") if request.param == "vllm"
            else dict(spec_algorithm="EAGLE3", enable_metrics=True))
    server = SimServer(SimConfig(engine=request.param, length_scale=0.03, token_time_s=0.0005, max_running_requests=4,
                                 spec_num_draft_tokens=3, spec_accept_p=0.6, **spec)).start()
    yield server
    server.stop()


def _run(s3_client: Any, bucket: str, url: str, root: str, intrude: bool) -> dict[str, Any]:
    body = "\n".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}: name {i} birds"}) for i in range(N))
    s3_client.put_object(Bucket=bucket, Key="bench/p.jsonl", Body=body.encode())
    cfg = EvalConfig.from_params({"prompts_uri": f"s3://{bucket}/bench/p.jsonl", "output_uri": f"s3://{bucket}/{root}",
                                  "drafters": [{"name": "d", "servers": [url]}], "greedy": False, "concurrency": [1],
                                  "max_tokens": 40, "save_every": 8})
    [assignment] = prepare(s3_client, cfg, "run1", lambda s: ServerSpec(name=s, base_url=s))
    sent: list[int] = []

    def progress(store: Any, key: str, settings: Any, n: int) -> Any:
        def on_progress(snapshot: dict[str, Any]) -> None:
            if intrude and not sent:  # another client of the same server, inside the measured window
                answer = requests.post(f"{url}/v1/chat/completions", timeout=30, json={
                    "model": settings.model, "max_tokens": 30,
                    "messages": [{"role": "user", "content": "someone else's request"}]})
                sent.append(answer.status_code)
        return on_progress

    run_server(s3_client, cfg, assignment, "run1", ServerSpec(name=url, base_url=url), progress_factory=progress)
    assert sent == ([200] if intrude else [])
    return run_report(s3_client, cfg, [assignment], "run1", plots=False)


def test_clean_run_matches_the_metrics_delta(s3_client: Any, bucket: str, drafter: SimServer) -> None:
    report = _run(s3_client, bucket, drafter.url, "evals/clean", intrude=False)
    [check] = report["groups"]["d"]["sampled_think-on_c1"]["crosscheck"]
    assert check["status"] == "match", check
    assert check["rows_sum"]["verify_steps"] == check["metrics_delta"]["verify_steps"] > 0
    if drafter.config.engine == "vllm":
        assert check["rows_sum"]["accepted_tokens"] == check["metrics_delta"]["accepted_tokens"]
    else:  # SGLang's /metrics has verify steps only (and generated tokens)
        assert set(check["metrics_delta"]) == {"verify_steps", "generation_tokens"}
    # every server's generated tokens, SGLang's and vLLM's counter alike
    assert check["checks"] == {"speculative": "match", "generation_tokens": "match"}
    assert check["rows_sum"]["generation_tokens"] == check["metrics_delta"]["generation_tokens"] > 0
    assert report["crosscheck_mismatches"] == []


def test_shared_server_traffic_is_flagged(s3_client: Any, bucket: str, drafter: SimServer) -> None:
    report = _run(s3_client, bucket, drafter.url, "evals/shared", intrude=True)
    [check] = report["groups"]["d"]["sampled_think-on_c1"]["crosscheck"]
    assert check["status"] == "mismatch", check
    diff = check["differences"]["verify_steps"]
    assert diff["metrics"] > diff["rows"] > 0
    tokens = check["differences"]["generation_tokens"]
    assert tokens["metrics"] > tokens["rows"] > 0
    assert report["statuses"]["d"]["sampled_think-on_c1"] == "untrusted" and report["status"] == "untrusted"
    assert "another client's traffic on a shared server" in check["note"]
    assert len(report["crosscheck_mismatches"]) == 1
