"""Our untrained DFlash drafter is what SpecForge 0.2.0 itself exports, and SpecForge loads it.

dev/engine/dflash_drafter.build_untrained writes a drafter for a target without torch; the loop serves
it beside drafters SpecForge trained, with the same vLLM settings. tests/trainers/dflash_format.py runs
SpecForge in .venv-trainers: its trainer's draft config for the same target (the dflash provider, its
mask-token rule), a fresh DFlashDraftModel written as ``specforge export --to hf`` writes it, and our
drafter loaded with ``load_draft_config_source`` and ``load_state_dict(strict=True)``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dflash_pipeline.dev.engine import cycle_qwen
from dflash_pipeline.dev.engine.dflash_drafter import build_untrained, read_config
from dflash_pipeline.dev.engine.safetensors_np import read_header

pytestmark = pytest.mark.slow

HELPER = Path(__file__).parent / "dflash_format.py"


def test_untrained_drafter_is_specforge_export(trainers_python: Path, qwen_tokenizer: Path, tmp_path: Path) -> None:
    target = cycle_qwen.build_checkpoint(tmp_path / "target", tokenizer_source=qwen_tokenizer, layers=3)
    ours = build_untrained(target, tmp_path / "ours", seed=1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([str(trainers_python), str(HELPER), str(target), str(ours), str(tmp_path / "specforge")],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])

    # SpecForge loads ours as its DFlash draft, every weight in place, with the settings we wrote
    assert seen["ours_loaded_as"] == "DFlashDraftModel"
    assert seen["ours_missing"] == [] and seen["ours_unexpected"] == []
    assert seen["ours_target_layer_ids"] == [1] and seen["ours_block_size"] == 16
    assert seen["ours_mask_token_id"] == 151669  # Qwen3: the first embedding row the tokenizer leaves unused

    # ... and writes the same files for this target: config (but its transformers version), names, shapes, dtype
    theirs = seen["specforge_config"]
    assert {k: v for k, v in theirs.items() if k != "transformers_version"} == read_config(ours)
    ours_weights = {k: [v["shape"], v["dtype"]] for k, v in read_header(ours / "model.safetensors").items()
                    if k != "__metadata__"}
    assert ours_weights == {k: [shape, {"bfloat16": "BF16"}[dtype]] for k, (shape, dtype)
                            in seen["specforge_weights"].items()}
    assert not any("embed" in k or "lm_head" in k for k in ours_weights)  # the target's are used
