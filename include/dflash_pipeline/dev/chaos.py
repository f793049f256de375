"""Randomized fault schedules against real processes: the chunk protocol's proof, not its examples.

One schedule (drawn from a seed, never hand-picked): a moto S3 server behind `S3FaultProxy` (503
SlowDown on any call, 409 on conditional writes, answers lost after the write took effect, an
outage), a simulated fleet (aborted, hung and failed requests, deaths with and without restart),
and one generate worker per server, each in its own process as a mapped Airflow task is, SIGTERMed
or SIGKILLed at random moments and retried (a new try) like Airflow retries a failed task.

Most schedules also inject faults at the protocol's own state transitions (dev/transitions.py:
delays, leases lost to a peer, a stop landing in a window, checkpoints in flight at the stop),
drawn from a stream of the seed of their own, so a seed's S3, server and worker events stay what
they were before transition faults existed. Most also get liveness faults (dev/chaos_liveness.py:
whole chunks of prompts no server can serve, servers busy enough to shed requests with 503), from a
stream of their own too; the unservable prompts must end as ContextLengthExceeded error rows.

Every schedule must end, within a bound, with every planned id exactly once, no unfinished answer
stored and no claim left; `requests wasted` (generation requests beyond one per row) is printed.
Stops are measured: every SIGTERM the runner sends and every stop a transition fault requests, to
the process's exit; one longer than `stop_grace_s + STOP_MARGIN_S` fails the schedule. A process
that does not end within `HANG_AFTER_STOP_S` of a stop, or a schedule still running at `bound_s`,
is a hang: the runner asks the child for a thread dump (SIGUSR1, `faulthandler`), puts it in the
result and SIGKILLs the process.
`bench/chaos.py` runs many; tests/integration/test_chaos.py runs a few in CI.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout, chunk_of_key
from dflash_pipeline.dataset.records import decode_part
from dflash_pipeline.dataset.store import Store
from dflash_pipeline.dev.chaos_liveness import (
    Busy,
    LivenessFaults,
    check_unservable,
    draw_liveness,
    liveness_prompts,
    run_params,
    sim_knobs,
    start_busy,
    unservable_ids,
)
from dflash_pipeline.dev.s3faults import S3FaultProxy
from dflash_pipeline.dev.sim import SimConfig, SimFleet
from dflash_pipeline.dev.sim.slowprobe import set_probe_delay
from dflash_pipeline.dev.transitions import FAULT_MARK, PEER_OWNER, STOP_MARK, TransitionFaults, TransitionRates
from dflash_pipeline.serving.sglang import ServerSpec, check_health, new_session
from dflash_pipeline.steps.generate.chunks import claim_doc
from dflash_pipeline.steps.plan import run_plan
from dflash_pipeline.steps.preflight import run_preflight
from dflash_pipeline.steps.validate import ValidationFailed, run_validation

logger = logging.getLogger(__name__)

EXIT_DONE, EXIT_LOST, EXIT_STOPPED, EXIT_OTHER = 0, 3, 4, 1
#: The stop grace the schedules run with (WorkerSettings' default, set explicitly so the bound
#: below does not move if the default does).
STOP_GRACE_S = 3.0
#: A stop may take `stop_grace_s` plus this, from the SIGTERM to the process's exit. Airflow 3's task
#: supervisor SIGKILLs a task 5 s after its SIGTERM (`ActivitySubprocess.kill(SIGTERM, force=True)`,
#: `escalation_delay=5.0`), which loses whatever the stop had not saved yet. The worker's stop ends by
#: its absolute deadline (`stop_grace_s` after the request); the margin covers what follows in a real
#: process: the signal reaching Python's main thread, the interpreter's exit, and this runner's
#: 50 ms poll. 3 + 1.5 = 4.5 s leaves half a second before the supervisor's SIGKILL.
STOP_MARGIN_S = 1.5
#: A SIGTERM event at or after this (seconds into the schedule) reaches a child whose handler is in.
SURE_SIGTERM_S = 2.0
#: A process still alive this long after a stop is hung: dumped, counted, SIGKILLed.
HANG_AFTER_STOP_S = 20.0
#: The child dumps every thread's stack (faulthandler) into its log on this signal.
DUMP_SIGNAL = signal.SIGUSR1
DUMP_WAIT_S = 1.0
#: The child logs this once its stop handler is in.
READY_MARK = "chaos-ready"
_DUMP_LINE = re.compile(r'^(Current thread|Thread) 0x[0-9a-f]+|^  File "|^  <no Python frame>|chaos-threads ')
_FAULT_LINE = re.compile(rf"{FAULT_MARK} kind=(\w+)")
_STOP_LINE = re.compile(rf"{STOP_MARK} by=(\w+) t=([0-9.]+)")


@dataclass
class Event:
    at_s: float
    kind: str  # "crash" (server), "sigterm" / "sigkill" (worker), "outage" (S3)
    target: int = 0
    arg: float | None = None  # crash: restart after (None = gone for good); outage, s3_slow, probe_slow: seconds
    delay_s: float | None = None  # s3_slow, probe_slow: how late each call is answered


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
    stop_grace_s: float = STOP_GRACE_S
    transitions: TransitionRates = field(default_factory=TransitionRates)
    liveness: LivenessFaults = field(default_factory=LivenessFaults)

    def describe(self) -> str:
        ev = ", ".join(f"{e.kind}{'' if e.kind == 'outage' else e.target}@{e.at_s:.0f}s" for e in self.events)
        s3 = "/".join(f"{self.s3[k]:.0%}" for k in ("slowdown", "conflict", "lost"))
        t = f"; {self.transitions.describe()}" if self.transitions.any else ""
        t += f"; {self.liveness.describe()}" if self.liveness.any else ""
        return f"{self.n_servers} srv, {self.n_prompts} prompts, S3 {s3}; {ev or 'no events'}{t}"


def random_schedule(seed: int, *, outage_s: float = 8.0, s3_only: bool = False,
                    n_servers: int | None = None, transitions: bool = True,
                    always_transitions: bool = False, liveness: bool = True,
                    always_liveness: bool = False) -> Schedule:
    """A schedule drawn from `seed`. At least one server never dies for good (a run needs one).

    Transition faults (`transitions`; none with `s3_only`) come from a stream of their own, so the
    rest of a seed's schedule is the same with or without them; most schedules draw some
    (`always_transitions`: every one)."""
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
    if not s3_only:
        events += draw_liveness_events(seed, n_servers)
    events.sort(key=lambda e: e.at_s)
    sc = Schedule(seed, rng.randint(300, 700), rng.choice([25, 50, 100]), n_servers, s3, servers, events)
    if transitions and not s3_only:
        sc.transitions = TransitionRates.draw(random.Random(f"chaos-transitions:{seed}"), always=always_transitions)
        # Every schedule measures a stop: unless a SIGTERM comes once the tasks are surely running (one
        # before ~1.5 s can land before a child's handler is in, and just ends it), each task's first
        # try stops itself early.
        if not any(e.kind == "sigterm" and e.at_s >= SURE_SIGTERM_S for e in events):
            sc.transitions = sc.transitions.with_certain_stop()
    if liveness and not s3_only:
        sc.liveness = draw_liveness(seed, sc.n_prompts, sc.save_every, n_servers, always=always_liveness)
    return sc


# -- liveness faults (issue 31, part B) ---------------------------------------------------------------
#: S3 calls that succeed, slowly (every request held `delay_s` before it is forwarded, for `arg`
#: seconds), and a server whose load probes (/v1/loads, /get_load, /metrics) answer `delay_s` late for
#: `arg` seconds (dev/sim/slowprobe.py). Neither fails anything: they find waits that take no deadline
#: (a stop that waits for a slow scan, a sweep or the concurrency pilot's probe).
LIVENESS_KINDS = ("s3_slow", "probe_slow")


def draw_liveness_events(seed: int, n_servers: int) -> list[Event]:
    """Liveness faults of one schedule, from a stream of their own (the rest of a seed's schedule is
    the same with or without them): about half the schedules slow S3, about half a server's probes."""
    rng = random.Random(f"chaos-liveness:{seed}")
    events: list[Event] = []
    if rng.random() < 0.5:
        events.append(Event(rng.uniform(1.0, 10.0), "s3_slow", 0, rng.uniform(2.0, 8.0), rng.uniform(0.5, 4.0)))
    if rng.random() < 0.5:
        events.append(Event(rng.uniform(0.5, 8.0), "probe_slow", rng.randrange(n_servers), rng.uniform(3.0, 12.0),
                            rng.uniform(2.0, 8.0)))
    return events


def apply_liveness_event(ev: Event, fleet: SimFleet, proxy: S3FaultProxy) -> None:
    """Start one liveness fault; each ends by itself after `ev.arg` seconds."""
    window = ev.arg or 1.0
    delay = ev.delay_s or 1.0
    if ev.kind == "s3_slow":
        proxy.add_rule(delay_s=delay, until=time.monotonic() + window)
    elif ev.kind == "probe_slow":
        sim = fleet.servers[ev.target]
        set_probe_delay(sim, delay)
        timer = threading.Timer(window, set_probe_delay, (sim, 0.0))
        timer.daemon = True
        timer.start()


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
    #: Each claim left: its key, its document and age, and whether its chunk's part exists.
    claims_left_detail: list[str] = field(default_factory=list)
    #: Claims of the injected peer (dev/transitions.py) left on committed chunks, deleted at the end as
    #: that peer's retry would; not the workers' doing, not counted in `claims_left`.
    peer_claims_swept: int = 0
    requests: int = 0
    wasted: int = 0
    tries: int = 0
    #: Tries that ended with an unexpected exception (exit 1): a schedule failure (the supervisor would
    #: retry them, but no injected fault should raise anything but ServerLost or TaskStopped).
    failed_tries: int = 0
    failed_tries_detail: list[str] = field(default_factory=list)
    #: SIGTERMs that reached a process before its stop handler was in (they end it; not measured).
    early_sigterms: int = 0
    #: Stops a SIGKILL pre-empted (not measured): a try killed after its stop began, or, with
    #: `stop_first`, a first try killed before it reached the transition where it stops itself.
    stops_preempted: int = 0
    #: Errors a worker's threads logged ("the ... thread failed"), a schedule failure.
    thread_errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    hung: bool = False
    hangs: list[str] = field(default_factory=list)
    #: Every measured stop (SIGTERM or a stop a transition fault requested -> process exit), seconds.
    stops: list[float] = field(default_factory=list)
    stop_bound_s: float = STOP_GRACE_S + STOP_MARGIN_S
    slow_stops: list[str] = field(default_factory=list)
    protocol_errors: list[str] = field(default_factory=list)
    #: Liveness faults (chaos_liveness.py): requests the busy servers shed (503 queue full), unservable
    #: prompts; and any unservable prompt that did not end as a ContextLengthExceeded error row.
    liveness: dict[str, int] = field(default_factory=dict)
    liveness_problems: list[str] = field(default_factory=list)
    thread_dumps: list[str] = field(default_factory=list)
    s3_faults: dict[str, int] = field(default_factory=dict)
    transition_faults: dict[str, int] = field(default_factory=dict)
    log_dir: str = ""

    @property
    def max_stop_s(self) -> float:
        return max(self.stops, default=0.0)

    @property
    def ok(self) -> bool:
        return not self.hung and self.missing == 0 and self.duplicated == 0 and self.unfinished_stored == 0 \
            and self.claims_left == 0 and self.rows > 0 and not self.slow_stops and not self.protocol_errors \
            and self.failed_tries == 0 and not self.thread_errors and not self.liveness_problems


def _prompts(n: int, seed: int) -> bytes:
    return "\n".join(json.dumps({"id": f"c{seed}-{i:05d}", "prompt": f"Chaos {seed}: is {1000 + 13 * i} prime?"})
                     for i in range(n)).encode()


class _Proc:
    """One try of one task: its process, its log, and the stop being measured."""

    def __init__(self, index: int, try_number: int, spec: dict[str, Any], log_dir: str) -> None:
        self.index = index
        self.try_number = try_number
        self.log_path = os.path.join(log_dir, f"w{index}-try{try_number}.log")
        with open(self.log_path, "wb") as log:  # the child holds its own descriptor
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "dflash_pipeline.dev.chaos", "worker", json.dumps(spec)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.exit_t: float | None = None  # monotonic, set by the waiter thread
        self.stop_t: float | None = None  # monotonic, when its stop was requested
        self.stop_by = ""
        self.killed = False  # SIGKILLed by the runner: its stop, if any, is not measured
        self.slow_dumped = False
        self.ready = False  # the child logged READY_MARK: its stop handler is in
        self._log_offset = 0
        self._log_rest = b""
        threading.Thread(target=self._wait, name=f"wait-w{index}", daemon=True).start()

    def _wait(self) -> None:
        self.popen.wait()
        self.exit_t = time.monotonic()

    @property
    def name(self) -> str:
        return f"w{self.index} try{self.try_number}"

    @property
    def ended(self) -> bool:
        return self.exit_t is not None

    def send(self, sig: signal.Signals) -> None:
        if self.ended:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stopping(self, t: float, by: str) -> None:
        if self.stop_t is None:
            self.stop_t, self.stop_by = t, by

    def scan_log(self) -> None:
        """Read what the child logged since the last call; a stop a transition fault requested
        starts the stop's clock (from the child's wall-clock stamp)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                data = f.read()
        except OSError:
            return
        self._log_offset += len(data)
        lines = (self._log_rest + data).split(b"\n")
        self._log_rest = lines.pop()
        for raw in lines:
            if READY_MARK.encode() in raw:
                self.ready = True
            m = _STOP_LINE.search(raw.decode(errors="replace"))
            if m and m.group(1) == "transition":
                self.stopping(time.monotonic() - max(0.0, time.time() - float(m.group(2))), "transition")

    def last_error(self) -> str:
        """The last exception line of the child's log (what ended a failed try)."""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            return "?"
        starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last):")]
        if not starts:
            return "no traceback in the log"
        return next((ln for ln in lines[starts[-1] + 1:] if ln and not ln[0].isspace()), "?")

    def thread_dump(self, why: str) -> str:
        """Ask the child for every thread's stack and return it (from its log)."""
        head = f"--- {self.name} ({self.log_path}): {why}"
        if self.ended:
            return f"{head}: exited before the dump"
        offset = os.path.getsize(self.log_path)
        try:
            os.kill(self.popen.pid, DUMP_SIGNAL)
        except ProcessLookupError:
            return f"{head}: gone before the dump"
        time.sleep(DUMP_WAIT_S)
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        dump = [line for line in text.splitlines() if _DUMP_LINE.search(line)]
        return "\n".join([head, *dump]) if dump else f"{head}: no dump in the log"


def run_schedule(schedule: Schedule, *, s3_endpoint: str, s3_port: int, bucket: str, s3_client: Any,
                 bound_s: float = 240.0, token_time_s: float = 0.002, log_dir: str | None = None,
                 hang_after_stop_s: float = HANG_AFTER_STOP_S) -> ChaosResult:
    """Run one schedule to its end (or `bound_s`: a hang) and check the dataset from moto directly.
    `s3_endpoint` is moto itself: the workers talk to it through the fault front, the injected peer
    (transition faults) directly."""
    sc = schedule
    result = ChaosResult(sc.seed, sc.describe(), stop_bound_s=sc.stop_grace_s + STOP_MARGIN_S)
    root = f"chaos/{sc.seed}-{int(time.time() * 1000)}"
    long = unservable_ids(sc.liveness, sc.n_prompts, sc.save_every, sc.n_servers)
    s3_client.put_object(Bucket=bucket, Key=f"{root}/prompts.jsonl",
                         Body=liveness_prompts(sc.seed, sc.n_prompts, long) if long else _prompts(sc.n_prompts, sc.seed))
    configs = [SimConfig(token_time_s=token_time_s, length_scale=0.05, max_running_requests=6, hang_s=60.0,
                         fault_seed=sc.seed * 10 + i, **knobs, **sim_knobs(sc.liveness))
               for i, knobs in enumerate(sc.servers)]
    params: dict[str, Any] = {
        "prompts_uri": f"s3://{bucket}/{root}/prompts.jsonl", "output_uri": f"s3://{bucket}/{root}/ds",
        "save_every": sc.save_every, "request_timeout_s": 12, "server_lost_after_s": 10,
        "server_handoff_after_s": 1, "claim_lease_s": sc.lease_s, "max_attempts": 6,
        **run_params(sc.liveness),
    }
    # WorkerSettings that are not run params: the stop grace, and how often checkpoints are taken.
    worker_settings = {"stop_grace_s": sc.stop_grace_s, "checkpoint_every_s": sc.transitions.checkpoint_every_s}
    log_dir = log_dir or tempfile.mkdtemp(prefix=f"chaos-{sc.seed}-")
    result.log_dir = log_dir
    proxy = S3FaultProxy(s3_port, seed=sc.seed, **sc.s3).start()
    procs: dict[int, _Proc] = {}
    try:
        with SimFleet(configs) as fleet:
            params["servers"] = fleet.urls
            cfg = RunConfig.from_params(params)
            run_id = f"chaos-{sc.seed}"
            run_plan(s3_client, cfg, run_id)
            infos = run_preflight(s3_client, cfg, [ServerSpec(u, u) for u in fleet.urls], run_id)
            tries = [0] * sc.n_servers
            done = [False] * sc.n_servers
            env_spec = {"endpoint": proxy.url, "direct_endpoint": s3_endpoint, "params": params, "run_id": run_id,
                        "seed": sc.seed, "worker": worker_settings, "transitions": sc.transitions.to_dict()}

            def start(i: int) -> None:
                tries[i] += 1
                result.tries += 1
                spec = {**env_spec, "map_index": i, "server": infos[i], "try": tries[i]}
                procs[i] = _Proc(i, tries[i], spec, log_dir)

            for i in range(sc.n_servers):
                start(i)
            t0 = time.monotonic()
            pending = sorted([*sc.events, *(Event(b.at_s, "busy", b.target, b.duration_s) for b in sc.liveness.busy)],
                             key=lambda e: e.at_s)
            retry_at: dict[int, float] = {}
            while not all(done):
                now = time.monotonic() - t0
                if now > bound_s:
                    result.hung = True
                    result.hangs.append(f"schedule still running after {bound_s:.0f}s")
                    for p in procs.values():
                        result.thread_dumps.append(p.thread_dump(f"schedule still running after {bound_s:.0f}s"))
                    break
                while pending and pending[0].at_s <= now:
                    ev = pending.pop(0)
                    if ev.kind == "busy":
                        start_busy(fleet.servers[ev.target], Busy(ev.at_s, ev.target, ev.arg or 1.0))
                    elif ev.kind == "crash":
                        fleet.servers[ev.target].crash(ev.arg)
                    elif ev.kind == "outage":
                        proxy.outage(ev.arg or 1.0)
                    elif ev.kind in LIVENESS_KINDS:
                        apply_liveness_event(ev, fleet, proxy)
                    elif ev.target in procs and not procs[ev.target].ended:
                        p = procs[ev.target]
                        if ev.kind == "sigterm":
                            p.scan_log()
                            if p.ready:  # before its handler is in, a SIGTERM just ends the process
                                p.stopping(time.monotonic(), "sigterm")
                            else:
                                result.early_sigterms += 1
                            p.send(signal.SIGTERM)
                        else:
                            p.scan_log()
                            if p.stop_t is not None or (sc.transitions.stop_first and p.try_number == 1):
                                result.stops_preempted += 1
                            p.killed = True
                            p.send(signal.SIGKILL)
                for i, p in list(procs.items()):
                    p.scan_log()
                    if not p.ended:
                        if p.stop_t is not None and not p.killed:
                            waited = time.monotonic() - p.stop_t
                            if waited > result.stop_bound_s and not p.slow_dumped:
                                # recorded now: a SIGKILL event may end the process before it exits
                                p.slow_dumped = True
                                result.slow_stops.append(f"{p.name} ({p.stop_by}): not ended {waited:.2f}s after "
                                                         "its stop")
                                result.thread_dumps.append(p.thread_dump(
                                    f"not ended {waited:.1f}s after its stop ({p.stop_by}; bound "
                                    f"{result.stop_bound_s:.1f}s)"))
                            elif waited > hang_after_stop_s:
                                result.hung = True
                                result.hangs.append(f"{p.name} not ended {waited:.0f}s after its stop ({p.stop_by})")
                                result.thread_dumps.append(p.thread_dump(f"hung {waited:.0f}s after its stop"))
                                p.killed = True  # as the supervisor would; the task is retried
                                p.send(signal.SIGKILL)
                        continue
                    del procs[i]
                    p.scan_log()  # a stop marker written just before the exit
                    if p.stop_t is not None and not p.killed and p.exit_t is not None:
                        took = p.exit_t - p.stop_t
                        result.stops.append(round(took, 2))
                        if took > result.stop_bound_s and not p.slow_dumped:
                            result.slow_stops.append(f"{p.name} ({p.stop_by}): {took:.2f}s")
                    code = p.popen.returncode
                    if code == EXIT_OTHER:
                        result.failed_tries += 1
                        result.failed_tries_detail.append(f"{p.name}: {p.last_error()}")
                    if code == EXIT_DONE:
                        done[i] = True
                    else:
                        # Airflow would retry the failed task after its retry delay.
                        retry_at[i] = time.monotonic() + 1.0
                for i, at in list(retry_at.items()):
                    if time.monotonic() >= at:
                        del retry_at[i]
                        start(i)
                time.sleep(0.05)
            result.wall_s = round(time.monotonic() - t0, 1)
            result.requests = sum(s.stats()["generation_requests"] for s in fleet.servers)
            result.liveness = {"queue_full": sum(s.stats()["rejected_queue_full"] for s in fleet.servers),
                               "unservable": len(long)}
    finally:
        for p in procs.values():
            p.send(signal.SIGKILL)
            p.popen.wait(timeout=10)
        proxy.stop()
    result.s3_faults = dict(proxy.counts)
    _read_logs(log_dir, result)
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
    for obj in store.list(layout.claims_prefix):
        got = store.get(obj.key)
        c = chunk_of_key(obj.key, layout.claims_prefix)
        if got is not None and claim_doc(got[0]).get("owner") == PEER_OWNER and c is not None \
                and store.head(layout.part_key(c)) is not None:
            store.delete(obj.key)  # the injected peer died holding it; its retry would delete it
            result.peer_claims_swept += 1
        else:
            result.claims_left += 1
            age = (store.server_time() - obj.last_modified).total_seconds()
            part = c is not None and store.head(layout.part_key(c)) is not None
            result.claims_left_detail.append(
                f"{obj.key} etag {obj.etag} modified {obj.last_modified:%H:%M:%S} ({age:.0f}s before the check), "
                f"part {'committed' if part else 'absent'}: {got[0].decode(errors='replace') if got else 'gone'}")
    result.wasted = result.requests - result.completions
    if long:
        result.liveness_problems = check_unservable(
            [row for obj in store.list(layout.completions_prefix)
             for got in [store.get(obj.key)] if got for row in decode_part(got[0]).to_pylist()], sc.seed, long)
    return result


def _read_logs(log_dir: str, result: ChaosResult) -> None:
    """The transition faults every try injected (SIGKILLed ones included) and any ProtocolError."""
    counts: Counter[str] = Counter()
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name), errors="replace") as f:
            for line in f:
                m = _FAULT_LINE.search(line)
                if m:
                    counts[m.group(1)] += 1
                if "chunks.ProtocolError: " in line and len(result.protocol_errors) < 10:
                    result.protocol_errors.append(f"{name}: {line.strip()}")
                if " thread failed: " in line and len(result.thread_errors) < 10:
                    result.thread_errors.append(f"{name}: {line.strip()}")
    result.transition_faults = dict(sorted(counts.items()))


def _worker_main(spec: dict[str, Any]) -> int:
    """One generate task (a child process): SIGTERM asks it to stop, as tasks.generate arranges;
    SIGUSR1 dumps every thread's stack into its log."""
    from dflash_pipeline.dataset.store import StoreUnavailable, with_retries
    from dflash_pipeline.dev.stack import s3_client
    from dflash_pipeline.steps.generate import ServerLost, TaskStopped, Worker, settings_for
    from dflash_pipeline.steps.generate.stopsignal import SignalStop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(name)s %(message)s")

    def thread_names(*_: Any) -> None:
        logger.warning("chaos-threads %s", {f"0x{t.ident:016x}": t.name for t in threading.enumerate() if t.ident})

    # The Python handler logs the threads' names; faulthandler (chained, C level) dumps their stacks at
    # once, whatever the main thread is doing.
    signal.signal(DUMP_SIGNAL, thread_names)
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=True)
    cfg = RunConfig.from_params(spec["params"])
    layout = DatasetLayout.from_uri(cfg.output_uri)
    store = Store(s3_client(spec["endpoint"]), layout.bucket)
    i = int(spec["map_index"])
    settings = settings_for(cfg, run_id=spec["run_id"], map_index=i, server=ServerSpec(spec["server"]["server"],
                            spec["server"]["server"]), server_info=spec["server"], try_number=int(spec["try"]),
                            backoff_base_s=0.1, backoff_cap_s=1.0, poll_s=0.3, store_deadline_s=120.0,
                            **spec.get("worker", {}))
    peer_store = Store(s3_client(spec.get("direct_endpoint") or spec["endpoint"]), layout.bucket)
    faults = TransitionFaults(TransitionRates(**spec.get("transitions", {})),
                              seed=f"transitions:{spec.get('seed', 0)}:{i}:{spec['try']}", peer_store=peer_store,
                              stop_grace_s=settings.stop_grace_s, try_number=int(spec["try"]))
    # A SIGTERM before the worker exists is remembered and passed on when it is attached. As in
    # tasks.generate, the stop is requested from a thread of its own, not inside the handler.
    SignalStop(lambda: faults.request_stop("signal"), chain=False).__enter__()
    logger.info(READY_MARK)
    # As tasks.generate: the manifest is read with retries (a try started during an S3 outage waits);
    # nothing to do ends the task; else it waits for the server's /health first.
    try:
        got = with_retries(lambda: store.get(layout.manifest_key), what="manifest",
                           deadline_s=settings.store_deadline_s, should_stop=lambda: faults.stopping)
    except StoreUnavailable:
        if faults.stopping:
            return EXIT_STOPPED
        raise
    manifest = json.loads(got[0])  # type: ignore[index]
    worker = Worker(store, layout, manifest, settings, transition_hook=faults)
    faults.attach(worker)
    try:
        if worker.all_done():
            return EXIT_DONE
    except StoreUnavailable:
        if faults.stopping:
            return EXIT_STOPPED
        raise
    session = new_session()
    waited = time.monotonic()
    while not check_health(session, settings.server, timeout_s=2.0):
        if faults.stopping:
            return EXIT_STOPPED
        if time.monotonic() - waited > cfg.server_lost_after_s:
            logger.warning("server %s not healthy for %.0fs: lost", settings.server.name, cfg.server_lost_after_s)
            return EXIT_LOST
        time.sleep(0.5)
    code = EXIT_OTHER
    try:
        worker.run()
        code = EXIT_DONE
    except ServerLost:
        code = EXIT_LOST
    except TaskStopped:
        code = EXIT_STOPPED
    except Exception:  # noqa: BLE001 - a failed try; the supervisor retries it
        logger.exception("worker %s failed", settings.worker)
    finally:
        # Evidence for a claim left behind: what this try still held as it ended.
        held = [(lease.chunk, lease.state.value) for lease in worker.leases.live()]
        logger.info("chaos-exit code=%d leases still held %s", code, held)
    return code


def schedule_dict(schedule: Schedule) -> dict[str, Any]:
    return asdict(schedule)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(_worker_main(json.loads(sys.argv[2])))
    sys.exit("usage: python -m dflash_pipeline.dev.chaos worker SPEC_JSON (bench/chaos.py runs schedules)")
