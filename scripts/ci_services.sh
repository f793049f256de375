#!/usr/bin/env bash
# PostgreSQL and Redis on loopback for the Celery end-to-end test (tests/e2e/test_celery.py).
#
#   eval "$(bash scripts/ci_services.sh)"    # from .ci/run: starts what is not answering, then
#                                            # exports DFLASH_CELERY_DB, a fresh empty database
#
# Idempotent: a service that already answers is left alone; one that does not is started the way
# this machine kind starts it (Debian's pg_ctlcluster; redis-server daemonized, no persistence).
# Progress goes to stderr; stdout carries only the `export` line, so `eval` is safe.
# The test drops DFLASH_CELERY_DB when it is done (and makes its own database when it is unset).
# Needs: psql, pg_isready, pg_ctlcluster (postgresql), redis-cli, redis-server (redis-server).
set -euo pipefail

PGHOST=${PGHOST:-127.0.0.1}
PGPORT=${PGPORT:-5432}
PGUSER=${PGUSER:-postgres}
REDIS_PORT=${REDIS_PORT:-6379}
export PGHOST PGPORT PGUSER

say() { echo "ci_services: $*" >&2; }
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2; shift 2
    for _ in $(seq 1 $((limit * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    say "$what did not answer within ${limit} s"; return 1
}

# ---- PostgreSQL
if pg_isready -q -h "$PGHOST" -p "$PGPORT" -t 2; then
    say "PostgreSQL already answers on $PGHOST:$PGPORT"
else
    version=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n1)
    if [ -z "$version" ]; then say "no PostgreSQL cluster under /etc/postgresql (apt-get install postgresql)"; exit 1; fi
    say "starting PostgreSQL $version (cluster main)"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start >&2 || true  # "already running" is fine
    wait_for 60 "PostgreSQL" pg_isready -q -h "$PGHOST" -p "$PGPORT"
fi
# The test connects as $PGUSER over TCP on loopback (trust auth on this machine kind).
psql -X -q -d postgres -c 'SELECT 1' >/dev/null

# ---- Redis
if redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; then
    say "Redis already answers on 127.0.0.1:$REDIS_PORT"
else
    say "starting Redis on 127.0.0.1:$REDIS_PORT"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log >&2
    wait_for 30 "Redis" sh -c "redis-cli -h 127.0.0.1 -p $REDIS_PORT ping | grep -q PONG"
fi

# ---- a fresh database for this run
db="dflash_ci_$(date -u +%Y%m%d%H%M%S)_$$"
psql -X -q -d postgres -v ON_ERROR_STOP=1 -c "CREATE DATABASE \"$db\"" >&2
say "created database $db (the Celery test drops it)"
echo "export DFLASH_CELERY_DB=$db"
