"""The simulated GPU fleet of the dev stack: ``python -m dflash_pipeline.dev.sim`` as one process.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from dflash_pipeline.dev.stack.procs import StackError, spawn, stop_process_groups, tail

log = logging.getLogger(__name__)


class SimFleetProcess:
    """``python -m dflash_pipeline.dev.sim --count N --urls-file PATH [extra_args]`` as a subprocess.

    ``settings`` is a convenience for ``--set key=value`` pairs (appended after ``extra_args``);
    ``engines`` gives server i the wire flavour ``engines[i]`` ("sglang" or "vllm"; a mixed fleet).
    :attr:`urls` holds the ``count`` base URLs once :meth:`start` has returned.
    """

    def __init__(
        self,
        count: int,
        extra_args: Sequence[str] = (),
        *,
        settings: Mapping[str, object] | None = None,
        workdir: Path | None = None,
        engines: Sequence[str] | None = None,
    ) -> None:
        if count < 1:
            raise ValueError("count must be >= 1")
        if engines is not None and len(engines) != count:
            raise ValueError(f"engines lists {len(engines)} servers, count is {count}")
        self.count = count
        self.extra_args = list(extra_args)
        for key, value in (settings or {}).items():
            self.extra_args += ["--set", f"{key}={value}"]
        for index, engine in enumerate(engines or ()):
            self.extra_args += ["--server-set", f"{index}:engine={engine}"]
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
            sys.executable, "-m", "dflash_pipeline.dev.sim",
            "--count", str(self.count), "--urls-file", str(urls_file), *self.extra_args,
        ]  # fmt: skip
        started = time.monotonic()
        self._proc = spawn(argv, env=None, log_path=self.log_path)
        deadline = started + timeout_s
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise StackError(f"simulated fleet exited with {code}:\n{tail(self.log_path)}")
            if urls_file.exists():
                lines = [ln.strip() for ln in urls_file.read_text().splitlines() if ln.strip()]
                if len(lines) >= self.count and all(ln.startswith("http") for ln in lines):
                    self.urls = lines[: self.count]
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise StackError(f"simulated fleet not listening within {timeout_s} s:\n{tail(self.log_path)}")
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


