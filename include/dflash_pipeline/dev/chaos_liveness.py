"""Chaos faults about who decides a server is broken or failing (issue 31, part A), kept apart from
the schedule runner (chaos.py) so each kind stays one small function:

- **unservable chunks**: every prompt of a whole chunk (or two) is longer than every server's
  context, so each is refused with a permanent ContextLengthExceeded (400), whichever server takes
  the chunk. They must end as error rows, exactly once, never as a ServerBroken task failure (a
  failed try fails the schedule) nor a chunk that nobody can commit (a hang).
- **busy servers**: for a few seconds a server generates 20x slower and keeps at most one request
  waiting (SGLang's --max-queued-requests: a request that finds the waiting queue full is refused
  with 503 "The request queue is full.", scheduler `_abort_on_queued_limit`, sglang 0.5.23; the
  simulator's `max_queued_requests` does the same), so long generations fill its slots and the
  rest of our requests are shed. A busy server is not failing: nothing of it may be handed off
  or thrown away for it (the schedule's wasted requests say what it cost).

Drawn from a stream of their own (`chaos-liveness:<seed>`), so a seed's S3, server, worker and
transition events stay what they were before these existed.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.steps.plan import chunk_sizes

#: Room for max_tokens (4096, RunConfig's default) plus a short chaos prompt, never a long one.
CONTEXT_LENGTH = 4096 + 256
LONG_WORDS = 600
BUSY_SLOW_FACTOR = 20.0
BUSY_MAX_QUEUED = 1
#: The chaos fleet's max_running_requests (chaos.run_schedule).
SIM_SLOTS = 6


@dataclass
class Busy:
    at_s: float
    target: int
    duration_s: float


@dataclass
class LivenessFaults:
    #: Chunk indexes (of the plan's layout) whose every prompt is too long for every server.
    unservable: list[int] = field(default_factory=list)
    busy: list[Busy] = field(default_factory=list)
    #: The run's concurrency_per_server (None: discovered). A discovered limit keeps few requests
    #: waiting at the server, so a busy server seldom sheds any; a fixed one above what a busy
    #: server holds is what makes it shed (the case of issue 31).
    fixed_concurrency: int | None = None

    @property
    def any(self) -> bool:
        return bool(self.unservable or self.busy)

    def describe(self) -> str:
        parts = []
        if self.unservable:
            parts.append(f"unservable chunk(s) {self.unservable}")
        parts += [f"busy{b.target}@{b.at_s:.0f}s/{b.duration_s:.0f}s" for b in self.busy]
        if self.fixed_concurrency:
            parts.append(f"concurrency {self.fixed_concurrency}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"unservable": list(self.unservable),
                "busy": [{"at_s": b.at_s, "target": b.target, "duration_s": b.duration_s} for b in self.busy],
                "fixed_concurrency": self.fixed_concurrency}


def draw_liveness(seed: int, n_prompts: int, save_every: int, n_servers: int, always: bool = False) -> LivenessFaults:
    """Most schedules get one kind or both (`always`: both)."""
    rng = random.Random(f"chaos-liveness:{seed}")
    faults = LivenessFaults()
    n_chunks = len(chunk_sizes(n_prompts, save_every, n_servers))
    if always or rng.random() < 0.5:
        faults.unservable = sorted(rng.sample(range(n_chunks), k=min(n_chunks, rng.choice([1, 1, 2]))))
    if always or rng.random() < 0.5:
        for _ in range(rng.choice([1, 1, 2])):
            faults.busy.append(Busy(rng.uniform(0.0, 3.0), rng.randrange(n_servers), rng.uniform(10.0, 25.0)))
        if always or rng.random() < 0.5:
            faults.fixed_concurrency = SIM_SLOTS + 4
    return faults


def unservable_ids(faults: LivenessFaults, n_prompts: int, save_every: int, n_servers: int) -> set[int]:
    """Prompt numbers (plan order) of the unservable chunks."""
    out: set[int] = set()
    start = 0
    for c, size in enumerate(chunk_sizes(n_prompts, save_every, n_servers)):
        if c in faults.unservable:
            out.update(range(start, start + size))
        start += size
    return out


def liveness_prompts(seed: int, n: int, long: set[int]) -> bytes:
    """The chaos prompts (chaos._prompts' text), those numbered in `long` made too long for any server."""
    rows = []
    for i in range(n):
        text = f"Chaos {seed}: is {1000 + 13 * i} prime?"
        if i in long:
            text += " Check" + " every divisor" * (LONG_WORDS // 2) + "."
        rows.append(json.dumps({"id": f"c{seed}-{i:05d}", "prompt": text}))
    return "\n".join(rows).encode()


def run_params(faults: LivenessFaults) -> dict[str, Any]:
    """Run params the faults need (a fixed concurrency_per_server)."""
    return {"concurrency_per_server": faults.fixed_concurrency} if faults.fixed_concurrency else {}


def sim_knobs(faults: LivenessFaults) -> dict[str, Any]:
    """SimConfig fields every server of the schedule needs: one context length for the whole fleet,
    so the too-long prompts are too long everywhere (preflight warns, and the run goes on)."""
    return {"context_length": CONTEXT_LENGTH} if faults.unservable else {}


#: Busy windows under way per server (id of the SimServer -> [windows open, knobs before the first]):
#: overlapping windows on one server restore its own knobs only when the last one ends (restoring
#: each window's "before" left a server 20x slow for good when two windows overlapped: seed 95261).
_busy_lock = threading.Lock()
_busy_open: dict[int, list[Any]] = {}


def start_busy(server: Any, busy: Busy) -> None:
    """Make `server` (a SimServer) busy now and restore its knobs when its last busy window ends."""
    with _busy_lock:
        entry = _busy_open.get(id(server))
        if entry is None:
            before = {"slow_factor": server.config.slow_factor,
                      "max_queued_requests": server.config.max_queued_requests}
            entry = _busy_open[id(server)] = [0, before]
        entry[0] += 1
        server.update_config(slow_factor=BUSY_SLOW_FACTOR, max_queued_requests=BUSY_MAX_QUEUED)

    def end() -> None:
        with _busy_lock:
            entry[0] -= 1
            if entry[0] == 0:
                _busy_open.pop(id(server), None)
                server.update_config(**entry[1])

    timer = threading.Timer(busy.duration_s, end)
    timer.daemon = True
    timer.start()


def check_unservable(rows: list[dict[str, Any]], seed: int, long: set[int]) -> list[str]:
    """The unservable prompts must be ContextLengthExceeded error rows (exactly once is the
    schedule's own check); any other outcome is a problem."""
    want = {f"c{seed}-{i:05d}" for i in long}
    problems = []
    for row in rows:
        if row.get("id") in want and row.get("error_class") != "ContextLengthExceeded":
            problems.append(f"{row['id']}: {row.get('error_class') or 'a completion'} instead of ContextLengthExceeded")
    return problems[:10]
