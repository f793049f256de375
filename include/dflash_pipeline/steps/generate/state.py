"""What the generate worker's threads pass around: an open chunk, one request's outcome, the
task's counters, and the exceptions that end a worker. No behaviour here (worker.py has it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.serving.sglang import RequestFailure
from dflash_pipeline.steps.generate.chunks import Lease, State

MAX_REQUEUES = 3


class ServerLost(Exception):
    """The server stopped answering for good; its work was released. Airflow may retry later."""


class ServerConfigError(Exception):
    """The server refuses us (API key, endpoint, model): a retry cannot fix it."""


class ServerBroken(ServerConfigError):
    """The server refuses what its peers serve: a one-line prompt, or prompts that fit the fleet's
    context (breaker.py). Never raised for prompts no server can serve: those are error rows."""


class TaskStopped(Exception):
    """Stopped from outside (SIGTERM): finished rows were saved and claims released."""


#: Lease states in which the chunk is no longer ours to work on (chunks.py invariant 8).
LOST = frozenset({State.RELEASED, State.TAKEN_OVER})


@dataclass
class OpenChunk:
    """One claimed chunk's work. Its lifecycle is its lease's (chunks.TRANSITIONS, each move owned
    by one thread); the work itself has one owner at a time: the claimer until it hands the chunk
    to the Ledger, main while it is open (`results`, `requeues`, `checkpointed`), the committer once
    queued, main again at the stop. Request threads only read `dropped` and the lease's state."""

    index: int
    lease: Lease | None
    prompts: list[dict[str, Any]]
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Set by main when it lets the chunk go without a lease move (e.g. a chunk with no lease).
    _dropped: bool = False
    # A repair: the committed part's rows and ETag; `prompts` are only the rows to redo.
    base_rows: list[dict[str, Any]] | None = None
    part_etag: str | None = None
    marker_runs: list[str] = field(default_factory=list)
    # Prompts still to send (all of them unless rows were reused from a partial).
    todo: list[dict[str, Any]] | None = None
    # Rows in the last checkpoint (a partial main saved while the chunk was open); main only.
    checkpointed: int = 0
    # Times each unit was put back because the server (not the prompt) failed; main only. Lives
    # and dies with the chunk, so it never grows with the dataset.
    requeues: dict[str, int] = field(default_factory=dict)
    # Context refusals not yet confirmed as the prompts' (unit key -> when refused, breaker.py's
    # context check); main only. A chunk holding one is neither completed nor saved with it.
    unconfirmed: dict[str, float] = field(default_factory=dict)
    # Requests of this chunk out on request threads; main only. A hand-off leaves a chunk with some
    # out until they are back, so a generation finishing in flight is never thrown away.
    in_flight: int = 0

    @property
    def dropped(self) -> bool:
        """No longer ours to work on: read from the lease, so no thread has to flag it in time."""
        lease = self.lease
        return self._dropped or (lease is not None and lease.state in LOST)

    @dropped.setter
    def dropped(self, value: bool) -> None:
        self._dropped = value

    def prompts_to_send(self) -> list[dict[str, Any]]:
        return self.prompts if self.todo is None else self.todo

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.prompts)

    @property
    def lost(self) -> bool:
        return self.dropped


@dataclass
class Outcome:
    chunk: OpenChunk
    prompt: dict[str, Any]
    row: dict[str, Any] | None = None
    failure: RequestFailure | None = None
    first_failure_t: float | None = None
    last_failure_t: float | None = None
    done_t: float = 0.0
    attempts: int = 0


@dataclass
class WorkerStats:
    completions: int = 0
    errors: int = 0
    permanent_errors: int = 0
    errors_by_class: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    chunks_committed: int = 0
    chunks_taken_over: int = 0
    chunks_lost_to_others: int = 0
    commits_refused: int = 0
    rows_discarded: int = 0
    requests_sent: int = 0
    requests_requeued: int = 0
    handoffs: int = 0
    # A 503 / transient failure while the server showed a sign of life: put back, not failing.
    busy_requeues: int = 0
    # Breaker suspicions judged (breaker.py), and those judged the prompts' fault.
    breaker_checks: int = 0
    prompt_verdicts: int = 0
    started_t: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["elapsed_s"] = round(time.monotonic() - d.pop("started_t"), 3)
        return d
