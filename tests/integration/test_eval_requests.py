"""What dflash_eval sends, seen at the wire (moto S3, simulated servers, steps/evaluate without Airflow):

- a dataset planned without a held-out split is refused by prepare before any server is touched, with
  the way out (issue 37 item 1);
- a condition owns the request: the prompt rows' own `enable_thinking` and `sampling` (kept in a
  held-out file on purpose) are recorded, not sent; the simulator's request log shows each condition's
  thinking flag and temperature on every row, and the report names what the rows asked for (item 3).
"""

from __future__ import annotations

import io
import json
from collections import Counter
from typing import Any

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.config import ConfigError, EvalConfig, RunConfig
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.steps.evaluate import prepare, run_report, run_server
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import PROOF_REQUEST_PREFIX

N = 12


@pytest.fixture
def sim() -> Any:
    server = SimServer(SimConfig(engine="vllm", length_scale=0.02, token_time_s=0.0005, max_running_requests=4,
                                 spec_algorithm="draft_model", spec_num_draft_tokens=3, spec_accept_p=0.6)).start()
    yield server
    server.stop()


def _resolve(s: str) -> ServerSpec:
    return ServerSpec(name=s, base_url=s)


def test_a_dataset_without_a_held_out_split_is_refused_before_any_server_is_touched(
        s3_client: Any, bucket: str, sim: SimServer) -> None:
    body = "\n".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) for i in range(N))
    s3_client.put_object(Bucket=bucket, Key="prompts/train.jsonl", Body=body.encode())
    # a dataset planned as the README's generate example did before: no heldout_fraction
    run_plan(s3_client, RunConfig.from_params({"prompts_uri": f"s3://{bucket}/prompts/train.jsonl",
                                               "output_uri": f"s3://{bucket}/ds/v1", "servers": [sim.url]}), "gen1")
    cfg = EvalConfig.from_params({"dataset_uri": f"s3://{bucket}/ds/v1", "output_uri": f"s3://{bucket}/evals/e1",
                                  "drafters": [{"name": "d", "servers": [sim.url]}]})
    with pytest.raises(ConfigError) as refused:
        prepare(s3_client, cfg, "run1", _resolve)
    message = str(refused.value)
    # what is wrong, why it cannot be added to this dataset, and both ways out
    assert "no held-out split" in message and "heldout_fraction" in message and "pinned" in message
    assert "new output_uri" in message and "prompts_uri" in message
    assert sim.requests.rows() == [] and sim.stats()["proof_requests"] == 0
    assert "Contents" not in s3_client.list_objects_v2(Bucket=bucket, Prefix="evals/")


def test_a_condition_owns_the_request_and_the_rows_own_settings_are_recorded(
        s3_client: Any, bucket: str, sim: SimServer) -> None:
    # every row asks for thinking off and its own temperature: the conditions must win anyway
    rows = [{"id": f"q{i}", "prompt": f"question {i}: name {i} birds", "enable_thinking": False,
             "sampling": {"temperature": 1.3}} for i in range(N)]
    s3_client.put_object(Bucket=bucket, Key="bench/p.jsonl", Body="\n".join(map(json.dumps, rows)).encode())
    cfg = EvalConfig.from_params({"prompts_uri": f"s3://{bucket}/bench/p.jsonl", "output_uri": f"s3://{bucket}/ev",
                                  "drafters": [{"name": "d", "servers": [sim.url]}], "thinking_modes": ["on", "off"],
                                  "concurrency": [1], "max_tokens": 30, "save_every": 6})
    [assignment] = prepare(s3_client, cfg, "run1", _resolve)
    run_server(s3_client, cfg, assignment, "run1", _resolve(sim.url))
    sent = [r for r in sim.requests.rows() if not r["request_id"].startswith(PROOF_REQUEST_PREFIX)]
    got = Counter((r["enable_thinking"], r["sampling"].get("temperature")) for r in sent)
    assert got == {(True, 0.6): N, (False, 0.6): N, (True, 0.0): N, (False, 0.0): N}, got
    proofs = {(r["enable_thinking"], r["sampling"].get("temperature"))
              for r in sim.requests.rows() if r["request_id"].startswith(PROOF_REQUEST_PREFIX)}
    assert proofs == {(True, 0.6), (False, 0.6), (True, 0.0), (False, 0.0)}
    report = run_report(s3_client, cfg, [assignment], "run1", plots=False)
    assert report["status"] == "complete", report["status_reasons"]
    on = report["row_settings"]["greedy_think-on_c1"]
    assert any(f"{N} row(s) asked thinking off; sent on" in d for d in on), on
    assert any("temperature 1.3" in d and "sent temperature 0" in d for d in on), on
    assert not any("thinking" in d for d in report["row_settings"]["sampled_think-off_c1"])
    md = s3_client.get_object(Bucket=bucket, Key="ev/report.md")["Body"].read().decode()
    assert "the prompt rows asked otherwise" in md and f"{N} row(s) asked thinking off; sent on" in md
    # the rows' own settings are kept in every completion row's metadata
    key = next(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="ev/d/greedy_think-on_c1/completions/")
               ["Contents"] if o["Key"].endswith(".parquet"))
    table = pq.read_table(io.BytesIO(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()))
    meta = [json.loads(m) for m in table.column("metadata").to_pylist()]
    assert all(m["row_enable_thinking"] is False and m["row_sampling"] == {"temperature": 1.3} for m in meta)
    assert set(table.column("thinking").to_pylist()) == {True}


def test_a_rerun_of_a_complete_condition_with_error_rows_sends_nothing(s3_client: Any, bucket: str) -> None:
    """Issue 37 item 8: error rows are measured outcomes of an eval; a rerun of a complete condition sends
    no generation request and writes no new metrics document (docs/evaluation.md "Resume")."""
    server = SimServer(SimConfig(engine="vllm", length_scale=0.02, token_time_s=0.0005, max_running_requests=4,
                                 spec_algorithm="draft_model", poison_text="poison", poison_fault="hang",
                                 hang_s=3.0)).start()
    try:
        rows = [{"id": f"q{i}", "prompt": f"question {i}" + (" poison" if i < 1 else "")} for i in range(8)]
        s3_client.put_object(Bucket=bucket, Key="r.jsonl", Body="\n".join(map(json.dumps, rows)).encode())
        cfg = EvalConfig.from_params({"prompts_uri": f"s3://{bucket}/r.jsonl", "output_uri": f"s3://{bucket}/rr",
                                      "drafters": [{"name": "d", "servers": [server.url]}], "greedy": False,
                                      "concurrency": [1], "max_tokens": 20, "request_timeout_s": 1})
        [assignment] = prepare(s3_client, cfg, "run1", _resolve)
        first = run_server(s3_client, cfg, assignment, "run1", _resolve(server.url))
        assert first["conditions"][0]["errors"] == 1
        sent = server.stats()["generation_requests"]
        [again] = prepare(s3_client, cfg, "run2", _resolve)
        second = run_server(s3_client, cfg, again, "run2", _resolve(server.url))
        assert second["conditions"] == [{"condition": "sampled_think-on_c1", "nothing_to_do": True}]
        assert server.stats()["generation_requests"] == sent
        docs = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="rr/d/")["Contents"]
                if "/metrics/" in o["Key"]]
        assert len(docs) == 1 and "/run1/" in docs[0]
    finally:
        server.stop()
