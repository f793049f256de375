"""The mix report on the simulator pipeline: a labelled prompt set, generated, validated, tokenized.

    .venv/bin/python bench/mix_report.py                                   # data/sample_prompts.jsonl, 600 rows
    .venv/bin/python bench/mix_report.py --rows 2000 --thinking-fraction 0.5 --min-loss-tokens 32,2

What it does (the figures quoted in docs/mix.md come from here):
- Reads --prompts (JSONL) and labels each row the way a user labels theirs before a run: `source` =
  --source, `domain` by a keyword rule on the last user message (code / logic / math; docs/mix.md shows
  the rule); rows that already carry a domain keep it.
- Starts a moto S3 server and --servers simulated SGLang servers (the sim tokenizer, so tokenize can check
  re-encoded turns), uploads the labelled set, runs plan + one generate worker per server in-process
  (dev/faultlab.run_generation, the DAG's own functions), then validation with --target.
- Tokenizes the dataset once per --min-loss-tokens value (clearing tokenized/ in between: the settings are
  pinned per root) with the target, and prints validation's and each tokenize run's mix sections.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "include"))

from dflash_pipeline.config import RunConfig, TokenizeConfig  # noqa: E402
from dflash_pipeline.dataset.layout import DatasetLayout  # noqa: E402
from dflash_pipeline.dev.faultlab import run_generation  # noqa: E402
from dflash_pipeline.dev.sim import SimFleet  # noqa: E402
from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer  # noqa: E402
from dflash_pipeline.dev.stack import MotoServer  # noqa: E402
from dflash_pipeline.steps.tokenize import plan, run_assignment, write_report  # noqa: E402
from dflash_pipeline.steps.validate import Thresholds, ValidationFailed, run_validation  # noqa: E402
from dflash_pipeline.steps.validate import mix as mixreport  # noqa: E402

BUCKET = "mix-bench"
CODE = re.compile(r"\b(function|code|Python|JavaScript|C\+\+|Rust|Go|Java|Kotlin|TypeScript|API|class)\b")
LOGIC = re.compile(r"knights?|knaves?|runners|sequence|explorers|coins|puzzle", re.I)
DEFAULT_TARGET = '{"domain": {"math": 0.4, "code": 0.4, "logic": 0.2}, "thinking": {"true": 0.5, "false": 0.5}}'


def last_user_text(row: dict[str, Any]) -> str:
    if "prompt" in row:
        return str(row["prompt"])
    users = [m.get("content") for m in row.get("messages") or [] if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def domain_of(text: str) -> str:
    """The keyword rule docs/mix.md shows: code, then logic puzzles, else math."""
    if CODE.search(text):
        return "code"
    if LOGIC.search(text):
        return "logic"
    return "math"


def labelled(path: Path, rows: int, source: str) -> bytes:
    out = []
    with path.open() as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            row.setdefault("source", source)
            row.setdefault("domain", domain_of(last_user_text(row)))
            out.append(json.dumps(row))
            if len(out) >= rows:
                break
    return "\n".join(out).encode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, default=REPO / "data" / "sample_prompts.jsonl")
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--source", default="sample_prompts")
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--enable-thinking", choices=("true", "false"), default="true")
    ap.add_argument("--thinking-fraction", type=float, default=None, help="the run param (null: --enable-thinking)")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--length-scale", type=float, default=1.0, help="simulated completion length factor")
    ap.add_argument("--target", default=DEFAULT_TARGET, help="target_mix JSON")
    ap.add_argument("--min-loss-tokens", default="32,2", help="comma-separated tokenize min_loss_tokens values")
    ap.add_argument("--json", type=Path, default=None, help="write the mix sections here as JSON")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="mix-bench-") as tmp, MotoServer(log_path=Path(tmp) / "moto.log") as moto:
        moto.create_bucket(BUCKET)
        client = moto.client()
        tokenizer = build_sim_tokenizer(Path(tmp) / "tokenizer")
        fleet = SimFleet.uniform(args.servers, token_time_s=0.00005, length_scale=args.length_scale,
                                 tokenizer_dir=str(tokenizer), token_ids_supported=False).start()
        try:
            client.put_object(Bucket=BUCKET, Key="prompts.jsonl", Body=labelled(args.prompts, args.rows, args.source))
            cfg = RunConfig.from_params({
                "prompts_uri": f"s3://{BUCKET}/prompts.jsonl", "output_uri": f"s3://{BUCKET}/ds",
                "servers": fleet.urls, "save_every": 100, "max_tokens": args.max_tokens,
                "enable_thinking": args.enable_thinking == "true", "thinking_fraction": args.thinking_fraction,
                "target_mix": json.loads(args.target),
                "max_rejects": args.rows})
            outcomes = run_generation(client, cfg, fleet.urls, "mix-bench")
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                raise failed[0]
        finally:
            fleet.stop()
        try:
            report = run_validation(client, cfg.output_uri, thresholds=Thresholds(max_truncation_rate=1.0),
                                    tokenizer=str(tokenizer), target_mix=cfg.target_mix, plots=False)
        except ValidationFailed as exc:
            print(f"validation failed: {exc}")
            raise
        print(f"# {args.rows} rows of {args.prompts.name}, thinking {args.enable_thinking}, thinking_fraction "
              f"{args.thinking_fraction}, max_tokens "
              f"{args.max_tokens}, {report['completions']} completions, {report['errors']} error rows")
        print(mixreport.markdown(report["mix"], "mix (before filters)"))
        results: dict[str, Any] = {"before": report["mix"]}
        layout = DatasetLayout.from_uri(cfg.output_uri)
        for mlt in [int(x) for x in args.min_loss_tokens.split(",") if x]:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=layout.tokenized_prefix):
                for o in page.get("Contents", []):
                    client.delete_object(Bucket=BUCKET, Key=o["Key"])
            tcfg = TokenizeConfig.from_params({"tokenizer": str(tokenizer), "workers": 1, "min_loss_tokens": mlt,
                                               "min_kept_share": 0.0, "target_mix": cfg.target_mix, "profiles": ["parquet"]})
            planned = plan(client, [layout.uri], tcfg)
            for a in planned["assignments"]:
                run_assignment(client, a)
            tok = write_report(client, planned["datasets"][0], target_mix=tcfg.target_mix)
            print(f"# tokenize min_loss_tokens={mlt}: {tok['rows_out']} training rows, dropped {tok['dropped_by_reason']}")
            print(mixreport.markdown(tok["mix"], f"mix after filters (min_loss_tokens {mlt})"))
            results[f"min_loss_tokens={mlt}"] = {"mix": tok["mix"], "dropped_by_reason": tok["dropped_by_reason"]}
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
