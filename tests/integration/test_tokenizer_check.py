"""The tokenizer is checked at plan, through the real DAG (`dag.test()`), moto S3 and a simulated server.

A wrong Hugging Face id (not in the hub cache, offline) or an S3 prefix without a tokenizer fails the `plan`
task with a message naming what was tried; no request reaches the server and no manifest is written. A
Hugging Face id held by the hub cache (built here, the layout huggingface_hub writes) runs through: the
manifest records it (kind, snapshot commit, sha256s) and validation recounts with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_dag_run import _run_dagtest, _upload_jsonl  # the sibling module's dag.test() runner

from dflash_pipeline.dev.hub_cache import fill_hub_cache
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer
from dflash_pipeline.dev.stack import MotoServer

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
REPO_ID = "tiny-org/sim-chat"


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory):
    server = MotoServer(log_path=tmp_path_factory.mktemp("moto") / "moto.log").start()
    server.create_bucket("data")
    yield server
    server.stop()


def _get(moto: MotoServer, key: str) -> Any:
    return json.loads(moto.client().get_object(Bucket="data", Key=key)["Body"].read())


def test_plan_checks_the_tokenizer_before_any_request(moto: MotoServer, tmp_path: Path) -> None:
    server = SimServer(SimConfig(token_time_s=0.0005, length_scale=0.05, max_running_requests=8)).start()
    try:
        cache = tmp_path / "hub"
        fill_hub_cache(cache, REPO_ID, build_sim_tokenizer(tmp_path / "sim-tok"), COMMIT)
        prompts = _upload_jsonl(moto, "prompts/tok.jsonl", [{"id": f"t{i}", "prompt": f"What is {i} plus {i}?"}
                                                            for i in range(30)])
        base = {"prompts_uri": prompts, "servers": [server.url], "save_every": 10, "max_tokens": 150,
                "max_truncation_rate": 0.5}
        confs = [
            {**base, "output_uri": "s3://data/tok/wrong-id", "tokenizer": "no-org/no-such-tokenizer"},
            {**base, "output_uri": "s3://data/tok/wrong-s3", "tokenizer": "s3://data/models/none"},
            {**base, "output_uri": "s3://data/tok/hub", "tokenizer": REPO_ID},
        ]
        before = server.stats()["generation_requests"]
        results, log = _run_dagtest(moto, tmp_path, confs, {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
        requests_after_failures = server.stats()["generation_requests"]
    finally:
        server.stop()

    for res in results[:2]:
        assert res["state"] == "failed", res
        states = {t: s for t, _, s in res["tasks"]}
        assert states["plan"] == "failed" and states["preflight"] == "upstream_failed", res
    assert ("tokenizer 'no-org/no-such-tokenizer': tokenizer.json of 'no-org/no-such-tokenizer' is not in the hub "
            f"cache {cache} only (HF_HUB_OFFLINE is set)") in log
    assert "tokenizer 's3://data/models/none': s3://data/models/none/tokenizer.json does not exist" in log
    assert "Nothing was sent to the servers" in log
    listed = moto.client().list_objects_v2(Bucket="data", Prefix="tok/wrong").get("Contents", [])
    assert not [o["Key"] for o in listed if o["Key"].endswith("manifest.json")]

    assert results[2]["state"] == "success", results[2]
    # one request per prompt of the good run (the preflight proof is not counted): none from the failed ones
    assert requests_after_failures - before == 30
    manifest = _get(moto, "tok/hub/manifest.json")
    rec = manifest["tokenizer"]
    assert (rec["source"], rec["kind"], rec["revision"]) == (REPO_ID, "huggingface", COMMIT)
    assert len(rec["tokenizer_json_sha256"]) == 64 and rec["template_source"] == "tokenizer_config.json"
    report = _get(moto, "tok/hub/report.json")
    assert report["token_recount"]["tokenizer"] == REPO_ID
