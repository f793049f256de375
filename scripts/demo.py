#!/usr/bin/env python3
"""The demo: the whole pipeline on this machine, with nothing but the venv.

Starts a local stack (moto S3, 3 simulated servers "serving" Qwen's real BPE with a Qwen3.6-style chat
template: SGLang's wire as of a version that returns no token ids, SGLang's and vLLM's wire returning
them; Airflow with LocalExecutor), uploads
data/sample_prompts.jsonl, triggers ``dflash_generate`` through the ``airflow dags trigger`` CLI,
follows the run, prints the report, the UI link, the S3 paths and the exact
``AIRFLOW_HOME=... .venv/bin/airflow ...`` line for the CLI against this stack, then stops everything it
started (``--keep`` leaves it running until Ctrl-C).

    make demo                     # or: .venv/bin/python scripts/demo.py [--keep] [-v]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "include"))  # works even before `pip install -e .`

from dflash_pipeline.dev.report_text import report_lines  # noqa: E402
from dflash_pipeline.dev.stack import Stack, TaskInstanceInfo  # noqa: E402

log = logging.getLogger("demo")

BUCKET = "dflash-demo"
PROMPTS_KEY = "prompts/sample_prompts.jsonl"
OUTPUT_PREFIX = "runs/demo"
TOKENIZER_PREFIX = "models/qwen-bpe"
DAG_ID = "dflash_generate"
MODEL = "Qwen/Qwen3-8B"


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    """The first SIGTERM or SIGINT stops the demo (a KeyboardInterrupt, as Ctrl-C); later ones are ignored.

    Why: `make demo` forwards the signal it gets to this process, so a Ctrl-C or a `kill -TERM` of the
    group arrives twice within microseconds, and a user may press Ctrl-C again. A second
    KeyboardInterrupt raised while the stack's shutdown runs abandoned it: Airflow, the simulated
    servers and moto kept running after "Stopped everything"."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def print_report(report: dict[str, Any]) -> None:
    print("\n".join(report_lines(report)))


# -- multi-turn sample (issue 14) ------------------------------------------------------------------


def print_conversation(s3: Any, bucket: str, prefix: str, width: int = 110) -> None:
    """One regenerated multi-turn row: the turns a trainer reads next to the answers it replaced."""
    import io

    import pyarrow.parquet as pq

    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/completions/").get("Contents", []))
    for key in keys:
        rows = pq.read_table(io.BytesIO(s3.get_object(Bucket=bucket, Key=key)["Body"].read()),
                             columns=["id", "sample", "conversation", "original_messages", "turns", "cut_short",
                                      "error_class"]).to_pylist()
        row = next((r for r in rows if not r["error_class"] and len(r["turns"] or []) > 1), None)
        if row is None:
            continue
        old = [m["content"] for m in row["original_messages"] if m["role"] == "assistant"]
        print(f"A regenerated conversation (id {row['id']}, sample {row['sample']}, {len(row['turns'])} turns, "
              f"cut short: {row['cut_short'] or 'no'}; from s3://{bucket}/{key}):")
        k = 0
        for m in row["conversation"]:
            text = " ".join((m["content"] or "").split())
            if m["role"] == "assistant":
                t = row["turns"][k]
                think = len((m["reasoning"] or "").split())
                cached = ("prompt cache not reported" if t["cached_tokens"] is None
                          else f"{t['cached_tokens']} prompt tokens cached")
                print(f"  assistant (new, {t['completion_tokens']} tokens, {think} words of reasoning, "
                      f"{cached}): {text[:width]}")
                if k < len(old):
                    print(f"    replaces the original: {' '.join(old[k].split())[:width]}")
                k += 1
            else:
                print(f"  {m['role']}: {text[:width]}")
        return
    print("No multi-turn row in this dataset (run with --regenerate all_turns).")


def server_connections(af: Any, urls: list[str]) -> list[str]:
    """One Airflow connection per simulated server, named for what it plays: the run's page and report name
    servers by connection, so the warning about the first one (an old SGLang without token ids, on purpose)
    says where it comes from. One `connections import` (each Airflow CLI call costs seconds)."""
    conns = {}
    for i, url in enumerate(urls):
        name = "demo-old-sglang-without-token-ids" if i == 0 else "demo-sglang" if i == 1 else f"demo-vllm-{i - 1}"
        host, port = url.removeprefix("http://").rsplit(":", 1)
        conns[name] = {"conn_type": "http", "host": host, "port": int(port)}
    path = af.home / "demo-connections.json"
    path.write_text(json.dumps(conns))
    af.cli("connections", "import", "--overwrite", str(path), check=True)
    return list(conns)


def cli_line(airflow_home: Path, *args: str) -> str:
    """The exact command line for the venv's `airflow` against the demo stack (from the current directory).

    Without AIRFLOW_HOME a plain `airflow` creates ~/airflow and reports an unmigrated database.
    """
    airflow = Path(sys.executable).parent / "airflow"
    shown = os.path.relpath(airflow)  # `.venv/bin/airflow` from the repo (it has a slash: runs as a path)
    if shown.startswith("..") or "/" not in shown:
        shown = str(airflow)
    return f"AIRFLOW_HOME={shlex.quote(str(airflow_home))} {shown} " + " ".join(shlex.quote(a) for a in args)


class Follower:
    """Prints each task instance's state when it changes."""

    def __init__(self, stack: Stack, run_id: str) -> None:
        self.stack = stack
        self.run_id = run_id
        self.started = time.monotonic()
        self.seen: dict[tuple[str, int], str | None] = {}
        self.run_state: str | None = None
        self.peak_memory = {"pss_bytes": 0, "rss_bytes": 0, "processes": 0}

    def __call__(self, run: dict[str, Any]) -> None:
        mem = self.stack.airflow.memory_usage()
        if mem["pss_bytes"] > self.peak_memory["pss_bytes"]:
            self.peak_memory = mem
        stamp = f"{time.monotonic() - self.started:6.1f}s"
        if run.get("state") != self.run_state:
            self.run_state = run.get("state")
            print(f"  {stamp}  run {self.run_state}", flush=True)
        tis: list[TaskInstanceInfo] = self.stack.airflow.task_instances(DAG_ID, self.run_id)
        for ti in tis:
            key = (ti.task_id, ti.map_index)
            if self.seen.get(key, "<new>") != ti.state:
                self.seen[key] = ti.state
                name = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"
                tries = f" (try {ti.try_number})" if ti.try_number > 1 else ""
                print(f"  {stamp}  {name:<22} {ti.state or 'none'}{tries}", flush=True)


# --- the tokenize step (dflash_tokenize, queued by the completions asset) ---------------------------


def follow_tokenize(stack: Stack, output_uri: str, timeout_s: float) -> bool:
    """Wait for the asset-triggered dflash_tokenize run to report this dataset; print its shards."""
    from dflash_pipeline.dataset.layout import DatasetLayout

    layout = DatasetLayout.from_uri(output_uri)
    s3 = stack.s3()
    print("dflash_tokenize was queued by the dflash_completions asset event; waiting for its shards ...", flush=True)
    deadline = time.monotonic() + timeout_s
    report: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        try:
            report = json.loads(s3.get_object(Bucket=BUCKET, Key=layout.tokenized_report_key)["Body"].read())
        except Exception:  # noqa: BLE001 - not written yet
            report = None
        if report is not None:
            break
        time.sleep(2)
    if report is None:
        print(f"No tokenized report at s3://{BUCKET}/{layout.tokenized_report_key} after {timeout_s:.0f} s")
        return False
    runs = stack.airflow.rest("GET", "/api/v2/dags/dflash_tokenize/dagRuns", params={"limit": 5}).json()
    run = (runs.get("dag_runs") or [{}])[-1]
    s = report["settings"]
    print(f"Tokenized ({run.get('run_type', '?')} run {run.get('dag_run_id', '?')}): {report['status']}, "
          f"{report['parts_tokenized']} parts, {report['rows_out']:,} training rows ({report['rows_dropped']:,} dropped: "
          f"{report['dropped_by_reason']}), {report['tokens']:,} tokens, {report['loss_tokens']:,} with loss "
          f"({report['loss_token_share']:.1%}), {report['truncated_to_max_length']:,} cut at max_length {s['max_length']}")
    src = report.get("ids_source") or {}
    print(f"        one row per regenerated turn: {src.get('engine', 0):,} built from the engine's own token ids "
          f"(return_token_ids), {src.get('retokenized', 0):,} re-encoded and checked against the engine's "
          f"counts (the server without ids); {report['unverified']:,} failed that check")
    print(f"        tokenizer {s['tokenizer']} (validation's), train_turns {s['train_turns']}, "
          f"loss_on_reasoning {s['loss_on_reasoning']}, train_eot_newline {s['train_eot_newline']}")
    for profile, files in (report.get("files") or {}).items():
        for kind, key in files.items():
            figures = report["profiles"][profile]
            if kind == "conversations":
                conv = figures.get("specforge_conversations") or {}
                left = ", ".join(f"{k} {v:,}" for k, v in sorted((conv.get("skipped") or {}).items())) or "none"
                count = f"{conv.get('rows', 0):,} rows; left out: {left}"
            else:
                count = f"{figures['rows']:,} rows"
            print(f"        {profile:11s} s3://{BUCKET}/{key}  ({kind}, {count})")
    print(f"        card        s3://{BUCKET}/{layout.dataset_card_key} (datasets.load_dataset(<root>, \"parquet\"))")
    print(f"        report      s3://{BUCKET}/{layout.tokenized_report_md_key}")
    return report["status"] == "complete"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run dflash_generate end to end on a local stack.")
    parser.add_argument("--keep", action="store_true", help="keep the stack running until Ctrl-C")
    parser.add_argument("--prompts", type=Path, default=REPO / "data" / "sample_prompts.jsonl")
    parser.add_argument("--servers", type=int, default=3,
                        help="simulated servers (the first two on SGLang's wire, the first without token ids; "
                        "the others on vLLM's)")
    parser.add_argument("--length-scale", type=float, default=0.05, help="simulated completion length factor")
    parser.add_argument("--token-time-s", type=float, default=0.002, help="simulated seconds per token")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--regenerate", choices=("last_turn", "all_turns"), default="all_turns",
                        help="the DAG param: all_turns replays the sample set's multi-turn rows turn by turn")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="the DAG param")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds to wait for the run")
    parser.add_argument("--home", type=Path, default=REPO / ".stack" / "demo",
                        help="stack state (wiped at start)")
    parser.add_argument("--screenshot", type=Path, default=None,
                        help="write a PNG of the finished run's progress page here (needs /usr/bin/chromium)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the stack's steps")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _on_stop_signal)
    signal.signal(signal.SIGINT, _on_stop_signal)  # even if started with SIGINT ignored

    if not args.prompts.exists():
        print(f"{args.prompts} is missing: run `make sample-data`", file=sys.stderr)
        return 2
    args.home.parent.mkdir(parents=True, exist_ok=True)
    lock = open(args.home.parent / f".{args.home.name}.lock", "w")  # noqa: SIM115 - held until exit
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another demo is running with --home {args.home}; stop it or pass another --home", file=sys.stderr)
        return 2
    if args.home.exists():
        shutil.rmtree(args.home)
    # Qwen's real BPE (built from the dashscope wheel on PyPI) with a Qwen3.6-style template: the
    # simulated servers render and encode with it as an engine serving that model would (vLLM-wire
    # servers return their token ids), validation recounts with it and tokenization builds from it.
    from dflash_pipeline.dev.qwen_tokenizer import copy_with_template, ensure_qwen_tokenizer

    tok_dir = copy_with_template(args.home / "tokenizer", "qwen3.6", source=ensure_qwen_tokenizer())
    stack = Stack(
        args.home, REPO / "dags", REPO / "plugins",
        sim_count=args.servers,
        sim_settings={"length_scale": args.length_scale, "token_time_s": args.token_time_s,
                      "tokenizer_dir": str(tok_dir)},
        sim_extra_args=["--server-set", "0:token_ids_supported=false",
                        *(a for i in range(2, args.servers) for a in ("--server-set", f"{i}:engine=vllm"))],
        buckets=[BUCKET],
        wait_for_dags=(DAG_ID,),
    )  # fmt: skip
    prompts_uri = f"s3://{BUCKET}/{PROMPTS_KEY}"
    output_uri = f"s3://{BUCKET}/{OUTPUT_PREFIX}"
    print(f"Starting moto S3, {args.servers} simulated servers (SGLang without token ids, SGLang, "
          f"{max(0, args.servers - 2)} vLLM) and Airflow under {args.home} ...", flush=True)
    t0 = time.monotonic()
    state: str | None = None
    tokenized = False
    try:
        with stack:
            af = stack.airflow
            print(f"Stack up in {time.monotonic() - t0:.0f} s: Airflow {af.url}, S3 {stack.moto.endpoint_url}")
            stack.s3().upload_file(str(args.prompts), BUCKET, PROMPTS_KEY)
            print(f"Uploaded {args.prompts.relative_to(REPO) if args.prompts.is_relative_to(REPO) else args.prompts}"
                  f" -> {prompts_uri}")
            for name in ("tokenizer.json", "tokenizer_config.json"):
                stack.s3().upload_file(str(tok_dir / name), BUCKET, f"{TOKENIZER_PREFIX}/{name}")
            conf = {"prompts_uri": prompts_uri, "output_uri": output_uri, "servers": server_connections(af, stack.server_urls),
                    "model": MODEL, "save_every": args.save_every, "tokenizer": f"s3://{BUCKET}/{TOKENIZER_PREFIX}",
                    "regenerate": args.regenerate, "samples_per_prompt": args.samples_per_prompt}
            print(cli_line(af.home, "dags", "trigger", DAG_ID, "--conf", json.dumps(conf)), flush=True)
            t1 = time.monotonic()
            run_id = af.trigger(DAG_ID, conf)
            print(f"Run {run_id}")
            follower = Follower(stack, run_id)
            state = af.wait_run(DAG_ID, run_id, timeout_s=args.timeout, poll_s=1.0, on_poll=follower)
            mem = follower.peak_memory
            print(f"\nRun finished: {state.upper()} in {time.monotonic() - t1:.0f} s "
                  f"(Airflow peak memory: PSS {mem['pss_bytes'] >> 20} MiB, RSS {mem['rss_bytes'] >> 20} MiB, "
                  f"{mem['processes']} processes)\n")

            report_key = f"{OUTPUT_PREFIX}/report.json"
            try:
                report = json.loads(stack.s3().get_object(Bucket=BUCKET, Key=report_key)["Body"].read())
            except Exception as exc:  # noqa: BLE001 - a failed run may have no report
                print(f"No report at s3://{BUCKET}/{report_key}: {type(exc).__name__}")
            else:
                print(f"Report (s3://{BUCKET}/{report_key}):")
                print_report(report)
            print()
            try:
                print_conversation(stack.s3(), BUCKET, OUTPUT_PREFIX)
            except Exception as exc:  # noqa: BLE001 - the sample is a courtesy; the run's state decides
                print(f"No multi-turn sample: {type(exc).__name__}: {exc}")
            tokenized = state == "success" and follow_tokenize(stack, output_uri, timeout_s=300)
            print()
            print(f"UI:     {af.ui_run_url(DAG_ID, run_id)}")
            from urllib.parse import quote

            print(f"Progress: {af.ui_run_url(DAG_ID, run_id)}/plugin/dflash-progress  (the run's 'DFlash progress' "
                  f"tab; the page alone: {af.url}/dflash/runs/{quote(DAG_ID, safe='')}/{quote(run_id, safe='')})")
            print(f"login:  {af.username} / {af.password}")
            print(f"S3:     endpoint {stack.moto.endpoint_url} (access key testing / testing)")
            print(f"        prompts {prompts_uri}")
            print(f"        output  {output_uri}/  (report.json, report.md, manifest, parts)")
            print(f"        e.g. AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing aws --endpoint-url "
                  f"{stack.moto.endpoint_url} s3 ls --recursive s3://{BUCKET}/{OUTPUT_PREFIX}/")
            print(f"Logs:   {af.logs_dir}")
            if args.screenshot is not None:
                from dflash_pipeline.dev.browser import screenshot_run_page

                try:
                    shot = screenshot_run_page(af.url, DAG_ID, run_id, af.username, af.password, args.screenshot)
                    print(f"Screenshot of the progress page: {shot}")
                except Exception as exc:  # noqa: BLE001 - a screenshot must not cost the demo
                    print(f"No screenshot: {type(exc).__name__}: {exc}")
            print(f"CLI:    {cli_line(af.home, 'dags', 'list-runs', DAG_ID)}")
            print("        (this AIRFLOW_HOME, or a plain `airflow` creates ~/airflow and finds no migrated database;"
                  " e.g. `dags trigger`, `tasks states-for-dag-run` the same way)")
            if args.keep:
                print("\nThe stack keeps running: the UI, S3 and the CLI line above work until you press Ctrl-C "
                      "(or kill -TERM this process).", flush=True)
                while True:
                    time.sleep(3600)
            print("\nStopping everything the demo started ... (to keep the stack up for the UI and the CLI: "
                  "make demo DEMO_ARGS=--keep)", flush=True)
    except KeyboardInterrupt:
        print("\nStopped everything the demo started (Airflow, the simulated servers, moto).")
        if state is None:  # interrupted before the run finished
            return 130
    else:
        print("Stopped: Airflow, the simulated servers and moto are down.")
    return 0 if state == "success" and tokenized else 1


if __name__ == "__main__":
    raise SystemExit(main())
