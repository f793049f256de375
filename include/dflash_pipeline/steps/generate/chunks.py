"""The chunk protocol: how generate tasks share one dataset root through S3 alone.

A chunk is `save_every` prompts of the plan; its output is one Parquet part. Keys (dataset/layout):
`claims/chunk-N.json` (the lease), `completions/part-N.parquet` (the output), `partials/chunk-N…`
(finished rows a worker saved before letting go), `retry/chunk-N.json` (the part has error rows a
later run may redo).

States of a chunk as one worker sees it, and the only transitions (`TRANSITIONS`), each owned by
exactly one thread of the worker:

    FREE (no Lease object) --claimer: claim (conditional create / If-Match take-over)--> CLAIMED
    CLAIMED   --claimer--> OPEN        inputs (and any partial rows) loaded; main may send its prompts
    CLAIMED   --claimer--> REPAIRING   a committed part whose error rows this run redoes
    CLAIMED   --claimer--> RELEASED    committed meanwhile / nothing to redo (claim deleted)
    OPEN, REPAIRING --main--> QUEUED   every row in; handed to the committer
    OPEN, REPAIRING --main--> RELEASED hand-off or give-up: finished rows saved as a partial first
    QUEUED    --committer--> COMMITTING --committer--> COMMITTED (the part exists: ours or a peer's)
    CLAIMED, OPEN, REPAIRING --renewer--> TAKEN_OVER   a renewal was refused: a peer owns it now

Owners. The claimer creates a Lease and owns it while CLAIMED; main owns OPEN/REPAIRING; the
committer owns QUEUED/COMMITTING; the renewer (LeaseKeeper) only renews and may move a *working*
state (CLAIMED/OPEN/REPAIRING) to TAKEN_OVER. Every move happens under the lease's lock and checks
the current state, so a race (main queues the chunk while the renewer sees a refusal) has one winner
and the loser sees the new state. When the worker stops, the claimer and committer are stopped (or
given a deadline) first; then main owns every lease left and releases it (`Leases.give_up_owner`).

S3 outcomes, mapped once (dataset/store.py):
- 412 PreconditionFailed: the race is lost (the key exists / changed), unless the write may be our
  own: a claim re-sent (by botocore or by our retry, always with the same nonce), or any renewal
  or release (an earlier renewal may have changed the ETag unanswered). Then a HEAD compares the
  `nonce` metadata each of our writes carries: a lost answer is never read as a lost race.
- 404 on a conditional write or delete (`KeyGone`): the claim was deleted (released by a peer
  that took it over and finished): a refused renewal or a no-op release.
- 409 ConditionalRequestConflict, 503 SlowDown, 5xx, connection errors: StoreUnavailable, retried
  with backoff; a renewal that cannot get through keeps the lease (we do not drop work on a hunch).
  Every S3 client has bounded timeouts and retries (`store.CLIENT_CONFIG`), so no call blocks
  for minutes.

Invariants (what makes a row exactly once and a run never hang):
1. A part is written only with If-None-Match: * (first commit) or If-Match its read ETag (repair):
   two workers can never both write a chunk, whatever the leases say. Leases only avoid waste.
2. A chunk counts as done only when its part was seen in S3 (a listing, our commit, or a HEAD after
   a refusal), never from a local guess: a commit refused with no part there raises.
3. Complete rows are not dropped when a lease is lost: QUEUED/COMMITTING chunks are committed anyway
   (invariant 1 keeps it exact), so a stalled-but-finished worker's GPU work is not wasted. Nor
   when a commit fails: the chunk stays in the Ledger (marked failed) and the stop path saves all
   its rows as the chunk's partial, complete chunks before open ones.
4. A lease we hold is renewed every lease/4 (at most RENEW_EVERY_MAX_S) in every non-final state,
   counted from when the last renewal was sent, each renewal on its own thread, so a slow commit
   or one stuck renewal never lets a peer take over healthy work.
5. Kill: SIGKILL loses the open chunks' rows finished since their last checkpoint (main saves
   finished rows as partials every `checkpoint_every_s`) and leaves claims that expire after
   `lease_s` (the task's own retry takes them back once they go `quiet_after_s` unrenewed: one
   renewal period and one for its write, so an earlier try that is still running keeps its
   chunks, slow S3 writes included).
   SIGTERM / an exception: one absolute deadline (the stop grace after the request; it also bounds
   the end of a run that completes as the stop arrives). The committer commits complete chunks
   until half the time left when the stop path starts; then main owns every lease left and, for all
   chunks at once, saves the
   finished rows (of open, queued and committing chunks) as partials and releases the claims
   (conditional delete, so a late owner never deletes a peer's claim). An S3 that does not answer
   in time costs those rows, never the deadline; the claims then expire with their lease. A claim
   the claimer completes after the stop began it releases itself.
6. Partials only carry results for good (finished completions, permanent errors); rows of any other
   kind found in one (older code) are redone. Writes of one chunk's partial are serialized
   (handback.PartialWriter): within a process, a checkpoint still in flight can never land after,
   and overwrite, the fuller partial the stop path saves. Across processes it can (a checkpoint PUT
   slowed past a lost lease lands after the new owner's save): that costs work redone, never a row,
   since a partial only seeds a chunk's results and the part is what counts.
7. Every renewal writes new bytes (a renewal counter in the claim), so its ETag changes: a peer's
   take-over or the sweep's conditional delete based on a listing older than our last renewal
   is refused (with identical bytes S3 would keep the ETag and let it through).
8. A chunk whose lease is gone (taken over or released) is lost for its worker, whatever flag
   anyone set: request threads and main read `OpenChunk.dropped` from the lease's state, so a
   lease refused at any moment (even between the claimer's OPEN and the chunk reaching main)
   ends its requests instead of requeueing them forever.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.dataset.store import (
    KeyGone,
    ObjectInfo,
    PreconditionFailed,
    Store,
    StoreUnavailable,
    with_retries,
)

logger = logging.getLogger(__name__)


class State(enum.Enum):
    CLAIMED = "claimed"
    OPEN = "open"
    REPAIRING = "repairing"
    QUEUED = "queued"
    COMMITTING = "committing"
    COMMITTED = "committed"
    RELEASED = "released"
    TAKEN_OVER = "taken_over"


S = State
#: (from, to) -> the only role allowed to make that move.
TRANSITIONS: dict[tuple[State, State], str] = {
    (S.CLAIMED, S.OPEN): "claimer",
    (S.CLAIMED, S.REPAIRING): "claimer",
    (S.CLAIMED, S.RELEASED): "claimer",
    (S.OPEN, S.QUEUED): "main",
    (S.REPAIRING, S.QUEUED): "main",
    (S.OPEN, S.RELEASED): "main",
    (S.REPAIRING, S.RELEASED): "main",
    (S.QUEUED, S.COMMITTING): "committer",
    (S.COMMITTING, S.COMMITTED): "committer",
    (S.CLAIMED, S.TAKEN_OVER): "renewer",
    (S.OPEN, S.TAKEN_OVER): "renewer",
    (S.REPAIRING, S.TAKEN_OVER): "renewer",
}
#: States whose claim we hold and renew.
RENEWED = frozenset({S.CLAIMED, S.OPEN, S.REPAIRING, S.QUEUED, S.COMMITTING})
#: States a refused renewal may end (work not yet complete); QUEUED/COMMITTING are committed anyway.
DROPPABLE = frozenset({S.CLAIMED, S.OPEN, S.REPAIRING})
FINAL = frozenset({S.COMMITTED, S.RELEASED, S.TAKEN_OVER})


class ProtocolError(RuntimeError):
    """A thread tried a move it does not own: a bug, never an S3 condition."""


@dataclass
class Lease:
    """Our claim on one chunk. `etag` and `state` change only under `lock`."""

    chunk: int
    etag: str
    nonce: str
    state: State = S.CLAIMED
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    last_renewed_t: float = field(default_factory=time.monotonic)
    #: Renewals that went through: written into the claim, so every renewal changes its bytes and
    #: ETag and a peer's If-Match based on an older listing is refused (invariant 7).
    renewals: int = 0

    @property
    def gone(self) -> bool:
        return self.state in FINAL


#: Called after each transition that happened, outside every lock: (lease, from, to, role). The
#: chaos harness (dev/transitions.py) injects delays and lost leases there; production has none.
TransitionHook = Callable[[Lease, State, State, str], None]


class Leases:
    """The leases this worker holds, by chunk. Thread-safe; a lease leaves it when it ends."""

    def __init__(self, hook: TransitionHook | None = None) -> None:
        self._lock = threading.Lock()
        self._by_chunk: dict[int, Lease] = {}
        self._hook = hook
        #: Role that owns every lease once the worker is stopping (see the module docstring).
        self.give_up_owner: str | None = None

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._by_chunk[lease.chunk] = lease

    def move(self, lease: Lease, to: State, role: str) -> bool:
        """Move `lease` to `to` if it is still where `role` may move it from; False if a peer
        transition got there first (e.g. the renewer took it over). Wrong roles raise."""
        with lease.lock:
            frm = lease.state
            if frm in FINAL:
                return False
            owner = TRANSITIONS.get((frm, to))
            if to == S.RELEASED and role == self.give_up_owner:
                pass  # stopping: the other threads are stopped and main owns every lease left
            elif owner is None:
                if to == S.TAKEN_OVER and role == "renewer":
                    return False  # QUEUED/COMMITTING: committed anyway (invariant 3)
                raise ProtocolError(f"chunk {lease.chunk}: no transition {frm.value} -> {to.value}")
            elif owner != role:
                raise ProtocolError(f"chunk {lease.chunk}: {frm.value} -> {to.value} belongs to {owner}, not {role}")
            lease.state = to
        if to in FINAL:
            with self._lock:
                if self._by_chunk.get(lease.chunk) is lease:
                    del self._by_chunk[lease.chunk]
        if self._hook is not None:
            self._hook(lease, frm, to, role)
        return True

    def held(self, chunk: int) -> bool:
        with self._lock:
            return chunk in self._by_chunk

    def live(self) -> list[Lease]:
        with self._lock:
            return [lease for lease in self._by_chunk.values() if lease.state in RENEWED]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_chunk)


class CommitOutcome(enum.Enum):
    COMMITTED = "committed"  # our bytes are the part
    REFUSED = "refused"  # a peer's part is there (we looked)


class ChunkStore:
    """The protocol's S3 operations, each mapping S3's answers to one outcome (module docstring)."""

    def __init__(self, store: Store, claim_key: Callable[[int], str], claim_body: Callable[..., bytes],
                 store_deadline_s: float = 600.0) -> None:
        self.store = store
        self.claim_key = claim_key
        self.claim_body = claim_body
        self.store_deadline_s = store_deadline_s
        # Claims whose write may have landed unanswered (a claim that ended StoreUnavailable after a
        # send): chunk -> its nonce, kept until S3 says whose the key is (`recover`, or the next
        # claim of that chunk, which re-sends the same nonce). Owner: the claimer thread (the only
        # caller of `claim`, `recover` and `is_pending`); the lock only guards against a future
        # reader elsewhere. Set from a claim's first send until it settles. A stop looks each one up
        # and releases it if it holds our nonce (stopping.Closer); a kill forgets them: a claim that
        # did land is then nobody's known lease; it expires after `lease_s` for peers, and this
        # task's retry takes it back once it is `quiet_after_s` unrenewed
        # (claiming.Claimer._find_own_stale).
        self._pending: dict[int, str] = {}
        self._pending_lock = threading.Lock()

    def pending(self) -> list[int]:
        """Chunks whose claim of ours may exist unanswered: a claim attempt that sent and has not
        settled (still being re-sent, or ended StoreUnavailable). The stop path looks each up by
        its nonce and releases it (stopping.Closer), so no such claim waits out its lease."""
        with self._pending_lock:
            return sorted(self._pending)

    def is_pending(self, chunk: int) -> bool:
        """Whether a claim of ours on `chunk` may exist although its write was never answered."""
        with self._pending_lock:
            return chunk in self._pending

    def recover(self, chunk: int, deadline_s: float = 30.0) -> Lease | None:
        """Our claim on `chunk` whose write went unanswered, if the key holds it (a HEAD compares the
        nonce): then it is ours, with no wait for any lease. None: the key holds no claim of ours
        (absent: the pending nonce is kept, the next claim re-sends it; a peer's: forgotten).
        StoreUnavailable propagates and the claim stays pending."""
        with self._pending_lock:
            nonce = self._pending.get(chunk)
        if nonce is None:
            return None
        key = self.claim_key(chunk)
        info = with_retries(lambda: self.store.head(key), what=f"head {key}", deadline_s=deadline_s,
                            cap_s=max(0.5, deadline_s / 4))
        if info is None:
            return None
        with self._pending_lock:
            self._pending.pop(chunk, None)
        if (info.metadata or {}).get("nonce") != nonce:
            return None
        logger.info("chunk %d: the claim whose answer was lost is ours (its nonce); keeping it", chunk)
        # Written a while ago (at least the claim's deadline): renewed at the keeper's next round.
        return Lease(chunk, info.etag, nonce, last_renewed_t=0.0)

    def _ours(self, key: str, nonce: str, deadline_s: float) -> ObjectInfo | None:
        """The object at `key` if it carries our nonce (our write went through, its answer lost)."""
        info = with_retries(lambda: self.store.head(key), what=f"head {key}", deadline_s=deadline_s,
                            cap_s=max(0.5, deadline_s / 4))
        if info is not None and (info.metadata or {}).get("nonce") == nonce:
            return info
        return None

    def claim(self, chunk: int, prev: ObjectInfo | None, deadline_s: float = 30.0,
              should_stop: Callable[[], bool] | None = None) -> Lease | None:
        """Create the claim (prev None) or take over `prev` (an expired or our own stale claim).
        None: a peer won. StoreUnavailable propagates after `deadline_s` (the caller retries later).

        Every send of one claim carries the same nonce, so a 412 that follows any earlier send (ours
        or botocore's) is checked with a HEAD: our own claim is never read as a peer's. A claim
        whose every answer was lost and that still ends in StoreUnavailable may exist with our nonce:
        its nonce is kept (`_pending`) and the next attempt on the chunk re-sends it, or `recover`
        finds the claim by it, so the chunk never waits for its own claim's lease."""
        with self._pending_lock:
            pending = self._pending.get(chunk)
        nonce = pending or uuid.uuid4().hex
        key = self.claim_key(chunk)
        sends = 0

        def put() -> str:
            nonlocal sends
            sends += 1
            if sends == 1:  # from the first send on, the claim may exist: a stop must look for it
                with self._pending_lock:
                    self._pending[chunk] = nonce
            return self.store.put(
                key, self.claim_body(nonce), if_none_match=prev is None,
                if_match=None if prev is None else prev.etag,
                content_type="application/json", metadata={"nonce": nonce},
            )

        try:
            etag = with_retries(put, what=f"claim {key}", deadline_s=deadline_s, cap_s=max(0.5, deadline_s / 4),
                                should_stop=should_stop)
        except KeyGone:
            self._settled(chunk)
            if sends == 1:
                return None  # the claim we meant to take over was released meanwhile
            raise StoreUnavailable(f"claim {key}: answer lost and the key gone; try again")
        except PreconditionFailed as exc:
            mine = self._ours(key, nonce, deadline_s) if exc.retried or sends > 1 or pending else None
            self._settled(chunk)
            if mine is None:
                return None
            logger.info("chunk %d: claim answer was lost but the claim is ours", chunk)
            etag = mine.etag
        except StoreUnavailable:
            if sends:
                with self._pending_lock:  # a send may have landed: remember whose it would be
                    self._pending[chunk] = nonce
            raise
        self._settled(chunk)
        return Lease(chunk, etag, nonce)

    def _settled(self, chunk: int) -> None:
        with self._pending_lock:
            self._pending.pop(chunk, None)

    def renew(self, lease: Lease, deadline_s: float = 30.0) -> bool:
        """Rewrite our claim If-Match its ETag (this refreshes LastModified, which peers judge
        the lease by). False: the claim changed or vanished, a peer owns the chunk now.

        Any 412 is checked with a HEAD (bounded by `deadline_s`): an earlier renewal whose answer
        was lost changed the ETag without telling us, and that claim is still ours."""
        key = self.claim_key(lease.chunk)
        renewal = lease.renewals + 1
        # The renewal counts from when it was sent, not from when its answer came: the next one is
        # due one period after this one left, however long this write took to land (a slow S3
        # must not stretch the gaps between the claim's Last-Modified, which `quiet_after_s` bounds).
        sent_t = time.monotonic()
        try:
            etag = self.store.put(key, self.claim_body(lease.nonce, renewal), if_match=lease.etag,
                                  content_type="application/json", metadata={"nonce": lease.nonce})
        except KeyGone:
            return False
        except PreconditionFailed:
            mine = self._ours(key, lease.nonce, deadline_s)
            if mine is None:
                return False
            logger.info("chunk %d: an earlier renewal went through unanswered; adopting its ETag", lease.chunk)
            etag = mine.etag
        with lease.lock:
            lease.etag = etag
            lease.renewals = renewal
            lease.last_renewed_t = sent_t
        return True

    def release(self, lease: Lease, deadline_s: float, should_stop: Callable[[], bool] | None = None) -> bool:
        """Delete our claim if it is still ours (If-Match): a late owner never deletes a peer's
        claim. A 412 is checked with a HEAD: if the claim carries our nonce (a renewal changed its
        ETag unanswered), it is deleted If-Match that ETag. False if S3 did not answer within
        `deadline_s` (the lease then simply expires)."""
        key = self.claim_key(lease.chunk)
        end = time.monotonic() + deadline_s
        left = lambda: max(0.1, end - time.monotonic())  # noqa: E731
        etag = lease.etag
        try:
            for _ in range(3):
                try:
                    with_retries(lambda: self.store.delete(key, if_match=etag), what=f"release {key}",
                                 deadline_s=left(), cap_s=max(0.5, deadline_s / 4), should_stop=should_stop)
                    return True
                except KeyGone:
                    return True  # already gone: released by us (answer lost) or by a peer that finished
                except PreconditionFailed:
                    mine = self._ours(key, lease.nonce, left())
                    if mine is None:
                        return True  # a peer's claim now: nothing of ours to delete
                    etag = mine.etag
            return True
        except StoreUnavailable as exc:
            logger.warning("could not release the claim of chunk %d (%s); it expires with its lease", lease.chunk, exc)
            return False

    def commit(self, key: str, data: bytes, *, nonce: str, if_match: str | None, deadline_s: float) -> CommitOutcome:
        """Write a part once: If-None-Match (first commit) or If-Match the part we repair. A
        refusal is checked with a HEAD: our own write whose answer was lost is COMMITTED, a peer's
        part is REFUSED. A refusal with no part there three times raises StoreUnavailable: a chunk
        counts as done only when its part was seen (invariant 2)."""
        end = time.monotonic() + deadline_s
        for _ in range(3):
            left = max(0.1, end - time.monotonic())
            try:
                with_retries(
                    lambda: self.store.put(key, data, if_none_match=if_match is None, if_match=if_match,
                                           metadata={"nonce": nonce}),
                    what=f"commit {key}", deadline_s=left,
                )
                return CommitOutcome.COMMITTED
            except PreconditionFailed:
                info = with_retries(lambda: self.store.head(key), what=f"head {key}",
                                    deadline_s=max(0.1, end - time.monotonic()))
                if info is not None and (info.metadata or {}).get("nonce") == nonce:
                    logger.info("%s: commit answer was lost but the part is ours", key)
                    return CommitOutcome.COMMITTED
                if info is not None:
                    return CommitOutcome.REFUSED
                # Refused yet absent: the part we repair was deleted meanwhile; write it fresh.
                if_match = None
        raise StoreUnavailable(f"commit {key}: refused three times yet no part is there")


class LeaseKeeper:
    """The renewer: renews every live lease every `lease_s / 4` (invariant 4).

    Each renewal runs on its own short-lived daemon thread (at most one per lease at a time), so
    one PUT stuck in a slow S3 never delays the renewal of the other leases. A refused renewal moves
    a working lease to TAKEN_OVER and calls `on_lost(lease)`; a lease already QUEUED/COMMITTING
    stays (invariant 3). S3 being unavailable keeps the lease: a peer can take it over only after
    `lease_s` without renewal, and then our commit is refused (invariant 1).
    """

    def __init__(self, leases: Leases, chunks: ChunkStore, lease_s: float,
                 on_lost: Callable[[Lease], None]) -> None:
        self.leases = leases
        self.chunks = chunks
        self.every_s = renew_every_s(lease_s)
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._busy: set[int] = set()
        self._busy_lock = threading.Lock()
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def renew_due(self, wait: bool = False) -> None:
        """Start a renewal for every lease due and not already being renewed (`wait`: join them)."""
        now = time.monotonic()
        started = []
        for lease in self.leases.live():
            if now - lease.last_renewed_t < self.every_s:
                continue
            with self._busy_lock:
                if lease.chunk in self._busy:
                    continue
                self._busy.add(lease.chunk)
            t = threading.Thread(target=self._renew_one, args=(lease,), name=f"renew-{lease.chunk}", daemon=True)
            t.start()
            started.append(t)
        if wait:
            for t in started:
                t.join(timeout=60.0)  # a renewal's calls end within min(30 s, every_s) each

    def _renew_one(self, lease: Lease) -> None:
        try:
            if lease.gone:
                return
            try:
                ok = self.chunks.renew(lease, deadline_s=min(30.0, self.every_s))
            except StoreUnavailable as exc:
                logger.warning("could not renew the claim of chunk %d (%s); will retry", lease.chunk, exc)
                return
            if not ok:
                if self.leases.move(lease, S.TAKEN_OVER, "renewer"):
                    logger.warning("chunk %d was taken over by another worker; dropping our copy", lease.chunk)
                    self.on_lost(lease)
                elif not lease.gone:
                    logger.warning("chunk %d: claim lost while its rows are committed; the commit decides", lease.chunk)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the worker's main loop
            self.error = exc
        finally:
            with self._busy_lock:
                self._busy.discard(lease.chunk)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 2)):
            try:
                self.renew_due()
            except BaseException as exc:  # noqa: BLE001 - surfaced by the worker's main loop
                self.error = exc
                return


#: The longest time between two renewals of a claim, whatever the lease. A task's own retry waits two
#: renewal periods for its earlier try's claims (`quiet_after_s`), so the period, not the lease, bounds
#: how long a retry after a SIGKILL waits (22 s); renewing a claim every 10 s costs one conditional PUT.
RENEW_EVERY_MAX_S = 10.0


def renew_every_s(lease_s: float) -> float:
    """How often a live worker renews each of its claims (LeaseKeeper): a quarter of the lease, at
    most RENEW_EVERY_MAX_S."""
    return max(0.25, min(lease_s / 4, RENEW_EVERY_MAX_S))


def quiet_after_s(lease_s: float) -> float:
    """A claim not renewed for this long is not being renewed by a live worker: one renewal period,
    one more for the renewal's own write (a renewal is sent a period after the last one was sent,
    or when that one's write returns if it took longer: a write taking up to a period to land
    still lands within two), the renewer's poll (half a period, at most 1 s) and 1 s for S3's
    one-second Last-Modified. A retry waits this long for its earlier try's claims (a SIGKILLed
    try stops renewing at once, a still-running one keeps renewing and keeps its chunks): 22 s for
    any lease of 40 s or more. Before (issue 39) the write had no allowance: with claim PUTs taking
    3 s a live earlier try's renewals landed 5-6 s apart, past the 4 s wait of an 8 s lease."""
    every = renew_every_s(lease_s)
    return 2 * every + min(1.0, every / 2) + 1.0


def claim_body(owner: str, worker: str, server: str, run_id: str, try_number: int) -> Callable[..., bytes]:
    """The claim document for one worker: `body(nonce, renewal=0)`. The nonce is fixed per claim;
    the renewal count makes each renewal's bytes, hence its ETag, new (invariant 7)."""

    def body(nonce: str, renewal: int = 0) -> bytes:
        return json.dumps({"owner": owner, "worker": worker, "server": server, "run_id": run_id,
                           "try": try_number, "nonce": nonce, "renewal": renewal}).encode()

    return body


def claim_doc(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}
