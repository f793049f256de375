#!/usr/bin/env python3
"""Write prompt files in the chat formats users bring (dflash_pipeline/dev/input_formats.py) to a folder:
sharegpt.jsonl, openai_tools.jsonl.gz, list_content.jsonl, sharegpt.parquet. Upload the folder and give its
prefix (or a glob, or a weighted list) as prompts_uri; docs/inputs.md shows how.

    python scripts/make_input_formats.py --out /tmp/inputs [--count 1200] [--seed 0]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from dflash_pipeline.dev.input_formats import jsonl, parquet, rows

log = logging.getLogger("make_input_formats")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=1200, help="rows per file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    files = {
        "sharegpt.jsonl": jsonl(rows("sharegpt", args.count, args.seed)),
        "openai_tools.jsonl.gz": jsonl(rows("openai_tools", args.count, args.seed), gz=True),
        "list_content.jsonl": jsonl(rows("list_content", args.count, args.seed)),
        # ShareGPT again, other ids, as Parquet
        "sharegpt.parquet": parquet(rows("sharegpt", args.count, args.seed, start=args.count)),
    }
    for name, data in files.items():
        (args.out / name).write_bytes(data)
        log.info("%s: %s bytes", args.out / name, len(data))


if __name__ == "__main__":
    main()
