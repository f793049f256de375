"""The local dev/test stack: real processes on loopback for the demo, the end-to-end tests and the benches.

One module per real process, and :class:`Stack` composing them:

* ``s3``: :class:`MotoServer`, the S3 protocol server (moto) as a subprocess, plus boto3 helpers.
* ``fleet``: :class:`SimFleetProcess`, ``python -m dflash_pipeline.dev.sim`` serving N simulated servers.
* ``airflow_stack``: :class:`AirflowStack`, Airflow 3's components (api-server, scheduler,
  dag-processor, triggerer; LocalExecutor on SQLite, or CeleryExecutor with named workers) under a
  private ``AIRFLOW_HOME``, driven through the ``airflow`` CLI and the REST API.
* ``services``: :class:`PostgresDatabase` and the Redis/Celery settings of the Celery shape.
* ``procs``: spawning each process in its own group with a log file, and stopping whole groups.
* ``compose``: :class:`Stack`, all of the above started together and stopped in reverse order.

Nothing here prints; everything is logged. Production code never imports this package.
"""

from dflash_pipeline.dev.stack.airflow_stack import AirflowStack, TaskInstanceInfo
from dflash_pipeline.dev.stack.compose import Stack
from dflash_pipeline.dev.stack.fleet import SimFleetProcess
from dflash_pipeline.dev.stack.procs import LOOPBACK, StackError, free_port, process_tree, venv_bin
from dflash_pipeline.dev.stack.s3 import MotoServer, aws_conn_json, aws_env, create_bucket, s3_client
from dflash_pipeline.dev.stack.services import (
    CeleryConfig,
    PostgresDatabase,
    postgres_unavailable,
    redis_unavailable,
    worker_hostname,
)

__all__ = [
    "LOOPBACK",
    "AirflowStack",
    "CeleryConfig",
    "MotoServer",
    "PostgresDatabase",
    "SimFleetProcess",
    "Stack",
    "StackError",
    "TaskInstanceInfo",
    "aws_conn_json",
    "aws_env",
    "create_bucket",
    "free_port",
    "postgres_unavailable",
    "process_tree",
    "redis_unavailable",
    "s3_client",
    "venv_bin",
    "worker_hostname",
]
