"""Plan bench for the inputs users have: 4 generated files under one prefix on a local moto_server.

    .venv/bin/python bench/inputs_plan_bench.py [--rows-per-file 25000]

ShareGPT (JSONL and Parquet), OpenAI with developer/tool turns (.jsonl.gz) and list-of-parts content
(dflash_pipeline/dev/input_formats.py), planned from `s3://bench-in/in/` with max_rejects 0 and
max_reject_share 0 (any reject fails). Prints prompts, rejects, chunks and the plan's wall time.
"""

from __future__ import annotations

import argparse
import os
import time

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dev.input_formats import jsonl, parquet, rows
from dflash_pipeline.dev.stack import MotoServer
from dflash_pipeline.steps.plan import run_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows-per-file", type=int, default=25_000)
    n = ap.parse_args().rows_per_file
    server = MotoServer().start()
    try:
        server.create_bucket("bench-in")
        client = server.client()
        files = {"a.jsonl": jsonl(rows("sharegpt", n)), "b.jsonl.gz": jsonl(rows("openai_tools", n), gz=True),
                 "c.jsonl": jsonl(rows("list_content", n)), "d.parquet": parquet(rows("sharegpt", n, start=n))}
        for name, body in files.items():
            client.put_object(Bucket="bench-in", Key=f"in/{name}", Body=body)
        cfg = RunConfig.from_params({"prompts_uri": "s3://bench-in/in/", "output_uri": "s3://bench-in/ds",
                                     "servers": ["http://127.0.0.1:9"], "max_rejects": 0, "max_reject_share": 0.0})
        print(f"load average {os.getloadavg()[0]:.1f}")  # noqa: T201 - a bench prints
        t = time.perf_counter()
        s = run_plan(client, cfg, "bench")
        dt = time.perf_counter() - t
        print(f"{s['prompts']} prompts from {s['files']} files, {s['rejects']} rejects, {s['chunks']} chunks: "  # noqa: T201
              f"{dt:.1f} s ({s['prompts'] / dt:,.0f} prompts/s)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
