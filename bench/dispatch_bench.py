"""Dispatch benchmark: the pipeline's generate client against a naive batch client, on a simulated fleet.

    .venv/bin/python bench/dispatch_bench.py            # defaults: 8000 prompts, 4 servers x 16 slots

What runs where (so the client's CPU is measured alone):
- S3 is a real moto server subprocess (`python -m dflash_pipeline.dev.s3server`: atomic conditional writes) (one for the whole benchmark;
  prompts in one bucket, each run's output in a fresh bucket: moto lists a prefix by scanning the whole bucket).
- The fleet is `python -m dflash_pipeline.dev.sim` in its own subprocess, fresh for every client and scenario.
- Each client runs in a child process of this script (`--child ours|baseline`), which reports its own
  CPU time (`time.process_time`) and peak RSS (VmHWM of that child only).
- "ours" is the code the DAG runs: `run_plan` and `run_preflight` here (the DAG's plan and preflight
  tasks), then in the child one `Worker(...).run()` thread per server (the DAG's mapped generate
  tasks), with `WorkerSettings` built as `tasks.generate` builds them; then `run_validation` here.
- "baseline" is the old design, written below: prompt i -> server i % n, per server batches of 500
  sent with 64 requests in flight, wait for the whole batch, save it, then the next batch; plain
  `requests` threads, no retries, a failed request's prompt is lost (counted).

Figures are taken at the servers (/sim/stats):
- capacity C_s = slots_s / (token_time_s_s * slow_factor_s) tokens/s; C = sum over servers.
- t0 = earliest first_admit_t of any server; t_end = latest last_finish_t (a crashed server's stats
  are read just before it is crashed: a crashed sim stops listening).
- actual_wall = t_end - t0.
- useful tokens U = output tokens of the rows in the final dataset (ours: run_validation's
  output_tokens; baseline: completion_tokens of its saved rows).
- ideal_wall = U / C. Killed scenario, server k crashed at t_c, d = t_c - t0: the killed server's
  capacity counts only until t_c, so ideal_wall = U / C if U <= C * d, else d + (U - C * d) / (C - C_k).
- % of ideal = ideal_wall / actual_wall.
- busy % of a server = busy_slot_seconds / (slots * wall) (wall ends at t_c for the killed one);
  "survivors busy %" pools all servers that were not killed over actual_wall.
- vLLM scenarios (`vllm`, `vllm_halve`): every server speaks vLLM's wire with `--vllm-slots` hidden
  slots (vLLM does not publish max_num_seqs), at `token_time_s x vllm_slots / slots` per token, so
  each server's capacity in tokens/s (and the ideal wall) is the default scenarios'. `vllm_halve`:
  once half the prompts are done, server 0 drops to half its slots and refuses (503) beyond 8
  waiting (POST /sim/config); its capacity counts in full until then, half after:
  ideal_wall = d + (U - C * d) / (C - C_0 / 2) when U > C * d.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BUCKET = "bench"
PROMPTS_KEY = "in/prompts.jsonl"
CONVERSATIONS_KEY = "in/conversations.jsonl"  # the all_turns scenario's multi-turn rows
MODEL = "Qwen/Qwen3-8B"

BASELINE_BATCH = 500
BASELINE_IN_FLIGHT = 64

# Fast lost-server detection for the killed scenario (passed through WorkerSettings).
# The hand-off interval is the DAG default (server_handoff_after_s 5 s, see settings_for); the task
# fails later (server_lost_after_s 30 s instead of 120 s, only so the bench does not wait 2 minutes).
KILLED_SETTINGS = {"server_lost_after_s": 30.0, "max_attempts": 3, "backoff_base_s": 0.1, "backoff_cap_s": 0.5}


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _s3(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        region_name="us-east-1",
        config=Config(max_pool_connections=32, retries={"max_attempts": 2, "mode": "standard"}),
    )


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (Linux /proc), to show how loaded the sim and moto were."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _maxrss_mb() -> float:
    """Peak RSS of this process since its exec (VmHWM).

    Not ru_maxrss: Linux carries ru_maxrss over execve, so a child started from this (bigger) parent
    would report the parent's RSS at fork time.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _prompt_rows(n: int) -> list[dict[str, Any]]:
    rng = random.Random(1234)
    topics = ("primes", "triangles", "sorting", "graphs", "integrals", "parity", "strings", "matrices")
    return [
        {"id": f"p{i:07d}", "prompt": f"Question {i}: reason step by step about {rng.choice(topics)} "
                                      f"and give the answer for case {rng.randint(1, 10**9)}."}
        for i in range(n)
    ]


def _conversation_rows(n: int) -> list[dict[str, Any]]:
    """Multi-turn rows for the all_turns scenario: 1 to 3 old answers each (2 on average), so a
    conversation is 2 to 4 sequential requests on one server."""
    rng = random.Random(4321)
    rows = []
    for i, row in enumerate(_prompt_rows(n)):
        msgs = [{"role": "user", "content": row["prompt"]}]
        for k in range(rng.randint(1, 3)):
            msgs += [{"role": "assistant", "content": f"An old answer {k} to question {i}: {rng.randint(1, 10**6)}."},
                     {"role": "user", "content": f"Follow-up {k}: check that result another way, briefly."}]
        rows.append({"id": row["id"], "messages": msgs})
    return rows


def _row_tokens_in_plan_order(s3: Any, output_uri: str) -> list[int]:
    """Output tokens of every row (a conversation: the sum of its turns), in plan order, for the bound."""
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dataset.records import read_parquet

    lay = DatasetLayout.from_uri(output_uri)
    keys = sorted(o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=lay.bucket, Prefix=lay.completions_prefix) for o in page.get("Contents", []))
    out: list[int] = []
    for key in keys:
        tbl = read_parquet(s3.get_object(Bucket=lay.bucket, Key=key)["Body"].read(), ["completion_tokens"])
        out += [int(v or 0) for v in tbl.column("completion_tokens").to_pylist()]
    return out


class Moto:
    def __init__(self) -> None:
        self.port = _free_port()
        # moto with S3's atomic conditional writes (dflash_pipeline.dev.s3server explains why).
        cmd = [sys.executable, "-m", "dflash_pipeline.dev.s3server"]
        self.proc = subprocess.Popen(cmd + ["-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Fleet:
    """`python -m dflash_pipeline.dev.sim` in its own process."""

    def __init__(self, args: argparse.Namespace, server_sets: list[str], workdir: Path, vllm: bool = False) -> None:
        urls_file = workdir / f"urls-{time.monotonic_ns()}.txt"
        slots, token_time = (args.vllm_slots, vllm_token_time(args)) if vllm else (args.slots, args.token_time_s)
        cmd = [
            sys.executable, "-m", "dflash_pipeline.dev.sim", "--count", str(args.servers), "--urls-file", str(urls_file),
            "--set", f"max_running_requests={slots}", "--set", f"token_time_s={token_time}",
            "--set", f"length_scale={args.length_scale}", "--set", f"mean_tokens={args.mean_tokens}",
            "--set", "track_ids=false",
        ]
        if vllm:
            cmd += ["--set", "engine=vllm"]
        for s in server_sets:
            cmd += ["--server-set", s]
        self.log = open(workdir / "sim.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=REPO)
        deadline = time.monotonic() + 30
        while not urls_file.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"sim fleet did not start; see {workdir / 'sim.log'}")
            time.sleep(0.05)
        self.urls = urls_file.read_text().split()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Monitor(threading.Thread):
    """Polls /sim/stats; in the killed scenario crashes server 0 once half the prompts are done
    (in vllm_halve, halves its slots and bounds its queue then).

    Before crashing it reads server 0's stats (a crashed sim no longer answers) and keeps them as
    that server's final figures.
    """

    def __init__(self, urls: list[str], prompts: int, kill: bool, expected_wall_s: float, every_s: float = 0.1,
                 halve: bool = False):
        super().__init__(daemon=True, name="monitor")
        import requests

        self.session = requests.Session()
        self.urls = urls
        self.prompts = prompts
        self.kill = kill
        self.expected_wall_s = expected_wall_s
        self.every_s = every_s
        self.stop_ev = threading.Event()
        self.samples: list[tuple[float, list[int], int]] = []  # (t, running per server, generation requests)
        self.waiting: list[list[int]] = []  # queued at each server, per sample
        self.killed_stats: dict[str, Any] | None = None
        self.crash_t: float | None = None
        self.killed_at_completed: int | None = None
        self._first_seen: float | None = None
        self.halve = halve
        self.halved_slots: tuple[int, int] | None = None  # server 0's slots (before, after)
        self.refused: list[tuple[float, int]] = []  # (t, server 0's 503 answers so far)

    def stats(self, i: int) -> dict[str, Any]:
        return self.session.get(self.urls[i] + "/sim/stats", timeout=10).json()

    def run(self) -> None:
        while not self.stop_ev.wait(self.every_s):
            t = time.time()
            running, waiting, gen, completed = [], [], 0, 0
            for i in range(len(self.urls)):
                if self.kill and self.crash_t is not None and i == 0:
                    running.append(0)
                    waiting.append(0)
                    continue
                try:
                    st = self.stats(i)
                except Exception:  # noqa: BLE001 - a server going away between polls
                    running.append(0)
                    waiting.append(0)
                    continue
                running.append(int(st["running"]))
                waiting.append(int(st["waiting"]))
                if i == 0:
                    self.refused.append((t, int((st.get("errors_by_code") or {}).get("503", 0))))
                gen += int(st["generation_requests"])
                completed += int(st["completed"])
            if self.killed_stats is not None:
                gen += int(self.killed_stats["generation_requests"])
                completed += int(self.killed_stats["completed"])
            self.samples.append((t, running, gen))
            self.waiting.append(waiting)
            if completed and self._first_seen is None:
                self._first_seen = t
            if (self.kill or self.halve) and self.crash_t is None and self._first_seen is not None and (
                completed >= self.prompts // 2 or t - self._first_seen >= self.expected_wall_s / 2
            ):
                if self.halve:
                    before = int(self.stats(0)["capacity_slots"])
                    self.session.post(self.urls[0] + "/sim/config", timeout=10,
                                      json={"max_running_requests": before // 2, "max_queued_requests": 8})
                    self.halved_slots = (before, before // 2)
                else:
                    self.killed_stats = self.stats(0)
                    self.session.post(self.urls[0] + "/sim/crash", json={}, timeout=10)
                self.crash_t = time.time()
                self.killed_at_completed = completed


# ------------------------------------------------------------------------------------------------
# child processes: the clients
# ------------------------------------------------------------------------------------------------
def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """One mapped generate task: one Worker for server `map_index`, alone in its process, as in the DAG."""
    from dflash_pipeline.config import RunConfig
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.serving.sglang import ServerSpec
    from dflash_pipeline.steps.generate import Worker, settings_for

    client = _s3(spec["endpoint"])
    cfg = RunConfig.from_params(spec["params"])
    layout = DatasetLayout.from_uri(cfg.output_uri)
    manifest = json.loads(Store(client, layout.bucket).get(layout.manifest_key)[0])
    rss_before = _maxrss_mb()
    map_index = spec["map_index"]
    url = cfg.servers[map_index]
    # As tasks.generate builds them (one mapped task per server), plus the bench's overrides.
    settings = settings_for(
        cfg, run_id=spec["run_id"], map_index=map_index, server=ServerSpec(name=url, base_url=url),
        server_info=spec["servers"][map_index], **spec.get("settings", {}),
    )
    worker = Worker(Store(client, layout.bucket), layout, manifest, settings)
    # Start together: the bench measures dispatch, not how long a process takes to import and start.
    Path(spec["ready_file"]).touch()
    while not Path(spec["go_file"]).exists():
        time.sleep(0.005)
    cpu0, wall0 = time.process_time(), time.monotonic()
    try:
        worker.run()
        outcome: Any = "ok"
    except BaseException as exc:  # noqa: BLE001 - reported (a lost server's task raises ServerLost)
        outcome = {"raised": type(exc).__name__, "message": str(exc)[:300]}
    control = worker.concurrency.snapshot() if hasattr(worker, "concurrency") else None  # absent before issue 25
    return {
        "cpu_s": time.process_time() - cpu0,
        "client_wall_s": time.monotonic() - wall0,
        "worker": {"worker": settings.worker, "outcome": outcome, **worker.stats.to_dict(), "concurrency": control},
        "maxrss_mb": _maxrss_mb(),
        "maxrss_before_run_mb": rss_before,
    }


def child_baseline(spec: dict[str, Any]) -> dict[str, Any]:
    """The old design: static split, gathered batches, no retries. Self-contained on purpose."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    import requests

    client = _s3(spec["endpoint"])
    urls: list[str] = spec["urls"]
    n = len(urls)
    body = client.get_object(Bucket=BUCKET, Key=PROMPTS_KEY)["Body"].read()
    rss_before = _maxrss_mb()
    cpu0, wall0 = time.process_time(), time.monotonic()
    prompts = [json.loads(line) for line in body.splitlines() if line.strip()]
    shares = [prompts[i::n] for i in range(n)]
    local = threading.local()
    counts = {"saved": 0, "lost": 0, "tokens": 0, "batches": 0}
    ids_saved: list[str] = []
    lock = threading.Lock()

    def one(url: str, p: dict[str, Any]) -> dict[str, Any] | None:
        s = getattr(local, "s", None)
        if s is None:
            s = local.s = requests.Session()
        req = {
            "model": MODEL, "messages": [{"role": "user", "content": p["prompt"]}],
            "max_tokens": spec["max_tokens"], "temperature": 0.6, "top_p": 0.95, "stream": False,
            "chat_template_kwargs": {"enable_thinking": True}, "separate_reasoning": True,
        }
        try:
            r = s.post(url + "/v1/chat/completions", json=req, timeout=300)
            if r.status_code != 200:
                return None
            d = r.json()
            msg = d["choices"][0]["message"]
            return {"id": p["id"], "content": msg.get("content"), "reasoning": msg.get("reasoning_content"),
                    "completion_tokens": int(d["usage"]["completion_tokens"]), "server": url}
        except Exception:  # noqa: BLE001 - no retries: the prompt is lost
            return None

    def drive(i: int) -> None:
        url = urls[i]
        with ThreadPoolExecutor(BASELINE_IN_FLIGHT, thread_name_prefix=f"s{i}") as pool:
            for b, start in enumerate(range(0, len(shares[i]), BASELINE_BATCH)):
                batch = shares[i][start:start + BASELINE_BATCH]
                results = list(pool.map(lambda p: one(url, p), batch))  # waits for the whole batch
                rows = [r for r in results if r is not None]
                if rows:
                    buf = io.BytesIO()
                    pq.write_table(pa.Table.from_pylist(rows), buf, compression="zstd")
                    client.put_object(Bucket=spec["bucket"], Key=f"{spec['prefix']}/server-{i}/batch-{b:05d}.parquet",
                                      Body=buf.getvalue())
                with lock:
                    counts["saved"] += len(rows)
                    counts["lost"] += len(batch) - len(rows)
                    counts["tokens"] += sum(r["completion_tokens"] for r in rows)
                    counts["batches"] += 1
                    ids_saved.extend(r["id"] for r in rows)

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu0
    return {
        "cpu_s": cpu,
        "client_wall_s": time.monotonic() - wall0,
        "completions": counts["saved"],
        "saved": counts["saved"],
        "lost": counts["lost"],
        "useful_tokens": counts["tokens"],
        "duplicates": len(ids_saved) - len(set(ids_saved)),
        "batches": counts["batches"],
        "maxrss_mb": _maxrss_mb(),
        "maxrss_before_run_mb": rss_before,
    }


def _start_child(kind: str, spec: dict[str, Any], workdir: Path, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    spec_path = workdir / f"{name}.spec.json"
    out_path = workdir / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    with open(workdir / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", kind,
                                 "--spec", str(spec_path), "--result", str(out_path)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    return proc, out_path


def _child_result(proc: subprocess.Popen[bytes], out_path: Path, kind: str, workdir: Path, name: str) -> dict[str, Any]:
    rc = proc.wait()
    if rc != 0 or not out_path.exists():
        raise RuntimeError(f"{kind} client failed (rc={rc}); see {workdir / (name + '.log')}")
    return json.loads(out_path.read_text())


def run_child(kind: str, spec: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    proc, out_path = _start_child(kind, spec, workdir, name)
    return _child_result(proc, out_path, kind, workdir, name)


def run_ours(spec: dict[str, Any], n_servers: int, workdir: Path, name: str) -> dict[str, Any]:
    """All mapped generate tasks at once, one process each (as Airflow runs them); figures summed."""
    go = workdir / f"{name}.go"
    ready = [workdir / f"{name}-w{i}.ready" for i in range(n_servers)]
    started = [(_start_child("ours", {**spec, "map_index": i, "ready_file": str(ready[i]), "go_file": str(go)},
                             workdir, f"{name}-w{i}"), i) for i in range(n_servers)]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready):
        if time.monotonic() > deadline or any(proc.poll() is not None for (proc, _), _ in started):
            break  # _child_result below reports the failure
        time.sleep(0.01)
    go.touch()
    parts = [_child_result(proc, out, "ours", workdir, f"{name}-w{i}") for (proc, out), i in started]
    workers = [p["worker"] for p in parts]
    return {
        "cpu_s": sum(p["cpu_s"] for p in parts),
        "client_wall_s": max(p["client_wall_s"] for p in parts),
        "completions": sum(w["completions"] for w in workers),
        "requests_sent": sum(w["requests_sent"] for w in workers),
        "workers": workers,
        "maxrss_mb": max(p["maxrss_mb"] for p in parts),
        "maxrss_before_run_mb": max(p["maxrss_before_run_mb"] for p in parts),
        "processes": n_servers,
    }


# ------------------------------------------------------------------------------------------------
# one scenario x client
# ------------------------------------------------------------------------------------------------
def capacity(st: dict[str, Any]) -> float:
    return st["capacity_slots"] / (st["token_time_s"] * st["slow_factor"])


def measure(stats: list[dict[str, Any]], useful_tokens: int, killed: int | None, crash_t: float | None,
            samples: list[tuple[float, list[int], int]], prompts: int,
            halved: tuple[int, int] | None = None) -> dict[str, Any]:
    """Figures of one run. `killed`/`crash_t`: server `killed` lost its capacity at crash_t; with
    `halved` (slots before, after) it went from the first to the second figure then instead."""
    t0 = min(s["first_admit_t"] for s in stats if s["first_admit_t"] is not None)
    t_end = max(s["last_finish_t"] for s in stats if s["last_finish_t"] is not None)
    wall = t_end - t0
    if halved is not None:  # capacity as it was before the change (its stats show the new slots)
        stats = [dict(s, capacity_slots=halved[0]) if i == killed else s for i, s in enumerate(stats)]
    caps = [capacity(s) for s in stats]
    c_all = sum(caps)
    lost = 0.0 if killed is None else caps[killed] * (1.0 if halved is None else 1.0 - halved[1] / halved[0])
    if killed is None:
        ideal = useful_tokens / c_all
    else:
        d = crash_t - t0
        ideal = (useful_tokens / c_all if useful_tokens <= c_all * d
                 else d + (useful_tokens - c_all * d) / (c_all - lost))
    busy = []
    slot_seconds = []
    for i, s in enumerate(stats):
        if i == killed and halved is not None:
            d = crash_t - t0
            slot_seconds.append(halved[0] * d + halved[1] * (wall - d))
        else:
            slot_seconds.append(s["capacity_slots"] * ((crash_t - t0) if i == killed else wall))
        busy.append(s["busy_slot_seconds"] / slot_seconds[-1])
    surv = [i for i in range(len(stats)) if i != killed or halved is not None]
    surv_busy = sum(stats[i]["busy_slot_seconds"] for i in surv) / sum(slot_seconds[i] for i in surv)
    # Diagnostics: when was the last prompt handed to a server, and how full were the slots until then?
    t_disp = next((t for t, _, g in samples if g >= prompts), None)
    steady = [sum(r[i] for i in surv) for t, r, _ in samples
              if t0 + 0.5 <= t <= (t_disp or t_end) and (halved is None or crash_t is None or t < crash_t)]
    slots_surv = sum(stats[i]["capacity_slots"] for i in surv)
    return {
        "t0": t0, "t_end": t_end, "actual_wall_s": wall, "ideal_wall_s": ideal,
        "pct_ideal": 100.0 * ideal / wall,
        "capacity_tok_s": c_all, "useful_tokens": useful_tokens,
        "busy_pct": [round(100 * b, 2) for b in busy], "survivors_busy_pct": 100 * surv_busy,
        "crash_after_s": None if crash_t is None else crash_t - t0,
        "all_dispatched_after_s": None if t_disp is None else t_disp - t0,
        "drain_s": None if t_disp is None else t_end - t_disp,
        "steady_occupancy_pct": 100 * sum(steady) / (len(steady) * slots_surv) if steady else None,
        "server_output_tokens": [s["output_tokens"] for s in stats],
        "server_generation_requests": [s["generation_requests"] for s in stats],
    }


def vllm_token_time(args: argparse.Namespace) -> float:
    """Per-token time of the vLLM scenarios' servers: as many tokens/s per server as the default ones."""
    return args.token_time_s * args.vllm_slots / args.slots


def scaled_max_tokens(args: argparse.Namespace) -> int:
    """The job's `max_tokens` in the sim's scaled tokens: the cap keeps its ratio to the mean length."""
    return max(1, round(args.max_tokens * args.length_scale))


def prompt_lengths(n: int, args: argparse.Namespace) -> list[int]:
    """The completion length the sim will produce for each prompt, in plan order (for the bound)."""
    from dflash_pipeline.dataset.prompts import normalize_row
    from dflash_pipeline.dev.sim.lengths import plan_lengths

    out = []
    for i, row in enumerate(_prompt_rows(n)):
        p = normalize_row(row, i + 1)
        want = plan_lengths(p.messages, mean_tokens=args.mean_tokens, length_scale=args.length_scale).total_tokens
        out.append(min(want, scaled_max_tokens(args)))
    return out


def oblivious_bound(lengths: list[int], stats: list[dict[str, Any]], killed: int | None,
                    kill_after_s: float | None, halved: tuple[int, int] | None = None) -> float:
    """% of ideal that a perfect length-oblivious dispatcher would reach on this scenario.

    Greedy list scheduling of the prompts in plan order onto the fleet's slots, with zero client
    latency and (killed scenario) instant loss detection: a request cut by the crash is redone from
    scratch at the crash time. With `halved` (slots before, after), server `killed` keeps running
    what it started but its slots above the second figure take nothing new after kill_after_s.
    Only the order of lengths is unknown to it, which is what makes the final drain (one long
    request started late) unavoidable for any dispatcher that does not know the lengths.
    """
    import heapq

    if halved is not None:
        stats = [dict(st, capacity_slots=halved[0]) if i == killed else st for i, st in enumerate(stats)]
    slots = []
    for i, st in enumerate(stats):
        step = st["token_time_s"] * st["slow_factor"]
        slots += [(0.0, i * 10_000 + k, i, step) for k in range(st["capacity_slots"])]
    heapq.heapify(slots)
    queue: list[tuple[int, float]] = [(x, 0.0) for x in reversed(lengths)]  # pop() takes the next one
    end = 0.0
    while queue:
        t, sid, srv, step = heapq.heappop(slots)
        gone = srv == killed and kill_after_s is not None and t >= kill_after_s
        if gone and (halved is None or sid % 10_000 >= halved[1]):
            continue  # this slot is gone
        tokens, avail = queue.pop()
        start = max(t, avail)
        finish = start + tokens * step
        if srv == killed and halved is None and kill_after_s is not None and finish > kill_after_s:
            queue.append((tokens, kill_after_s))  # lost with the server; redone elsewhere
            continue
        end = max(end, finish)
        heapq.heappush(slots, (finish, sid, srv, step))
    caps = [capacity(st) for st in stats]
    total = sum(lengths)
    if killed is None:
        ideal = total / sum(caps)
    else:
        d, c_all = kill_after_s, sum(caps)
        lost = caps[killed] * (1.0 if halved is None else 1.0 - halved[1] / halved[0])
        ideal = total / c_all if total <= c_all * d else d + (total - c_all * d) / (c_all - lost)
    return 100.0 * ideal / end


def run_one(args: argparse.Namespace, moto: Moto, scenario: str, client_kind: str, workdir: Path,
            lengths: list[int]) -> dict[str, Any]:
    from dflash_pipeline.config import RunConfig
    from dflash_pipeline.serving.sglang import ServerSpec
    from dflash_pipeline.steps.plan import run_plan
    from dflash_pipeline.steps.preflight import run_preflight
    from dflash_pipeline.steps.validate import ValidationFailed, run_validation

    server_sets = ["0:slow_factor=2.0"] if scenario == "slow" else []
    all_turns = scenario == "all_turns"
    kill = scenario == "killed"
    halve = scenario == "vllm_halve"
    hit = 0 if kill or halve else None  # the server that loses capacity mid-run
    t_phase = time.monotonic()
    fleet = Fleet(args, server_sets, workdir, vllm=scenario.startswith("vllm"))
    phases: dict[str, float] = {"fleet_start_s": time.monotonic() - t_phase}
    name = f"{scenario}-{client_kind}"
    prefix = f"out/{name}"
    out_bucket = f"{BUCKET}-{scenario.replace('_', '-')}-{client_kind}-{int(time.time())}"
    s3 = _s3(moto.endpoint)
    s3.create_bucket(Bucket=out_bucket)
    try:
        mean_tokens = sum(lengths) / max(1, len(lengths))
        expected_wall = args.prompts * mean_tokens * args.token_time_s / (args.servers * args.slots)
        monitor = Monitor(fleet.urls, args.prompts, kill, expected_wall, halve=halve)
        if client_kind == "ours":
            params = {
                "prompts_uri": f"s3://{BUCKET}/{CONVERSATIONS_KEY if all_turns else PROMPTS_KEY}",
                "output_uri": f"s3://{out_bucket}/{prefix}",
                "servers": fleet.urls, "save_every": args.save_every, "max_tokens": scaled_max_tokens(args),
                "concurrency_per_server": args.concurrency_per_server,
            }
            if all_turns:
                params["regenerate"] = "all_turns"
            cfg = RunConfig.from_params(params)
            run_id = f"bench-{name}"
            t_phase = time.monotonic()
            run_plan(s3, cfg, run_id)  # the DAG's plan task
            phases["plan_s"] = time.monotonic() - t_phase
            servers = run_preflight(s3, cfg, [ServerSpec(u, u) for u in fleet.urls], run_id)  # preflight task
            spec = {"endpoint": moto.endpoint, "params": params, "run_id": run_id, "servers": servers,
                    "settings": KILLED_SETTINGS if kill else {}}
            monitor.start()
            cpu_sim0, cpu_moto0, t_run0 = proc_cpu_s(fleet.proc.pid), proc_cpu_s(moto.proc.pid), time.monotonic()
            res = run_ours(spec, len(fleet.urls), workdir, name)
            run_s = time.monotonic() - t_run0
            phases["clients_s"] = run_s
            cpu_sim, cpu_moto = proc_cpu_s(fleet.proc.pid) - cpu_sim0, proc_cpu_s(moto.proc.pid) - cpu_moto0
            monitor.stop_ev.set()
            monitor.join()
            try:
                t_phase = time.monotonic()
                report = run_validation(s3, cfg.output_uri)  # the DAG's validate task
                phases["validate_s"] = time.monotonic() - t_phase
            except ValidationFailed:
                from dflash_pipeline.dataset.layout import DatasetLayout

                lay = DatasetLayout.from_uri(cfg.output_uri)
                report = json.loads(s3.get_object(Bucket=out_bucket, Key=lay.report_key)["Body"].read())
            res["validation"] = {k: report[k] for k in ("prompts", "completions", "errors", "missing", "duplicates",
                                                        "output_tokens", "parts_present", "chunks")}
            res["rows_present"] = report["prompts"] - report["missing"]
            res["duplicates"] = report["duplicates"]
            useful = int(report["output_tokens"])
            if all_turns:  # the bound schedules whole conversations (their turns run back to back on one slot)
                lengths = _row_tokens_in_plan_order(s3, cfg.output_uri)
                res["turns_generated"] = report.get("turns_generated")
                res["cached_prompt_tokens"] = report.get("cached_prompt_tokens")
        else:
            spec = {"endpoint": moto.endpoint, "urls": fleet.urls, "prefix": prefix, "bucket": out_bucket,
                    "max_tokens": scaled_max_tokens(args)}
            monitor.start()
            cpu_sim0, cpu_moto0, t_run0 = proc_cpu_s(fleet.proc.pid), proc_cpu_s(moto.proc.pid), time.monotonic()
            res = run_child("baseline", spec, workdir, name)
            run_s = time.monotonic() - t_run0
            cpu_sim, cpu_moto = proc_cpu_s(fleet.proc.pid) - cpu_sim0, proc_cpu_s(moto.proc.pid) - cpu_moto0
            monitor.stop_ev.set()
            monitor.join()
            res["rows_present"] = res["saved"]
            useful = int(res["useful_tokens"])
        res["cpu_pct_of_one_core"] = {
            "client": round(100 * res["cpu_s"] / res["client_wall_s"], 1),
            "sim_fleet": round(100 * cpu_sim / run_s, 1),
            "moto": round(100 * cpu_moto / run_s, 1),
        }
        stats = [monitor.stats(i) if not (kill and i == 0) else monitor.killed_stats for i in range(len(fleet.urls))]
        if kill and monitor.killed_stats is None:
            raise RuntimeError("the killed scenario finished before server 0 was crashed; use more prompts")
        if halve and monitor.halved_slots is None:
            raise RuntimeError("the vllm_halve scenario finished before server 0 was halved; use more prompts")
        res["measure"] = m = measure(stats, useful, hit, monitor.crash_t, monitor.samples, args.prompts,
                                     halved=monitor.halved_slots)
        m["oblivious_bound_pct"] = oblivious_bound(lengths, stats, hit, m["crash_after_s"], halved=monitor.halved_slots)
        if client_kind == "ours":
            res["concurrency"] = concurrency_figures(res["workers"], monitor)
        if all_turns:  # "all dispatched" counts requests against prompts: meaningless with several turns per row
            m["all_dispatched_after_s"] = m["drain_s"] = None
        res["timeline"] = [(round(t - m["t0"], 2), r, w) for (t, r, _), w in zip(monitor.samples, monitor.waiting)]
        res["scenario"], res["client"], res["expected_rows"] = scenario, client_kind, args.prompts
        res["phases"] = {k: round(v, 2) for k, v in phases.items()}
        return res
    finally:
        fleet.stop()


def concurrency_figures(workers: list[dict[str, Any]], monitor: Monitor) -> dict[str, Any]:
    """Each worker's final in-flight limit and slots; in vllm_halve, how long server 0's limit took
    to follow the change (its first slots figure at most the new slots + 2) and its 503 answers:
    in all, and from 2 s after that follow on (refusals that kept coming)."""
    out: dict[str, Any] = {"final": [(w.get("concurrency") or {}).get("limit") for w in workers],
                           "slots": [(w.get("concurrency") or {}).get("slots") for w in workers]}
    if monitor.halved_slots is None or monitor.crash_t is None:
        return out
    after = monitor.halved_slots[1]
    changes = (workers[0].get("concurrency") or {}).get("changes") or []
    follow_t = next((c[0] for c in changes if c[0] >= monitor.crash_t - 0.2 and c[2] is not None and c[2] <= after + 2),
                    None)
    refused = monitor.refused[-1][1] if monitor.refused else 0
    settled = None
    if follow_t is not None:
        settled = next((n for t, n in monitor.refused if t >= follow_t + 2.0), refused)
    out.update({
        "followed_after_s": None if follow_t is None else round(follow_t - monitor.crash_t, 2),
        "refused_503": refused,
        "refused_503_after_follow": None if settled is None else refused - settled,
    })
    return out


# ------------------------------------------------------------------------------------------------
# table
# ------------------------------------------------------------------------------------------------
def table(results: list[dict[str, Any]]) -> str:
    head = ["scenario", "client", "% of ideal", "ratio ours/baseline", "survivors busy %",
            "rows present/expected", "dups", "CPU ms/completion", "peak MB"]
    base = {r["scenario"]: r["measure"]["pct_ideal"] for r in results if r["client"] == "baseline"}
    rows = []
    for r in results:
        m = r["measure"]
        ratio = "-"
        if r["client"] == "ours" and r["scenario"] in base:
            ratio = f"{m['pct_ideal'] / base[r['scenario']]:.2f}x"
        cpu = 1000 * r["cpu_s"] / r["completions"] if r["completions"] else float("nan")
        rows.append([r["scenario"], r["client"], f"{m['pct_ideal']:.1f}", ratio, f"{m['survivors_busy_pct']:.1f}",
                     f"{r['rows_present']}/{r['expected_rows']}", str(r.get("duplicates", 0)), f"{cpu:.2f}",
                     f"{r['maxrss_mb']:.0f}"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]
    return "\n".join(out)


def details(results: list[dict[str, Any]]) -> str:
    out = []
    for r in results:
        m = r["measure"]
        extra = ""
        if r["client"] == "baseline":
            extra = f" saved={r['saved']} lost={r['lost']}"
        else:
            raised = [w["worker"] + ":" + w["outcome"]["raised"] for w in r["workers"] if w["outcome"] != "ok"]
            v = r["validation"]
            extra = (f" completions={v['completions']} error_rows={v['errors']} requests_sent={r['requests_sent']} sim_requests={sum(m['server_generation_requests'])}"
                     + (f" concurrency={r['concurrency']}" if r.get("concurrency") else "")
                     + (f" turns_generated={r['turns_generated']} cached_prompt_tokens={r['cached_prompt_tokens']}"
                        if r.get("turns_generated") is not None else "")
                     + (f" raised={raised}" if raised else ""))
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        out.append(
            f"  {r['scenario']:>7}/{r['client']:<8} bound={m['oblivious_bound_pct']:.1f}% wall={m['actual_wall_s']:.1f}s ideal={m['ideal_wall_s']:.1f}s "
            f"busy%/server={m['busy_pct']} steady-occupancy%={fmt(m['steady_occupancy_pct'])} "
            f"all-dispatched@{fmt(m['all_dispatched_after_s'])}s drain={fmt(m['drain_s'])}s "
            f"crash@{fmt(m['crash_after_s'])}s cpu%={r['cpu_pct_of_one_core']} rss-before-run={r['maxrss_before_run_mb']:.0f}MB{extra}"
            + (f" span/best-with-that-death={m['actual_wall_s'] / m['ideal_wall_s']:.3f}x"
               if m["crash_after_s"] is not None else "")
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=22000)
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--slots", type=int, default=16, help="max_running_requests of each sim server")
    p.add_argument("--save-every", type=int, default=500, help="the DAG param (500 as in the job)")
    p.add_argument("--length-scale", type=float, default=0.05)
    p.add_argument("--token-time-s", type=float, default=0.001)
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="the job's max_tokens in real tokens; sent scaled by --length-scale, so a completion is "
                        "at most this / the mean as long as the mean, as in the real run")
    p.add_argument("--mean-tokens", type=int, default=2350,
                   help="the sim's mean wanted length before the cap; 2350 capped at 4096 gives the job's ~1,820 "
                        "mean output tokens per completion (about 14%% end at the cap)")
    p.add_argument("--concurrency-per-server", type=int, default=None,
                   help="the DAG param for our client; default: derived from the server (slots + max(2, slots/4))")
    p.add_argument("--scenarios", default="uniform,slow,killed",
                   help="comma list of uniform, slow, killed, all_turns (multi-turn rows, regenerate=all_turns; "
                        "our client only: the baseline cannot replay conversations), vllm (every server vLLM-"
                        "flavoured with --vllm-slots hidden slots), vllm_halve (vllm, and server 0 drops to half "
                        "its slots and refuses beyond 8 waiting once half the prompts are done)")
    p.add_argument("--vllm-slots", type=int, default=64,
                   help="hidden slots of each server in the vllm scenarios (per-token time scaled so each "
                        "server's tokens/s are the default scenarios')")
    p.add_argument("--clients", default="ours,baseline")
    p.add_argument("--json-out", default=None)
    p.add_argument("--child", choices=("ours", "baseline"), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s %(message)s")
        if os.environ.get("DISPATCH_BENCH_DEBUG"):
            logging.getLogger("dflash_pipeline.steps.generate").setLevel(logging.DEBUG)
        spec = json.loads(Path(args.spec).read_text())
        res = child_ours(spec) if args.child == "ours" else child_baseline(spec)
        Path(args.result).write_text(json.dumps(res))
        return 0

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    for s in scenarios:
        if s not in ("uniform", "slow", "killed", "all_turns", "vllm", "vllm_halve"):
            p.error(f"unknown scenario {s!r}")
    workdir = Path(tempfile.mkdtemp(prefix="dispatch-bench-"))
    t_start = time.monotonic()
    moto = Moto()
    results: list[dict[str, Any]] = []
    lengths = prompt_lengths(args.prompts, args)
    try:
        s3 = _s3(moto.endpoint)
        s3.create_bucket(Bucket=BUCKET)
        data = "\n".join(json.dumps(r) for r in _prompt_rows(args.prompts)).encode() + b"\n"
        s3.put_object(Bucket=BUCKET, Key=PROMPTS_KEY, Body=data)
        if "all_turns" in scenarios:
            conv = "\n".join(json.dumps(r) for r in _conversation_rows(args.prompts)).encode() + b"\n"
            s3.put_object(Bucket=BUCKET, Key=CONVERSATIONS_KEY, Body=conv)
        for scenario in scenarios:
            for client in clients:
                if scenario == "all_turns" and client == "baseline":
                    continue
                t = time.monotonic()
                res = run_one(args, moto, scenario, client, workdir, lengths)
                results.append(res)
                print(f"[{time.monotonic() - t_start:6.1f}s] {scenario}/{client}: {res['measure']['pct_ideal']:.1f}% "
                      f"of ideal ({time.monotonic() - t:.1f}s)", file=sys.stderr, flush=True)
    finally:
        moto.stop()
    print(f"dispatch bench: {args.prompts} prompts, {args.servers} servers x {args.slots} slots, "
          f"save_every={args.save_every}, length_scale={args.length_scale}, token_time_s={args.token_time_s} "
          f"(logs: {workdir}; total {time.monotonic() - t_start:.0f}s)"
          + (f"; vllm scenarios: {args.vllm_slots} hidden slots per server, token_time_s={vllm_token_time(args):g}"
             if any(sc.startswith("vllm") for sc in scenarios) else ""))
    print(table(results))
    print("details:")
    print(details(results))
    print("bound = % of ideal a perfect length-oblivious dispatcher reaches here (greedy, plan order, zero latency).")
    print("peak MB = peak RSS (VmHWM) of the client's own child process; sim fleet and moto are other processes.")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
