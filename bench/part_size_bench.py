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

Then the trainer formats (dflash_tokenize's `profiles`): the same rows through the tokenize step's own
functions (`tokenize_table` with the default settings, max_length 4096, the labels carried, then
`build_profile_files`, one part per --rows-per-part rows), and the bytes of each profile's files, per
completions row and per 1 M completions rows (`--no-formats` skips this).
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
    ap.add_argument("--no-formats", action="store_true", help="skip the trainer formats' sizes")
    args = ap.parse_args()

    from tokenize_bench import make_rows  # type: ignore[import-not-found]

    from dflash_pipeline.dev.qwen_tokenizer import copy_with_template, ensure_qwen_tokenizer

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = str(copy_with_template(Path(tmp) / "q36", "qwen3.6", source=ensure_qwen_tokenizer()))
        rows = make_rows(args.rows, tok_dir, seed=3)
        part_sizes(rows, args.rows_per_part)
        if not args.no_formats:
            format_sizes(rows, tok_dir, args.rows_per_part)
    return 0


def _gib_per_million(per_row: float) -> float:
    return per_row * 1e6 / 2**30


def part_sizes(rows: list[dict[str, Any]], rows_per_part: int) -> None:
    from dflash_pipeline.dataset.records import encode_part

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
        size = sum(len(encode_part(vrows[i : i + rows_per_part])) for i in range(0, n, rows_per_part))
        per_row = size / n
        base = base or size
        print(f"  {name:18s} {per_row:9,.0f} B/row  {_gib_per_million(per_row):8.2f} GiB per 1 M rows  x{size / base:.2f}")


def format_sizes(rows: list[dict[str, Any]], tok_dir: str, rows_per_part: int) -> None:
    """Each trainer format's bytes for these completions, written by the tokenize step's own functions."""
    from dflash_pipeline.dataset.records import decode_part, encode_part
    from dflash_pipeline.steps.tokenize import TokenizeSettings, TrainingRowBuilder, tokenize_table
    from dflash_pipeline.steps.tokenize.profiles import PROFILES, build_profile_files
    from dflash_pipeline.steps.tokenize.rowlabels import labels_by_unit, with_labels
    from dflash_pipeline.steps.validate.tokencount import load_recounter

    settings = TokenizeSettings(tokenizer=tok_dir, profiles=PROFILES)
    builder = TrainingRowBuilder(load_recounter(tok_dir, lambda b, k: None, enable_thinking=True), settings)
    sizes: dict[str, int] = {}
    training_rows = tokens = 0
    for chunk, i in enumerate(range(0, len(rows), rows_per_part)):
        table = decode_part(encode_part(rows[i : i + rows_per_part]))
        out, conversations, stats = tokenize_table(table, builder)
        out = with_labels(out, labels_by_unit(table, True), True)
        training_rows += out.num_rows
        tokens += stats.tokens
        files = build_profile_files(out, chunk, PROFILES, thinking=True, conversations=conversations)
        for rel, data in files.files.items():
            folder = rel.rsplit("/", 1)[0]
            sizes[folder] = sizes.get(folder, 0) + len(data)
    n = len(rows)
    print(f"trainer formats: {n} completions rows -> {training_rows} training rows, {tokens:,} tokens "
          f"({tokens / max(1, training_rows):,.0f} per training row; default settings, max_length 4096)")
    for folder, size in sorted(sizes.items()):
        print(f"  {folder:36s} {size / n:9,.0f} B/row  {_gib_per_million(size / n):8.2f} GiB per 1 M rows")
    total = sum(sizes.values())
    print(f"  {'all formats':36s} {total / n:9,.0f} B/row  {_gib_per_million(total / n):8.2f} GiB per 1 M rows")


if __name__ == "__main__":
    sys.exit(main())
