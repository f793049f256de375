"""The throughput chart of the progress page: its series over a whole run, its axis, its labels.

A finished demo run once drew an x axis of "1s" with two points per line and one server missing:
each worker had published one history sample (its last), and the chart's grid spanned only the
sample times. These tests build the series from the same objects the writer publishes.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from dflash_pipeline.config import short_server_labels
from dflash_pipeline.monitor import ui
from dflash_pipeline.monitor.fleet import aggregate, fleet_series
from dflash_pipeline.monitor.progress import HISTORY_MAX, SERIES_POINTS, ProgressWriter
from tests.unit.test_progress import RUN, FakeStore, _snapshot

SERVERS = ("http://10.0.0.11:30000", "http://10.0.0.12:30000", "http://10.0.0.13:30000")


def _publish(worker: int, samples: list[tuple[float, float, int]], *, every_s: float = 10.0,
             state_at_end: str = "done") -> dict[str, Any]:
    """Drive a ProgressWriter with snapshots (time, elapsed_s, output tokens); return its last object."""
    store = FakeStore()
    clock = {"t": 0.0}
    writer = ProgressWriter(store, "k.json", run_id=RUN, try_number=1, every_s=every_s, n_servers=3,
                            clock=lambda: clock["t"])
    for i, (t, elapsed, tokens) in enumerate(samples):
        clock["t"] = t
        state = state_at_end if i == len(samples) - 1 else "running"
        writer.write(_snapshot(worker=f"w{worker:04d}", server=SERVERS[worker], state=state, elapsed_s=elapsed,
                               completions=tokens // 100, output_tokens=tokens), now=t)
    return store.doc("k.json")


def test_a_sixteen_hour_run_of_three_servers_stays_bounded_and_spans_the_run() -> None:
    run_start = 1_000_000.0
    gen_start = run_start + 60.0  # plan and preflight
    hours16 = 16 * 3600.0
    rates = (300.0, 200.0, 100.0)
    docs = []
    for w, rate in enumerate(rates):
        stop = hours16 if w != 2 else 8 * 3600.0  # the third server is lost half-way
        samples = [(gen_start + e, e, int(rate * e)) for e in range(10, int(stop) + 1, 10)]
        docs.append(_publish(w, samples, state_at_end="done" if w != 2 else "running"))
    for d in docs:
        assert len(d["history"]) <= HISTORY_MAX
        assert d["history"][0][0] == gen_start  # the start sample: the curve begins where the task began
    s = fleet_series(docs, start=run_start)
    assert len(s["t"]) == len(s["total"]) <= SERIES_POINTS
    assert s["span_s"] == pytest.approx(60.0 + hours16, abs=1.0)
    assert s["t"][-1] + s["bucket_s"] / 2 == pytest.approx(s["span_s"], abs=1.0)
    assert [x["server"] for x in s["servers"]] == list(SERVERS)
    n = len(s["t"])
    for w, rate in enumerate(rates):
        vals = s["servers"][w]["values"]
        inside = [v for t, v in zip(s["t"], vals) if 3600 < t < (7 if w == 2 else 15) * 3600]
        assert inside and all(v == pytest.approx(rate, rel=0.02) for v in inside), (w, inside[:5])
    lost = [v for t, v in zip(s["t"], s["servers"][2]["values"]) if t > 9 * 3600]
    assert lost and all(v == 0.0 for v in lost)
    for i in range(n):
        assert s["total"][i] == pytest.approx(sum(x["values"][i] for x in s["servers"]), abs=0.2)
    # tokens are conserved: the buckets add up to what the servers produced
    produced = sum(d["totals"]["output_tokens"] for d in docs)
    assert sum(s["total"]) * s["bucket_s"] == pytest.approx(produced, rel=0.01)

    svg = ui.throughput_svg(s)
    assert len(re.findall(r'<polyline class="server-line"', svg)) == 3
    ticks = re.findall(r'<text class="xtick"[^>]*>([^<]*)</text>', svg)
    assert ticks[:3] == ["0", "3h", "6h"] and ticks[-1] == "15h"


def test_a_short_demo_run_draws_every_server_over_the_whole_run() -> None:
    """The demo's shape: plan+preflight ~10 s, then three servers for ~10 s, reporting every second."""
    run_start = 500.0
    docs = []
    for w, (begin, end, rate) in enumerate([(510.0, 520.1, 6000.0), (510.2, 519.6, 6500.0), (510.1, 520.8, 5700.0)]):
        times = [begin + k for k in range(1, int(end - begin) + 1)] + [end]
        docs.append(_publish(w, [(t, t - begin, int(rate * (t - begin))) for t in times], every_s=10.0))
    s = fleet_series(docs, start=run_start)
    assert s["span_s"] == pytest.approx(20.8, abs=0.01)
    assert len(s["t"]) >= 15, "about one point per second of the run"
    for w, x in enumerate(s["servers"]):
        busy = [v for t, v in zip(s["t"], x["values"]) if 12 < t < 19]
        assert busy and min(busy) > 5000, (w, x["values"])
        assert all(v == 0.0 for t, v in zip(s["t"], x["values"]) if t < 9.5), "nothing before generate started"
    svg = ui.throughput_svg(s)
    for url in SERVERS:
        assert f'data-server="{url}"' in svg and f"<title>{url} (" in svg
    assert ">10.0.0.11:30000</span>" in svg  # short label in the legend, the full URL as its tooltip
    ticks = re.findall(r'<text class="xtick"[^>]*>([^<]*)</text>', svg)
    assert ticks == ["0", "5s", "10s", "15s", "20s"]


def test_the_old_one_sample_per_worker_objects_still_span_their_start() -> None:
    """One snapshot per worker (a task shorter than the interval) still gives a start and an end."""
    docs = [_publish(w, [(520.0 + w * 0.4, 10.0, 60_000)]) for w in range(3)]
    for w, d in enumerate(docs):
        assert [h[0] for h in d["history"]] == [round(510.0 + w * 0.4, 1), d["written_at"]]
    s = fleet_series(docs, start=505.0)
    assert s["span_s"] == pytest.approx(15.8, abs=0.01)
    assert all(max(x["values"]) > 5000 for x in s["servers"])


def test_snapshots_replaced_behind_a_slow_put_still_become_history_samples() -> None:
    import threading

    store = FakeStore()
    gate = threading.Event()
    original = store.put

    def slow_put(key: str, data: bytes, **kw: Any) -> str:
        gate.wait(5)
        return original(key, data, **kw)

    store.put = slow_put  # type: ignore[method-assign]
    clock = {"t": 100.0}
    writer = ProgressWriter(store, "k.json", run_id=RUN, try_number=1, every_s=10.0, final_wait_s=5.0,
                            clock=lambda: clock["t"])
    for i in range(1, 6):
        clock["t"] = 100.0 + i
        writer(_snapshot(output_tokens=1000 * i, elapsed_s=float(i)))
    gate.set()
    clock["t"] = 106.0
    writer(_snapshot(output_tokens=6000, elapsed_s=6.0, state="done"))
    hist = store.doc("k.json")["history"]
    assert [h[0] for h in hist] == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0, 106.0]
    assert [h[3] for h in hist] == [0, 1000, 2000, 3000, 4000, 5000, 6000]


def test_the_finished_runs_mean_rate_is_tokens_over_the_generation_time() -> None:
    docs = [_publish(w, [(110.0 + e, float(e), 100 * e) for e in range(1, 11)]) for w in range(3)]
    p = aggregate({"chunks": {"sizes": [30]}}, {0: 121.0}, docs, now=130.0, run_started_at=100.0)
    assert p["series"]["mean_output_tokens_per_s"] == pytest.approx(300.0)
    assert ui.rate_kpi(p, "success") == ("output tok/s (fleet, mean)", "300")


def test_empty_and_single_instant_histories_draw_no_chart() -> None:
    assert fleet_series([])["t"] == []
    one = {"worker": "w0000", "server": "a", "history": [[5.0, 1, 0, 10, 1.0, 0]]}
    assert fleet_series([one])["t"] == []
    assert "appears after" in ui.throughput_svg(fleet_series([one]))


@pytest.mark.parametrize(("span", "first", "last"), [
    (20.8, "0", "20s"), (95.0, "0", "1m 30s"), (3 * 3600 + 100, "0", "3h"), (16 * 3600 + 60, "0", "15h"),
    (3 * 86400.0, "0", "72h"),
])
def test_time_ticks_are_round_and_in_the_runs_units(span: float, first: str, last: str) -> None:
    ticks = ui.time_ticks(span)
    assert 2 <= len(ticks) <= 9 and ticks[-1] <= span
    labels = [ui.duration_tick(t) for t in ticks]
    assert (labels[0], labels[-1]) == (first, last)


def test_short_server_labels_are_distinct_and_short() -> None:
    assert short_server_labels(["http://127.0.0.1:41133", "http://127.0.0.1:33653/"]) == [
        "127.0.0.1:41133", "127.0.0.1:33653"]
    assert short_server_labels(["http://gpu0.cluster.internal:30000", "https://gpu1.cluster.internal:30000",
                                "sglang_gpu2"]) == ["gpu0:30000", "gpu1:30000", "sglang_gpu2"]
    # the first DNS label alone would collide: the whole host is kept
    assert short_server_labels(["http://gpu0.a.example:30000", "http://gpu0.b.example:30000"]) == [
        "gpu0.a.example:30000", "gpu0.b.example:30000"]
    long = [f"http://10.0.0.1:8000/v1/very/long/path/server-{i}" for i in range(2)]
    got = short_server_labels(long)
    assert len(set(got)) == 2 and all(len(x) <= 22 for x in got)


@pytest.mark.parametrize(("elapsed", "expected"), [(0.0, 1.0), (5.0, 1.0), (30.0, 3.0), (100.0, 10.0), (50_000.0, 10.0)])
def test_a_worker_reports_often_early_and_every_interval_later(elapsed: float, expected: float) -> None:
    """A task shorter than progress_every_s still publishes about ten samples (the demo's ~10 s tasks)."""
    import time

    from dflash_pipeline.config import Sampling
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.serving.sglang import ServerSpec
    from dflash_pipeline.steps.generate import Worker, WorkerSettings

    settings = WorkerSettings(run_id=RUN, worker="w0000", server=ServerSpec("gpu0", "http://gpu0:30000"),
                              model="m", sampling=Sampling(), concurrency=8)
    # A Store with no client: reporting must never call S3.
    worker = Worker(Store(None, "b"), DatasetLayout("b", "ds"), {"chunks": {"sizes": [4]}, "plan_id": "p"}, settings)
    worker.stats.started_t = time.monotonic() - elapsed
    assert worker._progress_interval() == pytest.approx(expected, abs=0.05)


def test_a_live_run_ends_at_what_every_live_worker_has_reported() -> None:
    a = {"worker": "w0000", "server": "a", "history": [[0.0, 0, 0, 0, 0.0, 0], [10.0, 0, 0, 1000, 0.0, 1],
                                                       [20.0, 0, 0, 2000, 0.0, 1]]}
    b = {"worker": "w0001", "server": "b", "history": [[0.0, 0, 0, 0, 0.0, 0], [10.0, 0, 0, 1000, 0.0, 1],
                                                       [18.0, 0, 0, 1800, 0.0, 1]]}
    live = fleet_series([a, b], live=["w0000", "w0001"])
    assert live["span_s"] == 18.0 and live["servers"][1]["values"][-1] == pytest.approx(100.0)
    finished = fleet_series([a, b])  # b stopped at 18 s: nothing from it in the last 2 s of the 10-20 s bucket
    assert finished["span_s"] == 20.0 and finished["servers"][1]["values"][-1] == pytest.approx(80.0)


def test_the_limit_over_time_is_recorded_and_drawn_per_server() -> None:
    """The in-flight limit (discovered concurrency) is the 7th field of every history sample; the
    page draws it per server on the throughput chart's time axis and shows slots in the table."""
    store = FakeStore()
    clock = {"t": 0.0}
    writer = ProgressWriter(store, "k.json", run_id=RUN, try_number=1, every_s=1.0, n_servers=1,
                            clock=lambda: clock["t"])
    control = {"mode": "load", "start": 16, "slots": 64, "limit": 80, "ceiling": None, "cap": 1024,
               "reason": "8 running with 16 waiting", "rejections": {}, "changes": [[1.0, 20, 16, None, "assumed"]]}
    for t, limit in ((100.0, 20), (101.0, 44), (102.0, 92), (103.0, 80), (104.0, 80)):
        clock["t"] = t
        writer.write(_snapshot(server=SERVERS[0], elapsed_s=t - 99.5, output_tokens=int(t), completions=1,
                               in_flight=limit, in_flight_limit=limit, concurrency_control=control), now=t)
    doc = store.doc("k.json")
    assert [h[6] for h in doc["history"]] == [20, 20, 44, 92, 80, 80]  # the task's start sample, then each write
    p = aggregate({"chunks": {"sizes": [10]}}, {}, [doc], now=105.0, run_started_at=99.0)
    server = p["servers"][0]
    assert server["limit_series"][-1] == [104.0, 80] and server["concurrency_control"]["slots"] == 64
    html = ui.progress_section(p, "running")
    assert 'id="concurrency"' in html and 'class="limit-line"' in html
    assert "slots 64" in html and "80 / 80" in html
    # Objects written before the limit was recorded (six-field samples) draw no limit chart.
    old = {**doc, "history": [h[:6] for h in doc["history"]], "concurrency_control": None}
    p_old = aggregate({"chunks": {"sizes": [10]}}, {}, [old], now=105.0, run_started_at=99.0)
    assert p_old["servers"][0]["limit_series"] == [] and 'id="concurrency"' not in ui.progress_section(p_old, "running")
