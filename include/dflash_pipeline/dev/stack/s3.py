"""The S3 protocol server of the dev stack (moto on loopback) and boto3 helpers pointed at it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from dflash_pipeline.dev.stack.procs import LOOPBACK, StackError, free_port, spawn, stop_process_groups, tail

log = logging.getLogger(__name__)

DEFAULT_REGION = "us-east-1"
#: Credentials moto accepts (any value works; these are the conventional ones).
MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing"  # noqa: S105 - a fake credential for a local fake S3



def s3_client(endpoint_url: str, region: str = DEFAULT_REGION) -> Any:
    """A boto3 S3 client talking to ``endpoint_url`` (moto) with the fake credentials."""
    import boto3  # local import: boto3 is slow to import and not needed by every user of this module
    from botocore.config import Config

    from dflash_pipeline.dataset.store import CLIENT_CONFIG

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=MOTO_ACCESS_KEY,
        aws_secret_access_key=MOTO_SECRET_KEY,
        config=Config(**CLIENT_CONFIG),
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
    """moto's S3 server (``python -m dflash_pipeline.dev.s3server -H 127.0.0.1 -p PORT``) as a subprocess.

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
        argv = [sys.executable, "-m", "dflash_pipeline.dev.s3server", "-H", self.host, "-p", str(self.port)]
        self._proc = spawn(argv, env=None, log_path=self.log_path)
        deadline = started + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise StackError(
                    f"moto_server exited with {self._proc.returncode}:\n{tail(self.log_path)}"
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


