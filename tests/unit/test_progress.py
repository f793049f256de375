"""Progress arithmetic: ETA on a long-tailed mix, counts after a resume, the writer, the page's HTML."""

from __future__ import annotations

import bisect
import heapq
import json
import logging
import math
import random
import threading
import time
from typing import Any

import pytest

from dflash_pipeline.monitor import ui
from dflash_pipeline.monitor.fleet import aggregate, fleet_series, worker_state
from dflash_pipeline.monitor.progress import (
    HISTORY_MAX,
    MIN_COMPLETIONS_FOR_ETA,
    ProgressWriter,
    carried_totals,
    downsample,
    eta_seconds,
    recent_rate,
)

RUN = "manual__2026-12-01T10:00:00+00:00"


class FakeStore:
    """Just get/put; `fail` makes puts raise like an unreachable S3."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.fail = False
        self.puts = 0
        self.lock = threading.Lock()

    def get(self, key: str) -> tuple[bytes, str] | None:
        data = self.objects.get(key)
        return None if data is None else (data, '"etag"')

    def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> str:
        with self.lock:
            self.puts += 1
            if self.fail:
                raise ConnectionError("S3 unreachable")
            self.objects[key] = data
        return '"etag"'

    def doc(self, key: str) -> dict[str, Any]:
        return json.loads(self.objects[key])


def _snapshot(**kw: Any) -> dict[str, Any]:
    base = {"run_id": RUN, "worker": "w0000", "server": "http://gpu0:30000", "try_number": 1, "state": "running",
            "concurrency": 16, "completions": 0, "errors": 0, "errors_by_class": {}, "in_flight": 0,
            "rows_pending_commit": 0, "chunks_committed": 0, "prompts_total": 0, "prompts_committed_total": 0,
            "output_tokens": 0, "output_tokens_per_s": 0.0, "max_completion_tokens_recent": 0}
    base.update(kw)
    return base


# ------------------------------------------------------------------------ a long-tailed mix


def _simulate_fleet(n: int, servers: int, slots: int, tok_per_s_per_slot: float, seed: int) -> list[list[tuple[float, int]]]:
    """Continuous batching: each server keeps `slots` requests decoding; a freed slot takes the next
    prompt of the shared queue at once. Lengths are lognormal (median 900, sigma 1.2, cap 16384),
    like a thinking model's. Returns each server's completions as (finish time, tokens)."""
    rng = random.Random(seed)
    lengths = [min(16384, max(1, int(rng.lognormvariate(math.log(900), 1.2)))) for _ in range(n)]
    heap: list[tuple[float, int, int]] = []
    nxt = 0
    for srv in range(servers):
        for _ in range(slots):
            heapq.heappush(heap, (lengths[nxt] / tok_per_s_per_slot, srv, nxt))
            nxt += 1
    done: list[list[tuple[float, int]]] = [[] for _ in range(servers)]
    while heap:
        t, srv, i = heapq.heappop(heap)
        done[srv].append((t, lengths[i]))
        if nxt < n:
            heapq.heappush(heap, (t + lengths[nxt] / tok_per_s_per_slot, srv, nxt))
            nxt += 1
    return done


def _docs_at(done: list[list[tuple[float, int]]], n: int, slots: int, until: float, every_s: float = 10.0
             ) -> list[dict[str, Any]]:
    """Drive one ProgressWriter per server with the snapshots `Worker._progress` would have given."""
    docs = []
    for srv, comps in enumerate(done):
        store = FakeStore()
        key = f"progress/w{srv:04d}.json"
        clock = {"t": 0.0}
        writer = ProgressWriter(store, key, run_id=RUN, try_number=1, every_s=every_s, n_servers=len(done),
                                clock=lambda: clock["t"])
        comps = sorted(comps)
        ends = [ft for ft, _ in comps]
        starts = sorted(ft - tok / 40.0 for ft, tok in comps)
        cum = [0]
        for _, tok in comps:
            cum.append(cum[-1] + tok)
        t = every_s
        while t <= until + 1e-9:
            k = bisect.bisect_right(ends, t)
            k0 = bisect.bisect_right(ends, t - 120)
            window = [tok for _, tok in comps[k0:k]]
            started = bisect.bisect_right(starts, t)
            clock["t"] = t
            writer.write(_snapshot(
                worker=f"w{srv:04d}", server=f"gpu{srv}", completions=k, output_tokens=cum[k],
                output_tokens_per_s=sum(window) / min(120.0, t), max_completion_tokens_recent=max(window, default=0),
                in_flight=min(slots, started - k), prompts_total=n), now=t)
            t += every_s
        docs.append(store.doc(key))
    return docs


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_eta_on_a_long_tailed_mix_tracks_the_real_end(seed: int) -> None:
    n, servers, slots = 3000, 2, 16
    done = _simulate_fleet(n, servers, slots, tok_per_s_per_slot=40.0, seed=seed)
    end = max(t for comps in done for t, _ in comps)
    manifest = {"chunks": {"sizes": [n]}}  # one chunk: nothing is committed until the very end
    for frac in (0.2, 0.5, 0.8):
        now = round(end * frac / 10) * 10
        docs = _docs_at(done, n, slots, now)
        finished = sum(1 for comps in done for t, _ in comps if t <= now)
        for d in docs:  # the worker knows these rows are done but not in a part yet
            d["rows_pending_commit"] = d["completions"]
        got = aggregate(manifest, {}, docs, now=now)
        assert got["prompts_done"] == finished
        actual = end - now
        assert got["eta_s"] == pytest.approx(actual, rel=0.25), (frac, got["eta_s"], actual)
        # The same arithmetic without the tail (long requests draining alone) is too optimistic.
        plain = got["prompts_remaining"] * got["mean_output_tokens"] / got["output_tokens_per_s"]
        assert plain < got["eta_s"]


def test_eta_uses_output_tokens_not_submitted_rows() -> None:
    # 900 of 1,000 planned prompts done; 64 more were submitted and are in flight: they are not done.
    docs = [
        {**_snapshot(worker="w0000", in_flight=32, rows_pending_commit=0), "written_at": 1000.0, "every_s": 10.0,
         "totals": {"completions": 450, "errors": 0, "output_tokens": 450 * 2000, "max_completion_tokens": 0},
         "history": [[700.0, 300, 0, 300 * 2000, 0, 32], [1000.0, 450, 0, 450 * 2000, 0, 32]]},
        {**_snapshot(worker="w0001", in_flight=32, rows_pending_commit=0), "written_at": 1000.0, "every_s": 10.0,
         "totals": {"completions": 450, "errors": 0, "output_tokens": 450 * 2000, "max_completion_tokens": 0},
         "history": [[700.0, 300, 0, 300 * 2000, 0, 32], [1000.0, 450, 0, 450 * 2000, 0, 32]]},
    ]
    manifest = {"chunks": {"sizes": [100] * 10}}
    committed = {c: 500.0 for c in range(9)}
    got = aggregate(manifest, committed, docs, now=1005.0)
    assert (got["prompts_done"], got["prompts_remaining"], got["in_flight"]) == (900, 100, 64)
    # each worker: 150 completions x 2,000 tokens in 300 s = 1,000 tok/s; the fleet 2,000 tok/s
    assert got["output_tokens_per_s"] == pytest.approx(2000.0)
    assert got["eta_s"] == pytest.approx(100 * 2000 / 2000.0)  # no tail term without a known longest


def test_eta_needs_enough_completions_and_a_rate() -> None:
    assert eta_seconds(0, None, 0.0, 0) == 0.0
    assert eta_seconds(10, 500.0, 100.0, MIN_COMPLETIONS_FOR_ETA - 1) is None
    assert eta_seconds(10, 500.0, 0.0, 100) is None
    assert eta_seconds(10, 500.0, 100.0, 100) == pytest.approx(50.0)
    # tail: 16 in flight share 100 tok/s (6.25 each); half of a 1,000-token completion takes 80 s
    assert eta_seconds(10, 500.0, 100.0, 100, max_completion_tokens=1000, in_flight=16) == pytest.approx(130.0)


# ------------------------------------------------------------------------------- resume


def test_counts_after_a_resume_start_from_what_earlier_runs_committed() -> None:
    sizes = [50, 50, 50, 50, 30, 20]  # 250 prompts; the end chunks shrink
    manifest = {"chunks": {"sizes": sizes}, "input": {"prompts": 250}}
    run_start = 10_000.0
    committed = {0: 9_000.0, 1: 9_100.0, 2: 10_050.0}  # chunks 0 and 1 by the earlier run
    doc = {**_snapshot(rows_pending_commit=17, in_flight=4), "written_at": 10_100.0, "every_s": 10.0,
           "totals": {"completions": 60, "errors": 7, "output_tokens": 60_000, "errors_by_class": {"Timeout": 7}},
           "history": [[10_040.0, 10, 0, 10_000, 0, 4], [10_100.0, 60, 7, 60_000, 0, 4]]}
    got = aggregate(manifest, committed, [doc], now=10_105.0, run_started_at=run_start,
                    task_states={"w0000": "running"})
    assert got["prompts_done_earlier_runs"] == 100
    assert got["prompts_committed"] == 150
    assert got["prompts_pending_commit"] == 17
    assert got["prompts_done"] == 167
    assert got["prompts_remaining"] == 83
    assert got["fraction_done"] == pytest.approx(167 / 250)
    assert got["errors_by_class"] == {"Timeout": 7}
    # 50,000 tokens in 60 s; mean 1,000 tokens per completion
    assert got["eta_s"] == pytest.approx(83 * 1000 / (50_000 / 60), rel=1e-3)
    html = ui.run_main({"run_state": "running", "progress": got, "output_uri": "s3://b/ds"})
    assert 'class="earlier" style="left:0.000%;width:40.000%"' in html


def test_a_resumed_run_with_everything_committed_is_done() -> None:
    manifest = {"chunks": {"sizes": [10, 10]}}
    got = aggregate(manifest, {0: 1.0, 1: 2.0, 7: 3.0}, [], now=5.0, run_started_at=4.0)
    assert (got["prompts_done"], got["prompts_done_earlier_runs"], got["eta_s"]) == (20, 20, 0.0)


def test_a_later_try_carries_the_earlier_tries_totals_and_history() -> None:
    store = FakeStore()
    key = "ds/runs/r/progress/w0001.json"
    first = ProgressWriter(store, key, run_id=RUN, try_number=1, every_s=10.0, clock=lambda: 100.0)
    first.write(_snapshot(completions=40, errors=2, errors_by_class={"Timeout": 2}, output_tokens=4000,
                          max_completion_tokens_recent=900))
    second = ProgressWriter(store, key, run_id=RUN, try_number=2, every_s=10.0, clock=lambda: 200.0)
    second.write(_snapshot(try_number=2, completions=5, errors=1, errors_by_class={"Timeout": 1, "BadRequest": 0},
                           output_tokens=500))
    doc = store.doc(key)
    assert doc["totals"] == {"completions": 45, "errors": 3, "output_tokens": 4500,
                             "errors_by_class": {"Timeout": 3, "BadRequest": 0}, "max_completion_tokens": 900}
    assert doc["tries"] == [1, 2]
    assert [h[0] for h in doc["history"]] == [100.0, 200.0]
    # another run's object, or one from a later try, is not carried
    assert carried_totals(doc, "other-run", 3)["completions"] == 0
    assert carried_totals(doc, RUN, 2)["completions"] == 0


# ------------------------------------------------------------------------------- writer


def test_worker_snapshot_separates_done_from_submitted() -> None:
    from dflash_pipeline.config import Sampling
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.serving.sglang import ServerSpec
    from dflash_pipeline.steps.generate import OpenChunk, Worker, WorkerSettings

    settings = WorkerSettings(run_id=RUN, worker="w0003", server=ServerSpec("gpu3", "http://gpu3:30000"),
                              model="m", sampling=Sampling(), concurrency=8, try_number=2)
    assert settings.progress_every_s == 10.0
    got: list[dict[str, Any]] = []
    # A Store with no client: the snapshot must never call S3 (an S3 call would raise here).
    worker = Worker(Store(None, "b"), DatasetLayout("b", "ds"), {"chunks": {"sizes": [4, 4, 2]}, "plan_id": "p"},
                    settings, on_progress=got.append)
    worker.scanner.mark_done(0)
    chunk = OpenChunk(1, None, [{"id": str(i)} for i in range(4)], results={"0": {}, "1": {}})
    worker.ledger.offer(chunk)
    worker.in_flight = 2
    worker.stats.completions, worker.stats.output_tokens = 2, 300
    worker._tok_window.extend([(worker.stats.started_t, 100), (worker.stats.started_t, 200)])
    worker._progress()
    snap = got[-1]
    assert (snap["prompts_total"], snap["prompts_committed_total"], snap["rows_pending_commit"]) == (10, 4, 2)
    assert (snap["in_flight"], snap["try_number"], snap["worker"], snap["state"]) == (2, 2, "w0003", "running")
    assert snap["max_completion_tokens_recent"] == 200
    worker._progress(force=True)
    assert got[-1]["state"] == "done"


def test_writer_never_raises_and_logs_one_warning_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    store = FakeStore()
    writer = ProgressWriter(store, "k.json", run_id=RUN, try_number=1, every_s=10.0)
    store.fail = True
    with caplog.at_level(logging.WARNING, logger="dflash_pipeline.monitor.progress"):
        for i in range(5):
            assert writer.write(_snapshot(completions=i)) is False
    assert sum("could not write" in r.getMessage() for r in caplog.records) == 1
    store.fail = False
    assert writer.write(_snapshot(completions=9)) is True
    assert store.doc("k.json")["completions"] == 9


def test_writer_puts_off_the_calling_thread_and_flushes_the_final_snapshot() -> None:
    store = FakeStore()
    gate = threading.Event()
    original = store.put

    def slow_put(key: str, data: bytes, **kw: Any) -> str:
        gate.wait(5)
        return original(key, data, **kw)

    store.put = slow_put  # type: ignore[method-assign]
    writer = ProgressWriter(store, "k.json", run_id=RUN, try_number=1, every_s=10.0, final_wait_s=5.0)
    for i in range(50):  # returns at once although the first PUT hangs
        writer(_snapshot(completions=i))
    assert "k.json" not in store.objects
    gate.set()
    writer(_snapshot(completions=99, state="done"))  # the final one is waited for
    assert store.doc("k.json")["completions"] == 99
    assert store.puts <= 3, "snapshots queued behind a slow PUT are replaced, not piled up"


def test_a_waiting_worker_publishes_idle_heartbeats() -> None:
    store = FakeStore()
    writer = ProgressWriter(store, "k.json", run_id=RUN, try_number=1, every_s=0.05)
    writer(_snapshot(completions=7, in_flight=5, output_tokens_per_s=900.0))
    deadline = time.monotonic() + 10
    while store.objects.get("k.json") is None or store.doc("k.json")["state"] != "idle":
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.02)
    doc = store.doc("k.json")
    assert (doc["completions"], doc["in_flight"], doc["output_tokens_per_s"]) == (7, 0, 0.0)
    assert doc["idle_s"] >= 0.075
    got = aggregate({"chunks": {"sizes": [10]}}, {}, [doc], now=doc["written_at"])
    assert got["servers"][0]["state"] == "idle" and got["servers"][0]["idle_s"] == doc["idle_s"]
    writer(_snapshot(completions=10, state="done"))
    puts = store.puts
    time.sleep(0.3)
    assert store.doc("k.json")["state"] == "done" and store.puts == puts, "no heartbeat after the end"


def test_history_stays_bounded_and_covers_the_whole_run() -> None:
    store = FakeStore()
    t = {"now": 0.0}
    writer = ProgressWriter(store, "k.json", run_id=RUN, try_number=1, every_s=10.0, clock=lambda: t["now"])
    for i in range(1, 2001):
        t["now"] = 10.0 * i
        writer.write(_snapshot(completions=i, output_tokens=100 * i))
    hist = store.doc("k.json")["history"]
    assert len(hist) <= HISTORY_MAX
    assert hist[0][0] <= 100.0 and hist[-1][0] == 20_000.0
    assert recent_rate(hist) == pytest.approx(10.0)  # 100 tokens per 10 s
    assert len(downsample([[float(i)] for i in range(1000)], 100)) <= 100


def test_stopped_and_stale_workers_do_not_count_as_live() -> None:
    doc = {**_snapshot(in_flight=8), "written_at": 100.0, "every_s": 10.0, "totals": {}}
    assert worker_state(doc, 110.0) == "running"
    assert worker_state(doc, 200.0) == "stale"
    assert worker_state(doc, 110.0, "failed") == "stopped"
    assert worker_state(doc, 110.0, "up_for_retry") == "retrying"
    assert worker_state({**doc, "state": "done"}, 10_000.0) == "done"
    got = aggregate({"chunks": {"sizes": [10]}}, {}, [doc], now=110.0, task_states={"w0000": "failed"})
    assert (got["in_flight"], got["output_tokens_per_s"]) == (0, 0.0)


def test_fleet_series_sums_the_servers_and_drops_stopped_ones() -> None:
    # a: 100 tok/s from 0 to 20 s; b: 50 tok/s from 10 to 60 s (cumulative tokens in the history)
    a = {"worker": "w0000", "server": "a", "every_s": 10.0,
         "history": [[0.0, 0, 0, 0, 0.0, 1], [10.0, 0, 0, 1000, 100.0, 1], [20.0, 0, 0, 2000, 100.0, 1]]}
    b = {"worker": "w0001", "server": "b", "every_s": 10.0,
         "history": [[10.0, 0, 0, 0, 0.0, 1], [60.0, 0, 0, 2500, 50.0, 1]]}
    s = fleet_series([a, b])
    assert s["span_s"] == 60.0 and len(s["t"]) == 6 and s["bucket_s"] == 10.0
    assert s["t"][0] == 5.0 and s["t"][-1] == 55.0
    assert s["total"] == [100.0, 150.0, 50.0, 50.0, 50.0, 50.0]
    assert [x["server"] for x in s["servers"]] == ["a", "b"]
    assert s["servers"][0]["values"] == [100.0, 100.0, 0.0, 0.0, 0.0, 0.0]  # a stopped at 20 s
    assert s["mean_output_tokens_per_s"] == pytest.approx(4500 / 60)


# ---------------------------------------------------------------------------------- HTML


def test_page_html_escapes_and_shows_bars_report_and_plots() -> None:
    p = aggregate({"chunks": {"sizes": [10]}}, {0: 1.0}, [
        {**_snapshot(server="<script>x</script>", state="done"), "written_at": 1.0, "every_s": 10.0,
         "totals": {"completions": 10, "errors": 0, "output_tokens": 100}, "history": []}], now=2.0)
    view = {"dag_id": "dflash_generate", "run_id": RUN, "run_state": "success", "output_uri": "s3://b/ds",
            "progress": p, "report": {"status": "passed", "prompts": 10, "problems": [], "checks": [
                {"name": "coverage", "figure": "100%", "threshold": "min_coverage", "limit": 1.0, "ok": True}]},
            "plot_urls": [("report-x.png", "/dflash/runs/d/r/plots/report-x.png")], "report_md_url": "/md"}
    html = ui.run_page(view)
    assert "<script>x</script>" not in html and "&lt;script&gt;x&lt;/script&gt;" in html
    assert 'id="run-progress"' in html and 'class="bar server-progress"' in html
    assert 'id="report"' in html and 'src="/dflash/runs/d/r/plots/report-x.png"' in html
    assert 'data-final="1"' in html  # finished with its report: the page stops refreshing


def test_page_shows_the_mix_next_to_the_target_after_validation() -> None:
    from dflash_pipeline.steps.validate import mix as mixreport

    tally = mixreport.MixTally()
    import pyarrow as pa

    tally.add(pa.table({"id": ["a", "b", "c", "d"], "domain": ["math", "math", "code", "<b>x</b>"],
                        "thinking": [True, True, False, True]}))
    report = {"status": "passed", "problems": [], "mix": mixreport.mix_report(
        tally.to_counts(), {"domain": {"math": 0.3, "code": 0.3, "chat": 0.4}})}
    view = {"dag_id": "dflash_generate", "run_id": RUN, "run_state": "success", "output_uri": "s3://b/ds",
            "progress": None, "report": report,
            "plot_urls": [("report-mix.png", "/dflash/runs/d/r/plots/report-mix.png")]}
    html = ui.run_page(view)
    assert 'id="mix"' in html and 'src="/dflash/runs/d/r/plots/report-mix.png"' in html
    section = html[html.index('<section id="mix">'):]
    section = section[:section.index("</section>")]
    table = section[section.index('data-dim="domain"'):]
    # actual next to target, with the gap, for each label (the absent target label too)
    assert "<td class=\"\">math</td><td class=\"n\">2</td><td class=\"n\">50.0 %</td><td class=\"n\">30.0 %</td>" \
           "<td class=\"n\">+20.0 pp</td>" in table
    assert "<td class=\"\">chat</td><td class=\"n\">0</td><td class=\"n\">0.0 %</td><td class=\"n\">40.0 %</td>" \
           "<td class=\"n\">-40.0 pp</td>" in table
    assert "largest gap 40.0 pp" in table
    assert '<li data-dim="thinking"><b>thinking</b>: true 75.0 % \u00b7 false 25.0 %</li>' in section
    assert "&lt;b&gt;x&lt;/b&gt;" in section and "<b>x</b>" not in section
    assert ui.mix_section(None) == "" and 'id="mix"' not in ui.run_page({**view, "report": {"status": "passed"}})
