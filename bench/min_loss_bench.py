"""What `min_loss_tokens` (and the default tokenize filters) drop, by thinking mode.

    .venv/bin/python bench/min_loss_bench.py                      # the demo's prompts and simulator settings
    .venv/bin/python bench/min_loss_bench.py --prompts 500 --length-scale 1.0
    .venv/bin/python bench/min_loss_bench.py --filter-cost 400     # the quality filter's rows/s on one core

The demo's data (data/sample_prompts.jsonl, regenerate=all_turns) answered by the simulator's length and text
model (dev/sim/lengths.py: the demo's length_scale 0.05, max_tokens 4096) with Qwen's real BPE and a Qwen3.6-style
template (dev/sim/tokens.py), once with thinking on and once off, tokenized by `tokenize_table` with no loss
minimum; then, per thinking mode, the training rows each `min_loss_tokens` threshold would drop (with
SpecForge's consecutive-pair rule), and the share the default settings keep (the gate's `kept_share`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))


def sim_rows(prompts: list[Any], tok_dir: Path, thinking: bool, length_scale: float, max_tokens: int) -> list[dict[str, Any]]:
    """Completion rows as the demo's simulated servers write them (all_turns: every assistant turn regenerated)."""
    from dflash_pipeline.dev.sim.lengths import plan_lengths, render_completion
    from dflash_pipeline.dev.sim.rows import engine_row
    from dflash_pipeline.dev.sim.tokens import SimTokenModel

    tm = SimTokenModel(str(tok_dir))
    rows = []
    for p in prompts:
        msgs = [m for m in p.messages]
        answers = []
        for i, m in enumerate([*msgs, {"role": "assistant"}]):
            if m["role"] != "assistant":
                continue
            plan = plan_lengths(msgs[:i], seed=0, mean_tokens=1800, length_scale=length_scale, enable_thinking=thinking)
            full = render_completion(plan, max_tokens=None, separate_reasoning=True)
            answers.append((full.reasoning_content, full.content))
        row = engine_row(tm, msgs, answers, thinking=thinking, max_tokens=max_tokens, row_id=f"{p.id}",
                         regenerate_all=True)
        row["thinking"] = thinking
        row["domain"] = p.domain
        rows.append(row)
    return rows


def filter_cost(n: int) -> dict[str, Any]:
    """The default quality filter's time per completion row (tokenize_bench's rows: ~2k-token conversations of
    prose and code, 1 in 10 cut at max_tokens), without and with a `languages` list; py3langid loaded first."""
    import time

    sys.path.insert(0, str(REPO / "bench"))
    from tokenize_bench import make_rows

    from dflash_pipeline.config import TokenizeConfig
    from dflash_pipeline.dev.qwen_tokenizer import copy_with_template, ensure_qwen_tokenizer
    from dflash_pipeline.steps.tokenize.qualityfilter import quality_filter

    with tempfile.TemporaryDirectory() as tmp:
        rows = make_rows(n, str(copy_with_template(Path(tmp) / "q", "qwen3.6", source=ensure_qwen_tokenizer())))
    out: dict[str, Any] = {"rows": n}
    for name, params in (("default", {}), ("languages_en", {"languages": ["en"]})):
        cfg = TokenizeConfig.from_params(params)
        qf = quality_filter(cfg.drop_quality, cfg.quality_params(), {})
        assert qf is not None
        qf(rows[0])
        t = time.perf_counter()
        got = [qf(r) for r in rows]
        dt = time.perf_counter() - t
        out[name] = {"rows_per_s": round(n / dt), "dropped": {k: got.count(k) for k in set(got) if k}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--filter-cost", type=int, default=0, help="measure the quality filter on this many rows instead")
    args = ap.parse_args()
    if args.filter_cost:
        print(json.dumps(filter_cost(args.filter_cost), indent=1))
        return 0

    import numpy as np
    import pyarrow as pa

    from dflash_pipeline.dataset.prompts import Prompt, iter_jsonl
    from dflash_pipeline.dataset.records import PART_SCHEMA
    from dflash_pipeline.dev.qwen_tokenizer import copy_with_template, ensure_qwen_tokenizer
    from dflash_pipeline.steps.tokenize import TokenizeSettings, TrainingRowBuilder, tokenize_table
    from dflash_pipeline.steps.tokenize.qualityfilter import quality_filter
    from dflash_pipeline.config import TokenizeConfig
    from dflash_pipeline.steps.validate.tokencount import load_recounter

    with open(REPO / "data" / "sample_prompts.jsonl", "rb") as f:
        prompts = [p for p in iter_jsonl(f, regenerate="all_turns") if isinstance(p, Prompt)][: args.prompts]
    out: dict[str, Any] = {"prompts": len(prompts), "length_scale": args.length_scale, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = copy_with_template(Path(tmp) / "q36", "qwen3.6", source=ensure_qwen_tokenizer())
        for thinking in (True, False):
            rows = sim_rows(prompts, tok_dir, thinking, args.length_scale, args.max_tokens)
            table = pa.Table.from_pylist([{c: r.get(c) for c in PART_SCHEMA.names} for r in rows], schema=PART_SCHEMA)
            mode = "on" if thinking else "off"
            s = TokenizeSettings(tokenizer=str(tok_dir), min_loss_tokens=1, require_consecutive_loss_tokens=False,
                                 enable_thinking=thinking)
            b = TrainingRowBuilder(load_recounter(str(tok_dir), lambda bk, k: None, enable_thinking=thinking), s)
            built, _, stats = tokenize_table(table, b)
            loss = built.column("num_loss_tokens").to_numpy()
            mask_pairs = np.array([any(a and c for a, c in zip(m, m[1:])) for m in built.column("loss_mask").to_pylist()])
            turns = len(loss) + sum(stats.dropped.values())
            per = {"training_rows": turns, "dropped_before_min_loss": stats.dropped,
                   "loss_tokens_p10_p50_p90": [int(x) for x in np.percentile(loss, [10, 50, 90])] if len(loss) else []}
            for t in (2, 8, 16, 32):
                dropped = int(np.sum((loss < t) | ~mask_pairs))
                per[f"min_loss_tokens_{t}_drops"] = f"{dropped} of {turns} ({dropped / turns:.1%})"
            cfg = TokenizeConfig()
            qf = quality_filter(cfg.drop_quality, cfg.quality_params(), {})
            ds = TokenizeSettings(tokenizer=str(tok_dir), enable_thinking=thinking, min_loss_tokens=cfg.min_loss_tokens)
            db = TrainingRowBuilder(load_recounter(str(tok_dir), lambda bk, k: None, enable_thinking=thinking), ds)
            kept, _, dstats = tokenize_table(table, db, quality_filter=qf)
            counted = kept.num_rows + sum(dstats.dropped.values())
            per["default_settings"] = {"min_loss_tokens": cfg.min_loss_tokens, "kept": kept.num_rows,
                                       "counted": counted, "kept_share": round(kept.num_rows / counted, 4),
                                       "dropped": dstats.dropped}
            out[f"thinking_{mode}"] = per
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
