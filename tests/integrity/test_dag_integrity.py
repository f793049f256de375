"""DAG integrity: the DAG file imports cleanly, does no I/O at parse time, and is wired as designed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import copy

import pytest

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_no_import_errors(dagbag) -> None:
    assert dagbag.import_errors == {}
    assert {"dflash_generate", "dflash_tokenize", "dflash_eval", "dflash_train"} <= set(dagbag.dags)


def test_tokenize_shape_prepare_mapped_tokenize_report(dagbag) -> None:
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    from dflash_pipeline.config import TOKENIZE_PARAM_SCHEMAS

    dag = dagbag.dags["dflash_tokenize"]
    assert set(dag.task_ids) == {"prepare", "tokenize", "report"}
    assert dag.get_task("tokenize").upstream_task_ids == {"prepare"}
    assert dag.get_task("report").upstream_task_ids == {"prepare", "tokenize"}
    assert isinstance(dag.get_task("tokenize"), MappedOperator), "one mapped task per worker"
    assert [a.name for a in dag.timetable.asset_condition.objects] == ["dflash_completions"]
    assert [o.name for o in dag.get_task("report").outlets] == ["dflash_tokenized"]
    assert set(dag.params.keys()) == set(TOKENIZE_PARAM_SCHEMAS)
    for name in dag.params.keys():
        param = dag.params.get_param(name)
        assert param.description and param.schema.get("type"), name
    assert dag.params.get_param("max_length").value == 4096
    assert dag.params.get_param("formats").value == ["parquet", "specforge"]
    assert dag.params.get_param("train_turns").schema["enum"] == ["all", "last"]
    for task in dag.tasks:
        assert task.retries >= 1, f"{task.task_id} has no retries"


def test_shape_plan_preflight_mapped_generate_validate(dagbag) -> None:
    dag = dagbag.dags["dflash_generate"]
    assert dag.schedule is None or str(dag.timetable.summary) in ("None", "Never, external triggers only")
    assert set(dag.task_ids) == {"plan", "preflight", "generate", "near_duplicates", "digest_shards", "digest_parts",
                                 "validate_and_count"}
    assert dag.get_task("preflight").upstream_task_ids == {"plan"}
    assert dag.get_task("generate").upstream_task_ids == {"preflight"}
    # issue 40: near-duplicates beside generation (prompts only); missing digests mapped over workers
    assert dag.get_task("near_duplicates").upstream_task_ids == {"plan"}
    assert dag.get_task("digest_parts").upstream_task_ids == {"generate", "digest_shards"}
    assert dag.get_task("digest_parts").trigger_rule == "all_done"
    assert dag.get_task("validate_and_count").upstream_task_ids == {"generate", "digest_parts", "near_duplicates"}
    assert dag.get_task("validate_and_count").trigger_rule == "all_done"
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    assert isinstance(dag.get_task("generate"), MappedOperator), "one mapped task per server"


def test_tags_and_retries(dagbag) -> None:
    dag = dagbag.dags["dflash_generate"]
    assert {"dflash", "sglang"} <= set(dag.tags)
    for task in dag.tasks:
        assert task.retries >= 1, f"{task.task_id} has no retries"


def test_params_are_the_interface(dagbag) -> None:
    from dflash_pipeline.config import PARAM_SCHEMAS

    dag = dagbag.dags["dflash_generate"]
    assert set(dag.params.keys()) == set(PARAM_SCHEMAS)
    for name in dag.params.keys():
        param = dag.params.get_param(name)
        assert param.description, f"param {name} has no description"
        assert param.schema.get("type"), f"param {name} has no type"
    assert dag.params.get_param("max_tokens").value == 4096


@pytest.mark.parametrize("conf", [
    {"sampling_extra": {"top_kk": 20}},
    {"sampling_ladder": [{"temperature": 0.6}, {"temprature": 1.0}]},
    {"regenerate": "every_turn"},
    {"retry_failed_rows": "some"},
])
def test_what_a_schema_can_say_is_refused_at_trigger(dagbag, conf) -> None:
    """Issue 41: a misspelt sampling key or a value outside an enumeration is refused by the params' schema,
    so at trigger (UI, CLI, REST), not later at plan."""
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.exceptions import ParamValidationError

    dag = dagbag.dags["dflash_generate"]
    base = {"prompts_uri": "s3://b/p.jsonl", "output_uri": "s3://b/ds", "servers": ["http://127.0.0.1:1"]}
    def with_conf(c: dict) -> ParamsDict:
        params = copy.deepcopy(dag.params)
        for key, value in c.items():
            params[key] = value  # ParamsDict sets the value of the key's Param, as a trigger does
        return params

    with_conf(base).validate()  # the base conf is fine
    with pytest.raises(ParamValidationError):
        with_conf({**base, **conf}).validate()


def test_eval_shape_params_tags_retries(dagbag) -> None:
    """dflash_eval: prepare -> evaluate (mapped over servers) -> report (all_done, the dflash_eval outlet);
    every param documented and typed; manual trigger only."""
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    from dflash_pipeline.config import EVAL_PARAM_SCHEMAS

    dag = dagbag.dags["dflash_eval"]
    assert dag.schedule is None or str(dag.timetable.summary) in ("None", "Never, external triggers only")
    assert set(dag.task_ids) == {"prepare", "evaluate", "report"}
    assert dag.get_task("evaluate").upstream_task_ids == {"prepare"}
    assert dag.get_task("report").upstream_task_ids == {"prepare", "evaluate"}
    assert dag.get_task("report").trigger_rule == "all_done"
    assert isinstance(dag.get_task("evaluate"), MappedOperator), "one mapped task per server"
    assert [o.name for o in dag.get_task("report").outlets] == ["dflash_eval"]
    assert {"dflash", "eval"} <= set(dag.tags)
    for task in dag.tasks:
        assert task.retries >= 1, f"{task.task_id} has no retries"
    assert set(dag.params.keys()) == set(EVAL_PARAM_SCHEMAS)
    for name in dag.params.keys():
        param = dag.params.get_param(name)
        assert param.description and param.schema.get("type"), name
    assert dag.params.get_param("concurrency").value == [1, "production"]
    assert dag.params.get_param("greedy").value is True


def test_train_shape_params_asset_retries(dagbag) -> None:
    """dflash_train: check -> (local jobs -> train_local mapped | pod specs -> train_pod, a mapped
    KubernetesPodOperator run inside the task) -> card (none_failed: one backend's branch is skipped), the dflash_drafter outlet;
    scheduled on dflash_tokenized; every param documented and typed."""
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    from dflash_pipeline.config import TRAIN_PARAM_SCHEMAS

    dag = dagbag.dags["dflash_train"]
    assert set(dag.task_ids) == {"check", "local_jobs", "pod_specs", "train_local", "train_pod", "card"}
    assert dag.get_task("train_local").upstream_task_ids == {"local_jobs"}
    assert dag.get_task("train_pod").upstream_task_ids == {"pod_specs"}
    assert dag.get_task("card").upstream_task_ids == {"check", "train_local", "train_pod"}
    assert dag.get_task("card").trigger_rule == "none_failed"
    assert isinstance(dag.get_task("train_pod"), MappedOperator)
    assert isinstance(dag.get_task("train_local"), MappedOperator)
    assert [a.name for a in dag.timetable.asset_condition.objects] == ["dflash_tokenized"]
    assert [o.name for o in dag.get_task("card").outlets] == ["dflash_drafter"]
    assert set(dag.params.keys()) == set(TRAIN_PARAM_SCHEMAS)
    for name in dag.params.keys():
        param = dag.params.get_param(name)
        assert param.description and param.schema.get("type"), name
    assert dag.params.get_param("backend").schema["enum"] == ["local", "kubernetes"]
    for task in dag.tasks:
        assert task.retries >= 1, f"{task.task_id} has no retries"


@pytest.mark.parametrize("dag_module", ["dflash_generate", "dflash_tokenize", "dflash_eval", "dflash_train"])
def test_parse_time_does_no_io_and_reads_no_connections(dag_module: str) -> None:
    """Parse the DAG in a fresh interpreter where sockets, connections and variables all explode."""
    probe = textwrap.dedent(
        f"""
        import socket, sys
        def boom(*a, **k):
            raise RuntimeError("network I/O at DAG parse time")
        socket.socket.connect = boom
        socket.create_connection = boom
        socket.getaddrinfo = boom
        import airflow.sdk
        from airflow.sdk import BaseHook, Connection, Variable
        def no_conn(*a, **k):
            raise RuntimeError("connection/variable read at DAG parse time")
        BaseHook.get_connection = staticmethod(no_conn)
        Connection.get = staticmethod(no_conn)
        Variable.get = staticmethod(no_conn)
        before = set(sys.modules)
        sys.path.insert(0, {str(DAGS)!r})
        import {dag_module}
        heavy = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in
                       ("boto3", "botocore", "requests", "pandas", "pyarrow", "tokenizers"))
        print("HEAVY", heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HEAVY []" in out.stdout, f"heavy imports at parse time: {out.stdout}"
