"""dag.test() runs of dflash_generate, then the asset hand-off, all in one fresh interpreter.

Like dagtest_runner.py (one RESULT line per run, same fields plus "validate_xcom"), then:
* one ASSETS line: the asset events the runs emitted (source run, extra) and the DAGs queued on the
  asset (AssetDagRunQueue), read from the metadata DB;
* one CONSUMER line: the scheduler's own step that turns the queue into an asset-triggered run of
  dflash_tokenize (SchedulerJobRunner._create_dag_runs_asset_triggered), that run executed in-process
  the way dag.test() runs tasks, its state, task states and the report task's XCom (the tokenized datasets).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dagtest_runner import open_bag, run_confs  # this folder is sys.path[0]: run as a script

CONSUMER = "dflash_tokenize"


def _xcom(dag_id: str, run_id: str, task_id: str) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        value = session.scalar(
            select(XComModel.value).where(
                XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.task_id == task_id,
                XComModel.key == "return_value", XComModel.map_index == -1,
            )
        )
    return None if value is None else XComModel.deserialize_value(type("X", (), {"value": value})())


def _assets() -> dict[str, Any]:
    from airflow.models.asset import AssetDagRunQueue, AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from dflash_pipeline.steps.handoff import ASSET_NAME

    with create_session() as session:
        asset = session.scalar(select(AssetModel).where(AssetModel.name == ASSET_NAME))
        events = session.scalars(select(AssetEvent).where(AssetEvent.asset_id == asset.id).order_by(AssetEvent.id)).all()
        queued = session.scalars(select(AssetDagRunQueue.target_dag_id).where(AssetDagRunQueue.asset_id == asset.id)).all()
        return {
            "uri": asset.uri,
            "events": [{"source_dag_id": e.source_dag_id, "source_run_id": e.source_run_id, "extra": e.extra} for e in events],
            "queued_dag_ids": sorted(queued),
        }


def _run_consumer(dag: Any) -> dict[str, Any]:
    """Create the asset-triggered run as the scheduler does, then run its tasks like dag.test()."""
    from airflow.jobs.job import Job
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.models.dag import DagModel
    from airflow.models.dagrun import DagRun
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from sqlalchemy import select

    with create_session() as session:
        runner = SchedulerJobRunner(job=Job())
        dag_model = session.scalar(select(DagModel).where(DagModel.dag_id == CONSUMER))
        runner._create_dag_runs_asset_triggered(dag_models=[dag_model], session=session)
    with create_session() as session:
        dr = session.scalar(select(DagRun).where(DagRun.dag_id == CONSUMER))
        if dr is None:
            return {"state": None, "error": "the scheduler created no run"}
        consumed = [{"source_run_id": e.source_run_id, "extra": e.extra} for e in dr.consumed_asset_events]
        dr.dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))  # as dag.test() does
        dr.state = DagRunState.RUNNING
        session.commit()
        while dr.state == DagRunState.RUNNING:
            session.expire_all()
            schedulable, _ = dr.update_state(session=session)
            for ti in schedulable:
                ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
            session.commit()
            for ti in [t for t in dr.get_task_instances(session=session) if t.state == TaskInstanceState.SCHEDULED]:
                _run_task(ti=ti, task=dag.task_dict[ti.task_id])
        run_id, state = dr.run_id, str(dr.state)
        tasks = sorted((t.task_id, t.map_index, str(t.state)) for t in dr.get_task_instances(session=session))
        run_type = str(dr.run_type)
    return {"state": state, "run_id": run_id, "run_type": run_type, "consumed_events": consumed,
            "report": _xcom(CONSUMER, run_id, "report"),
            "tasks": tasks}


def main() -> int:
    bag = open_bag(Path(sys.argv[1]))
    run_confs(bag.get_dag("dflash_generate"), json.loads(sys.argv[2]),
              extra=lambda dr: {"validate_xcom": _xcom("dflash_generate", dr.run_id, "validate_and_count")})
    sys.stdout.write("ASSETS " + json.dumps(_assets(), default=str) + "\n")
    sys.stdout.flush()
    sys.stdout.write("CONSUMER " + json.dumps(_run_consumer(bag.get_dag(CONSUMER)), default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
