"""SpecForge 0.2.0 training a DFlash drafter on CPU: trainer wall time and rows per second.

    .venv/bin/python bench/specforge_train_bench.py                        # 200 rows, 100 steps, batch 4
    .venv/bin/python bench/specforge_train_bench.py --rows 400 --steps 300 --keep /tmp/drafter-run

Builds the learnable tiny target (dev/engine/topic_qwen.py), writes ``tokenized/specforge`` files for
`--rows` of its prompts with the tokenize step's own functions (the target's completions sampled from its
design, thinking on, off or both; ``--original`` trains on the prompts' original answers instead), and runs
steps/train/specforge_entry.py in .venv-trainers (SpecForge's own offline DFlash route on CPU). Prints one
JSON line: the train log's figures (rows, tokens, wall_s, rows_per_s, first and last loss) and the whole
run's wall time (capture and export included). With ``--keep DIR`` the run (``DIR/run/drafter``) and the
target (``DIR/target``) stay, to serve with ``python -m dflash_pipeline.dev.engine.dflash_measure
--target topic --drafter-dir DIR/run/drafter``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "include"))
ENTRY = REPO / "include" / "dflash_pipeline" / "steps" / "train" / "specforge_entry.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--original", action="store_true", help="train on the original answers")
    parser.add_argument("--thinking", choices=("on", "off", "both"), default="on",
                        help="rows rendered with thinking on, off, or half each (two parts)")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    args = parser.parse_args()
    from dflash_pipeline.dev.engine import topic_qwen

    with tempfile.TemporaryDirectory(prefix="sf-bench-") as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        target = topic_qwen.build_checkpoint(work / "target")
        modes = {"on": [True], "off": [False], "both": [True, False]}[args.thinking]
        files = [f for mode in modes for f in topic_qwen.specforge_files(
            target, work / "dataset", args.rows // len(modes), seed=args.seed, original=args.original,
            thinking=mode)]
        cfg = {"target_model": str(target), "train_files": [str(f) for f in files], "output_dir": str(work / "run"),
               "steps": args.steps, "seed": args.seed, "learning_rate": args.learning_rate,
               "batch_size": args.batch_size, "max_length": 512, "block_size": args.block_size,
               "num_draft_layers": 1, "save_every": max(1, args.steps // 2)}
        (work / "cfg.json").write_text(json.dumps(cfg))
        started = time.monotonic()
        subprocess.run([str(REPO / ".venv-trainers" / "bin" / "python"), str(ENTRY), "--config",
                        str(work / "cfg.json")], check=True)
        total = time.monotonic() - started
        log = json.loads((work / "run" / "train_log.json").read_text())
        print(json.dumps({"rows": log["rows"], "tokens": log["tokens"], "steps": log["steps"],
                          "batch_size": args.batch_size, "block_size": args.block_size,
                          "trainer_wall_s": log["wall_s"], "rows_per_s": log["rows_per_s"],
                          "loss_first": round(log["loss"][0][1], 3), "loss_last": round(log["loss"][-1][1], 3),
                          "entry_wall_s": round(total, 1), "original": args.original,
                          "thinking": args.thinking}))


if __name__ == "__main__":
    main()
