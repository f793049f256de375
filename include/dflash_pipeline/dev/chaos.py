"""Randomized fault schedules against real processes: the chunk protocol's proof, not its examples.

One schedule (drawn from a seed, never hand-picked): a moto S3 server behind `S3FaultProxy` (503
SlowDown on any call, 409 on conditional writes, answers lost after the write took effect, an
outage), a simulated fleet (aborted, hung and failed requests, deaths with and without restart),
and one generate worker per server, each in its own process as a mapped Airflow task is, SIGTERMed
or SIGKILLed at random moments and retried (a new try) like Airflow retries a failed task.

Every schedule must end, within a bound, with every planned id exactly once, no unfinished answer
stored and no claim left; `requests wasted` (generation requests beyond one per row) is printed.
`bench/chaos.py` runs many; tests/integration/test_chaos.py runs a few in CI.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.dev.s3faults import S3FaultProxy
from dflash_pipeline.dev.sim import SimConfig, SimFleet
from dflash_pipeline.serving.sglang import ServerSpec, check_health, new_session
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import run_preflight
from dflash_pipeline.steps.validate import ValidationFailed, run_validation

logger = logging.getLogger(__name__)

EXIT_DONE, EXIT_LOST, EXIT_STOPPED, EXIT_OTHER = 0, 3, 4, 1


@dataclass
class Event:
    at_s: float
    kind: str  # "crash" (server), "sigterm" / "sigkill" (worker), "outage" (S3)
    target: int = 0
    arg: float | None = None  # crash: restart after (None = gone for good); outage: seconds


@dataclass
class Schedule:
    seed: int
    n_prompts: int
    save_every: int
    n_servers: int
    s3: dict[str, float]
    servers: list[dict[str, float]]
    events: list[Event]
    lease_s: float = 8.0

    def describe(self) -> str:
        ev = ", ".join(f"{e.kind}{'' if e.kind == 'outage' else e.target}@{e.at_s:.0f}s" for e in self.events)
        s3 = "/".join(f"{self.s3[k]:.0%}" for k in ("slowdown", "conflict", "lost"))
        return f"{self.n_servers} srv, {self.n_prompts} prompts, S3 {s3}; {ev or 'no events'}"


def random_schedule(seed: int, *, outage_s: float = 8.0, s3_only: bool = False,
                    n_servers: int | None = None) -> Schedule:
    """A schedule drawn from `seed`. At least one server never dies for good (a run needs one)."""
    rng = random.Random(f"chaos:{seed}")
    n_servers = n_servers or rng.randint(2, 4)
    s3 = {"slowdown": rng.uniform(0, 0.10), "conflict": rng.uniform(0, 0.15), "lost": rng.uniform(0, 0.05)}
    servers = []
    for _ in range(n_servers):
        servers.append({} if s3_only else {
            "abort_rate": rng.choice([0.0, 0.0, rng.uniform(0, 0.05)]),
            "hang_rate": rng.choice([0.0, 0.0, rng.uniform(0, 0.01)]),
            "error_rate": rng.choice([0.0, rng.uniform(0, 0.1)]),
        })
    events: list[Event] = []
    if not s3_only:
        survivor = rng.randrange(n_servers)
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(["crash", "sigterm", "sigkill", "outage"])
            at = rng.uniform(0.5, 8.0)
            if kind == "crash":
                others = [i for i in range(n_servers) if i != survivor]
                restart = rng.choice([None, rng.uniform(0.5, 4.0)])
                target = rng.choice(others) if others else survivor
                events.append(Event(at, kind, target, restart if others else rng.uniform(0.5, 4.0)))
            elif kind == "outage":
                events.append(Event(at, kind, 0, rng.uniform(1.0, outage_s)))
            else:
                events.append(Event(at, kind, rng.randrange(n_servers)))
    events.sort(key=lambda e: e.at_s)
    return Schedule(seed, rng.randint(300, 700), rng.choice([25, 50, 100]), n_servers, s3, servers, events)


@dataclass
class ChaosResult:
    seed: int
    schedule: str
    rows: int = 0
    completions: int = 0
    errors: int = 0
    missing: int = 0
    duplicated: int = 0
    unfinished_stored: int = 0
    claims_left: int = 0
    requests: int = 0
    wasted: int = 0
    tries: int = 0
    wall_s: float = 0.0
    hung: bool = False
    s3_faults: dict[str, int] = field(default_factory=dict)
    log_dir: str = ""

    @property
    def ok(self) -> bool:
        return not self.hung and self.missing == 0 and self.duplicated == 0 and self.unfinished_stored == 0 \
            and self.claims_left == 0 and self.rows > 0


def _prompts(n: int, seed: int) -> bytes:
    return "\n".join(json.dumps({"id": f"c{seed}-{i:05d}", "prompt": f"Chaos {seed}: is {1000 + 13 * i} prime?"})
                     for i in range(n)).encode()


def _spawn(spec: dict[str, Any], log_dir: str) -> subprocess.Popen[bytes]:
    log = open(os.path.join(log_dir, f"w{spec['map_index']}-try{spec['try']}.log"), "wb")  # noqa: SIM115
    with log:  # the child holds its own descriptor
        return subprocess.Popen([sys.executable, "-m", "dflash_pipeline.dev.chaos", "worker", json.dumps(spec)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_schedule(schedule: Schedule, *, s3_endpoint: str, s3_port: int, bucket: str, s3_client: Any,
                 bound_s: float = 240.0, token_time_s: float = 0.002, log_dir: str | None = None) -> ChaosResult:
    """Run one schedule to its end (or `bound_s`: a hang) and check the dataset from moto directly."""
    sc = schedule
    result = ChaosResult(sc.seed, sc.describe())
    root = f"chaos/{sc.seed}-{int(time.time() * 1000)}"
    s3_client.put_object(Bucket=bucket, Key=f"{root}/prompts.jsonl", Body=_prompts(sc.n_prompts, sc.seed))
    configs = [SimConfig(token_time_s=token_time_s, length_scale=0.05, max_running_requests=6, hang_s=60.0,
                         fault_seed=sc.seed * 10 + i, **knobs) for i, knobs in enumerate(sc.servers)]
    params = {
        "prompts_uri": f"s3://{bucket}/{root}/prompts.jsonl", "output_uri": f"s3://{bucket}/{root}/ds",
        "save_every": sc.save_every, "request_timeout_s": 12, "server_lost_after_s": 10,
        "server_handoff_after_s": 1, "claim_lease_s": sc.lease_s, "max_attempts": 6,
    }
    log_dir = log_dir or tempfile.mkdtemp(prefix=f"chaos-{sc.seed}-")
    result.log_dir = log_dir
    proxy = S3FaultProxy(s3_port, seed=sc.seed, **sc.s3).start()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        with SimFleet(configs) as fleet:
            params["servers"] = fleet.urls
            cfg = RunConfig.from_params(params)
            run_id = f"chaos-{sc.seed}"
            run_plan(s3_client, cfg, run_id)
            infos = run_preflight(s3_client, cfg, [ServerSpec(u, u) for u in fleet.urls], run_id)
            tries = [0] * sc.n_servers
            done = [False] * sc.n_servers
            env_spec = {"endpoint": proxy.url, "params": params, "run_id": run_id}

            def start(i: int) -> None:
                tries[i] += 1
                result.tries += 1
                procs[i] = _spawn({**env_spec, "map_index": i, "server": infos[i], "try": tries[i]}, log_dir)

            for i in range(sc.n_servers):
                start(i)
            t0 = time.monotonic()
            pending = list(sc.events)
            retry_at: dict[int, float] = {}
            while not all(done):
                now = time.monotonic() - t0
                if now > bound_s:
                    result.hung = True
                    break
                while pending and pending[0].at_s <= now:
                    ev = pending.pop(0)
                    if ev.kind == "crash":
                        fleet.servers[ev.target].crash(ev.arg)
                    elif ev.kind == "outage":
                        proxy.outage(ev.arg or 1.0)
                    elif ev.target in procs and procs[ev.target].poll() is None:
                        sig = signal.SIGTERM if ev.kind == "sigterm" else signal.SIGKILL
                        os.killpg(procs[ev.target].pid, sig)
                for i, p in list(procs.items()):
                    code = p.poll()
                    if code is None:
                        continue
                    del procs[i]
                    if code == EXIT_DONE:
                        done[i] = True
                    else:
                        # Airflow would retry the failed task after its retry delay.
                        retry_at[i] = time.monotonic() + 1.0
                for i, at in list(retry_at.items()):
                    if time.monotonic() >= at:
                        del retry_at[i]
                        start(i)
                time.sleep(0.1)
            result.wall_s = round(time.monotonic() - t0, 1)
            result.requests = sum(s.stats()["generation_requests"] for s in fleet.servers)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        proxy.stop()
    result.s3_faults = dict(proxy.counts)
    layout = DatasetLayout.from_uri(params["output_uri"])
    store = Store(s3_client, bucket)
    try:
        report = run_validation(s3_client, params["output_uri"])
    except ValidationFailed:
        report = json.loads(store.get(layout.report_key)[0])  # type: ignore[index]
    result.completions, result.errors = report["completions"], report["errors"]
    result.rows = report["completions"] + report["errors"]
    result.missing, result.duplicated = report["missing"], report["duplicates"]
    for obj in store.list(layout.completions_prefix):
        got = store.get(obj.key)
        for row in decode_part(got[0]).to_pylist() if got else []:
            if not row.get("error_class") and row.get("finish_reason") not in ("stop", "length"):
                result.unfinished_stored += 1
    result.claims_left = sum(1 for _ in store.list(layout.claims_prefix))
    result.wasted = result.requests - result.completions
    return result


def _worker_main(spec: dict[str, Any]) -> int:
    """One generate task (a child process): SIGTERM asks it to stop, as tasks.generate arranges."""
    from dflash_pipeline.dev.stack import s3_client
    from dflash_pipeline.steps.generate import ServerLost, TaskStopped, Worker, settings_for

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(name)s %(message)s")
    cfg = RunConfig.from_params(spec["params"])
    layout = DatasetLayout.from_uri(cfg.output_uri)
    store = Store(s3_client(spec["endpoint"]), layout.bucket)
    manifest = json.loads(store.get(layout.manifest_key)[0])  # type: ignore[index]
    i = int(spec["map_index"])
    settings = settings_for(cfg, run_id=spec["run_id"], map_index=i, server=ServerSpec(spec["server"]["server"],
                            spec["server"]["server"]), server_info=spec["server"], try_number=int(spec["try"]),
                            backoff_base_s=0.1, backoff_cap_s=1.0, poll_s=0.3, store_deadline_s=120.0)
    worker = Worker(store, layout, manifest, settings)
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    # As tasks.generate: nothing to do ends the task; else wait for the server's /health first.
    if worker.all_done():
        return EXIT_DONE
    session = new_session()
    waited = time.monotonic()
    while not check_health(session, settings.server, timeout_s=2.0):
        if time.monotonic() - waited > cfg.server_lost_after_s:
            return EXIT_LOST
        time.sleep(0.5)
    try:
        worker.run()
    except ServerLost:
        return EXIT_LOST
    except TaskStopped:
        return EXIT_STOPPED
    except Exception:  # noqa: BLE001 - a failed try; the supervisor retries it
        logger.exception("worker %s failed", settings.worker)
        return EXIT_OTHER
    return EXIT_DONE


def schedule_dict(schedule: Schedule) -> dict[str, Any]:
    return asdict(schedule)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(_worker_main(json.loads(sys.argv[2])))
    sys.exit("usage: python -m dflash_pipeline.dev.chaos worker SPEC_JSON (bench/chaos.py runs schedules)")
