"""Train a DFlash drafter with SpecForge 0.2.0's own code, on CPU, from the files ``dflash_tokenize`` writes.

Run in the trainers' venv (it imports only the standard library, torch, transformers, specforge and their
dependencies; never ``dflash_pipeline``, which that venv does not have)::

    .venv-trainers/bin/python include/dflash_pipeline/steps/train/specforge_entry.py --config cfg.json

``cfg.json`` (every key required): ``target_model`` (local Hugging Face directory of the target),
``train_files`` (list of local files: ``tokenized/specforge/part-*.jsonl``, SpecForge's pre-tokenized
format, ``input_ids`` + ``loss_mask`` per line), ``output_dir``, ``steps`` (optimizer steps),
``seed``, ``learning_rate``, ``batch_size``, ``max_length``, ``block_size``, ``num_draft_layers``,
``save_every`` (steps between saved states).

Writes (under ``output_dir``):

* ``state/``: everything a rerun needs to resume: ``entry_config.json`` (the cfg; a rerun with another
  cfg is refused, exit code 3), ``inputs.json`` (the train files' sha256: changed bytes are refused too), ``train.jsonl`` (the train files concatenated, as SpecForge's
  ``data.prompts_path`` takes one file), ``draft_config.json``, ``hidden_states/`` (the offline
  features), ``specforge.json`` (SpecForge's run config), ``specforge/`` (SpecForge's own checkpoints,
  every ``save_every`` steps) and ``loss.jsonl``.
* ``drafter/``: ``config.json`` + ``model.safetensors`` as ``specforge export --to hf`` writes them.
* ``train_log.json``: ``{"trainer": "specforge", "trainer_version", "steps", "loss": [[step, loss], ...],
  "rows", "tokens", "wall_s", "rows_per_s", "resumed_from_step"}``. ``rows``/``tokens``: training rows
  (and their tokens) SpecForge kept after its DFlash filter; ``wall_s``: this invocation's SpecForge
  training process; ``rows_per_s``: rows consumed (steps run x batch_size) / ``wall_s``.

Exit codes: 0 done; 2 bad cfg or inputs; 3 cfg differs from the one ``output_dir`` was made with;
143 stopped by SIGTERM (SpecForge's process is stopped too; a rerun resumes); 1 any other failure
(SpecForge's last output is in the message).

What differs from SpecForge's documented offline DFlash route (``scripts/prepare_hidden_states.py``
then ``specforge train`` with ``mode: offline``, as ``examples/configs/qwen3-8b-dflash-offline.yaml``),
and why; SpecForge's code itself is not modified:

1. Hidden states are captured with transformers, not SGLang (SpecForge's capture needs an SGLang
   engine, i.e. a GPU): one forward pass of the target with ``output_hidden_states=True``, features
   selected by SpecForge's own ``extract_context_feature`` (layer ``i`` = ``hidden_states[i + 1]``, as its
   ``spec_generate`` does; the base model's pass, without the lm_head), written one ``torch.save`` file per row with the keys SpecForge's DFlash
   offline reader takes (``input_ids``, ``loss_mask``, ``hidden_states`` ``[1, seq, len(ids) * hidden]``),
   in its ``rows_<a>-<b>/data_<i>.ckpt`` layout. Rows are chosen by SpecForge's
   ``prepare_prompt_tasks`` with DFlash's own filter (the same rows its online route would train).
2. ``training.attention_backend: sdpa`` (the default ``flex_attention`` compiles kernels for GPUs),
   ``training.fsdp_sharding: NO_SHARD`` (one CPU process), ``training.lr_scheduler: constant``
   with ``warmup_ratio: 0`` (a few hundred steps; SpecForge's default warms up and decays), and
   ``model.torch_dtype: float32`` (bfloat16 on CPU is slow); SpecForge picks the ``gloo`` process group
   itself on CPU (``specforge/distributed.py``).
3. The draft config SpecForge generates from the target is written to ``state/draft_config.json``
   with the ``mask_token_id`` its trainer resolves in memory (``resolve_mask_token_id``), so the
   export carries it (vLLM needs it) and a rerun trains the same architecture.
4. The drafter is exported with SpecForge's ``export_to_hf`` and then cast to bfloat16 (what SpecForge
   writes when it trains in bfloat16, its default).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("specforge_entry")

KEYS: dict[str, type | tuple[type, ...]] = {
    "target_model": str, "train_files": list, "output_dir": str, "steps": int, "seed": int,
    "learning_rate": (int, float), "batch_size": int, "max_length": int, "block_size": int,
    "num_draft_layers": int, "save_every": int,
}
RUN_ID = "dflash"
FILE_GROUP = 2000  # SpecForge's prepare_hidden_states.py default file_group_size
STEP_LINE = re.compile(r"^step (\d+): (\{.*\})\s*$")
"""SpecForge's console logger (``training/assembly.py::_logger``): ``step N: {'loss': 1.23, ...}``."""
LOSS = re.compile(r"'loss': ([-+0-9.eE]+|nan|inf|-inf)[,}]")
EXIT_BAD_CONFIG, EXIT_OTHER_CONFIG = 2, 3


class EntryError(Exception):
    """A failure with a message for the user and an exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def load_cfg(path: Path) -> dict[str, Any]:
    """The cfg, checked: every key present with its type and in range; no other key."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise EntryError(f"cannot read the config {path}: {e}", EXIT_BAD_CONFIG) from e
    if not isinstance(cfg, dict):
        raise EntryError(f"{path}: the config must be a JSON object", EXIT_BAD_CONFIG)
    problems = [f"missing key {k!r}" for k in KEYS if k not in cfg]
    problems += [f"unknown key {k!r}" for k in cfg if k not in KEYS]
    for key, kind in KEYS.items():
        if key in cfg and (not isinstance(cfg[key], kind) or isinstance(cfg[key], bool)):
            problems.append(f"{key!r} must be {kind}, got {cfg[key]!r}")
    if not problems:
        for key in ("steps", "batch_size", "max_length", "num_draft_layers", "save_every"):
            if cfg[key] < 1:
                problems.append(f"{key!r} must be >= 1, got {cfg[key]}")
        if cfg["block_size"] < 2:
            problems.append(f"'block_size' must be >= 2, got {cfg['block_size']}")
        if not cfg["learning_rate"] > 0:
            problems.append(f"'learning_rate' must be > 0, got {cfg['learning_rate']}")
        if not cfg["train_files"] or not all(isinstance(f, str) for f in cfg["train_files"]):
            problems.append("'train_files' must be a non-empty list of paths")
        else:
            problems += [f"train file {f} not found" for f in cfg["train_files"] if not Path(f).is_file()]
        if not (Path(cfg["target_model"]) / "config.json").is_file():
            problems.append(f"target_model {cfg['target_model']}: no config.json (a local Hugging Face directory)")
    if problems:
        raise EntryError(f"{path}: " + "; ".join(problems), EXIT_BAD_CONFIG)
    cfg["train_files"] = [str(Path(f).resolve()) for f in cfg["train_files"]]
    cfg["target_model"] = str(Path(cfg["target_model"]).resolve())
    cfg["output_dir"] = str(Path(cfg["output_dir"]).resolve())
    return cfg


def claim_output_dir(cfg: dict[str, Any]) -> Path:
    """``output_dir/state``, made for this cfg; refuses a dir made with another (exit 3)."""
    state = Path(cfg["output_dir"]) / "state"
    recorded = state / "entry_config.json"
    if recorded.exists():
        before = json.loads(recorded.read_text())
        if before != cfg:
            diff = sorted(k for k in set(before) | set(cfg) if before.get(k) != cfg.get(k))
            raise EntryError(f"{cfg['output_dir']} was made with another config (differs in {diff}); use a new "
                             "output_dir or the original config", EXIT_OTHER_CONFIG)
        inputs = json.loads((state / "inputs.json").read_text()) if (state / "inputs.json").exists() else None
        if inputs is not None and inputs != _input_hashes(cfg):
            raise EntryError(f"{cfg['output_dir']}: the train files changed since this run started (same paths, "
                             "other bytes); use a new output_dir", EXIT_OTHER_CONFIG)
        logger.info("output_dir %s was made with this config: resuming", cfg["output_dir"])
    else:
        if Path(cfg["output_dir"]).exists() and any(Path(cfg["output_dir"]).iterdir()):
            raise EntryError(f"{cfg['output_dir']} is not empty and holds no state/entry_config.json: not a run of "
                             "this entry; use a new output_dir", EXIT_OTHER_CONFIG)
        state.mkdir(parents=True, exist_ok=True)
        _atomic_write(state / "inputs.json", json.dumps(_input_hashes(cfg), indent=1))
        _atomic_write(recorded, json.dumps(cfg, indent=1, sort_keys=True))
    return state


def _input_hashes(cfg: dict[str, Any]) -> dict[str, str]:
    """sha256 of each train file: a rerun on the same paths with other bytes is refused, not resumed."""
    import hashlib

    out = {}
    for f in cfg["train_files"]:
        digest = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        out[f] = digest.hexdigest()
    return out


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def specforge_config(cfg: dict[str, Any], state: Path, draft_config: Path | None) -> dict[str, Any]:
    """SpecForge's run config (``specforge train --config``): offline DFlash, one CPU process."""
    return {
        "model": {
            "target_model_path": cfg["target_model"],
            "draft_model_config": str(draft_config) if draft_config else None,
            "draft_num_hidden_layers": cfg["num_draft_layers"],
            "draft_block_size": cfg["block_size"],
            "torch_dtype": "float32",
        },
        "data": {
            "hidden_states_path": str(state / "hidden_states"),
            "max_length": cfg["max_length"],
            "dataloader_num_workers": 0,
            "cache_dir": str(state / "cache"),
        },
        "training": {
            "strategy": "dflash",
            "num_epochs": 1_000_000,  # bounded by max_steps
            "max_steps": cfg["steps"],
            "batch_size": cfg["batch_size"],
            "learning_rate": float(cfg["learning_rate"]),
            "lr_scheduler": "constant",
            "warmup_ratio": 0.0,
            "max_grad_norm": 1.0,
            "attention_backend": "sdpa",
            "fsdp_sharding": "NO_SHARD",
            "save_interval": cfg["save_every"],
            "log_interval": 1,
            "max_checkpoints": 2,
            "seed": cfg["seed"],
        },
        "run_id": RUN_ID,
        "output_dir": str(state / "specforge"),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }


def write_draft_config(cfg: dict[str, Any], state: Path) -> Path:
    """The draft config SpecForge generates for the target, with the mask token its trainer resolves."""
    path = state / "draft_config.json"
    if path.exists():
        return path
    from specforge.algorithms.dflash.providers import algorithm_providers
    from specforge.config import Config
    from specforge.training.model_loading import resolve_draft_config
    from specforge.training.model_utils import resolve_mask_token_id
    from transformers import AutoTokenizer

    run = Config.model_validate(specforge_config(cfg, state, None))
    draft = resolve_draft_config(run, provider=algorithm_providers().model.draft_config)
    tokenizer = AutoTokenizer.from_pretrained(cfg["target_model"])
    mask = resolve_mask_token_id(explicit=None, tokenizer=tokenizer, embedding_vocab_size=int(draft.vocab_size))
    draft.dflash_config = {**dict(getattr(draft, "dflash_config", None) or {}), "mask_token_id": mask}
    draft.to_json_file(str(path.with_name(path.name + ".tmp")))
    os.replace(path.with_name(path.name + ".tmp"), path)
    logger.info("draft config: %d layer(s), block %d, target layers %s, mask token %d", draft.num_hidden_layers,
                draft.block_size, draft.dflash_config["target_layer_ids"], mask)
    return path


def training_rows(cfg: dict[str, Any], state: Path) -> list[tuple[list[int], list[int]]]:
    """The rows SpecForge trains on: its ``prepare_prompt_tasks`` over the concatenated files, with
    DFlash's minimum loss tokens and adjacent-pair filter, cut at ``max_length``."""
    from specforge.algorithms.dflash.providers import algorithm_providers
    from specforge.data.prompt_builder import prepare_prompt_tasks

    joined = state / "train.jsonl"
    if not joined.exists():
        tmp = joined.with_name("train.jsonl.tmp")
        with tmp.open("wb") as out:
            for f in cfg["train_files"]:
                data = Path(f).read_bytes()
                out.write(data if data.endswith(b"\n") or not data else data + b"\n")
        os.replace(tmp, joined)
    model = algorithm_providers().model
    tasks = prepare_prompt_tasks(
        str(joined), None, chat_template=None, max_length=cfg["max_length"], is_preformatted=False,
        train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None,
        min_loss_tokens=2, loss_mask_filter=model.loss_mask_filter,
    )
    rows = []
    for t in tasks:
        ids, mask = (list(map(int, t["payload"][k]))[: cfg["max_length"]] for k in ("input_ids", "loss_mask"))
        if model.loss_mask_filter(mask):
            rows.append((ids, mask))
    if not rows:
        raise EntryError(f"no training row left after SpecForge's DFlash filter in {cfg['train_files']}",
                         EXIT_BAD_CONFIG)
    return rows


def capture_hidden_states(cfg: dict[str, Any], state: Path, draft_config: Path,
                          rows: list[tuple[list[int], list[int]]]) -> None:
    """SpecForge's offline DFlash features, from the target run by transformers (see the docstring, 1.)."""
    out = state / "hidden_states"
    done = out / "complete.json"
    if done.exists() and json.loads(done.read_text()).get("rows") == len(rows):
        logger.info("hidden states of %d rows already captured", len(rows))
        return
    import torch
    from specforge.modeling.draft.dflash import extract_context_feature
    from transformers import AutoModelForCausalLM

    layer_ids = json.loads(draft_config.read_text())["dflash_config"]["target_layer_ids"]
    target = AutoModelForCausalLM.from_pretrained(cfg["target_model"], dtype=torch.float32)
    target.eval()
    body = getattr(target, target.base_model_prefix)
    started = time.monotonic()
    with torch.inference_mode():
        for i, (ids, mask) in enumerate(rows):
            group = (i // FILE_GROUP) * FILE_GROUP
            path = out / f"rows_{group}-{group + FILE_GROUP}" / f"data_{i}.ckpt"
            if path.exists():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            input_ids = torch.tensor([ids], dtype=torch.long)
            # The base model's hidden states are the causal LM's (same tuple); skipping lm_head saves the
            # vocabulary-sized logits nobody reads.
            hidden = body(input_ids=input_ids, output_hidden_states=True).hidden_states
            record = {"input_ids": input_ids[0].clone(), "loss_mask": torch.tensor(mask, dtype=torch.long),
                      "hidden_states": extract_context_feature(list(hidden), layer_ids).clone()}
            torch.save(record, str(path) + ".tmp")
            os.replace(str(path) + ".tmp", path)
    _atomic_write(done, json.dumps({"rows": len(rows), "target_layer_ids": layer_ids}))
    logger.info("captured hidden states (layers %s) of %d rows in %.1f s", layer_ids, len(rows),
                time.monotonic() - started)


def latest_checkpoint_step(state: Path) -> int | None:
    """The step of SpecForge's newest complete checkpoint (its ``<run>-step<N>/training_state.pt``)."""
    steps = [int(m.group(1)) for p in (state / "specforge").glob(f"{RUN_ID}-step*")
             if (m := re.fullmatch(rf"{RUN_ID}-step(\d+)", p.name)) and (p / "training_state.pt").is_file()]
    return max(steps, default=None)


def run_specforge(cfg: dict[str, Any], state: Path, draft_config: Path) -> tuple[int | None, float, int]:
    """``specforge train`` (its CLI, unchanged) as a child process; returns (resumed from step,
    wall seconds, steps run). Each logged step's loss is appended to ``state/loss.jsonl``."""
    resumed = latest_checkpoint_step(state)
    run = specforge_config(cfg, state, draft_config)
    if resumed is not None:
        run["training"]["resume_from"] = str(state / "specforge" / f"{RUN_ID}-step{resumed}")
        logger.info("resuming SpecForge from its checkpoint at step %d", resumed)
    run_file = state / "specforge.json"
    _atomic_write(run_file, json.dumps(run, indent=1))
    losses = state / "loss.jsonl"
    kept = [line for line in (losses.read_text().splitlines() if losses.exists() else [])
            if line and json.loads(line)[0] <= (resumed or 0)]
    _atomic_write(losses, "".join(line + "\n" for line in kept))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "specforge.cli", "train", "--config", str(run_file)]
    logger.info("running %s", " ".join(cmd))
    started = time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=str(state)) as proc, losses.open("a") as loss_out:
        try:
            ran, tail = _follow(proc, loss_out)
        finally:  # stopped (SIGTERM, an error here): SpecForge must not train on alone
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise EntryError("specforge train failed (exit %d); its last output:\n%s" % (proc.returncode, "\n".join(tail)))
    return resumed, wall, ran


def _follow(proc: subprocess.Popen[str], loss_out: Any) -> tuple[int, list[str]]:
    """Read SpecForge's output to its end: each ``step N: {...}`` line's loss to `loss_out`; returns
    (steps logged, the last 40 lines)."""
    tail: list[str] = []
    ran = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail = (tail + [line])[-40:]
        m = STEP_LINE.match(line)
        loss = LOSS.search(m.group(2)) if m else None
        if m and loss:
            ran += 1
            loss_out.write(json.dumps([int(m.group(1)), float(loss.group(1))]) + "\n")
            loss_out.flush()
            logger.info("step %s loss %s", m.group(1), loss.group(1))
        else:
            logger.debug("specforge: %s", line)
    proc.wait()
    return ran, tail


def export_drafter(cfg: dict[str, Any], state: Path, draft_config: Path) -> Path:
    """``output_dir/drafter``: SpecForge's HF export of its last checkpoint, in bfloat16 (see 4.)."""
    import torch
    from safetensors.torch import load_file, save_file
    from specforge.export.to_hf import export_to_hf

    final = Path(cfg["output_dir"]) / "drafter"
    tmp = Path(cfg["output_dir"]) / "drafter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    step = latest_checkpoint_step(state)
    if step != cfg["steps"]:
        raise EntryError(f"SpecForge's last checkpoint is at step {step}, not {cfg['steps']}")
    export_to_hf(str(state / "specforge" / f"{RUN_ID}-step{step}"), str(draft_config), str(tmp))
    weights = tmp / "model.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(weights)).items()}, str(weights),
              metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config.pop("torch_dtype", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """The whole run (see the module docstring); returns the train log."""
    from importlib.metadata import version

    state = claim_output_dir(cfg)
    draft_config = write_draft_config(cfg, state)
    rows = training_rows(cfg, state)
    logger.info("%d training rows (%d tokens) after SpecForge's DFlash filter", len(rows),
                sum(len(r[0]) for r in rows))
    capture_hidden_states(cfg, state, draft_config, rows)
    resumed, wall, ran = (None, 0.0, 0)
    if latest_checkpoint_step(state) != cfg["steps"]:
        resumed, wall, ran = run_specforge(cfg, state, draft_config)
    else:
        logger.info("SpecForge's checkpoint at step %d is the last: nothing to train", cfg["steps"])
        log_file = Path(cfg["output_dir"]) / "train_log.json"
        if log_file.exists():
            previous = json.loads(log_file.read_text())
            resumed, wall, ran = previous["resumed_from_step"], previous["wall_s"], round(
                previous["rows_per_s"] * previous["wall_s"] / cfg["batch_size"])
    drafter = export_drafter(cfg, state, draft_config)
    losses = [json.loads(line) for line in (state / "loss.jsonl").read_text().splitlines() if line]
    log = {
        "trainer": "specforge", "trainer_version": version("specforge"), "steps": cfg["steps"],
        "loss": losses, "rows": len(rows), "tokens": sum(len(r[0]) for r in rows), "wall_s": round(wall, 3),
        "rows_per_s": round(ran * cfg["batch_size"] / wall, 3) if wall > 0 else 0.0,
        "resumed_from_step": resumed,
    }
    _atomic_write(Path(cfg["output_dir"]) / "train_log.json", json.dumps(log, indent=1))
    logger.info("drafter written to %s (%d steps, last loss %s)", drafter, cfg["steps"],
                losses[-1][1] if losses else None)
    return log


def _stop(signum: int, _frame: Any) -> None:
    """SIGTERM (a task killed): unwind, so SpecForge's process is stopped with this one."""
    raise EntryError(f"stopped by signal {signum}; rerun with the same config to resume", 128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, type=Path, help="the run's cfg.json (see the module docstring)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _stop)
    try:
        train(load_cfg(args.config))
    except EntryError as e:
        logger.error("%s", e)
        return e.code
    except Exception:  # noqa: BLE001 - any failure: a clear message and a non-zero exit
        logger.exception("training failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
