"""Load our files with the trainers' OWN code and dump what they would train on, as JSONL.

Runs in .venv-trainers (`make trainers-venv`: specforge 0.2.0, speculators 0.9.0, datasets), never in the
pipeline's .venv: tests/trainers start it as a subprocess and compare the dump with the rows we wrote.
It imports nothing from dflash_pipeline. Each command writes one JSON object per loaded row to --out
(``key`` when the trainer keeps one, else null; ``input_ids``; ``loss_mask``) and a summary on stdout.

    specforge-tokens         specforge.data.prompt_builder.prepare_prompt_tasks on a pre-tokenized JSONL, with
                             DFlash's min_loss_tokens and loss_mask_filter from SpecForge's own registration
    specforge-conversations  the same entry on a conversations JSONL (its build_eagle3_dataset + parser +
                             template); keys from its shuffle, or each row alone when it dropped some
    speculators              speculators.cli.prepare_data.prepare_data (pre-tokenized passthrough), then its
                             training ArrowDataset over the prepared folder
    parquet                  datasets.load_dataset on the Parquet files and through the dataset card's configs
    batch                    several of the above in one process (one import of torch and the trainers)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16


def _ints(value: Any) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if value and isinstance(value[0], list):  # [1, seq] tensors
        value = value[0]
    return [int(v) for v in value]


def _write(out: Path, rows: list[dict[str, Any]]) -> None:
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _dflash() -> tuple[int, Any]:
    """SpecForge's DFlash eligibility, from its registration (not restated here)."""
    from specforge.algorithms.dflash.providers import algorithm_providers

    model = algorithm_providers().model
    return int(model.minimum_loss_tokens(None, {"block_size": BLOCK_SIZE})), model.loss_mask_filter


def specforge_tokens(args: argparse.Namespace) -> dict[str, Any]:
    from specforge.data.prompt_builder import prepare_prompt_tasks

    min_loss, loss_filter = _dflash()
    tasks = prepare_prompt_tasks(
        args.file, None, chat_template=None, max_length=args.max_length, is_preformatted=False,
        train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None,
        min_loss_tokens=min_loss, loss_mask_filter=loss_filter,
    )
    rows = [{"key": None, "input_ids": _ints(t["payload"]["input_ids"]), "loss_mask": _ints(t["payload"]["loss_mask"])}
            for t in tasks]
    _write(args.out, rows)
    return {"rows": len(rows), "min_loss_tokens": min_loss, "loss_mask_filter": loss_filter.__name__}


def specforge_conversations(args: argparse.Namespace) -> dict[str, Any]:
    import inspect

    import datasets
    from transformers import AutoTokenizer

    from specforge.data.preprocessing import build_eagle3_dataset
    from specforge.data.prompt_builder import prepare_prompt_tasks

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    min_loss, loss_filter = _dflash()
    records = [json.loads(line) for line in Path(args.file).read_text().splitlines()]
    # The real entry point of a run with data.train_data_path (_prepare_raw_prompts -> build_eagle3_dataset):
    # its rows carry no key and come shuffled with build_eagle3_dataset's default seed.
    tasks = prepare_prompt_tasks(
        args.file, tokenizer, chat_template=args.chat_template, max_length=args.max_length, is_preformatted=False,
        train_only_last_turn=True, cache_dir=None, cache_key=None, num_proc=1,
        min_loss_tokens=min_loss, loss_mask_filter=loss_filter,
    )
    rows = []
    if len(tasks) == len(records):
        # Nothing dropped: row j is record perm[j], perm being that shuffle (a function of the seed and the
        # length only). A wrong key here makes the comparison fail, never pass.
        seed = inspect.signature(build_eagle3_dataset).parameters["shuffle_seed"].default
        perm = datasets.Dataset.from_dict({"i": list(range(len(records)))}).shuffle(seed=seed)["i"]
        for j, task in enumerate(tasks):
            rows.append({"key": records[perm[j]]["id"], "input_ids": _ints(task["payload"]["input_ids"]),
                         "loss_mask": _ints(task["payload"]["loss_mask"])})
        keyed_by = "entry"
    else:
        # Some rows dropped: each record alone through the same build_eagle3_dataset (same map, parser,
        # template, filter) to say which.
        for record in records:
            one = build_eagle3_dataset(
                datasets.Dataset.from_list([record]), tokenizer, chat_template=args.chat_template,
                max_length=args.max_length, num_proc=None, train_only_last_turn=True, minimum_valid_tokens=min_loss,
            )
            rows.append({"key": record["id"], "input_ids": _ints(one[0]["input_ids"]) if len(one) else None,
                         "loss_mask": _ints(one[0]["loss_mask"]) if len(one) else None})
        keyed_by = "per_row"
    _write(args.out, rows)
    return {"rows": len(rows), "entry_rows": len(tasks), "keyed_by": keyed_by, "min_loss_tokens": min_loss}


def speculators(args: argparse.Namespace) -> dict[str, Any]:
    from speculators.cli.prepare_data import prepare_data
    from speculators.train.data import ArrowDataset

    prepare_data(model=args.tokenizer, data=[args.data], output=str(args.prepared), seq_length=args.max_length,
                 num_preprocessing_workers=1, minimum_valid_tokens=args.minimum_valid_tokens, skip_token_freq=True)
    ds = ArrowDataset(max_len=args.max_length, datapath=str(args.prepared), on_missing="raise", train_ratio=1.0)
    rows = []
    for i in range(len(ds)):
        item = ds.data[i]
        ids, mask = _ints(item["input_ids"]), _ints(item["loss_mask"])
        if int(ds.approx_lengths[i]) != len(ids):
            raise SystemExit(f"row {i}: seq_len {ds.approx_lengths[i]} != {len(ids)} input ids")
        rows.append({"key": None, "input_ids": ids, "loss_mask": mask})
    _write(args.out, rows)
    return {"rows": len(rows), "columns": sorted(ds.data.column_names)}


def parquet(args: argparse.Namespace) -> dict[str, Any]:
    import datasets

    datasets.disable_progress_bars()
    files = sorted(str(p) for p in (args.root / "tokenized" / "parquet").glob("part-*.parquet"))
    direct = datasets.load_dataset("parquet", data_files=files, split="train")
    card = datasets.load_dataset(str(args.root), "parquet", split="train")
    if direct.features != card.features:
        raise SystemExit(f"features differ: {direct.features} vs {card.features}")
    configs = {}
    for glob in args.json_globs:  # the JSONL profiles, with the json builder (see card.front_matter)
        configs[glob] = len(datasets.load_dataset("json", data_files=str(args.root / glob), split="train"))
    rows = [{"key": r["key"], "input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in card]
    _write(args.out, rows)
    return {"rows": len(rows), "features": direct.features.to_dict(), "configs": configs,
            "config_names": datasets.get_dataset_config_names(str(args.root))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("specforge-tokens")
    p.add_argument("--file", required=True)
    p.add_argument("--max-length", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("specforge-conversations")
    p.add_argument("--file", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--chat-template", required=True)
    p.add_argument("--max-length", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("speculators")
    p.add_argument("--data", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--prepared", type=Path, required=True)
    p.add_argument("--max-length", type=int, required=True)
    p.add_argument("--minimum-valid-tokens", type=int, default=None)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("parquet")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--json-globs", nargs="*", default=[])
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("batch", help="run several commands in one process: a JSON list of argument lists")
    p.add_argument("--jobs", type=Path, required=True)
    commands = {"specforge-tokens": specforge_tokens, "specforge-conversations": specforge_conversations,
                "speculators": speculators, "parquet": parquet}
    args = parser.parse_args()
    if args.command == "batch":
        summaries = []
        for argv in json.loads(args.jobs.read_text()):
            job = parser.parse_args(argv)
            summaries.append(commands[job.command](job))
        sys.stdout.write(json.dumps(summaries) + "\n")
    else:
        sys.stdout.write(json.dumps(commands[args.command](args)) + "\n")


if __name__ == "__main__":
    main()
