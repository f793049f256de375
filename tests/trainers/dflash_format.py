"""Run in .venv-trainers by test_dflash_drafter_format.py: SpecForge 0.2.0's own view of a DFlash drafter.

    python dflash_format.py <target_dir> <our_drafter_dir> <specforge_out_dir>

1. Generates the draft config SpecForge's trainer makes for the target (``resolve_draft_config``
   with the dflash algorithm's provider, the mask token resolved as its trainer resolves it),
   builds a fresh ``DFlashDraftModel`` and writes it as ``specforge export --to hf`` does
   (``save_pretrained`` in bfloat16, then ``apply_legacy_rope_scaling``) into <specforge_out_dir>.
2. Loads <our_drafter_dir> with SpecForge: its config through ``load_draft_config_source`` and its
   weights into a ``DFlashDraftModel`` with ``load_state_dict(strict=True)``.

Prints one JSON line: SpecForge's config and weight shapes, and what loading ours found.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from specforge.algorithms.dflash.providers import algorithm_providers
from specforge.export.checkpoint_io import apply_legacy_rope_scaling
from specforge.modeling.auto import AutoDraftModel
from specforge.training.model_loading import load_draft_config_source, resolve_draft_config
from specforge.training.model_utils import resolve_mask_token_id


def specforge_export(target: Path, out: Path) -> None:
    cfg = SimpleNamespace(
        model=SimpleNamespace(target_model_path=str(target), cache_dir=None, trust_remote_code=False,
                              draft_model_config=None, draft_checkpoint_path=None, draft_num_hidden_layers=None,
                              draft_block_size=None),
        training=SimpleNamespace(strategy="dflash"))
    draft_config = resolve_draft_config(cfg, provider=algorithm_providers().model.draft_config)
    model = AutoDraftModel.from_config(draft_config, torch_dtype=torch.bfloat16)
    mask = resolve_mask_token_id(explicit=None, tokenizer=AutoTokenizer.from_pretrained(str(target)),
                                 draft_model=model, embedding_vocab_size=int(draft_config.vocab_size))
    model.config.dflash_config["mask_token_id"] = mask  # as the trainer's _build_dflash_family_model does
    model.save_pretrained(str(out))
    apply_legacy_rope_scaling(str(out))


def main() -> None:
    target, ours, out = (Path(a) for a in sys.argv[1:4])
    specforge_export(target, out)
    exported = load_file(str(out / "model.safetensors"))
    ours_config = load_draft_config_source(str(ours))
    model = AutoDraftModel.from_config(ours_config, torch_dtype=torch.float32)
    weights = load_file(str(ours / "model.safetensors"))
    result = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    print(json.dumps({
        "specforge_config": json.loads((out / "config.json").read_text()),
        "specforge_weights": {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in exported.items()},
        "ours_loaded_as": type(model).__name__,
        "ours_missing": list(result.missing_keys), "ours_unexpected": list(result.unexpected_keys),
        "ours_target_layer_ids": list(model.target_layer_ids), "ours_mask_token_id": model.mask_token_id,
        "ours_block_size": model.block_size,
    }))


if __name__ == "__main__":
    main()
