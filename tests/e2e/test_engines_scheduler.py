"""dflash_generate through a real Airflow scheduler on a mixed fleet (1 SGLang + 2 vLLM simulators)
and on an all-vLLM fleet.

Every row exactly once, the thinking split on both engines, each server's engine in the manifest,
and a report of the same shape as an all-SGLang run's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dev.sim import SimConfig, SimFleet
from dflash_pipeline.dev.stack import AirflowStack

pytestmark = pytest.mark.slow

DAG = "dflash_generate"
SIM = {"token_time_s": 0.001, "length_scale": 0.05, "max_running_requests": 8}


def _upload(s3: Any, bucket: str, key: str, n: int, tag: str) -> str:
    body = "\n".join(json.dumps({"id": f"{tag}-{i}", "prompt": f"{tag} question {i}: what is {i} times {i + 3}?"})
                     for i in range(n))
    s3.put_object(Bucket=bucket, Key=key, Body=body.encode())
    return f"s3://{bucket}/{key}"


def _get(s3: Any, bucket: str, key: str) -> dict[str, Any]:
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def _rows(s3: Any, bucket: str, root: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for obj in s3.list_objects_v2(Bucket=bucket, Prefix=f"{root}/completions/").get("Contents", []):
        rows += decode_part(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()).to_pylist()
    return rows


def _shape(value: Any) -> Any:
    """The keys of a report, recursively, without the values (server names are normalised). A
    figure the engine does not report is null (vLLM has no `reasoning_tokens` in its usage, and
    reports cached tokens only when some were cached): a null leaf matches any type."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value[:1]]
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def _same_shape(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_shape(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_shape(x, y) for x, y in zip(a, b))
    return a == b or "NoneType" in (a, b)


def _run(stack: AirflowStack, s3: Any, bucket: str, fleet: SimFleet, tag: str, n: int) -> dict[str, Any]:
    conf = {"prompts_uri": _upload(s3, bucket, f"p/{tag}.jsonl", n, tag), "output_uri": f"s3://{bucket}/ds/{tag}",
            "servers": fleet.urls, "save_every": 40}
    run_id = stack.trigger(DAG, conf)
    assert stack.wait_run(DAG, run_id, timeout_s=300) == "success"
    return _get(s3, bucket, f"ds/{tag}/report.json")


def test_mixed_and_all_vllm_fleets_through_the_scheduler(airflow_stack: AirflowStack, s3_client, bucket) -> None:
    n = 360
    engines = ["sglang", "vllm", "vllm"]
    with SimFleet([SimConfig(engine=e, **SIM) for e in engines]).start() as mixed:
        report = _run(airflow_stack, s3_client, bucket, mixed, "mixed", n)
        requests = sum(s["generation_requests"] for s in mixed.stats())
        proofs = [s["proof_requests"] for s in mixed.stats()]
    assert (report["prompts"], report["completions"], report["missing"], report["duplicates"]) == (n, n, 0, 0)
    assert requests == n and proofs == [1, 1, 1], "each prompt sent once; proofs tagged and not counted"
    rows = _rows(s3_client, bucket, "ds/mixed")
    assert sorted(r["id"] for r in rows) == sorted(f"mixed-{i}" for i in range(n))
    engine_of = dict(zip(mixed.urls, engines))
    split_on = {engine_of[r["server"]] for r in rows if r["reasoning"] and "<think>" not in (r["content"] or "")}
    assert split_on == {"sglang", "vllm"}, "thinking split on both engines"
    assert all(r["reasoning"] for r in rows)
    manifest = _get(s3_client, bucket, "ds/mixed/manifest.json")
    assert [s["engine"] for s in manifest["servers"]] == engines

    with SimFleet([SimConfig(engine="vllm", **SIM) for _ in engines]).start() as vllm_only:
        report_vllm = _run(airflow_stack, s3_client, bucket, vllm_only, "vllm", n)
        assert sum(s["generation_requests"] for s in vllm_only.stats()) == n
    assert (report_vllm["completions"], report_vllm["missing"], report_vllm["duplicates"]) == (n, 0, 0)
    rows = _rows(s3_client, bucket, "ds/vllm")
    assert sorted(r["id"] for r in rows) == sorted(f"vllm-{i}" for i in range(n))
    assert all(r["reasoning"] and "<think>" not in (r["content"] or "") for r in rows), "thinking split on vLLM"
    assert {s["engine"] for s in _get(s3_client, bucket, "ds/vllm/manifest.json")["servers"]} == {"vllm"}

    with SimFleet([SimConfig(**SIM) for _ in engines]).start() as sglang_only:
        baseline = _run(airflow_stack, s3_client, bucket, sglang_only, "sglang", n)
    # per_server is keyed by server; quality and mix are keyed by what the data holds (languages, domains,
    # labels seen), so of those only their own keys must agree.
    names = {"per_server": None, "quality": None, "mix": None}
    shape_base = _shape({k: v for k, v in baseline.items() if k not in names})
    for other in (report, report_vllm):
        assert _same_shape(_shape({k: v for k, v in other.items() if k not in names}), shape_base)
        for section in ("quality", "mix"):
            assert other[section].keys() == baseline[section].keys(), section
        assert _same_shape(_shape(next(iter(other["per_server"].values()))),
                           _shape(next(iter(baseline["per_server"].values()))))
