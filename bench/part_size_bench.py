"""What keeping the engine's token ids costs on S3: a completions part's Parquet size with and without them.

    .venv/bin/python bench/part_size_bench.py                  # 1,000 rows of real text (two 500-row parts)
    .venv/bin/python bench/part_size_bench.py --rows 2000

Rows are generated like bench/tokenize_bench.py's (real documentation prose and standard-library code,
1-3-turn conversations, regenerate=all_turns, Qwen's BPE with a Qwen3.6-style template, the engine's
prompt and generated ids kept as the generate step stores them) and written with the generate step's
own encoder (`records.encode_part`, zstd). Printed per variant: bytes per row and the projection to
1 M rows, and the ratio to the text-only part:

* text only: the part without the id columns (what parts cost before engine ids were kept);
* generated ids: plus `output_token_ids`;
* all ids: plus `prompt_token_ids` too (what the generate step writes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(REPO / "bench"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--rows-per-part", type=int, default=500)
    args = ap.parse_args()

    from tokenize_bench import make_rows  # type: ignore[import-not-found]

    from dflash_pipeline.dataset.records import encode_part
    from dflash_pipeline.dev.qwen_tokenizer import copy_with_template, ensure_qwen_tokenizer

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = str(copy_with_template(Path(tmp) / "q36", "qwen3.6", source=ensure_qwen_tokenizer()))
        rows = make_rows(args.rows, tok_dir, seed=3)

    def variant(drop: tuple[str, ...]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in drop} for r in rows]

    variants = {
        "text only": variant(("prompt_token_ids", "output_token_ids")),
        "generated ids": variant(("prompt_token_ids",)),
        "all ids (stored)": variant(()),
    }
    n = len(rows)
    turns = sum(len(r["turns"]) for r in rows)
    out_tokens = sum(t["completion_tokens"] for r in rows for t in r["turns"])
    prompt_tokens = sum(t["prompt_tokens"] for r in rows for t in r["turns"])
    print(f"{n} rows, {turns} turns, {out_tokens:,} generated tokens ({out_tokens / n:,.0f} per row), "
          f"{prompt_tokens:,} prompt tokens over all turns ({prompt_tokens / n:,.0f} per row)")
    base = None
    for name, vrows in variants.items():
        size = sum(len(encode_part(vrows[i : i + args.rows_per_part])) for i in range(0, n, args.rows_per_part))
        per_row = size / n
        base = base or size
        print(f"  {name:18s} {per_row:9,.0f} B/row  {per_row * 1e6 / 2**30:8.2f} GiB per 1 M rows  x{size / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
