"""What an answer becomes (steps/generate/outcomes.py) and the chunk protocol's state table (chunks.py)."""

from __future__ import annotations

import threading

import pytest

from dflash_pipeline.config import Sampling
from dflash_pipeline.serving.sglang import Completion, RequestFailure, parse_chat_response
from dflash_pipeline.steps.generate.chunks import DROPPABLE, RENEWED, TRANSITIONS, Lease, Leases, ProtocolError, State
from dflash_pipeline.steps.generate.outcomes import completion_row, error_row, judge, unexpected_failure


def _completion(finish: str | None, reasoning: str | None = "r", content: str = "answer") -> Completion:
    return Completion(reasoning, content, finish, None, 10, 20, 5, "m")


@pytest.mark.parametrize("finish", ["abort", None, "error", "cancelled"])
def test_unfinished_answers_are_transient_failures_not_rows(finish: str | None) -> None:
    with pytest.raises(RequestFailure) as info:
        judge(_completion(finish), Sampling())
    assert info.value.error_class == "Unfinished" and info.value.transient


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_finished_answers_are_kept_as_they_are(finish: str) -> None:
    c = _completion(finish)
    assert judge(c, Sampling()) == c


def test_thinking_cut_at_length_with_think_in_the_prompt_is_all_reasoning() -> None:
    # Qwen3-2507's template puts <think> in the prompt: a truncated answer has no tags at all.
    got = judge(_completion("length", reasoning=None, content="step 1, step 2"), Sampling(enable_thinking=True))
    assert (got.reasoning, got.content) == ("step 1, step 2", "")
    # Without thinking, or when the answer finished, the text stays the answer.
    assert judge(_completion("length", None, "x"), Sampling(enable_thinking=False)).content == "x"
    assert judge(_completion("stop", None, "x"), Sampling(enable_thinking=True)).content == "x"


def test_error_object_with_http_200_is_classified_by_its_code() -> None:
    body = {"object": "error", "message": "This model's maximum context length is 4096 tokens", "code": 400}
    with pytest.raises(RequestFailure) as info:
        parse_chat_response(body)
    assert info.value.error_class == "ContextLengthExceeded" and not info.value.transient
    with pytest.raises(RequestFailure) as info:
        parse_chat_response({"object": "error", "message": "busy", "code": 503})
    assert info.value.transient


def test_unexpected_exception_is_one_rows_transient_failure() -> None:
    f = unexpected_failure(KeyError("choices"))
    assert f.error_class == "UnexpectedError" and f.transient and "KeyError" in f.message
    row = error_row({"id": "a", "messages": []}, f, model="m", server="s", attempts=1, chunk=0, run_id="r")
    assert row["error_class"] == "UnexpectedError" and row["retryable"] is True
    ok = completion_row({"id": "a", "messages": []}, _completion("stop"), model="m", server="s", attempts=2,
                        latency_s=1.23456, chunk=3, run_id="r")
    assert ok["finish_reason"] == "stop" and ok["latency_s"] == 1.2346 and ok["chunk"] == 3


def test_every_transition_has_one_owner_and_wrong_roles_are_refused() -> None:
    leases = Leases()
    lease = Lease(0, '"e"', "n")
    leases.add(lease)
    with pytest.raises(ProtocolError):
        leases.move(lease, State.OPEN, "main")  # opening is the claimer's
    assert leases.move(lease, State.OPEN, "claimer")
    with pytest.raises(ProtocolError):
        leases.move(lease, State.COMMITTING, "committer")  # not queued yet
    assert leases.move(lease, State.QUEUED, "main")
    # A refused renewal of a complete chunk does not drop it: it is committed anyway.
    assert not leases.move(lease, State.TAKEN_OVER, "renewer")
    assert lease.state is State.QUEUED and leases.held(0)
    assert leases.move(lease, State.COMMITTING, "committer")
    assert leases.move(lease, State.COMMITTED, "committer")
    assert not leases.held(0) and not leases.move(lease, State.RELEASED, "main")
    assert DROPPABLE < RENEWED
    assert all(role in ("claimer", "main", "committer", "renewer") for role in TRANSITIONS.values())


def test_racing_queue_and_take_over_have_exactly_one_winner() -> None:
    for _ in range(200):
        leases = Leases()
        lease = Lease(1, '"e"', "n", state=State.OPEN)
        leases.add(lease)
        wins: list[str] = []
        barrier = threading.Barrier(2)

        def go(to: State, role: str) -> None:
            barrier.wait()
            if leases.move(lease, to, role):
                wins.append(role)

        threads = [threading.Thread(target=go, args=(State.QUEUED, "main")),
                   threading.Thread(target=go, args=(State.TAKEN_OVER, "renewer"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1
        assert lease.state is (State.QUEUED if wins == ["main"] else State.TAKEN_OVER)


def test_stopping_main_may_release_any_lease_left() -> None:
    leases = Leases()
    lease = Lease(2, '"e"', "n")
    leases.add(lease)
    with pytest.raises(ProtocolError):
        leases.move(lease, State.RELEASED, "main")
    leases.give_up_owner = "main"
    assert leases.move(lease, State.RELEASED, "main") and len(leases) == 0


class _RefusingButEmpty:
    """A store whose conditional writes are always refused while no part is ever there: S3 never
    behaves so, and the protocol must not turn it into "a peer committed" (a chunk marked done unseen)."""

    def put(self, *args: object, **kwargs: object) -> str:
        from dflash_pipeline.dataset.store import PreconditionFailed

        raise PreconditionFailed("412")

    def head(self, key: str) -> None:
        return None


def test_a_commit_that_never_sees_its_part_is_not_done() -> None:
    from dflash_pipeline.dataset.store import StoreUnavailable
    from dflash_pipeline.steps.generate.chunks import ChunkStore

    chunks = ChunkStore(_RefusingButEmpty(), lambda c: f"claims/{c}", lambda n: b"{}")  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailable, match="no part is there"):
        chunks.commit("completions/part-000001.parquet", b"x", nonce="n", if_match='"e"', deadline_s=1.0)


def test_a_stop_ends_a_store_backoff_within_one_poll() -> None:
    """A task stopped while it waits out an S3 outage (the manifest read, the first scan) must not sleep
    out the whole backoff: the stop has a deadline. The clock here is a fake one (no timing)."""
    from dflash_pipeline.dataset.store import STOP_POLL_S, StoreUnavailable, with_retries

    slept: list[float] = []
    calls = 0

    def failing() -> None:
        nonlocal calls
        calls += 1
        raise StoreUnavailable("outage")

    # the stop comes 5 polls into the first backoff (10-20 s long)
    with pytest.raises(StoreUnavailable):
        with_retries(failing, what="t", base_s=10.0, cap_s=30.0, deadline_s=600.0, sleep=slept.append,
                     should_stop=lambda: len(slept) >= 5)
    assert calls == 1 and len(slept) == 5 and sum(slept) <= 5 * STOP_POLL_S + 1e-9
    # without should_stop the backoff is one sleep of the whole delay, as before
    slept.clear()

    def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise StoreUnavailable("outage")
        return "ok"

    calls = 0
    assert with_retries(flaky, what="t", base_s=10.0, cap_s=30.0, deadline_s=600.0, sleep=slept.append) == "ok"
    assert calls == 2 and len(slept) == 1 and 10.0 <= slept[0] <= 20.0


def test_a_body_cut_short_or_failing_its_checksum_is_a_retryable_store_error() -> None:
    """A GET whose body breaks off or fails botocore's checksum check (chaos seed 2065: the claimer died
    on a raw FlexibleChecksumError reading a claim) is StoreUnavailable, which every caller retries."""
    from botocore.exceptions import FlexibleChecksumError, ResponseStreamingError

    from dflash_pipeline.dataset.store import Store, StoreUnavailable

    class Body:
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def read(self) -> bytes:
            raise self.exc

    class Client:
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def get_object(self, **kwargs: object) -> dict[str, object]:
            return {"Body": Body(self.exc), "ETag": '"e"', "ResponseMetadata": {}}

    for exc in (FlexibleChecksumError(error_msg="Expected checksum g/DIaw== did not match calculated checksum"),
                ResponseStreamingError(error="connection reset")):
        with pytest.raises(StoreUnavailable, match=type(exc).__name__):
            Store(Client(exc), "b").get("k")
