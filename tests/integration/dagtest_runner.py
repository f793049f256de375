"""Run `dag.test()` for a list of confs in a fresh interpreter with its own AIRFLOW_HOME.

Used by the integration tests: each call gets a clean, migrated SQLite metadata DB, and the
environment (AWS connection pointing at the test's S3 server) is set before Airflow is imported.
Prints one JSON line per run: {"state", "tasks": [[task_id, map_index, state], ...], "error"}.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def open_bag(dags_folder: Path) -> Any:
    """A migrated metadata DB and the DagBag of `dags_folder` (Airflow imported only now)."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils import db

    db.initdb()
    return DagBag(dag_folder=str(dags_folder))


def run_confs(dag: Any, confs: list[dict[str, Any]], extra: Callable[[Any], dict[str, Any]] | None = None) -> None:
    """`dag.test()` each conf and print its RESULT line (`extra(dag_run)` adds keys to it)."""
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
            if extra is not None:
                out.update(extra(dr))
        sys.stdout.write("RESULT " + json.dumps(out) + "\n")
        sys.stdout.flush()


def main() -> int:
    run_confs(open_bag(Path(sys.argv[1])).get_dag("dflash_generate"), json.loads(sys.argv[2]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
