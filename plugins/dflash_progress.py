"""Airflow UI plugin: a live progress / report page for dflash_generate runs.

Wiring only; the app is `dflash_pipeline.monitor.ui_app`, the HTML `dflash_pipeline.monitor.ui`, the arithmetic
`dflash_pipeline.monitor.progress`. Every Airflow component imports plugins, so the FastAPI app (which
imports the API server's security modules) is built on its first request, in the API server only.

- `/dflash/runs/{dag_id}/{run_id}`: the page (a "DFlash progress" tab on every DAG run)
- `/dflash/`: recent dflash_generate runs (a "DFlash runs" entry in the Browse menu)
- `/dflash/api/runs/{dag_id}/{run_id}`: the same data as JSON
"""

from __future__ import annotations

import threading
from typing import Any

from airflow.plugins_manager import AirflowPlugin

URL_PREFIX = "/dflash"


class _LazyApp:
    """An ASGI app that builds the real one on first use."""

    def __init__(self) -> None:
        self._app: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        if self._app is None:
            with self._lock:
                if self._app is None:
                    from dflash_pipeline.monitor.ui_app import create_app

                    self._app = create_app(URL_PREFIX)
        return self._app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._get()(scope, receive, send)

    def __repr__(self) -> str:
        return "dflash_pipeline.monitor.ui_app:create_app (built on first request)"


class DflashProgressPlugin(AirflowPlugin):
    name = "dflash_progress"
    fastapi_apps = [{"app": _LazyApp(), "url_prefix": URL_PREFIX, "name": "DFlash progress"}]
    external_views = [
        {
            "name": "DFlash progress",
            "href": URL_PREFIX + "/runs/{DAG_ID}/{RUN_ID}",
            "destination": "dag_run",
            "url_route": "dflash-progress",
        },
        {
            "name": "DFlash runs",
            "href": URL_PREFIX + "/",
            "destination": "nav",
            "category": "browse",
            "url_route": "dflash-runs",
        },
    ]
