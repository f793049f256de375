"""The progress snapshot a worker hands to `on_progress` (monitor/progress.py writes it to S3, the
page and the ETA read it). A function of the worker's owners' read-only views; it changes nothing.

Counts are this try's; `rows_pending_commit` are finished rows not yet in a part, and
`chunks_done_total` is this worker's latest view of the parts committed by anyone (earlier runs
included), so the reader can tell done prompts from submitted ones.
"""

from __future__ import annotations

import time
from typing import Any


def progress_snapshot(w: Any, state: str) -> dict[str, Any]:
    """`w` is a generate Worker (typed loosely: this module sits below worker.py)."""
    s = w.settings
    now = time.monotonic()
    window_tokens = sum(t for _, t in w._tok_window)
    span = min(120.0, max(1e-9, now - w.stats.started_t))
    done_chunks = w.scanner.done()
    snapshot = {
        "run_id": s.run_id,
        "worker": s.worker,
        "server": s.server.name,
        "try_number": s.try_number,
        "concurrency": s.concurrency,
        "in_flight_limit": w._limit(),
        "concurrency_control": w.concurrency.snapshot(),
        "state": state,
        "elapsed_s": round(now - w.stats.started_t, 1),
        "completions": w.stats.completions,
        "errors": w.stats.errors,
        "permanent_errors": w.stats.permanent_errors,
        "errors_by_class": dict(w.stats.errors_by_class),
        "requests_sent": w.stats.requests_sent,
        "requests_requeued": w.stats.requests_requeued,
        "rows_discarded": w.stats.rows_discarded,
        "chunks_committed": w.stats.chunks_committed,
        "chunks_taken_over": w.stats.chunks_taken_over,
        "chunks_lost_to_others": w.stats.chunks_lost_to_others,
        "handoffs": w.stats.handoffs,
        "probes": w.health.probes,
        "in_flight": w.in_flight,
        "ready": len(w.pending),
        "open_chunks": len(w.ledger.open_chunks()),
        "held_rows": w.ledger.held_rows(),
        "rows_pending_commit": w.ledger.rows_pending_commit(),
        "chunks_total": w.n_chunks,
        "chunks_done_total": len(done_chunks),
        "prompts_total": sum(w.sizes),
        "prompts_committed_total": sum(w.sizes[c] for c in done_chunks),
        "output_tokens": w.stats.output_tokens,
        "output_tokens_per_s": round(window_tokens / span, 1),
        # Longest completion of the last two minutes: snapshots overlap, so their running max is
        # the run's longest, which sizes the ETA's tail (the last long requests drain alone).
        "max_completion_tokens_recent": max((t for _, t in w._tok_window), default=0),
    }
    return snapshot
