"""PostgreSQL and Redis for the Celery stack (metadata DB, result backend, broker) and its worker naming.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.dev.stack.procs import LOOPBACK

log = logging.getLogger(__name__)

#: Where the Celery stack finds PostgreSQL and Redis unless told otherwise (both on loopback).
PG_ADMIN_URL_ENV = "DFLASH_PG_URL"
DEFAULT_PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_URL_ENV = "DFLASH_REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: Set per Celery worker process; read by :func:`worker_hostname`.
WORKER_NAME_ENV = "DFLASH_WORKER_NAME"



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


