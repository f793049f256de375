"""SpecForge 0.2.0 trains a DFlash drafter on CPU from the files our tokenization writes.

The rows are what ``dflash_tokenize`` makes of generations of the learnable tiny target
(``dev/engine/topic_qwen.py``): its prompts rendered with its chat template, its own sampled completions
(thinking on), a trained ``\\n`` after ``<|im_end|>``, made DFlash-ready and written as the ``specforge``
format by steps/tokenize. ``steps/train/specforge_entry.py`` runs in .venv-trainers (SpecForge's own
offline DFlash route; see its docstring for what runs differently on CPU). Checked: the loss falls, a
run stopped (SIGTERM) after a saved state stops SpecForge with it and resumes from that state with the
same cfg, another cfg in the same output_dir is
refused (exit 3), and the drafter is one vLLM's DFlash path takes (``check_drafter``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.dev.engine import topic_qwen
from dflash_pipeline.dev.engine.dflash_drafter import check_drafter

pytestmark = pytest.mark.slow

ENTRY = Path(__file__).parents[2] / "include" / "dflash_pipeline" / "steps" / "train" / "specforge_entry.py"
ROWS = 24


@pytest.fixture(scope="module")
def setup(qwen_tokenizer: Path, trainers_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sf-train")
    target = topic_qwen.build_checkpoint(tmp / "target", tokenizer_source=qwen_tokenizer)
    files = topic_qwen.specforge_files(target, tmp / "dataset", ROWS)
    assert sum(1 for f in files for _ in f.open()) == ROWS
    cfg = {"target_model": str(target), "train_files": [str(f) for f in files], "output_dir": str(tmp / "run"),
           "steps": 6, "seed": 0, "learning_rate": 1e-3, "batch_size": 4, "max_length": 512, "block_size": 4,
           "num_draft_layers": 1, "save_every": 3}
    return {"tmp": tmp, "target": target, "cfg": cfg, "python": trainers_python}


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp / "hf-home"),
            "TOKENIZERS_PARALLELISM": "false"}


def _run(setup: dict[str, Any], cfg: dict[str, Any], name: str) -> subprocess.CompletedProcess[str]:
    path = setup["tmp"] / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return subprocess.run([str(setup["python"]), str(ENTRY), "--config", str(path)], capture_output=True, text=True,
                          env=_env(setup["tmp"]), timeout=900, check=False)


def _specforge_running(out: Path) -> bool:
    """Whether a process runs SpecForge on this run's config (its command line names it)."""
    needle = str(out / "state" / "specforge.json").encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle in (proc / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def test_trains_resumes_refuses_and_exports(setup: dict[str, Any]) -> None:
    cfg, tmp = setup["cfg"], setup["tmp"]
    out = Path(cfg["output_dir"])
    path = tmp / "cfg.json"
    path.write_text(json.dumps(cfg))
    # First run: stopped (SIGTERM to the entry alone, as a task's kill) once SpecForge has saved step 3.
    proc = subprocess.Popen([str(setup["python"]), str(ENTRY), "--config", str(path)], env=_env(tmp),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    saved = out / "state" / "specforge" / "dflash-step3" / "training_state.pt"
    deadline = time.monotonic() + 600
    while not saved.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert saved.exists(), f"no state saved at step 3 (entry exit {proc.poll()})"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "rerun with the same config to resume" in err
    assert not _specforge_running(out), "SpecForge's process outlived the entry"
    assert not (out / "drafter").exists() and not (out / "train_log.json").exists()

    # Another cfg in the same output_dir: refused before any work.
    refused = _run(setup, {**cfg, "learning_rate": 2e-3}, "other")
    assert refused.returncode == 3, refused.stderr[-3000:]
    assert "another config" in refused.stderr and "learning_rate" in refused.stderr

    # The same cfg on train files whose bytes changed: refused too.
    first = Path(cfg["train_files"][0])
    original = first.read_bytes()
    first.write_bytes(original + original.splitlines(keepends=True)[0])
    changed = _run(setup, cfg, "changed")
    first.write_bytes(original)
    assert changed.returncode == 3 and "train files changed" in changed.stderr, changed.stderr[-3000:]

    # The same cfg: resumes from SpecForge's step-3 checkpoint and finishes.
    done = _run(setup, cfg, "again")
    assert done.returncode == 0, done.stderr[-6000:]
    log = json.loads((out / "train_log.json").read_text())
    assert log["trainer"] == "specforge" and log["trainer_version"] == "0.2.0"
    assert log["resumed_from_step"] == 3 and log["steps"] == 6
    assert [s for s, _ in log["loss"]] == [1, 2, 3, 4, 5, 6]
    losses = [v for _, v in log["loss"]]
    assert losses[-1] < losses[0] - 0.5, losses
    assert log["rows"] == ROWS and log["tokens"] > 0 and log["wall_s"] > 0 and log["rows_per_s"] > 0
    assert check_drafter(out / "drafter", setup["target"]) == []
    drafter = json.loads((out / "drafter" / "config.json").read_text())
    assert drafter["block_size"] == 4 and drafter["num_hidden_layers"] == 1 and drafter["dtype"] == "bfloat16"
    assert drafter["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1]}

    # Done: a rerun of the same cfg trains nothing and leaves the same drafter.
    before = (out / "drafter" / "model.safetensors").read_bytes()
    rerun = _run(setup, cfg, "third")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (out / "drafter" / "model.safetensors").read_bytes() == before


def test_bad_config_is_refused(setup: dict[str, Any]) -> None:
    bad = {**setup["cfg"], "output_dir": str(setup["tmp"] / "bad"), "steps": 0}
    bad.pop("seed")
    proc = _run(setup, bad, "bad")
    assert proc.returncode == 2
    assert "missing key 'seed'" in proc.stderr and "'steps' must be >= 1" not in proc.stderr  # types first
    assert not (setup["tmp"] / "bad").exists()
