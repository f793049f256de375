"""Validation benchmark: run_validation over a full-size synthetic dataset on a local moto_server.

    .venv/bin/python bench/validate_bench.py                 # 902,087 rows, save_every 500, 8 servers
    .venv/bin/python bench/validate_bench.py --rows 20000    # a quick look
    .venv/bin/python bench/validate_bench.py --recount-only  # only the recount sample (10 parts, ~20 s)

What it does:
- Waits until the 1-minute load average is <= --max-load (up to 10 min; the machine is shared) and
  prints it.
- Starts a `moto_server` subprocess and writes a dataset in the pipeline's exact format:
  manifest.json, one input per planned chunk (records.encode_inputs) and one part per chunk
  (records.encode_part), chunk sizes from plan.chunk_sizes. Lengths are drawn like the simulator's
  (sim.lengths.plan_lengths: lognormal, mean 1800 tokens, 80-90% thinking) and cut at max_tokens as
  a reasoning parser would; the texts are that many words of the simulator's vocabulary, so the
  sim tokenizer counts them exactly. 0.2% of the rows are ContextLengthExceeded error rows.
  Compromise (moto keeps objects in RAM): the words are slices of one random 4M-word pool, which
  zstd compresses slightly better than fully independent text; sizes are printed.
- Runs `run_validation` (no tokenizer, plots on, default thresholds) in a child process and prints
  wall time, rows/s and the child's peak RSS (ru_maxrss).
- Runs the tokenizer recount (`Recounter.recount`: each conversation rendered and encoded once) on
  the first --recount-parts parts, read into memory first, in another child and prints, separately:
  output tokens/s (reasoning + answer tokens recounted per second of recount time, the figure the
  target is about) and training tokens/s (whole rendered conversations). `--recount-reference`
  also times the previous method (`recount_separately`: reasoning, answer and conversation each
  encoded) in the same child; `--recount-tokenizer DIR` uses another tokenizer than the sim one;
  `--recount-only` writes just those parts (the same rows as a full run's sample) and skips the
  validation.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))

BUCKET = "bench-validate"
ROOT = "datasets/bench"
PLAN_ID = "bench0001"
POOL_WORDS = 4_000_000
ERROR_EVERY = 500


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_for_quiet(max_load: float, max_wait_s: float = 600.0) -> float:
    waited = 0.0
    while (load := loadavg()) > max_load and waited < max_wait_s:
        print(f"load average {load:.2f} > {max_load}: waiting 60 s ({waited:.0f} s so far)", flush=True)
        time.sleep(60)
        waited += 60
    return load


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- dataset writer (worker processes) ----------------------------------------------------------
_POOL: str = ""
_OFFS: Any = None
_CLIENT: Any = None


def _init_worker(endpoint: str, seed: int) -> None:
    import numpy as np

    from dflash_pipeline.dev.sim.lengths import VOCAB
    from dflash_pipeline.dev.stack import s3_client

    global _POOL, _OFFS, _CLIENT
    rng = random.Random(seed)
    words = rng.choices(VOCAB, k=POOL_WORDS)
    _POOL = " ".join(words)
    lens = np.fromiter((len(w) + 1 for w in words), dtype=np.int64, count=len(words))
    _OFFS = np.concatenate([[0], np.cumsum(lens)])
    _CLIENT = s3_client(endpoint)


def _text(rng: random.Random, n: int) -> str:
    if n <= 0:
        return ""
    start = rng.randrange(0, POOL_WORDS - n)
    return _POOL[int(_OFFS[start]) : int(_OFFS[start + n]) - 1]


def _write_chunk(args: tuple[int, int, int, int, int]) -> tuple[int, int, int, int, int]:
    """Input + part of one chunk; returns (chunk, rows, input bytes, part bytes, text bytes)."""
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dataset.records import encode_inputs, encode_part
    from dflash_pipeline.dev.sim.lengths import count_prompt_tokens, plan_lengths

    c, first, size, max_tokens, n_servers = args
    layout = DatasetLayout(BUCKET, ROOT)
    rng = random.Random(c)
    prompts, rows, text_bytes = [], [], 0
    for k in range(size):
        i = first + k
        pid = f"p{i:08d}"
        messages = [{"role": "user", "content": _text(rng, max(5, int(rng.lognormvariate(math.log(60), 0.8))))}]
        prompts.append({"id": pid, "messages": messages})
        server = f"http://gpu{c % n_servers:02d}:30000"
        if i % ERROR_EVERY == ERROR_EVERY - 1:
            rows.append({"id": pid, "messages": messages, "model": "Qwen/Qwen3-8B", "server": server, "attempts": 1,
                         "error_class": "ContextLengthExceeded", "error_message": "too long", "retryable": False,
                         "chunk": c, "run_id": "bench"})
            continue
        plan = plan_lengths(messages, seed=i)
        t_used = min(plan.thinking_tokens, max_tokens)
        a_used = min(plan.answer_tokens, max_tokens - t_used)
        done = t_used == plan.thinking_tokens and a_used == plan.answer_tokens
        reasoning, content = _text(rng, t_used), _text(rng, a_used)
        text_bytes += len(reasoning) + len(content)
        rows.append({
            "id": pid, "messages": messages, "reasoning": reasoning or None, "content": content,
            "finish_reason": "stop" if done else "length", "matched_stop": "151645" if done else None,
            "prompt_tokens": count_prompt_tokens(messages), "completion_tokens": t_used + a_used,
            "reasoning_tokens": t_used, "model": "Qwen/Qwen3-8B", "server": server, "attempts": 1,
            "latency_s": round(0.02 * (t_used + a_used) + rng.uniform(0.05, 0.5), 3), "chunk": c, "run_id": "bench",
        })
    inp, part = encode_inputs(prompts), encode_part(rows)
    _CLIENT.put_object(Bucket=BUCKET, Key=layout.input_key(PLAN_ID, c), Body=inp)
    _CLIENT.put_object(Bucket=BUCKET, Key=layout.part_key(c), Body=part)
    return c, size, len(inp), len(part), text_bytes


def write_dataset(endpoint: str, rows: int, save_every: int, n_servers: int, max_tokens: int, workers: int,
                  only_chunks: int | None = None) -> dict[str, Any]:
    """The dataset's manifest and chunks (only the first `only_chunks`, if given: same rows as a full write)."""
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dev.stack import s3_client
    from dflash_pipeline.steps.plan import chunk_sizes

    sizes = chunk_sizes(rows, save_every, n_servers)
    firsts = [0]
    for s in sizes[:-1]:
        firsts.append(firsts[-1] + s)
    manifest = {
        "format": "dflash-pipeline/manifest/1", "plan_id": PLAN_ID, "created_by_run": "bench",
        "pinned": {"input": {"uri": "s3://bench/prompts.jsonl", "limit": None}, "model": "Qwen/Qwen3-8B",
                   "sampling": {"max_tokens": max_tokens, "temperature": 0.6, "top_p": 0.95,
                                "enable_thinking": True, "seed": None}},
        "input": {"prompts": rows}, "model_resolved": "Qwen/Qwen3-8B", "runs": {},
        "chunks": {"save_every": save_every, "planned_for_servers": n_servers, "sizes": sizes,
                   "inputs_prefix": f"{ROOT}/inputs/{PLAN_ID}/"},
    }
    s3_client(endpoint).put_object(Bucket=BUCKET, Key=DatasetLayout(BUCKET, ROOT).manifest_key,
                                   Body=json.dumps(manifest).encode())
    started = time.monotonic()
    jobs = [(c, firsts[c], s, max_tokens, n_servers) for c, s in enumerate(sizes)][:only_chunks]
    totals = {"chunks": len(jobs), "rows": 0, "input_bytes": 0, "part_bytes": 0, "text_bytes": 0}
    with mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(endpoint, 7)) as pool:
        for done, (_c, n, ib, pb, tb) in enumerate(pool.imap_unordered(_write_chunk, jobs, chunksize=4), 1):
            totals["rows"] += n
            totals["input_bytes"] += ib
            totals["part_bytes"] += pb
            totals["text_bytes"] += tb
            if done % 200 == 0 or done == len(jobs):
                print(f"  wrote {done}/{len(jobs)} chunks, {totals['rows']:,} rows, "
                      f"{totals['part_bytes'] / 2**30:.2f} GiB of parts, {time.monotonic() - started:.0f} s", flush=True)
    totals["write_s"] = round(time.monotonic() - started, 1)
    return totals


# -- children ----------------------------------------------------------------------------------
def child_digests(endpoint: str, signals: bool) -> None:
    """What the generate workers do as parts land (issue 40): every part's digest and, with signals, the
    near-duplicate search beside generation. Timed apart: the fleet spends it during generation."""
    from dflash_pipeline.config.quality import QualitySettings
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.dev.stack import s3_client
    from dflash_pipeline.steps.validate.run import compute_digests, near_duplicates, read_manifest

    client = s3_client(endpoint)
    quality = QualitySettings(enabled=signals)
    started = time.monotonic()
    cpu0 = time.process_time()
    got = compute_digests(client, f"s3://{BUCKET}/{ROOT}", 0, 1, quality=quality)
    near_s = 0.0
    if signals:
        layout = DatasetLayout.from_uri(f"s3://{BUCKET}/{ROOT}")
        store = Store(client, BUCKET)
        t0 = time.monotonic()
        near_duplicates(store, layout, read_manifest(store, layout), quality)
        near_s = time.monotonic() - t0
    print("RESULT " + json.dumps({"wall_s": round(time.monotonic() - started, 1), "near_dup_s": round(near_s, 1),
                                  "cpu_s": round(time.process_time() - cpu0, 1), **got}), flush=True)


def child_validate(endpoint: str, signals: bool = True) -> None:
    from dflash_pipeline.config.quality import QualitySettings
    from dflash_pipeline.dev.stack import s3_client
    from dflash_pipeline.steps.validate import ValidationFailed, run_validation

    client = s3_client(endpoint)
    started = time.monotonic()
    cpu0 = time.process_time()
    status = "passed"
    try:
        report = run_validation(client, f"s3://{BUCKET}/{ROOT}", quality=QualitySettings(enabled=signals))
    except ValidationFailed as exc:
        status = f"failed: {exc}"[:300]
        report = json.loads(client.get_object(Bucket=BUCKET, Key=f"{ROOT}/report.json")["Body"].read())
    wall = time.monotonic() - started
    rows = report["completions"] + report["errors"]
    out = {
        "wall_s": round(wall, 1), "cpu_s": round(time.process_time() - cpu0, 1), "rows": rows,
        "rows_per_s": round(rows / wall), "maxrss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "status": status,
        "headline": {k: report[k] for k in ("prompts", "completions", "errors", "missing", "duplicates", "truncated",
                                            "truncation_rate", "output_tokens")},
        "output_tokens_stats": report["token_stats"]["output_tokens"], "digests": report.get("digests"),
    }
    print("RESULT " + json.dumps(out), flush=True)


def child_recount(endpoint: str, parts: int, tokenizer: str | None, reference: bool) -> None:
    import io

    import pyarrow.parquet as pq

    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer
    from dflash_pipeline.dev.stack import s3_client
    from dflash_pipeline.steps.validate.tokencount import load_recounter

    client = s3_client(endpoint)
    layout = DatasetLayout(BUCKET, ROOT)
    tables = []
    for c in range(parts):
        body = client.get_object(Bucket=BUCKET, Key=layout.part_key(c))["Body"].read()
        t = pq.read_table(io.BytesIO(body), columns=["messages", "reasoning", "content", "error_class"])
        tables.append(t.filter(t.column("error_class").is_null()))
    tok = tokenizer or str(build_sim_tokenizer(Path(tempfile.mkdtemp(prefix="bench-tok-"))))
    rec = load_recounter(tok, lambda b, k: None, enable_thinking=True)
    cols = [(t.column("messages").to_pylist(), t.column("reasoning").to_pylist(), t.column("content").to_pylist())
            for t in tables]

    def timed(method: Any) -> dict[str, Any]:
        cpu0, started = time.process_time(), time.perf_counter()
        out_tokens = train_tokens = rows = alone = 0
        for m, r, c in cols:  # one call per part, as Validator._recount does
            res = method(m, r, c)
            out_tokens += int(res.output.sum())
            train_tokens += int(res.training.sum())
            rows += len(c)
            alone += res.rows_encoded_alone
        secs, cpu = time.perf_counter() - started, time.process_time() - cpu0
        return {"rows": rows, "seconds": round(secs, 2), "cpu_s": round(cpu, 2), "cores_used": round(cpu / secs, 2),
                "output_tokens": out_tokens, "training_tokens": train_tokens,
                "output_tokens_per_s": round(out_tokens / secs), "training_tokens_per_s": round(train_tokens / secs),
                "rows_per_s": round(rows / secs), "rows_encoded_alone": alone}

    out = {"tokenizer": "sim" if tokenizer is None else tokenizer,
           "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM", "default (on)"), "cpus": os.cpu_count(),
           "single_pass": timed(rec.recount)}
    if reference:
        out["separate_reference"] = timed(rec.recount_separately)
    print("RESULT " + json.dumps(out), flush=True)


def _child(args: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"child {args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _delete(client: Any, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])


def compare(moto: Any, max_load: float) -> None:
    """Signals on (merged), off (merged), and the batch pass, each validation in its own child."""
    client = moto.client()
    rows: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = []
    for signals in ("on", "off"):
        load = wait_for_quiet(max_load)
        d = _child(["--child", "digests", "--signals", signals, "--endpoint", moto.endpoint_url])
        print(f"digests (signals {signals}; the workers' share, during generation; load {load:.2f}): {json.dumps(d)}",
              flush=True)
        load = wait_for_quiet(max_load)
        v = _child(["--child", "validate", "--signals", signals, "--endpoint", moto.endpoint_url])
        v["load"] = load
        rows.append((f"merge, signals {signals}", v, d))
    _delete(client, f"{ROOT}/digests/")
    _delete(client, f"{ROOT}/quality/")
    load = wait_for_quiet(max_load)
    v = _child(["--child", "validate", "--signals", "on", "--endpoint", moto.endpoint_url])
    v["load"] = load
    rows.append(("batch pass, signals on", v, None))
    print("| validation after the last part | wall | rows/s | cpu | peak RSS | digests stored / computed | load |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name, v, _ in rows:
        dg = v.get("digests") or {}
        print(f"| {name} | {v['wall_s']} s | {v['rows_per_s']:,} | {v['cpu_s']} s | {v['maxrss_mib']} MiB | "
              f"{dg.get('stored')} / {dg.get('computed')} | {v['load']:.2f} |")
    for name, _, d in rows:
        if d:
            print(f"workers' digests for '{name}': {d['wall_s']} s wall, {d['cpu_s']} s cpu in one process "
                  f"(near-duplicates {d['near_dup_s']} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=902_087)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2, help="processes writing the dataset")
    ap.add_argument("--recount-parts", type=int, default=10, help="parts in the tokenizer recount sample")
    ap.add_argument("--recount-only", action="store_true",
                    help="write only the recount sample's parts and skip the validation run")
    ap.add_argument("--recount-tokenizer", help="tokenizer dir/tokenizer.json for the recount (default: the sim one)")
    ap.add_argument("--recount-reference", action="store_true",
                    help="also time the previous method (texts and conversation encoded separately)")
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--compare", action="store_true",
                    help="issue 40: validation after the last part with signals on (digests merged), off, and the batch "
                         "pass (every digest computed at validation), side by side; skips the recount sample")
    ap.add_argument("--signals", choices=["on", "off"], default="on")
    ap.add_argument("--child", choices=["validate", "recount", "digests"])
    ap.add_argument("--endpoint")
    args = ap.parse_args()
    if args.child == "validate":
        child_validate(args.endpoint, args.signals == "on")
        return 0
    if args.child == "digests":
        child_digests(args.endpoint, args.signals == "on")
        return 0
    if args.child == "recount":
        child_recount(args.endpoint, args.recount_parts, args.recount_tokenizer, args.recount_reference)
        return 0

    from dflash_pipeline.dev.stack import MotoServer

    with MotoServer(log_path=Path(tempfile.mkdtemp(prefix="bench-moto-")) / "moto.log") as moto:
        moto.create_bucket(BUCKET)
        print(f"writing {args.rows:,} rows to {moto.endpoint_url} (save_every={args.save_every}, "
              f"{args.servers} servers, max_tokens={args.max_tokens})", flush=True)
        totals = write_dataset(moto.endpoint_url, args.rows, args.save_every, args.servers, args.max_tokens, args.workers,
                               only_chunks=args.recount_parts if args.recount_only else None)
        moto_rss = rss_kb(moto._proc.pid) / 1024 if moto._proc else 0.0  # noqa: SLF001 - our own child
        print(f"dataset: {totals['rows']:,} rows in {totals['chunks']:,} chunks; parts {totals['part_bytes'] / 2**30:.2f} GiB "
              f"(text {totals['text_bytes'] / 2**30:.2f} GiB before compression), inputs "
              f"{totals['input_bytes'] / 2**20:.0f} MiB; written in {totals['write_s']} s; moto RSS {moto_rss:,.0f} MiB",
              flush=True)

        if args.compare:
            compare(moto, args.max_load)
            return 0
        if not args.recount_only:
            load = wait_for_quiet(args.max_load)
            print(f"validation (load average {load:.2f}, {Path('/proc/loadavg').read_text().split()[:3]})", flush=True)
            v = _child(["--child", "validate", "--endpoint", moto.endpoint_url])
            print(json.dumps(v, indent=1), flush=True)
            print(f"VALIDATION: {v['rows']:,} rows in {v['wall_s']} s = {v['rows_per_s']:,} rows/s, "
                  f"peak RSS {v['maxrss_mib']} MiB, cpu {v['cpu_s']} s, {v['status'][:60]}", flush=True)

        load = wait_for_quiet(args.max_load)
        print(f"recount sample (load average {load:.2f}, {Path('/proc/loadavg').read_text().split()[:3]})", flush=True)
        extra = ["--recount-tokenizer", args.recount_tokenizer] if args.recount_tokenizer else []
        extra += ["--recount-reference"] if args.recount_reference else []
        rc = _child(["--child", "recount", "--endpoint", moto.endpoint_url, "--recount-parts", str(args.recount_parts),
                     *extra])
        print(json.dumps(rc, indent=1), flush=True)
        for key, label in (("single_pass", "RECOUNT"), ("separate_reference", "RECOUNT (reference: separate encodings)")):
            if key in rc:
                x = rc[key]
                print(f"{label}: {x['rows']:,} rows in {x['seconds']} s ({x['cores_used']} cores busy): "
                      f"OUTPUT {x['output_tokens_per_s']:,} tokens/s (reasoning + answer, {x['output_tokens']:,} tokens); "
                      f"TRAINING {x['training_tokens_per_s']:,} tokens/s (whole conversations, {x['training_tokens']:,} "
                      f"tokens)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
