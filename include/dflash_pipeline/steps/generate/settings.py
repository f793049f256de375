"""A generate worker's settings: what one task needs to drive one server (from the run's params
and preflight's answer for that server)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_pipeline.config import Sampling
from dflash_pipeline.serving.sglang import ServerSpec


@dataclass(frozen=True)
class WorkerSettings:
    run_id: str
    worker: str
    server: ServerSpec
    model: str
    sampling: Sampling
    concurrency: int
    request_timeout_s: float = 300.0
    max_attempts: int = 5
    # The server's engine (serving/engines.py) as preflight detected it: the request body's dialect.
    engine: str = "sglang"
    # Request fields that make a speculating server return each answer's statistics (preflight's
    # `spec_request`, from serving/specwire.request_fields); empty when it does not speculate.
    spec_request: tuple[tuple[str, Any], ...] = ()
    # Before this server completed a request, the slowest decode speed (tokens/s per request) still
    # counted as generating: a request's deadline is max_tokens at that speed (serving/deadline.py).
    min_decode_tok_s: float = 5.0
    server_lost_after_s: float = 120.0
    # A server failing everything this long hands its open chunks to the fleet (and keeps probing).
    handoff_after_s: float = 5.0
    lease_s: float = 180.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 30.0
    poll_s: float = 1.0
    progress_every_s: float = 10.0
    # Early in a run progress is published more often (every elapsed/10 s, at least this often), so
    # a short run still draws a throughput curve; from 10 x progress_every_s on it is every_s.
    progress_first_s: float = 1.0
    store_deadline_s: float = 600.0
    try_number: int = 1
    retry_failed_rows: str = "transient"
    # Derived concurrency (not set by the user): the in-flight limit is discovered from the server's
    # live load (serving/concurrency.py), starting from `declared_slots` (SGLang's
    # max_running_requests) or the engines' default, never above `concurrency_cap`; it queues about
    # `headroom_s` of work at the server, so a fast server's freed slots never wait for the client.
    # False: `concurrency` is the user's concurrency_per_server, used as given.
    adaptive_headroom: bool = False
    headroom_s: float = 0.25
    declared_slots: int | None = None
    concurrency_cap: int = 1024
    probe_every_s: float = 0.5
    # Claim the next chunk while at least this many seconds of work (at the current completion
    # rate) are still ready, or 3x the measured claim latency if that is longer: a claim is
    # several S3 round trips, and a slow S3 must not leave the server's slots empty.
    claim_ahead_s: float = 0.5
    map_index: int = 0
    n_workers: int = 1
    # A claim may use a listing of parts and claims this recent (see Worker._try_claim).
    scan_reuse_s: float = 1.0
    # Retry markers of earlier runs only change when a run ends; list them this often, not per claim.
    marker_scan_every_s: float = 30.0
    # Rows claimed and not yet committed (open, queued, committing); None = 2 chunks + 4x concurrency.
    held_rows_cap: int | None = None
    # Finished rows of open chunks are saved as partials this often (0: never), so a SIGKILLed task's
    # successor redoes only what finished after the last save (whole conversations in all_turns mode).
    checkpoint_every_s: float = 60.0
    # After request_stop(): time to commit complete chunks, save partials and release claims.
    stop_grace_s: float = 3.0
    # Breaker: over the last `breaker_window` results, trip at this permanent-error share alone, or
    # at `breaker_share_vs_fleet` when the other workers' share is at most a quarter of ours.
    breaker_window: int = 40
    breaker_share_alone: float = 0.95
    breaker_share_vs_fleet: float = 0.5

    @property
    def owner(self) -> str:
        return f"{self.run_id}#{self.worker}"


def settings_for(
    cfg: Any,
    *,
    run_id: str,
    map_index: int,
    server: ServerSpec,
    server_info: dict[str, Any],
    try_number: int = 1,
    **overrides: Any,
) -> WorkerSettings:
    """WorkerSettings of the generate task for one server, from the run's config (`RunConfig`) and
    preflight's per-server dict: the one place the DAG, the benchmarks and the fault lab build them."""
    values: dict[str, Any] = dict(
        run_id=run_id,
        worker=f"w{map_index:04d}",
        map_index=map_index,
        n_workers=len(cfg.servers),
        server=server,
        model=server_info["model"],
        sampling=cfg.sampling,
        concurrency=int(server_info["concurrency"]),
        request_timeout_s=cfg.request_timeout_s,
        max_attempts=cfg.max_attempts,
        engine=server_info.get("engine") or "sglang",
        spec_request=tuple(sorted((server_info.get("spec_request") or {}).items())),
        server_lost_after_s=cfg.server_lost_after_s,
        handoff_after_s=min(float(getattr(cfg, "server_handoff_after_s", 5.0)), cfg.server_lost_after_s),
        lease_s=cfg.claim_lease_s,
        try_number=try_number,
        retry_failed_rows=cfg.retry_failed_rows,
        adaptive_headroom=cfg.concurrency_per_server is None,
        declared_slots=server_info.get("max_running_requests"),
        concurrency_cap=int(getattr(cfg, "max_concurrency_per_server", 1024)),
    )
    values.update(overrides)
    return WorkerSettings(**values)
