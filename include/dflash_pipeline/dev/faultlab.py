"""Fault scenarios against real processes: simulated servers, a real S3-protocol server, a TCP cut.

Used by tests/integration/test_faults.py (which asserts the outcomes) and bench/fault_table.py
(which prints the figures for the notes). Each scenario plans a fresh dataset root, runs one
generate worker per server exactly as the DAG's mapped tasks do (same `Worker`, same settings),
injects its fault, optionally runs a second "repair" run into the same root, and validates.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.steps.generate import ServerLost, Worker, settings_for
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import run_preflight
from dflash_pipeline.steps.validate import ValidationFailed, run_validation

logger = logging.getLogger(__name__)


class TcpCut:
    """A loopback TCP forwarder that can be cut (new connections refused, open ones reset).

    Put between the client and the S3 server, it makes "the S3 endpoint is unreachable for 30 s"
    a real network fault without losing moto's in-memory state.
    """

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.host = host
        probe = socket.socket()
        probe.bind((host, 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> TcpCut:
        self._open()
        return self

    def _open(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((self.host, self.port))
        ls.listen(128)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True, name="tcpcut-accept").start()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        try:
            while True:
                for key, _ in sel.select(timeout=1.0):
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def restore(self) -> None:
        if self._listener is None:
            self._open()

    def stop(self) -> None:
        self.cut()


@dataclass
class FaultResult:
    name: str
    injected: str
    expected: int
    present: int = 0
    duplicated: int = 0
    completions: int = 0
    error_rows: int = 0
    requests: int = 0
    wasted: int = 0
    lost_servers: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    runs: int = 1
    report: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "report"}


def _prompts(n: int, tag: str) -> bytes:
    return "\n".join(
        json.dumps({"id": f"{tag}-{i}", "prompt": f"{tag}: how many primes are below {100 + i}?"}) for i in range(n)
    ).encode()


def run_generation(
    client: Any,
    cfg: RunConfig,
    urls: list[str],
    run_id: str,
    *,
    settings_overrides: dict[str, Any] | None = None,
) -> list[BaseException | dict[str, Any]]:
    """plan + preflight + one Worker thread per server, like one DAG run (retries not included)."""
    run_plan(client, cfg, run_id)
    specs = [ServerSpec(u, u) for u in urls]
    servers = run_preflight(client, cfg, specs, run_id)
    layout = DatasetLayout.from_uri(cfg.output_uri)
    manifest = json.loads(client.get_object(Bucket=layout.bucket, Key=layout.manifest_key)["Body"].read())
    out: list[BaseException | dict[str, Any]] = [None] * len(specs)  # type: ignore[list-item]

    def work(i: int) -> None:
        overrides = {"backoff_base_s": 0.2, "backoff_cap_s": 2.0, "progress_every_s": 5.0, **(settings_overrides or {})}
        settings = settings_for(cfg, run_id=run_id, map_index=i, server=specs[i], server_info=servers[i], **overrides)
        try:
            out[i] = Worker(Store(client, layout.bucket), layout, manifest, settings).run()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            out[i] = exc

    threads = [threading.Thread(target=work, args=(i,), name=f"worker-{i}") for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run_scenario(
    name: str,
    injected: str,
    *,
    s3_client: Any,
    bucket: str,
    fleet: Any,
    n: int = 300,
    params: dict[str, Any] | None = None,
    during: Callable[[], None] | None = None,
    repair_run: bool = False,
    store_client: Any | None = None,
) -> FaultResult:
    """Plan n prompts, generate on `fleet` (a started SimFleet), call `during()` in a thread, validate."""
    key = f"faults/{name}/prompts.jsonl"
    s3_client.put_object(Bucket=bucket, Key=key, Body=_prompts(n, name))
    conf = {
        "prompts_uri": f"s3://{bucket}/{key}",
        "output_uri": f"s3://{bucket}/faults/{name}/ds",
        "servers": fleet.urls,
        "save_every": 25,
        "request_timeout_s": 5,
        "server_lost_after_s": 3,
        "claim_lease_s": 10,
    }
    conf.update(params or {})
    cfg = RunConfig.from_params(conf)
    client = store_client or s3_client
    before = sum(s.stats()["generation_requests"] for s in fleet.servers)
    result = FaultResult(name, injected, n)
    t0 = time.monotonic()
    side = threading.Thread(target=during, daemon=True) if during else None
    if side:
        side.start()
    outcomes = run_generation(client, cfg, fleet.urls, f"{name}-run1")
    if side:
        side.join(timeout=120)
    if repair_run:
        result.runs = 2
        outcomes += run_generation(client, cfg, [s.url for s in fleet.servers if s.up], f"{name}-run2")
    result.wall_s = round(time.monotonic() - t0, 2)
    result.lost_servers = [str(o) for o in outcomes if isinstance(o, ServerLost)]
    unexpected = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, ServerLost)]
    if unexpected:
        raise unexpected[0]
    try:
        report = run_validation(s3_client, cfg.output_uri)
    except ValidationFailed as exc:
        logger.warning("%s: %s", name, exc)
        layout = DatasetLayout.from_uri(cfg.output_uri)
        report = json.loads(s3_client.get_object(Bucket=bucket, Key=layout.report_key)["Body"].read())
    result.report = report
    result.present = report["completions"] + report["errors"]
    result.duplicated = report["duplicates"]
    result.completions = report["completions"]
    result.error_rows = report["errors"]
    result.requests = sum(s.stats()["generation_requests"] for s in fleet.servers) - before
    result.wasted = result.requests - result.completions
    return result
