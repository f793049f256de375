"""dag.test() runs of dflash_eval in a fresh interpreter with its own AIRFLOW_HOME (as dagtest_runner.py
does for dflash_generate): one RESULT line per conf ({"state", "run_id", "tasks", "error", "report_xcom"}),
then one ASSETS line with the dflash_eval asset's events (source run, extra), read from the metadata DB.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _events() -> list[dict[str, Any]]:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from dflash_pipeline.steps.handoff import EVAL_ASSET_NAME

    with create_session() as session:
        asset = session.scalar(select(AssetModel).where(AssetModel.name == EVAL_ASSET_NAME))
        if asset is None:
            return []
        events = session.scalars(select(AssetEvent).where(AssetEvent.asset_id == asset.id).order_by(AssetEvent.id)).all()
        return [{"source_dag_id": e.source_dag_id, "source_run_id": e.source_run_id, "extra": e.extra} for e in events]


def main() -> int:
    dags_folder = Path(sys.argv[1])
    confs = json.loads(sys.argv[2])
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils import db

    db.initdb()
    dag = DagBag(dag_folder=str(dags_folder)).get_dag("dflash_eval")
    for conf in confs:
        out: dict[str, object] = {"state": None, "tasks": [], "error": None}
        try:
            dr = dag.test(run_conf=conf)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["error"] = f"{type(exc).__name__}: {exc}"
        else:
            out["state"] = str(dr.state)
            out["run_id"] = dr.run_id
            out["tasks"] = sorted([ti.task_id, ti.map_index, str(ti.state)] for ti in dr.get_task_instances())
        sys.stdout.write("RESULT " + json.dumps(out) + "\n")
        sys.stdout.flush()
    sys.stdout.write("ASSETS " + json.dumps(_events()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
