"""moto S3 + the simulated fleet + Airflow, started together and stopped in reverse order.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from dflash_pipeline.dev.stack.airflow_stack import AirflowStack, StackMode
from dflash_pipeline.dev.stack.fleet import SimFleetProcess
from dflash_pipeline.dev.stack.s3 import MotoServer

log = logging.getLogger(__name__)

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

