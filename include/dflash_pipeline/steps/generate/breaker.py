"""The breaker: a server answering (nearly) every request with a permanent error while the fleet does
not (a smaller --context-length, a broken template) must stop before it commits a dataset of
error rows. Main owns it: `record()` after each result, which raises ServerBroken to trip.

Transient failures are not its business: a server failing everything transiently is "failing"
(failing.py) and hands its chunks over; a permanent error may be the prompt's fault, which is why
the breaker compares with the other workers (their progress documents in S3) before tripping.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from dflash_pipeline.dataset.layout import DatasetLayout
from dflash_pipeline.dataset.store import Store, StoreUnavailable
from dflash_pipeline.serving.sglang import RequestFailure
from dflash_pipeline.steps.generate.chunks import claim_doc
from dflash_pipeline.steps.generate.settings import WorkerSettings
from dflash_pipeline.steps.generate.state import ServerBroken

logger = logging.getLogger(__name__)


class Breaker:
    """Recent results of one server and the trip rule (module docstring)."""

    def __init__(self, store: Store, layout: DatasetLayout, settings: WorkerSettings) -> None:
        self.store = store
        self.layout = layout
        self.settings = settings
        self._recent_permanent: deque[bool] = deque(maxlen=settings.breaker_window)
        self._breaker_checked_t = 0.0
        self._last_permanent = ""

    def record(self, failure: RequestFailure | None) -> None:
        """A result: a completion (None) or an error row's failure. Raises ServerBroken to trip."""
        permanent = failure is not None and not failure.transient
        self._recent_permanent.append(permanent)
        if permanent:
            assert failure is not None
            self._last_permanent = f"{failure.error_class}: {failure.message[:200]}"
            self._check()

    def _check(self) -> None:
        """Trip when this server's recent results are (nearly) all permanent errors and the fleet's
        are not: its context length or chat template differs, and every row it writes is lost."""
        s = self.settings
        recent = self._recent_permanent
        if len(recent) < max(10, s.breaker_window // 2):
            return
        share = sum(recent) / len(recent)
        if share < s.breaker_share_vs_fleet:
            return
        others_done, others_perm = 0, 0
        now = time.monotonic()
        if share < s.breaker_share_alone:
            if now - self._breaker_checked_t < 5.0:
                return
            self._breaker_checked_t = now
            others_done, others_perm = self.fleet_results()
            if others_done < s.breaker_window or others_perm / others_done > share / 4:
                return
        raise ServerBroken(
            f"server {s.server.name} answered {sum(recent)} of its last {len(recent)} requests with a permanent "
            f"error (last: {self._last_permanent}); the other servers: {others_perm} permanent errors in "
            f"{others_done} results. Check its --context-length and chat template against the others'; "
            f"its open chunks were released without its error rows."
        )

    def fleet_results(self) -> tuple[int, int]:
        """(results, permanent errors) of the other workers of this run, from their progress docs."""
        prefix = self.layout.run_key(self.settings.run_id, "progress/")
        done = perm = 0
        try:
            for obj in self.store.list(prefix):
                if obj.key.endswith(f"/{self.settings.worker}.json"):
                    continue
                got = self.store.get(obj.key)
                doc = claim_doc(got[0]) if got else {}
                done += int(doc.get("completions") or 0) + int(doc.get("errors") or 0)
                perm += int(doc.get("permanent_errors") or 0)
        except (StoreUnavailable, ValueError, TypeError) as exc:
            logger.warning("breaker: could not read the fleet's progress (%s)", exc)
        return done, perm

