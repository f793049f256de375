"""Local dev/test stack: real processes on loopback for the demo and the end-to-end tests.

Three pieces, each usable alone or together through :class:`Stack`:

* :class:`MotoServer`: a ``moto_server`` subprocess speaking the S3 protocol over HTTP.
* :class:`SimFleetProcess`: ``python -m dflash_pipeline.sim`` serving ``count`` simulated SGLang servers.
* :class:`AirflowStack`: an Airflow 3 deployment (api-server, scheduler, dag-processor, triggerer,
  LocalExecutor on SQLite) under a private ``AIRFLOW_HOME``, driven through the ``airflow`` CLI and the
  REST API. With ``executor="celery"`` and a :class:`CeleryConfig` it is the distributed shape
  instead: CeleryExecutor, PostgreSQL metadata DB and result backend, Redis broker, and N named
  ``airflow celery worker`` processes (see :meth:`AirflowStack.kill_worker`).
* :class:`PostgresDatabase`: a fresh, uniquely named database on a PostgreSQL server, dropped after.

Every process is started in its own process group with its output in a log file, and stopped by
signalling the whole group (SIGINT, then SIGTERM, then SIGKILL), so nothing outlives the stack.

Nothing here prints; everything is logged through ``logging.getLogger(__name__)``. The admin password
and the JWT secret are never logged: read :attr:`AirflowStack.password` if you must show it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import requests

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_REGION = "us-east-1"
#: Credentials moto accepts (any value works; these are the conventional ones).
MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing"  # noqa: S105 - a fake credential for a local fake S3
ADMIN_USER = "admin"
TERMINAL_RUN_STATES = frozenset({"success", "failed"})
StackMode = Literal["standalone", "components"]
Executor = Literal["local", "celery"]
#: ``straggler(pid, members of its process group) -> signal to send it once, or None``.
Straggler = Callable[[int, Sequence[int]], "signal.Signals | None"]
#: The Airflow components started one by one in "components" mode.
COMPONENTS: tuple[str, ...] = ("api-server", "scheduler", "dag-processor", "triggerer")
#: The components of a Celery stack besides its workers (no deferrable operators here: no triggerer).
CELERY_COMPONENTS: tuple[str, ...] = ("api-server", "scheduler", "dag-processor")
#: Where the Celery stack finds PostgreSQL and Redis unless told otherwise (both on loopback).
PG_ADMIN_URL_ENV = "DFLASH_PG_URL"
DEFAULT_PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_URL_ENV = "DFLASH_REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: Set per Celery worker process; read by :func:`worker_hostname`.
WORKER_NAME_ENV = "DFLASH_WORKER_NAME"


class StackError(RuntimeError):
    """A process of the stack failed to start, died, or did not become ready in time."""


# --------------------------------------------------------------------------------------------------
# small helpers


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that is free on ``host`` right now (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def venv_bin(name: str) -> str:
    """Path of executable ``name`` next to the running interpreter (the venv's bin), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise StackError(f"executable {name!r} not found next to {sys.executable} nor on PATH")
    return found


def _tail(path: Path | None, lines: int = 40) -> str:
    """Last ``lines`` lines of a log file, for error messages."""
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids of process group ``pgid``; Linux /proc, falls back to killpg(0)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members: list[int] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces, so split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _is_live(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


def _describe(pid: int) -> str:
    return f"{pid} {_cmdline(pid)[:80] or '?'}"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _airflow_straggler(pid: int, members: Sequence[int]) -> signal.Signals | None:
    """What to send a process still up 3 s into Airflow's shutdown (known 3.3.2 hangs), if anything.

    * an idle LocalExecutor worker (``airflow worker -- LocalExecutor: <idle>``): the scheduler
      sometimes waits forever on one that missed its shutdown message. It runs nothing: SIGKILL.
    * a triggerer whose trigger-runner child has already exited: it still waits a fixed 10 s for
      it; a second signal makes it exit at once.
    """
    cmd = _cmdline(pid)
    if "LocalExecutor" in cmd and cmd.endswith("<idle>"):
        return signal.SIGKILL
    if cmd.endswith("airflow triggerer") and list(members) == [pid]:
        return signal.SIGINT
    return None


def _wait_groups_empty(
    pgids: Sequence[int],
    timeout: float,
    *,
    straggler: Straggler | None = None,
    straggler_after_s: float = 3.0,
) -> bool:
    started = time.monotonic()
    nudged: set[tuple[int, signal.Signals]] = set()
    while True:
        groups = {pgid: _group_members(pgid) for pgid in pgids}
        if not any(groups.values()):
            return True
        elapsed = time.monotonic() - started
        if elapsed >= timeout:
            return False
        if straggler is not None and elapsed >= straggler_after_s:
            for members in groups.values():
                for pid in members:
                    sig = straggler(pid, members)
                    if sig is not None and (pid, sig) not in nudged:
                        nudged.add((pid, sig))
                        log.debug("straggler %s: sending %s", _describe(pid), sig.name)
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.kill(pid, sig)
        time.sleep(0.2)


def stop_process_groups(
    procs: Sequence[subprocess.Popen[bytes]],
    *,
    name: str,
    first_signal: signal.Signals = signal.SIGINT,
    grace_s: float = 15.0,
    term_grace_s: float = 5.0,
    straggler: Straggler | None = None,
) -> None:
    """Stop processes started with ``start_new_session=True`` and everything in their groups.

    Sends ``first_signal`` to every group, waits up to ``grace_s`` for the groups to empty, then
    SIGTERM (``term_grace_s``), then SIGKILL. Reaps the direct children. During the first wait,
    from 3 s on, ``straggler(pid, members_of_its_group)`` may name a signal to send that process
    once (see :func:`_airflow_straggler`).
    """
    pgids = [p.pid for p in procs]
    if not pgids:
        return
    started = time.monotonic()
    steps: list[tuple[signal.Signals, float]] = [(first_signal, grace_s)]
    if first_signal != signal.SIGTERM:
        steps.append((signal.SIGTERM, term_grace_s))
    steps.append((signal.SIGKILL, 5.0))
    for sig, wait_s in steps:
        if not any(_group_members(pgid) for pgid in pgids):
            break
        log.debug("%s: sending %s to process groups %s", name, sig.name, pgids)
        for pgid in pgids:
            _signal_group(pgid, sig)
        if _wait_groups_empty(pgids, wait_s, straggler=straggler if sig == first_signal else None):
            break
        log.warning(
            "%s: still running %.0f s after %s: %s", name, wait_s, sig.name,
            "; ".join(_describe(pid) for pgid in pgids for pid in _group_members(pgid)),
        )  # fmt: skip
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    log.info("%s stopped in %.1f s", name, time.monotonic() - started)


def _spawn(
    argv: Sequence[str], *, env: Mapping[str, str] | None, log_path: Path | None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session (own process group) with stdout+stderr appended to log_path."""
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out: Any = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    else:
        out = subprocess.DEVNULL
    try:
        return subprocess.Popen(
            list(argv),
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        if log_path is not None:
            out.close()


def _process_memory(pids: Sequence[int]) -> dict[str, int]:
    """Sum RSS and PSS (bytes) of ``pids`` from /proc/PID/smaps_rollup (PSS avoids double counting)."""
    total = {"rss_bytes": 0, "pss_bytes": 0, "processes": 0}
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        total["processes"] += 1
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                total[f"{key.lower()}_bytes"] += int(rest.split()[0]) * 1024
    return total


# --------------------------------------------------------------------------------------------------
# S3 (moto)


def s3_client(endpoint_url: str, region: str = DEFAULT_REGION) -> Any:
    """A boto3 S3 client talking to ``endpoint_url`` (moto) with the fake credentials."""
    import boto3  # local import: boto3 is slow to import and not needed by every user of this module

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=MOTO_ACCESS_KEY,
        aws_secret_access_key=MOTO_SECRET_KEY,
    )


def create_bucket(endpoint_url: str, name: str, region: str = DEFAULT_REGION) -> str:
    """Create bucket ``name`` on the S3 endpoint (no-op if it exists already); return the name."""
    client = s3_client(endpoint_url, region)
    try:
        client.create_bucket(Bucket=name)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    log.info("bucket s3://%s ready on %s", name, endpoint_url)
    return name


def aws_conn_json(endpoint_url: str, region: str = DEFAULT_REGION) -> str:
    """Value for ``AIRFLOW_CONN_AWS_DEFAULT`` so ``S3Hook(aws_conn_id="aws_default")`` uses moto."""
    return json.dumps(
        {
            "conn_type": "aws",
            "login": MOTO_ACCESS_KEY,
            "password": MOTO_SECRET_KEY,
            "extra": {"endpoint_url": endpoint_url, "region_name": region},
        }
    )


def aws_env(endpoint_url: str, region: str = DEFAULT_REGION) -> dict[str, str]:
    """Environment pointing both Airflow's ``aws_default`` connection and plain boto3 at moto."""
    return {
        "AIRFLOW_CONN_AWS_DEFAULT": aws_conn_json(endpoint_url, region),
        "AWS_ACCESS_KEY_ID": MOTO_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": MOTO_SECRET_KEY,
        "AWS_DEFAULT_REGION": region,
        "AWS_ENDPOINT_URL_S3": endpoint_url,
    }


class MotoServer:
    """moto's S3 server (``python -m dflash_pipeline.s3server -H 127.0.0.1 -p PORT``) as a subprocess.

    The launcher makes conditional writes atomic, as they are on S3 (see ``s3server``).

    Usage::

        with MotoServer() as moto:
            moto.create_bucket("b")
            client = moto.client()
    """

    def __init__(
        self, *, host: str = LOOPBACK, port: int | None = None, log_path: Path | None = None
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``: the S3 endpoint."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> MotoServer:
        """Start the server and wait until it answers HTTP."""
        if self._proc is not None:
            return self
        started = time.monotonic()
        argv = [sys.executable, "-m", "dflash_pipeline.s3server", "-H", self.host, "-p", str(self.port)]
        self._proc = _spawn(argv, env=None, log_path=self.log_path)
        deadline = started + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise StackError(
                    f"moto_server exited with {self._proc.returncode}:\n{_tail(self.log_path)}"
                )
            with contextlib.suppress(requests.RequestException):
                requests.get(self.endpoint_url + "/", timeout=2)
                break
            if time.monotonic() > deadline:
                self.stop()
                raise StackError(f"moto_server did not answer within {timeout_s} s")
            time.sleep(0.1)
        log.info("moto S3 at %s (started in %.1f s)", self.endpoint_url, time.monotonic() - started)
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM to its group, then SIGKILL)."""
        if self._proc is None:
            return
        stop_process_groups([self._proc], name="moto_server", first_signal=signal.SIGTERM, grace_s=5)
        self._proc = None

    def client(self) -> Any:
        """A boto3 S3 client for this server."""
        return s3_client(self.endpoint_url)

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (idempotent); return the name."""
        return create_bucket(self.endpoint_url, name)

    def env(self) -> dict[str, str]:
        """See :func:`aws_env`."""
        return aws_env(self.endpoint_url)

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------------
# simulated SGLang fleet


class SimFleetProcess:
    """``python -m dflash_pipeline.sim --count N --urls-file PATH [extra_args]`` as a subprocess.

    ``settings`` is a convenience for ``--set key=value`` pairs (appended after ``extra_args``).
    :attr:`urls` holds the ``count`` base URLs once :meth:`start` has returned.
    """

    def __init__(
        self,
        count: int,
        extra_args: Sequence[str] = (),
        *,
        settings: Mapping[str, object] | None = None,
        workdir: Path | None = None,
    ) -> None:
        if count < 1:
            raise ValueError("count must be >= 1")
        self.count = count
        self.extra_args = list(extra_args)
        for key, value in (settings or {}).items():
            self.extra_args += ["--set", f"{key}={value}"]
        self._own_workdir = workdir is None
        self.workdir = workdir
        self.urls: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path | None:
        return None if self.workdir is None else self.workdir / "sim.log"

    def start(self, timeout_s: float = 60.0) -> SimFleetProcess:
        """Start the fleet and wait until the URLs file lists ``count`` URLs."""
        if self._proc is not None:
            return self
        if self.workdir is None:
            import tempfile

            self.workdir = Path(tempfile.mkdtemp(prefix="dflash-sim-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        urls_file = self.workdir / "urls.txt"
        urls_file.unlink(missing_ok=True)
        argv = [
            sys.executable, "-m", "dflash_pipeline.sim",
            "--count", str(self.count), "--urls-file", str(urls_file), *self.extra_args,
        ]  # fmt: skip
        started = time.monotonic()
        self._proc = _spawn(argv, env=None, log_path=self.log_path)
        deadline = started + timeout_s
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise StackError(f"simulated fleet exited with {code}:\n{_tail(self.log_path)}")
            if urls_file.exists():
                lines = [ln.strip() for ln in urls_file.read_text().splitlines() if ln.strip()]
                if len(lines) >= self.count and all(ln.startswith("http") for ln in lines):
                    self.urls = lines[: self.count]
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise StackError(f"simulated fleet not listening within {timeout_s} s:\n{_tail(self.log_path)}")
            time.sleep(0.1)
        log.info(
            "simulated fleet of %d at %s (started in %.1f s)",
            self.count, ", ".join(self.urls), time.monotonic() - started,
        )  # fmt: skip
        return self

    def stop(self) -> None:
        """Stop the fleet (SIGTERM, then SIGKILL)."""
        if self._proc is None:
            return
        stop_process_groups([self._proc], name="simulated fleet", first_signal=signal.SIGTERM, grace_s=10)
        self._proc = None

    def __enter__(self) -> SimFleetProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------------
# PostgreSQL and Redis (the Celery stack's metadata DB, result backend and broker)


def _pg_parts(url: str) -> dict[str, Any]:
    """``postgresql://user[:pw]@host:port/db`` (any ``+driver``) as psycopg2 connect() keywords."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    if not parts.scheme.startswith("postgresql"):
        raise ValueError(f"not a postgresql URL: {parts.scheme}://...")
    out: dict[str, Any] = {
        "host": parts.hostname or LOOPBACK,
        "port": parts.port or 5432,
        "user": unquote(parts.username or "postgres"),
        "dbname": parts.path.lstrip("/") or "postgres",
    }
    if parts.password:
        out["password"] = unquote(parts.password)
    return out


def postgres_unavailable(admin_url: str | None = None) -> str | None:
    """Why the PostgreSQL server at ``admin_url`` cannot be used, or None if it answers."""
    try:
        import psycopg2
    except ImportError as exc:
        return f"psycopg2 is not installed ({exc})"
    try:
        psycopg2.connect(connect_timeout=3, **_pg_parts(admin_url or _pg_admin_url())).close()
    except psycopg2.Error as exc:
        return f"PostgreSQL at {admin_url or _pg_admin_url()} does not answer: {str(exc).strip()[:200]}"
    return None


def redis_unavailable(url: str | None = None) -> str | None:
    """Why the Redis server at ``url`` cannot be used, or None if it answers PING."""
    try:
        import redis
    except ImportError as exc:
        return f"the redis client is not installed ({exc})"
    url = url or os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)
    try:
        redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3).ping()
    except redis.RedisError as exc:
        return f"Redis at {url} does not answer: {exc}"
    return None


def _pg_admin_url() -> str:
    return os.environ.get(PG_ADMIN_URL_ENV, DEFAULT_PG_ADMIN_URL)


class PostgresDatabase:
    """A database named ``name`` (default ``dflash_<hex>``) on the server of ``admin_url``.

    ``admin_url`` (default ``$DFLASH_PG_URL`` or ``postgresql://postgres@127.0.0.1:5432/postgres``)
    must name a role allowed to create databases. :meth:`create` makes it (empty, owned by that
    role); :meth:`drop` removes it with ``WITH (FORCE)``, closing leftover connections. Usage::

        with PostgresDatabase() as db:
            db.sqlalchemy_url   # postgresql+psycopg2://postgres@127.0.0.1:5432/dflash_1a2b3c4d
    """

    def __init__(self, admin_url: str | None = None, name: str | None = None) -> None:
        self.admin_url = admin_url or _pg_admin_url()
        self.name = name or f"dflash_{secrets.token_hex(4)}"
        if not self.name.replace("_", "").isalnum() or not self.name[0].isalpha():
            raise ValueError(f"database name {self.name!r}: letters, digits and _ only")
        self._parts = {**_pg_parts(self.admin_url), "dbname": self.name}

    def __repr__(self) -> str:
        return f"PostgresDatabase({self.name!r} on {self._parts['host']}:{self._parts['port']})"

    def url(self, scheme: str = "postgresql+psycopg2") -> str:
        """The database's URL with ``scheme`` (the password, if any, is included)."""
        from urllib.parse import quote

        p = self._parts
        auth = quote(p["user"], safe="") + (":" + quote(p["password"], safe="") if "password" in p else "")
        return f"{scheme}://{auth}@{p['host']}:{p['port']}/{self.name}"

    @property
    def sqlalchemy_url(self) -> str:
        """For ``[database] sql_alchemy_conn``: psycopg2 named (Airflow derives asyncpg from it)."""
        return self.url("postgresql+psycopg2")

    @property
    def result_backend_url(self) -> str:
        """For ``[celery] result_backend``: ``db+postgresql+psycopg2://`` (plain ``db+postgresql://``
        resolves to psycopg 3 under SQLAlchemy 2.1, which is not installed)."""
        return self.url("db+postgresql+psycopg2")

    def _admin(self) -> Any:
        import psycopg2

        conn = psycopg2.connect(connect_timeout=5, **_pg_parts(self.admin_url))
        conn.autocommit = True  # CREATE/DROP DATABASE cannot run inside a transaction
        return conn

    def exists(self) -> bool:
        conn = self._admin()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.name,))
                return cur.fetchone() is not None
        finally:
            conn.close()

    def create(self) -> PostgresDatabase:
        """``CREATE DATABASE name`` (fails if it exists: a fresh database is the point)."""
        conn = self._admin()
        try:
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{self.name}"')
        finally:
            conn.close()
        log.info("created database %s", self)
        return self

    def drop(self) -> None:
        """``DROP DATABASE IF EXISTS name WITH (FORCE)`` (PostgreSQL 13+)."""
        conn = self._admin()
        try:
            with conn.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        finally:
            conn.close()
        log.info("dropped database %s", self)

    def __enter__(self) -> PostgresDatabase:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.drop()


def worker_hostname() -> str:
    """``[core] hostname_callable`` of the Celery stack: ``NAME@fqdn`` in a worker, else the fqdn.

    Two workers on one host would both record the host's name as the task instance's hostname; the
    stack sets ``DFLASH_WORKER_NAME`` per worker so a task instance shows which worker ran it (the
    same ``NAME@host`` form as the Celery node name ``-H NAME@%h``). In containers or on separate
    machines the default (``airflow.utils.net.getfqdn``) already tells workers apart.
    """
    name = os.environ.get(WORKER_NAME_ENV)
    fqdn = socket.getfqdn()
    return f"{name}@{fqdn}" if name else fqdn


@dataclass(frozen=True)
class CeleryConfig:
    """What a Celery-mode :class:`AirflowStack` needs besides Airflow itself.

    ``sql_alchemy_conn`` and ``result_backend`` usually come from one :class:`PostgresDatabase`
    (:meth:`for_database`). ``key_prefix`` prefixes every Redis key of this stack (kombu's
    ``global_keyprefix``), so stacks sharing one Redis do not steal each other's tasks.
    ``workers`` are the Celery node names (``-H NAME@%h``), ``concurrency`` the slots of each.
    """

    sql_alchemy_conn: str
    result_backend: str
    broker_url: str = DEFAULT_REDIS_URL
    workers: tuple[str, ...] = ("w1", "w2")
    concurrency: int = 4
    key_prefix: str = field(default_factory=lambda: f"dflash-{secrets.token_hex(4)}:")

    @classmethod
    def for_database(cls, db: PostgresDatabase, broker_url: str | None = None, **kwargs: Any) -> CeleryConfig:
        broker = broker_url or os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)
        return cls(sql_alchemy_conn=db.sqlalchemy_url, result_backend=db.result_backend_url, broker_url=broker, **kwargs)

    def env(self) -> dict[str, str]:
        """The ``AIRFLOW__*`` settings every component (scheduler, API server, workers) shares."""
        return {
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.sql_alchemy_conn,
            "AIRFLOW__CELERY__BROKER_URL": self.broker_url,
            "AIRFLOW__CELERY__RESULT_BACKEND": self.result_backend,
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(self.concurrency),
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__GLOBAL_KEYPREFIX": self.key_prefix,
            # Two workers on one host: record NAME@host as the task instance's hostname.
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": f"{__name__}.worker_hostname",
        }


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (through /proc, so across process groups and sessions)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2 and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


# --------------------------------------------------------------------------------------------------
# Airflow


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
            self._procs["standalone"] = _spawn(
                [airflow, "standalone"], env=self.env, log_path=self.logs_dir / "standalone.log",
                cwd=self.home,
            )  # fmt: skip
        else:
            migrate = self.cli("db", "migrate", timeout_s=300)
            if migrate.returncode != 0:
                raise StackError(f"airflow db migrate failed:\n{migrate.stdout[-3000:]}{migrate.stderr[-3000:]}")
            for component in self.components:
                self._procs[component] = _spawn(
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
                    f"airflow {name} exited with {proc.returncode}:\n{_tail(self.logs_dir / f'{name}.log')}"
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
            straggler=_airflow_straggler,
        )  # fmt: skip
        self._procs.clear()
        self._token = None
        leftovers = self._alive_remembered()
        if leftovers:
            log.warning("killing %d leftover task process(es): %s", len(leftovers), [_describe(p) for p in leftovers])
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
        self._procs[key] = _spawn(argv, env=env, log_path=log_path, cwd=self.home)
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
                raise StackError(f"celery worker {name} not ready within {timeout_s} s:\n{_tail(log_path)}")
            time.sleep(0.3)
        log.info("celery worker %s ready (waited %.1f s)", name, time.monotonic() - started)

    def worker_pids(self, name: str) -> list[int]:
        """Every live process of worker ``name``: its group and descendants (task runners included)."""
        proc = self._procs.get(self._worker_key(name))
        if proc is None or proc.poll() is not None:
            return []
        return sorted(set(_group_members(proc.pid)) | {p for p in process_tree(proc.pid) if Path(f"/proc/{p}").exists()})

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
        victims = sorted(set(_group_members(proc.pid)) | set(process_tree(proc.pid)))
        _signal_group(proc.pid, signal.SIGKILL)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() and _is_live(p) for p in victims) and time.monotonic() < deadline:
            time.sleep(0.05)
        log.warning("celery worker %s killed (SIGKILL to %d processes)", name, len(victims))
        return victims

    def __enter__(self) -> AirflowStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pids(self) -> list[int]:
        """All live pids of the stack's process groups (components, executor workers, parsers...)."""
        return [pid for proc in self._procs.values() for pid in _group_members(proc.pid)]

    def memory_usage(self) -> dict[str, int]:
        """``{"rss_bytes", "pss_bytes", "processes"}`` summed over :meth:`pids`."""
        return _process_memory(self.pids())

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
            run = self.get_run(dag_id, run_id)
            if on_poll is not None:
                on_poll(run)
            state = str(run.get("state"))
            if state in TERMINAL_RUN_STATES:
                log.info("run %s/%s finished: %s", dag_id, run_id, state)
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {dag_id}/{run_id} still {state} after {timeout_s} s")
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


# --------------------------------------------------------------------------------------------------
# everything together


class Stack:
    """moto S3 + simulated SGLang fleet + Airflow, started together and stopped in reverse order.

    Usage::

        with Stack(home, dags_folder, plugins_folder, buckets=["dflash-demo"]) as stack:
            run_id = stack.airflow.trigger("dflash_generate", {..., "servers": stack.server_urls})
            stack.airflow.wait_run("dflash_generate", run_id)

    ``sim_count=0`` skips the fleet. ``sim_settings`` become ``--set key=value`` for the fleet.
    Airflow's environment gets :func:`aws_env` for the moto endpoint plus ``env_extra``.
    """

    def __init__(
        self,
        home: Path,
        dags_folder: Path,
        plugins_folder: Path | None = None,
        *,
        sim_count: int = 3,
        sim_settings: Mapping[str, object] | None = None,
        sim_extra_args: Sequence[str] = (),
        buckets: Sequence[str] = (),
        env_extra: Mapping[str, str] | None = None,
        parallelism: int = 4,
        mode: StackMode = "components",
        wait_for_dags: Sequence[str] = ("dflash_generate",),
        extra_dag_folders: Mapping[str, Path] | None = None,
    ) -> None:
        self.home = Path(home).resolve()
        self.moto = MotoServer(log_path=self.home / "stack-logs" / "moto.log")
        self.fleet: SimFleetProcess | None = (
            SimFleetProcess(sim_count, sim_extra_args, settings=sim_settings, workdir=self.home / "sim")
            if sim_count > 0
            else None
        )
        self.buckets = list(buckets)
        self.airflow = AirflowStack(
            self.home / "airflow", dags_folder, plugins_folder,
            {**self.moto.env(), **(env_extra or {})},
            parallelism=parallelism, mode=mode, wait_for_dags=wait_for_dags,
            extra_dag_folders=extra_dag_folders,
        )  # fmt: skip
        self._exit = contextlib.ExitStack()

    @property
    def server_urls(self) -> list[str]:
        return list(self.fleet.urls) if self.fleet is not None else []

    def s3(self) -> Any:
        """boto3 S3 client for the stack's moto."""
        return self.moto.client()

    def start(self) -> Stack:
        started = time.monotonic()
        with contextlib.ExitStack() as guard:
            self.moto.start()
            guard.callback(self.moto.stop)
            for bucket in self.buckets:
                self.moto.create_bucket(bucket)
            self.airflow.launch()  # the slow part: boot it while the fleet starts
            guard.callback(self.airflow.stop)
            if self.fleet is not None:
                self.fleet.start()
                guard.callback(self.fleet.stop)
            self.airflow.wait_ready()
            self._exit = guard.pop_all()
        log.info("stack ready in %.1f s", time.monotonic() - started)
        return self

    def stop(self) -> None:
        """Stop Airflow, the fleet and moto (reverse order of start)."""
        self._exit.close()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

