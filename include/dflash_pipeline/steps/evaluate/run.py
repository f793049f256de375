"""One server's part of dflash_eval: its group's conditions in turn, each with the generate step's Worker.

Why per server and in turn: a group's servers share each condition's chunks exactly as generate's
tasks share a dataset's (claims in S3, hand-offs, exactly-once parts). A Worker returns only when
every chunk of its condition is committed (by any server of the group), so the group moves to the
next condition together: a server never runs two conditions at once, and its `/metrics` delta
around one condition holds only that condition's traffic (plus anyone else's: the report says so).

Owners: this function (the task's main thread) owns the loop and the scrapes; the Worker owns
everything during `run()` (worker.py). A SIGTERM asks the running Worker to stop (it saves and
releases within its grace) and the task fails; a retry resumes from S3: committed conditions are
skipped, the open one continues where its parts end. Each try writes its own metrics document
(`runs/<run_id>/metrics/<worker>-try<N>.json` under the condition's root), never overwriting
another try's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from dflash_pipeline.config import ConfigError
from dflash_pipeline.config.evaluate import EvalConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store, with_retries
from dflash_pipeline.serving.sglang import ServerSpec, check_health, new_session
from dflash_pipeline.steps.evaluate import metrics
from dflash_pipeline.steps.evaluate.prepare import condition_from_dict
from dflash_pipeline.steps.generate import ServerLost, Worker, WorkerSettings, settings_for
from dflash_pipeline.steps.generate.stopsignal import SignalStop

logger = logging.getLogger(__name__)

METRICS_FORMAT = "dflash-pipeline/eval-metrics/1"


def metrics_key(layout: DatasetLayout, run_id: str, worker: str, try_number: int) -> str:
    return layout.run_key(run_id, f"metrics/{worker}-try{try_number}.json")


def metrics_prefix(layout: DatasetLayout, run_id: str | None = None) -> str:
    return layout.run_key(run_id, "metrics/") if run_id else layout.key("runs/")


def wait_healthy(spec: ServerSpec, deadline_s: float, stop_after: Callable[[], bool] = lambda: False) -> None:
    session = new_session()
    start = time.monotonic()
    while not check_health(session, spec):
        waited = time.monotonic() - start
        if waited >= deadline_s or stop_after():
            raise ServerLost(f"server {spec.name} did not answer /health for {waited:.0f}s")
        logger.warning("server %s not healthy yet; waiting (%.0fs so far)", spec.name, waited)
        time.sleep(min(5.0, max(0.5, deadline_s / 10)))


def run_server(
    client: Any,
    cfg: EvalConfig,
    assignment: dict[str, Any],
    run_id: str,
    spec: ServerSpec,
    try_number: int = 1,
    progress_factory: Callable[[Store, str, WorkerSettings, int], Any] | None = None,
) -> dict[str, Any]:
    """Run every condition of `assignment` on `spec`; return a small summary per condition (XCom)."""
    group = cfg.group(assignment["group"])
    summaries: list[dict[str, Any]] = []
    session = new_session()
    for entry in assignment["conditions"]:
        cond = condition_from_dict(entry)
        rc = cfg.run_config(group, cond, assignment["prompts_uri"])
        layout = DatasetLayout.from_uri(rc.output_uri)
        store = Store(client, layout.bucket)
        got = with_retries(lambda: store.get(layout.manifest_key), what="manifest",
                           deadline_s=WorkerSettings.store_deadline_s)
        if got is None:
            raise ConfigError(f"{layout.uri}/manifest.json is missing; prepare did not run")
        manifest = json.loads(got[0])
        settings = settings_for(rc, run_id=run_id, map_index=int(assignment["index"]), server=spec,
                                server_info=entry["server_info"], try_number=try_number)
        on_progress = None
        if progress_factory is not None:
            on_progress = progress_factory(store, layout.progress_key(run_id, settings.worker), settings,
                                           len(group.servers))
        worker = Worker(store, layout, manifest, settings, on_progress=on_progress)
        if worker.all_done():
            logger.info("%s/%s is complete; nothing to do on %s", group.name, cond.name, spec.name)
            summaries.append({"condition": cond.name, "nothing_to_do": True})
            continue
        wait_healthy(spec, rc.server_lost_after_s)
        before = metrics.scrape(session, spec)
        started = time.time()
        with SignalStop(worker.request_stop):
            result = worker.run()
        ended = time.time()
        after = metrics.scrape(session, spec)
        doc = {
            "format": METRICS_FORMAT, "run_id": run_id, "server": spec.name, "worker": settings.worker,
            "try_number": try_number, "group": group.name, "condition": cond.name,
            "started": started, "ended": ended, "before": before, "after": after,
            "delta": metrics.delta(before, after),
            "completions": result.get("completions"), "errors": result.get("errors"),
            "output_tokens": result.get("output_tokens"),
        }
        key = metrics_key(layout, run_id, settings.worker, try_number)
        with_retries(lambda: store.put(key, json.dumps(doc, indent=1).encode(), content_type="application/json"),
                     what=f"write {key}")
        logger.info("%s/%s on %s: %s completions in %.1fs, /metrics delta %s", group.name, cond.name, spec.name,
                    result.get("completions"), ended - started, doc["delta"])
        summaries.append({"condition": cond.name, "completions": result.get("completions"),
                          "errors": result.get("errors"), "seconds": round(ended - started, 3),
                          "metrics_delta": doc["delta"]})
    return {"server": spec.name, "group": group.name, "conditions": summaries}
