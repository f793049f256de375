"""Why a task failed, where the run's page can show it (issue 41): without this, a failure's reason lived only
in the task's log, and the run's tab said "No plan yet" after a plan that refused the conf.

Each failed or up-for-retry try writes one object, `runs/<run_id>/failures/<task>[-<map index>]-try<N>.json`
(deterministic key: a callback run twice writes the same document), holding the exception's class and
message (never its traceback: the message is what says what to change). Written by the task's own failure
callback (tasks.on_task_failure), best effort: a failure to record a failure is logged and dropped, never
raised, so it cannot mask the task's own error. Read by the run's page (monitor/ui_app.py)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store, with_retries

logger = logging.getLogger(__name__)

MESSAGE_CHARS = 4000
"""A message longer than this is cut (a task log holds the rest)."""


def failure_doc(task_id: str, map_index: int, try_number: int, state: str, exc: BaseException | None) -> dict[str, Any]:
    """The record: the exception's class and message as people should read them (a wrapped exception, e.g.
    AirflowFailException from a ConfigError, shows the message it carries)."""
    message = str(exc) if exc is not None else "the task failed without an exception (killed, or timed out)"
    return {"task_id": task_id, "map_index": map_index, "try_number": try_number, "state": state,
            "error_class": type(exc).__name__ if exc is not None else None,
            "message": message[:MESSAGE_CHARS], "at": time.time()}


def record_failure(store: Store, layout: DatasetLayout, run_id: str, doc: Mapping[str, Any],
                   deadline_s: float = 15.0) -> None:
    """Write `doc` (failure_doc) under the run; never raises."""
    key = layout.failure_key(run_id, str(doc["task_id"]), int(doc["map_index"]), int(doc["try_number"]))
    try:
        with_retries(lambda: store.put(key, json.dumps(doc).encode(), content_type="application/json"),
                     what="failure record", deadline_s=deadline_s)
    except Exception as exc:  # noqa: BLE001 - must not hide the task's own failure
        logger.warning("could not record the failure of %s at %s: %r", doc.get("task_id"), key, exc)


def read_failures(store: Store, layout: DatasetLayout, run_id: str) -> list[dict[str, Any]]:
    """Each task's latest recorded try, failed ones first, then by task."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for obj in store.list(layout.run_key(run_id, "failures/")):
        got = store.get(obj.key)
        if got is None:
            continue
        try:
            doc = json.loads(got[0])
        except ValueError:
            continue
        key = (str(doc.get("task_id")), int(doc.get("map_index", -1)))
        if key not in latest or int(doc.get("try_number", 0)) > int(latest[key].get("try_number", 0)):
            latest[key] = doc
    return sorted(latest.values(), key=lambda d: (d.get("state") != "failed", d["task_id"], d.get("map_index", -1)))
