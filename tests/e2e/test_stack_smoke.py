"""The dev/test stack itself: a tiny mapped DAG through the real scheduler, CLI trigger, S3Hook -> moto.

Proves the harness the real end-to-end tests stand on: the DAG file is written into the session
stack's throw-away DAG bundle, triggered with ``airflow dags trigger --conf`` (the users' path),
followed over REST to success, and its three objects are read back from moto.
"""

from __future__ import annotations

import json
import logging
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests

from dflash_pipeline.dev.stack import AirflowStack

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)

SMOKE_DAG = '''
from __future__ import annotations

import json

from airflow.sdk import dag, get_current_context, task


@dag(dag_id="stack_smoke", schedule=None, catchup=False, tags=["test"])
def stack_smoke():
    @task
    def put(item: str) -> str:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        ctx = get_current_context()
        conf = ctx["dag_run"].conf
        key = f"{conf['prefix']}/{item}.json"
        body = {"item": item, "map_index": ctx["ti"].map_index, "run_id": ctx["run_id"]}
        S3Hook(aws_conn_id="aws_default").load_string(
            json.dumps(body), key=key, bucket_name=conf["bucket"], replace=True
        )
        return key

    put.expand(item=["a", "b", "c"])


stack_smoke()
'''


def test_mapped_dag_through_cli_trigger_writes_to_moto(
    airflow_stack: AirflowStack, airflow_dags_dir: Path, tmp_path: Path, bucket: str, s3_client: Any,
) -> None:
    # The DAG is written in this test's tmp_path, then moved into the stack's test bundle in one step
    # so the dag-processor never parses a half-written file.
    staged = tmp_path / "stack_smoke.py"
    staged.write_text(textwrap.dedent(SMOKE_DAG))
    staged.replace(airflow_dags_dir / "stack_smoke.py")

    # The API requires the bearer token.
    assert requests.get(f"{airflow_stack.url}/api/v2/dags", timeout=10).status_code == 401

    prefix = f"smoke/{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    run_id = airflow_stack.trigger("stack_smoke", {"bucket": bucket, "prefix": prefix})
    state = airflow_stack.wait_run("stack_smoke", run_id, timeout_s=180, poll_s=0.5)
    log.info("stack_smoke: trigger to %s in %.1f s", state, time.monotonic() - started)
    assert state == "success"

    tis = airflow_stack.task_instances("stack_smoke", run_id)
    assert [(ti.task_id, ti.map_index, ti.state) for ti in tis] == [
        ("put", 0, "success"), ("put", 1, "success"), ("put", 2, "success"),
    ]
    assert all(ti.try_number == 1 and ti.hostname for ti in tis)

    keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"])
    assert keys == [f"{prefix}/a.json", f"{prefix}/b.json", f"{prefix}/c.json"]
    bodies = [json.loads(s3_client.get_object(Bucket=bucket, Key=k)["Body"].read()) for k in keys]
    assert sorted(b["map_index"] for b in bodies) == [0, 1, 2]
    assert {b["run_id"] for b in bodies} == {run_id}

    # The run is visible through the CLI too (same DB the scheduler uses).
    listed = airflow_stack.cli("dags", "list-runs", "stack_smoke", "--output", "json", check=True)
    assert run_id in listed.stdout
    mem = airflow_stack.memory_usage()
    log.info("stack memory: PSS %d MiB, RSS %d MiB in %d processes",
             mem["pss_bytes"] >> 20, mem["rss_bytes"] >> 20, mem["processes"])
