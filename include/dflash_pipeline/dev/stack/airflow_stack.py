"""Airflow 3 as real processes: api-server, scheduler, dag-processor, triggerer (LocalExecutor on SQLite),
or the Celery shape (PostgreSQL + Redis + named workers), driven through the CLI and the REST API.

The admin password and the JWT secret are never logged: read :attr:`AirflowStack.password` if you must show it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import requests

from dflash_pipeline.dev.stack.procs import (
    LOOPBACK,
    StackError,
    airflow_straggler,
    describe,
    free_port,
    group_members,
    is_live,
    process_memory,
    process_tree,
    signal_group,
    spawn,
    stop_process_groups,
    tail,
    venv_bin,
)
from dflash_pipeline.dev.stack.services import WORKER_NAME_ENV, CeleryConfig

log = logging.getLogger(__name__)

ADMIN_USER = "admin"
TERMINAL_RUN_STATES = frozenset({"success", "failed"})
StackMode = Literal["standalone", "components"]
Executor = Literal["local", "celery"]
#: The Airflow components started one by one in "components" mode.
COMPONENTS: tuple[str, ...] = ("api-server", "scheduler", "dag-processor", "triggerer")
#: The components of a Celery stack besides its workers (no deferrable operators here: no triggerer).
CELERY_COMPONENTS: tuple[str, ...] = ("api-server", "scheduler", "dag-processor")



@dataclass(frozen=True)
class TaskInstanceInfo:
    """One task instance of a run, from ``GET /api/v2/dags/{dag}/dagRuns/{run}/taskInstances``."""

    task_id: str
    map_index: int  # -1 for an unmapped task
    state: str | None  # None before the scheduler has looked at it
    try_number: int
    hostname: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_rest(cls, item: Mapping[str, Any]) -> TaskInstanceInfo:
        return cls(
            task_id=str(item["task_id"]),
            map_index=int(item.get("map_index", -1)),
            state=item.get("state"),
            try_number=int(item.get("try_number") or 0),
            hostname=item.get("hostname") or None,
            raw=dict(item),
        )


class AirflowStack:
    """A private Airflow 3 deployment on loopback.

    ``home`` becomes ``AIRFLOW_HOME`` (SQLite DB, logs, component logs under ``home/stack-logs``).
    ``extra_dag_folders`` maps bundle names to more local folders parsed as DAG bundles beside the
    default ``dags-folder`` bundle (``dags_folder``); the tests use one for throw-away DAGs.
    ``env_extra`` is added last to the components' environment (AIRFLOW__*, AIRFLOW_CONN_*, ...).
    Inherited ``AIRFLOW__*``/``AIRFLOW_CONN_*``/``AIRFLOW_VAR_*`` variables are dropped so the stack is
    hermetic. ``mode`` "components" (default) runs ``airflow db migrate`` then the four components
    as separate processes, one log file each; "standalone" runs ``airflow standalone``. Measured on
    2 cores: components ready in ~10.5 s and stopped in 3-9 s; standalone ready in 10-18 s, often
    needing SIGKILL after 20 s to stop, and ~70 MB more PSS (~1.0 GB PSS, 1.7 GB RSS idle).

    :meth:`start` returns once the API answers health 200 with a healthy scheduler and dag-processor,
    and every DAG in ``wait_for_dags`` is parsed. :meth:`trigger` waits for its DAG to be parsed too.

    ``executor="celery"`` (with ``celery=CeleryConfig(...)``, components mode only) runs the
    CeleryExecutor on PostgreSQL + Redis: api-server, scheduler, dag-processor and one
    ``airflow celery worker -H NAME@%h`` per name in ``celery.workers``, each with its own log-server
    port, pid file and log (``celery-worker-NAME.log``); :meth:`start` also waits for every worker to
    report ready. :meth:`kill_worker` loses a worker the way a machine is lost (SIGKILL to its whole
    process tree, task processes included); :meth:`start_worker` brings one (back) up.
    ``task_heartbeat_timeout_s`` lowers ``[scheduler] task_instance_heartbeat_timeout`` (default 300 s)
    so the scheduler notices a dead task sooner (its check interval becomes a quarter of it).
    """

    def __init__(
        self,
        home: Path,
        dags_folder: Path,
        plugins_folder: Path | None = None,
        env_extra: Mapping[str, str] | None = None,
        *,
        extra_dag_folders: Mapping[str, Path] | None = None,
        parallelism: int = 4,
        mode: StackMode = "components",
        port: int | None = None,
        wait_for_dags: Sequence[str] = ("dflash_generate",),
        dag_refresh_interval_s: int = 5,
        executor: Executor = "local",
        celery: CeleryConfig | None = None,
        task_heartbeat_timeout_s: int | None = None,
    ) -> None:
        if executor == "celery":
            if celery is None:
                raise ValueError('executor="celery" needs celery=CeleryConfig(...)')
            if mode != "components":
                raise ValueError('executor="celery" runs in mode "components" only')
        self.executor: Executor = executor
        self.celery = celery if executor == "celery" else None
        self.task_heartbeat_timeout_s = task_heartbeat_timeout_s
        self.home = Path(home).resolve()
        self.dags_folder = Path(dags_folder).resolve()
        self.plugins_folder = (
            Path(plugins_folder).resolve() if plugins_folder is not None else self.home / "plugins"
        )
        self.extra_dag_folders = {k: Path(v).resolve() for k, v in (extra_dag_folders or {}).items()}
        self.parallelism = parallelism
        self.mode: StackMode = mode
        self.port = port or free_port()
        self.wait_for_dags = tuple(wait_for_dags)
        self.dag_refresh_interval_s = dag_refresh_interval_s
        self._env_extra = dict(env_extra or {})
        self._password = secrets.token_urlsafe(12)
        self._jwt_secret = secrets.token_urlsafe(64)  # 86 characters: above the 64-byte minimum
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._token: str | None = None
        self._session = requests.Session()
        self._parsed_dags: set[str] = set()
        self.env: dict[str, str] = self._build_env()
        self.startup_s: float | None = None
        #: worker name -> its environment (own log-server port and DFLASH_WORKER_NAME).
        self._worker_env: dict[str, dict[str, str]] = {}
        self._worker_log_offset: dict[str, int] = {}  # where a (re)started worker's log began
        self._snapshot: dict[int, float] = {}  # pid -> create time of the processes seen at stop()

    def __repr__(self) -> str:  # never shows the secrets
        return f"AirflowStack(home={self.home}, url={self.url}, mode={self.mode}, executor={self.executor})"

    @property
    def components(self) -> tuple[str, ...]:
        """The non-worker Airflow processes this stack runs (components mode)."""
        return CELERY_COMPONENTS if self.executor == "celery" else COMPONENTS

    @property
    def worker_names(self) -> tuple[str, ...]:
        """The Celery workers' names (``()`` for the LocalExecutor)."""
        return self.celery.workers if self.celery is not None else ()

    # ----- configuration

    @property
    def url(self) -> str:
        """Base URL of the API server and UI, ``http://127.0.0.1:PORT``."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def username(self) -> str:
        return ADMIN_USER

    @property
    def password(self) -> str:
        """The admin password (generated per stack). Show it only where a human needs it."""
        return self._password

    @property
    def logs_dir(self) -> Path:
        """Where the components' stdout/stderr go (one file per process)."""
        return self.home / "stack-logs"

    def ui_run_url(self, dag_id: str, run_id: str) -> str:
        """The UI page of a DAG run."""
        from urllib.parse import quote

        return f"{self.url}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"

    def _build_env(self) -> dict[str, str]:
        from cryptography.fernet import Fernet

        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_VAR_")) and k != "AIRFLOW_HOME"
        }
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        passwords_file = self.home / "simple_auth_manager_passwords.json"
        bundles = [{"name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
                    "kwargs": {}}]  # fmt: skip
        for name, path in self.extra_dag_folders.items():
            bundles.append({"name": name, "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
                            "kwargs": {"path": str(path)}})  # fmt: skip
        env.update(
            {
                "AIRFLOW_HOME": str(self.home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                "AIRFLOW__CORE__PLUGINS_FOLDER": str(self.plugins_folder),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords_file),
                "AIRFLOW__API_AUTH__JWT_SECRET": self._jwt_secret,
                "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
                "AIRFLOW__API__HOST": LOOPBACK,
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": str(self.dag_refresh_interval_s),
                "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(bundles),
                # Several stacks (demo + tests) may run at once: no fixed ports.
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.celery is not None:
            env.update(self.celery.env())
        if self.task_heartbeat_timeout_s is not None:
            timeout = int(self.task_heartbeat_timeout_s)
            env["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"] = str(timeout)
            env["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL"] = str(max(1.0, timeout / 4))
        env.update(self._env_extra)
        return env

    def _prepare_home(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.plugins_folder.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        passwords_file = Path(self.env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
        fd = os.open(passwords_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({ADMIN_USER: self._password}, fh)

    # ----- life cycle

    @property
    def running(self) -> bool:
        return bool(self._procs)

    def launch(self) -> None:
        """Start the processes without waiting for readiness (see :meth:`wait_ready`)."""
        if self._procs:
            return
        self._launched_at = time.monotonic()
        self._prepare_home()
        airflow = venv_bin("airflow")
        if self.mode == "standalone":
            self._procs["standalone"] = spawn(
                [airflow, "standalone"], env=self.env, log_path=self.logs_dir / "standalone.log",
                cwd=self.home,
            )  # fmt: skip
        else:
            migrate = self.cli("db", "migrate", timeout_s=300)
            if migrate.returncode != 0:
                raise StackError(f"airflow db migrate failed:\n{migrate.stdout[-3000:]}{migrate.stderr[-3000:]}")
            for component in self.components:
                self._procs[component] = spawn(
                    [airflow, component], env=self.env, log_path=self.logs_dir / f"{component}.log",
                    cwd=self.home,
                )  # fmt: skip
            for name in self.worker_names:
                self.start_worker(name, wait=False)
        log.info("airflow (%s, %s) launched under %s, API %s", self.mode, self.executor, self.home, self.url)

    def start(self, timeout_s: float = 240.0) -> AirflowStack:
        """Launch and wait until ready; stops what it started if that fails."""
        self.launch()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise StackError(
                    f"airflow {name} exited with {proc.returncode}:\n{tail(self.logs_dir / f'{name}.log')}"
                )

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        """Wait for health 200 (scheduler and dag-processor healthy) and for ``wait_for_dags``."""
        deadline = time.monotonic() + timeout_s
        last: str = "no answer"
        while True:
            self._check_alive()
            try:
                resp = self._session.get(f"{self.url}/api/v2/monitor/health", timeout=5)
                if resp.status_code == 200:
                    health = resp.json()
                    states = {k: (v or {}).get("status") for k, v in health.items()}
                    if all(states.get(k) == "healthy" for k in ("metadatabase", "scheduler", "dag_processor")):
                        break
                    last = f"health {states}"
                else:
                    last = f"health HTTP {resp.status_code}"
            except requests.RequestException as exc:
                last = type(exc).__name__
            if time.monotonic() > deadline:
                raise StackError(f"airflow not healthy within {timeout_s} s ({last}); logs in {self.logs_dir}")
            time.sleep(0.5)
        log.info("airflow healthy after %.1f s", time.monotonic() - self._launched_at)
        for name in self.worker_names:
            self.wait_worker(name, timeout_s=max(5.0, deadline - time.monotonic()))
        for dag_id in self.wait_for_dags:
            self.wait_dag(dag_id, timeout_s=max(5.0, deadline - time.monotonic()))
        self.startup_s = time.monotonic() - self._launched_at
        log.info("airflow ready after %.1f s: %s", self.startup_s, self.url)

    def stop(self) -> None:
        """SIGINT to every process group, ~15 s grace, then SIGTERM, then SIGKILL.

        Task processes run in process groups of their own (the Task SDK's supervisor puts each
        task runner in a new group); any that outlive their component are killed at the end.
        """
        if not self._procs:
            return
        self._remember_tree()
        stop_process_groups(
            list(self._procs.values()), name=f"airflow ({self.mode}, {self.executor})", grace_s=15.0,
            straggler=airflow_straggler,
        )  # fmt: skip
        self._procs.clear()
        self._token = None
        leftovers = self._alive_remembered()
        if leftovers:
            log.warning("killing %d leftover task process(es): %s", len(leftovers), [describe(p) for p in leftovers])
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self._snapshot.clear()
        if self.celery is not None:
            self._clear_broker_keys()

    def _clear_broker_keys(self) -> None:
        """Delete this stack's keys (its ``key_prefix``) from the shared Redis; best effort."""
        assert self.celery is not None
        try:
            import redis

            client = redis.Redis.from_url(self.celery.broker_url, socket_connect_timeout=3, socket_timeout=5)
            keys = list(client.scan_iter(match=self.celery.key_prefix + "*", count=500))
            if keys:
                client.delete(*keys)
            log.info("deleted %d broker key(s) with prefix %s", len(keys), self.celery.key_prefix)
        except Exception as exc:  # noqa: BLE001 - cleanup must not mask the test's outcome
            log.warning("could not clean the broker keys %s*: %s", self.celery.key_prefix, exc)

    def _remember_tree(self) -> None:
        """Note every live descendant of our processes (pid + create time, to survive pid reuse)."""
        import psutil

        for proc in self._procs.values():
            for pid in process_tree(proc.pid):
                with contextlib.suppress(psutil.Error):
                    self._snapshot.setdefault(pid, psutil.Process(pid).create_time())

    def _alive_remembered(self) -> list[int]:
        import psutil

        alive = []
        for pid, created in self._snapshot.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        return alive

    # ----- Celery workers

    def _worker_key(self, name: str) -> str:
        if name not in self.worker_names:
            raise KeyError(f"no Celery worker {name!r} in this stack (workers: {self.worker_names})")
        return f"celery-worker-{name}"

    def worker_log(self, name: str) -> Path:
        return self.logs_dir / f"{self._worker_key(name)}.log"

    def start_worker(self, name: str, *, wait: bool = True, timeout_s: float = 120.0) -> None:
        """Start Celery worker ``name`` (``-H NAME@%h``); no-op if it runs. Waits until it is ready."""
        key = self._worker_key(name)
        proc = self._procs.get(key)
        if proc is not None and proc.poll() is None:
            return
        assert self.celery is not None
        env = self._worker_env.get(name)
        if env is None:  # a restarted worker keeps its log-server port, so old logs stay reachable
            env = {**self.env, "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()), WORKER_NAME_ENV: name}
            self._worker_env[name] = env
        log_path = self.worker_log(name)
        self._worker_log_offset[name] = log_path.stat().st_size if log_path.exists() else 0
        argv = [
            venv_bin("airflow"), "celery", "worker", "--celery-hostname", f"{name}@%h",
            "--concurrency", str(self.celery.concurrency), "--pid", str(self.home / f"{key}.pid"),
        ]  # fmt: skip
        (self.home / f"{key}.pid").unlink(missing_ok=True)  # a SIGKILLed worker leaves its pid file
        self._procs[key] = spawn(argv, env=env, log_path=log_path, cwd=self.home)
        if wait:
            self.wait_worker(name, timeout_s)

    def wait_worker(self, name: str, timeout_s: float = 120.0) -> None:
        """Wait until worker ``name`` logs Celery's ``NAME@host ready.`` line (since it was started)."""
        log_path = self.worker_log(name)
        offset = self._worker_log_offset.get(name, 0)
        started = time.monotonic()
        while True:
            self._check_alive()
            if log_path.exists():
                with open(log_path, "rb") as fh:
                    fh.seek(offset)
                    text = fh.read().decode(errors="replace")
                if f"{name}@" in text and " ready." in text:
                    break
            if time.monotonic() - started > timeout_s:
                raise StackError(f"celery worker {name} not ready within {timeout_s} s:\n{tail(log_path)}")
            time.sleep(0.3)
        log.info("celery worker %s ready (waited %.1f s)", name, time.monotonic() - started)

    def worker_pids(self, name: str) -> list[int]:
        """Every live process of worker ``name``: its group and descendants (task runners included)."""
        proc = self._procs.get(self._worker_key(name))
        if proc is None or proc.poll() is not None:
            return []
        return sorted(set(group_members(proc.pid)) | {p for p in process_tree(proc.pid) if Path(f"/proc/{p}").exists()})

    def kill_worker(self, name: str) -> list[int]:
        """Lose worker ``name`` like a lost machine: SIGKILL its process group and every descendant.

        Killing only the worker's process group would leave its task processes running: the Task
        SDK's supervisor puts each task runner in a process group of its own, so an orphaned task
        would go on generating. Returns the pids killed; the worker is no longer part of the
        stack's liveness checks until :meth:`start_worker`.
        """
        key = self._worker_key(name)
        proc = self._procs.pop(key, None)
        if proc is None:
            return []
        victims = sorted(set(group_members(proc.pid)) | set(process_tree(proc.pid)))
        signal_group(proc.pid, signal.SIGKILL)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() and is_live(p) for p in victims) and time.monotonic() < deadline:
            time.sleep(0.05)
        log.warning("celery worker %s killed (SIGKILL to %d processes)", name, len(victims))
        return victims

    def __enter__(self) -> AirflowStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pids(self) -> list[int]:
        """All live pids of the stack's process groups (components, executor workers, parsers...)."""
        return [pid for proc in self._procs.values() for pid in group_members(proc.pid)]

    def memory_usage(self) -> dict[str, int]:
        """``{"rss_bytes", "pss_bytes", "processes"}`` summed over :meth:`pids`."""
        return process_memory(self.pids())

    # ----- CLI

    def cli(self, *args: str, timeout_s: float = 180.0, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``airflow ARGS...`` with the stack's environment; return the CompletedProcess (text)."""
        started = time.monotonic()
        result = subprocess.run(
            [venv_bin("airflow"), *args],
            env=self.env,
            cwd=self.home,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        log.debug("airflow %s -> %d in %.1f s", " ".join(args[:3]), result.returncode, time.monotonic() - started)
        if check and result.returncode != 0:
            raise StackError(f"airflow {' '.join(args[:3])} exited {result.returncode}:\n{result.stderr[-3000:]}")
        return result

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None, run_id: str | None = None) -> str:
        """``airflow dags trigger DAG --conf JSON --run-id RUN``; return the run id.

        Waits for the DAG to be parsed first. ``run_id`` defaults to ``manual__devstack_<UTC time>_<hex>``.
        Raises :class:`StackError` with the CLI's output if the trigger is refused (e.g. bad params).
        """
        self.wait_dag(dag_id)
        if run_id is None:
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
            run_id = f"manual__devstack_{stamp}_{secrets.token_hex(3)}"
        args = ["dags", "trigger", dag_id, "--run-id", run_id, "--output", "json"]
        if conf is not None:
            args += ["--conf", json.dumps(conf)]
        result = self.cli(*args)
        if result.returncode != 0 or run_id not in result.stdout:
            raise StackError(
                f"airflow dags trigger {dag_id} failed ({result.returncode}):\n"
                f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            )
        log.info("triggered %s run %s", dag_id, run_id)
        return run_id

    # ----- REST

    def token(self) -> str:
        """A bearer token from ``POST /auth/token`` (cached)."""
        if self._token is None:
            resp = self._session.post(
                f"{self.url}/auth/token",
                json={"username": ADMIN_USER, "password": self._password},
                timeout=10,
            )
            if resp.status_code not in (200, 201):
                raise StackError(f"POST /auth/token answered {resp.status_code}")
            self._token = str(resp.json()["access_token"])
        return self._token

    def rest(
        self,
        method: str,
        path: str,
        json: Any = None,  # noqa: A002 - mirrors requests' argument
        *,
        params: Mapping[str, Any] | None = None,
        timeout_s: float = 30.0,
    ) -> requests.Response:
        """Authenticated request to ``self.url + path`` (e.g. ``/api/v2/dags``); returns the Response.

        The status is not checked (tests assert on 400s); a 401 renews the token once.
        """
        url = self.url + (path if path.startswith("/") else "/" + path)
        for attempt in (1, 2):
            resp = self._session.request(
                method, url, json=json, params=params, timeout=timeout_s,
                headers={"Authorization": f"Bearer {self.token()}"},
            )  # fmt: skip
            if resp.status_code == 401 and attempt == 1:
                self._token = None
                continue
            return resp
        raise AssertionError("unreachable")

    def wait_dag(self, dag_id: str, timeout_s: float = 120.0) -> None:
        """Wait until ``GET /api/v2/dags/DAG`` answers 200 (the DAG is parsed and serialized)."""
        if dag_id in self._parsed_dags:
            return
        started = time.monotonic()
        while True:
            self._check_alive()
            if self.rest("GET", f"/api/v2/dags/{dag_id}").status_code == 200:
                break
            if time.monotonic() - started > timeout_s:
                errors = self.rest("GET", "/api/v2/importErrors").text[-3000:]
                raise StackError(f"DAG {dag_id!r} not parsed within {timeout_s} s; import errors: {errors}")
            time.sleep(0.5)
        self._parsed_dags.add(dag_id)
        log.info("DAG %s parsed (waited %.1f s)", dag_id, time.monotonic() - started)

    def get_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        """``GET /api/v2/dags/DAG/dagRuns/RUN`` as a dict (raises StackError if not 200)."""
        resp = self.rest("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")
        if resp.status_code != 200:
            raise StackError(f"GET dagRun {dag_id}/{run_id}: HTTP {resp.status_code} {resp.text[:500]}")
        return dict(resp.json())

    def wait_run(
        self,
        dag_id: str,
        run_id: str,
        timeout_s: float = 600.0,
        *,
        poll_s: float = 1.0,
        on_poll: Callable[[dict[str, Any]], None] | None = None,
    ) -> str:
        """Poll the run until it is ``success`` or ``failed``; return that state.

        ``on_poll(run_dict)`` is called after every poll (the demo prints task states from it).
        Raises TimeoutError with the last state after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            try:
                run = self.get_run(dag_id, run_id)
            except requests.exceptions.ReadTimeout:  # a starved API server on a loaded 2-core runner: poll again
                if time.monotonic() > deadline:
                    raise
                log.warning("GET dagRun %s/%s timed out; polling again", dag_id, run_id)
                continue
            if on_poll is not None:
                on_poll(run)
            state = str(run.get("state"))
            if state in TERMINAL_RUN_STATES:
                log.info("run %s/%s finished: %s", dag_id, run_id, state)
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {dag_id}/{run_id} still {state} after {timeout_s} s")
            time.sleep(poll_s)

    def run_logs_mention(self, dag_id: str, run_id: str, text: str) -> bool:
        """Whether any task log of the run contains `text` (e.g. which dataset a failed run was about)."""
        logs = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
        return logs.is_dir() and any(text in p.read_text(errors="replace") for p in logs.rglob("*.log"))

    def run_ids(self, dag_id: str) -> set[str]:
        """The ids of the DAG's runs so far (up to 1000)."""
        resp = self.rest("GET", f"/api/v2/dags/{dag_id}/dagRuns", params={"limit": 1000})
        if resp.status_code != 200:
            raise StackError(f"GET dagRuns {dag_id}: HTTP {resp.status_code} {resp.text[:500]}")
        return {str(r["dag_run_id"]) for r in resp.json()["dag_runs"]}

    def wait_new_run(self, dag_id: str, known: set[str], timeout_s: float = 900.0, *, poll_s: float = 2.0,
                     ours: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        """Wait for a run of `dag_id` not in `known` (one the scheduler creates, e.g. asset-triggered) to end;
        return it. A downstream DAG's timing depends on the scheduler and the machine's load, so tests wait
        for the run itself rather than for one of its outputs to appear within a guessed time. On a shared
        stack an earlier test's asset event may queue a run too: `ours(run)` (asked once a run has ended)
        tells the caller's run apart; others are passed over."""
        known = set(known)
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            resp = self.rest("GET", f"/api/v2/dags/{dag_id}/dagRuns", params={"limit": 1000})
            new = [r for r in resp.json().get("dag_runs", []) if r["dag_run_id"] not in known] \
                if resp.status_code == 200 else []
            for run in (dict(r) for r in new if str(r.get("state")) in TERMINAL_RUN_STATES):
                log.info("run %s/%s (%s) finished: %s", dag_id, run["dag_run_id"], run.get("run_type"), run["state"])
                if ours is None or ours(run):
                    return run
                known.add(str(run["dag_run_id"]))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new {dag_id} run ended within {timeout_s} s; new runs: "
                                   f"{[(r['dag_run_id'], r.get('state')) for r in new]}")
            time.sleep(poll_s)

    def task_instances(self, dag_id: str, run_id: str) -> list[TaskInstanceInfo]:
        """All task instances of a run (all map indexes, paginated), sorted by (task_id, map_index)."""
        items: list[dict[str, Any]] = []
        while True:
            resp = self.rest(
                "GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances",
                params={"limit": 100, "offset": len(items)},
            )  # fmt: skip
            if resp.status_code != 200:
                raise StackError(f"GET taskInstances {dag_id}/{run_id}: HTTP {resp.status_code} {resp.text[:500]}")
            body = resp.json()
            page = body.get("task_instances", [])
            items.extend(page)
            if not page or len(items) >= int(body.get("total_entries", len(items))):
                break
        tis = [TaskInstanceInfo.from_rest(item) for item in items]
        return sorted(tis, key=lambda ti: (ti.task_id, ti.map_index))


