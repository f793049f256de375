"""Issue 38's loop on CPU, side by side in one run: trainer wall time and rows/s, and the acceptance of
(a) regenerated, (b) original answers, (c) untrained (and with --sensitivity, (a) with a planted data defect:
shifted_loss_mask, thinking_off_as_on), with intervals and (a)'s paired differences.

    PYTHONPATH=include .venv/bin/python bench/loop_bench.py                     # the CI test's sizes, all prompts
    PYTHONPATH=include .venv/bin/python bench/loop_bench.py --sensitivity --steps 100 --keep /tmp/loop-bench

Everything goes through the pipeline's steps (dev/engine/loop_experiment.py): a moto S3 server, real
``vllm serve`` (.venv-vllm, CPU) for the topic target and for each drafter through vLLM's DFlash path,
SpecForge's DFlash training through dflash_train's local backend (.venv-trainers). Prints the eval's
report.md, then one JSON line (timings, trainer figures, per condition acceptance and differences).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))


def main() -> None:
    from dflash_pipeline.dev.engine.loop_experiment import DEFECTS, LoopSettings, format_table, report_markdown, run_loop
    from dflash_pipeline.dev.qwen_tokenizer import ensure_qwen_tokenizer
    from dflash_pipeline.dev.stack import MotoServer

    d = LoopSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=d.prompts)
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--max-tokens", type=int, default=d.eval_max_tokens, help="eval and generation")
    parser.add_argument("--eval-max-prompts", type=int, default=None, help="default: every held-out prompt")
    parser.add_argument("--sensitivity", action="store_true", help=f"also train and measure {list(DEFECTS)}")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("dflash_pipeline.dev.engine.loop_experiment").setLevel(logging.INFO)
    settings = LoopSettings(prompts=args.prompts, steps=args.steps, batch_size=args.batch_size,
                            learning_rate=args.learning_rate, seed=args.seed, gen_max_tokens=args.max_tokens,
                            eval_max_tokens=args.max_tokens, eval_max_prompts=args.eval_max_prompts,
                            sensitivity=DEFECTS if args.sensitivity else ())
    with tempfile.TemporaryDirectory(prefix="loop-bench-") as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        moto = MotoServer(log_path=work / "moto.log").start()
        try:
            moto.create_bucket("loop-bench")
            client = moto.client()
            result = run_loop(client, "loop-bench", work, settings, tokenizer_source=ensure_qwen_tokenizer())
            md = report_markdown(client, "s3://loop-bench/loop/eval")
        finally:
            moto.stop()
    print(md)
    print("\n## Trainer (SpecForge DFlash on CPU, dflash_train local backend)\n")
    print("| drafter | rows | steps | trainer wall s | rows/s | loss first -> last |")
    print("|---|---:|---:|---:|---:|---|")
    for name, t in result.train.items():
        print(f"| {name} | {t['rows']} | {t['steps']} | {t['wall_s']} | {t['rows_per_s']} | "
              f"{t['loss_first']:.3f} -> {t['loss_last']:.3f} |")
    print("\n## Acceptance length [interval]; regenerated minus each (paired) [interval]\n")
    print(format_table(result))
    print()
    print(json.dumps({"settings": result.settings, "timings": result.timings, "train": result.train,
                      "tokenizations": result.tokenizations, "summary": result.summary}, default=str))


if __name__ == "__main__":
    main()
