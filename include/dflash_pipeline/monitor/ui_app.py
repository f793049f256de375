"""The FastAPI app behind the Airflow UI plugin (`plugins/dflash_progress.py` mounts it).

Auth is Airflow's own: every route depends on `requires_access_dag` from
`airflow.api_fastapi.core_api.security`, which takes the user from the `Authorization: Bearer`
header or the UI's `_token` cookie (so the page works inside the UI's iframe) and asks the auth
manager whether that user may read the DAG's runs. No user, no page: 401 (403 without the right).

The run's conf (from Airflow's DB) names `output_uri` and `aws_conn_id`; everything else is read
from S3 through the S3Hook with that connection: the manifest, the committed parts (listed, never
read), the workers' progress objects, the report and its plots. This module imports Airflow's API
server modules at import, so only the API server imports it (the plugin builds the app on first
request).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import requires_access_dag
from airflow.models.dagrun import DagRun
from airflow.models.taskinstance import TaskInstance
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from sqlalchemy import select

from dflash_pipeline.dataset.layout import DatasetLayout, UriError, chunk_of_key
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.monitor import ui
from dflash_pipeline.monitor.fleet import aggregate
from dflash_pipeline.monitor.failures import read_failures
from dflash_pipeline.monitor.livequality import live_view, merge_groups

logger = logging.getLogger(__name__)

URL_PREFIX = "/dflash"
DEFAULT_DAG_ID = "dflash_generate"
EVAL_DAG_ID = "dflash_eval"
REFRESH_S = 10
_PLOT_RE = re.compile(r"^report-[a-z0-9][a-z0-9-]{0,80}\.png$")
_CLIENT_TTL_S = 300.0
_clients: dict[str, tuple[float, Any]] = {}
_clients_lock = threading.Lock()


# ----------------------------------------------------------------------------------- S3 reading


def _s3_client(aws_conn_id: str) -> Any:
    """A boto3 client from the Airflow connection, reused for a few minutes (creating one is slow)."""
    now = time.monotonic()
    with _clients_lock:
        hit = _clients.get(aws_conn_id)
        if hit is not None and now - hit[0] < _CLIENT_TTL_S:
            return hit[1]
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    client = S3Hook(aws_conn_id=aws_conn_id).get_conn()
    with _clients_lock:
        _clients[aws_conn_id] = (now, client)
    return client


def _json(store: Store, key: str) -> dict[str, Any] | None:
    got = store.get(key)
    return None if got is None else json.loads(got[0])


def server_abilities_rows(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per server of the manifest: its preflight abilities (serving/abilities.py), or why
    there are none (unreachable at preflight, or a manifest from before abilities were recorded)."""
    rows = []
    for entry in manifest.get("servers") or []:
        row = {"server": entry.get("name"), **(entry.get("abilities") or {})}
        if not entry.get("abilities"):
            row["note"] = (f"unreachable at preflight: {entry['unreachable']}" if entry.get("unreachable")
                           else "not recorded by this preflight")
        rows.append(row)
    return rows


def collect(store: Store, layout: DatasetLayout, run_id: str, *, run_started_at: float | None,
            task_states: Mapping[str, str], now: float) -> dict[str, Any]:
    """Everything the page shows that lives in S3, already aggregated."""
    out: dict[str, Any] = {"progress": None, "report": None, "plots": [], "warnings": [], "abilities": []}
    manifest = _json(store, layout.manifest_key)
    if manifest is not None:
        out["abilities"] = server_abilities_rows(manifest)
        exact_warning = ((manifest.get("runs") or {}).get(run_id) or {}).get("token_exact_warning")
        if exact_warning:
            out["warnings"].append(exact_warning)
    prefix = layout.run_key(run_id, "progress/")
    docs: list[dict[str, Any]] = []
    for obj in store.list(prefix):
        if not obj.key.endswith(".json"):
            continue
        try:
            doc = _json(store, obj.key)
        except ValueError:
            out["warnings"].append(f"unreadable progress object {obj.key}")
            continue
        if doc is not None:
            docs.append(doc)
    if manifest is not None:
        committed: dict[int, float] = {}
        for obj in store.list(layout.completions_prefix):
            c = chunk_of_key(obj.key, layout.completions_prefix)
            if c is not None:
                committed[c] = obj.last_modified.timestamp()
        out["progress"] = aggregate(manifest, committed, docs, now=now, run_started_at=run_started_at,
                                    task_states=task_states)
    out["live_quality"] = live_quality(store, layout, run_id)
    report = _json(store, layout.report_key)
    if report is not None:
        out["report"] = report
        names = [k.rsplit("/", 1)[-1] for k in (report.get("files") or {}).get("plots") or []]
        if not names:
            names = [o.key.rsplit("/", 1)[-1] for o in store.list(f"{layout.root}/report-")]
        out["plots"] = sorted(n for n in names if _PLOT_RE.match(n))
    return out


def live_quality(store: Store, layout: DatasetLayout, run_id: str) -> dict[str, Any] | None:
    """The generate tasks' live quality figures of this run (steps/quality/live.py), merged; None before any."""
    docs = []
    for obj in store.list(layout.run_key(run_id, "quality/")):
        try:
            doc = _json(store, obj.key)
        except ValueError:
            continue
        if doc is not None:
            docs.append(doc)
    if not docs:
        return None
    return live_view(merge_groups(docs)) | {"parts": sum(int(d.get("parts") or 0) for d in docs)}


def tokenize_datasets(session: Any, dag_id: str, run_id: str, conf: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What a dflash_tokenize run tokenized: its prepare task's plan (XCom), else the output_uri param."""
    from airflow.models.xcom import XComModel

    value = session.scalar(select(XComModel.value).where(
        XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.task_id == "prepare",
        XComModel.key == "return_value"))
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    found: dict[tuple[str, str | None], dict[str, Any]] = {}
    for assignment in value if isinstance(value, list) else []:
        for d in (assignment or {}).get("datasets") or []:
            found.setdefault((d.get("output_uri"), d.get("tokenization")), d)
    if not found and conf.get("output_uri"):
        found[(conf["output_uri"], conf.get("tokenization"))] = {"output_uri": conf["output_uri"],
                                                                 "tokenization": conf.get("tokenization")}
    return list(found.values())


def tokenize_reports(store_for: Any, datasets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tokenized dataset's report (its drops by reason), or why it is not there."""
    out = []
    for d in datasets:
        entry: dict[str, Any] = {"output_uri": d.get("output_uri"), "tokenization": d.get("tokenization"),
                                 "report": None, "error": None}
        try:
            layout = DatasetLayout.from_uri(str(d["output_uri"])).tokenized_as(d.get("tokenization"))
            entry["report"] = _json(store_for(layout.bucket), layout.tokenized_report_key)
            entry["report_key"] = layout.tokenized_report_key
        except Exception as exc:  # noqa: BLE001 - the page shows what it could not read
            entry["error"] = f"{type(exc).__name__}: {exc}"
        out.append(entry)
    return out


# ------------------------------------------------------------------------------------ Airflow DB


def _dag_run(session: Any, dag_id: str, run_id: str) -> Any:
    run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    if run is None:
        raise HTTPException(status_code=404, detail=f"no run {run_id!r} of DAG {dag_id!r}")
    return run


def _task_instances(session: Any, dag_id: str, run_id: str) -> list[dict[str, Any]]:
    rows = session.execute(
        select(TaskInstance.task_id, TaskInstance.map_index, TaskInstance.state, TaskInstance.try_number)
        .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
        .order_by(TaskInstance.task_id, TaskInstance.map_index)
    ).all()
    return [{"task_id": r[0], "map_index": int(r[1]), "state": r[2], "try_number": int(r[3] or 0)} for r in rows]


def _ts(dt: Any) -> float | None:
    return None if dt is None else dt.timestamp()


_DATASET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}/[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _eval_datasets(store: Store, layout: DatasetLayout, run_id: str) -> list[str]:
    """A dflash_eval run's (group, condition) datasets, from the `runs/<run_id>/eval.json` prepare wrote."""
    doc = _json(store, layout.run_key(run_id, "eval.json")) or {}
    groups = [g.get("name") for g in (doc.get("config") or {}).get("groups") or []]
    return [f"{g}/{c.get('name')}" for g in groups for c in doc.get("conditions") or []]


def run_view(session: Any, dag_id: str, run_id: str, base: str, dataset: str | None = None) -> dict[str, Any]:
    """The data of one run's page (also what the JSON endpoint returns). `dataset` (a dflash_eval run's
    `<group>/<condition>`) shows that generate dataset under the run's output_uri instead of the root."""
    run = _dag_run(session, dag_id, run_id)
    conf = dict(run.conf or {})
    tasks = _task_instances(session, dag_id, run_id)
    now = time.time()
    run_base = f"{base}/runs/{ui.quote_id(dag_id)}/{ui.quote_id(run_id)}"
    if dataset is not None and not _DATASET_RE.match(dataset):
        raise HTTPException(status_code=404, detail="no such dataset")
    view: dict[str, Any] = {
        "dag_id": dag_id,
        "run_id": run_id,
        "run_state": str(run.state) if run.state is not None else None,
        "run_started_at": _ts(run.start_date),
        "run_ended_at": _ts(run.end_date),
        "output_uri": conf.get("output_uri"),
        "aws_conn_id": conf.get("aws_conn_id") or "aws_default",
        "tasks": tasks,
        "now": now,
        "refresh_s": REFRESH_S,
        "progress": None,
        "report": None,
        "plot_urls": [],
        "report_md_url": None,
        "report_url": None,
        "warnings": [],
        "links": [("Airflow run", f"/dags/{ui.quote_id(dag_id)}/runs/{ui.quote_id(run_id)}"),
                  ("all runs", f"{base}/"), ("JSON", f"{base}/api/runs/{ui.quote_id(dag_id)}/{ui.quote_id(run_id)}")],
    }
    if dag_id == "dflash_tokenize" or {t["task_id"] for t in tasks} >= {"prepare", "tokenize", "report"}:
        view["tokenize"] = tokenize_reports(lambda bucket: Store(_s3_client(str(view["aws_conn_id"])), bucket),
                                            tokenize_datasets(session, dag_id, run_id, conf))
        view["report_missing_final"] = True
        return view
    if not view["output_uri"]:
        view["warnings"].append("This run's conf has no output_uri: not a dflash_generate run.")
        view["report_missing_final"] = True
        return view
    try:
        root = DatasetLayout.from_uri(str(view["output_uri"]))
        layout = DatasetLayout.from_uri(f"{root.uri}/{dataset}") if dataset else root
    except UriError as exc:
        view["warnings"].append(str(exc))
        return view
    # dflash_eval's mapped tasks are numbered over all groups, its workers within a group: no states then
    task_states = {f"w{t['map_index']:04d}": t["state"] for t in tasks if t["task_id"] == "generate"}
    if dag_id == EVAL_DAG_ID or any(t["task_id"] == "evaluate" for t in tasks):
        view.update(kind="eval", eval_dataset=dataset, run_base=run_base)
    try:
        store = Store(_s3_client(str(view["aws_conn_id"])), layout.bucket)
        if dataset is None and view.get("kind") == "eval":
            view["datasets"] = _eval_datasets(store, root, run_id)
            view["links"] += [(d, f"{run_base}?dataset={d}") for d in view["datasets"]]
        if dataset is not None:
            view["output_uri"] = layout.uri
        data = collect(store, layout, run_id, run_started_at=view["run_started_at"], task_states=task_states, now=now)
    except Exception as exc:  # noqa: BLE001 - the page shows what it could not read
        logger.warning("dflash page: reading %s failed: %s", layout.uri, exc)
        view["warnings"].append(f"could not read {layout.uri} with connection {view['aws_conn_id']!r}: "
                                f"{type(exc).__name__}: {exc}")
        return view
    view["failures"] = _failures(store, root, run_id)
    view["progress"] = data["progress"]
    view["live_quality"] = data.get("live_quality")
    view["abilities"] = data["abilities"]
    view["report"] = data["report"]
    view["warnings"] += data["warnings"]
    if data["report"] is not None:
        view["plot_urls"] = [(n, f"{run_base}/plots/{n}") for n in data["plots"]]
        view["report_md_url"] = f"{run_base}/report.md"
        view["report_url"] = f"{run_base}/report"
    # A finished run whose validation never wrote a report: stop refreshing anyway.
    validate_states = [t["state"] for t in tasks if t["task_id"] == "validate_and_count"]
    view["report_missing_final"] = bool(validate_states) and validate_states[0] in ("failed", "upstream_failed")
    return view


def _failures(store: Store, root: DatasetLayout, run_id: str) -> list[dict[str, Any]]:
    """The failed tries' reasons (monitor/failures.py); [] when they cannot be read (the page still shows)."""
    try:
        return read_failures(store, root, run_id)
    except Exception as exc:  # noqa: BLE001 - the page shows the rest
        logger.warning("dflash page: reading the failures of %s failed: %s", run_id, exc)
        return []


def _read_run_object(session: Any, dag_id: str, run_id: str, name: str) -> tuple[bytes, str]:
    run = _dag_run(session, dag_id, run_id)
    conf = dict(run.conf or {})
    if not conf.get("output_uri"):
        raise HTTPException(status_code=404, detail="not a dflash_generate run")
    layout = DatasetLayout.from_uri(str(conf["output_uri"]))
    store = Store(_s3_client(str(conf.get("aws_conn_id") or "aws_default")), layout.bucket)
    key = f"{layout.root}/{name}"
    got = store.get(key)
    if got is None:
        raise HTTPException(status_code=404, detail=f"s3://{layout.bucket}/{key} does not exist")
    return got[0], key


# -------------------------------------------------------------------------------------------- app


def create_app(url_prefix: str = URL_PREFIX) -> FastAPI:
    """The plugin's app; every route requires read access to the DAG's runs."""
    can_read_runs = Depends(requires_access_dag("GET", DagAccessEntity.RUN))
    can_read_default = Depends(requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=DEFAULT_DAG_ID))
    app = FastAPI(title="dflash progress", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        """Browsers get a short page with a link to Airflow's login; API clients get JSON."""
        if "text/html" in request.headers.get("accept", "") and exc.status_code in (401, 403, 404):
            link = None
            if exc.status_code == 401:
                from airflow.api_fastapi.app import get_auth_manager

                link = (get_auth_manager().get_url_login(next_url=str(request.url)), "Log in to Airflow")
            body = ui.message_page(f"{exc.status_code}: {exc.detail}", "This page needs an Airflow login "
                                   "with read access to the DAG's runs." if exc.status_code != 404 else "", link=link)
            return HTMLResponse(body, status_code=exc.status_code, headers=exc.headers)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.get("/", response_class=HTMLResponse, dependencies=[can_read_default])
    def index(session: SessionDep) -> HTMLResponse:
        runs = session.scalars(select(DagRun).where(DagRun.dag_id == DEFAULT_DAG_ID)
                               .order_by(DagRun.id.desc()).limit(50)).all()
        items = [{"run_id": r.run_id, "state": str(r.state), "start": _ts(r.start_date),
                  "output_uri": (r.conf or {}).get("output_uri")} for r in runs]
        return HTMLResponse(ui.index_page(
            DEFAULT_DAG_ID, items,
            lambda rid: f"{url_prefix}/runs/{ui.quote_id(DEFAULT_DAG_ID)}/{ui.quote_id(rid)}"))

    @app.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse, dependencies=[can_read_runs])
    def run_page(dag_id: str, run_id: str, session: SessionDep, fragment: int = 0,
                 dataset: str | None = None) -> HTMLResponse:
        view = run_view(session, dag_id, run_id, url_prefix, dataset)
        body = ui.run_main(view) if fragment else ui.run_page(view)
        return HTMLResponse(body, headers={"Cache-Control": "no-store"})

    @app.get("/api/runs/{dag_id}/{run_id}", dependencies=[can_read_runs])
    def run_json(dag_id: str, run_id: str, session: SessionDep, dataset: str | None = None) -> JSONResponse:
        view = run_view(session, dag_id, run_id, url_prefix, dataset)
        view["links"] = [{"title": t, "href": u} for t, u in view["links"]]
        view["plot_urls"] = [{"name": n, "href": u} for n, u in view["plot_urls"]]
        return JSONResponse(json.loads(ui.to_json(view)), headers={"Cache-Control": "no-store"})

    @app.get("/runs/{dag_id}/{run_id}/plots/{name}", dependencies=[can_read_runs])
    def plot(dag_id: str, run_id: str, name: str, session: SessionDep) -> Response:
        if not _PLOT_RE.match(name):
            raise HTTPException(status_code=404, detail="no such plot")
        data, _ = _read_run_object(session, dag_id, run_id, name)
        return Response(data, media_type="image/png", headers={"Cache-Control": "private, max-age=60"})

    @app.get("/runs/{dag_id}/{run_id}/report", response_class=HTMLResponse, dependencies=[can_read_runs])
    def report_html(dag_id: str, run_id: str, session: SessionDep) -> HTMLResponse:
        """report.md rendered (the page's "full report" link); the raw Markdown stays at report.md."""
        data, _ = _read_run_object(session, dag_id, run_id, "report.md")
        run_base = f"{url_prefix}/runs/{ui.quote_id(dag_id)}/{ui.quote_id(run_id)}"
        body = ui.report_page(f"report \u00b7 {run_id}", data.decode("utf-8", errors="replace"),
                              [("back to the run", run_base), ("report.md (Markdown source)", f"{run_base}/report.md")])
        return HTMLResponse(body, headers={"Cache-Control": "no-store"})

    @app.get("/runs/{dag_id}/{run_id}/report.md", dependencies=[can_read_runs])
    def report_md(dag_id: str, run_id: str, session: SessionDep) -> PlainTextResponse:
        data, _ = _read_run_object(session, dag_id, run_id, "report.md")
        return PlainTextResponse(data.decode("utf-8", errors="replace"), media_type="text/markdown; charset=utf-8")

    return app
