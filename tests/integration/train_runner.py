"""dag.test() runs of dflash_train in a fresh interpreter with its own AIRFLOW_HOME (as eval_runner.py does
for dflash_eval): one RESULT line per conf, then one ASSETS line with the dflash_drafter asset's events."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dagtest_runner import open_bag, run_confs  # this folder is sys.path[0]: run as a script


def _events() -> list[dict[str, Any]]:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from dflash_pipeline.steps.handoff import DRAFTER_ASSET_NAME

    with create_session() as session:
        asset = session.scalar(select(AssetModel).where(AssetModel.name == DRAFTER_ASSET_NAME))
        if asset is None:
            return []
        events = session.scalars(select(AssetEvent).where(AssetEvent.asset_id == asset.id).order_by(AssetEvent.id)).all()
        return [{"source_run_id": e.source_run_id, "extra": e.extra} for e in events]


def main() -> int:
    run_confs(open_bag(Path(sys.argv[1])).get_dag("dflash_train"), json.loads(sys.argv[2]))
    sys.stdout.write("ASSETS " + json.dumps(_events()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
