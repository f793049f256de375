"""A tiny Qwen3 checkpoint whose greedy output is a known cycle of words: a target to check drafters against.

Why: the tiny designed target (``tiny_qwen.py``) answers "Okay we we we ..." at temperature 0
(thinking on) and "The value value ..." (thinking off), so nearly any drafter that drafts one
frequent word is accepted at greedy: even a random DFlash drafter was fully accepted on its
thinking-off answers. Whether a drafter's tokens are really used, position by position, shows only
on a target whose greedy continuation changes at every step. Here every generated token is one of
``N`` words and the next is always the word after it in a fixed cycle, so the greedy text is known
in advance, and a drafter that drafts the wrong offset or ignores the bonus token is never accepted.

Design (as ``tiny_qwen``: the layers compute but add nothing, ``o_proj`` and ``down_proj`` are zero,
so ``logits = lm_head(RMSNorm(embed(token)))``): token classes are the ``N`` cycle words (one class
each), ``\\n`` (the thinking-on generation prompt's last token), ``\\n\\n`` (thinking off's) and
"other" (every other token); a class's embedding is ``sqrt(hidden)`` times its basis vector, and
``lm_head`` gives the next token a logit 18 above every other (probability 1 - 2.3e-3 at
temperature 1 over the vocabulary). Word j is followed by word j+1 (mod N); ``\\n`` and "other"
by word 0, ``\\n\\n`` by word N/2. No end token is ever likely: every answer runs to ``max_tokens``.
``layers`` is free (3 by default, so a one-layer drafter's target layer, SpecForge's ``L // 2``, is
not the last one). Qwen's vocabulary and the Qwen3.6-style chat template, as the tiny target's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipeline.dev.engine import tiny_qwen
from dflash_pipeline.dev.engine.safetensors_np import write_safetensors

logger = logging.getLogger(__name__)

WORDS = tuple(" " + w for w in (
    "one two three four five six seven eight nine ten red green blue black white brown cat dog cow pig "
    "horse bird fish tree leaf root stone sand rain snow wind fire water earth moon star sun sky cloud "
    "river lake sea hill road town city house door"
).split())
"""The cycle, in order (each one Qwen token)."""
MODEL_NAME = "cycle-qwen3"
NEXT_LOGIT_GAP = 18.0


def classes(encode: Any) -> tuple[dict[int, int], dict[int, int], int]:
    """(token -> class dimension for the listed tokens, class dimension -> next token, "other"'s dimension)."""
    words = tiny_qwen.single_ids(encode, WORDS)
    n = len(words)
    token_class = {tok: j for j, tok in enumerate(words)}
    token_class[tiny_qwen.NEWLINE] = n
    token_class[tiny_qwen.DOUBLE_NEWLINE] = n + 1
    other = n + 2
    following = {j: words[(j + 1) % n] for j in range(n)}
    following.update({n: words[0], n + 1: words[n // 2], other: words[0]})
    return token_class, following, other


def word_ids(checkpoint: Path) -> list[int]:
    """The cycle's token ids, in order, with the checkpoint's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    return tiny_qwen.single_ids(lambda text: tok.encode(text, add_special_tokens=False).ids, WORDS)


def tensors(encode: Any, layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (Qwen3ForCausalLM's names)."""
    hidden = tiny_qwen.HIDDEN
    token_class, following, other = classes(encode)
    if other >= hidden - 1:
        raise ValueError(f"{other + 1} classes do not fit a hidden size of {hidden} with one dimension to spare")
    scale = np.sqrt(hidden)
    klass = np.full(tiny_qwen.VOCAB_SIZE, other, dtype=np.int64)
    for tok, c in token_class.items():
        klass[tok] = c
    embed = np.zeros((tiny_qwen.VOCAB_SIZE, hidden), np.float32)
    embed[np.arange(tiny_qwen.VOCAB_SIZE), klass] = scale
    lm_head = np.zeros((tiny_qwen.VOCAB_SIZE, hidden), np.float32)
    lm_head[:, : other + 1] = -NEXT_LOGIT_GAP / scale
    for c, tok in following.items():
        lm_head[tok, c] = 0.0
    rng = np.random.default_rng(seed)
    h, q, kv, inter = hidden, tiny_qwen.HEADS * tiny_qwen.HEAD_DIM, tiny_qwen.KV_HEADS * tiny_qwen.HEAD_DIM, \
        tiny_qwen.INTERMEDIATE
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    for i in range(layers):
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h)}
        p = f"model.layers.{i}."
        out.update({p + n + ".weight": (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s in shapes.items()})
        out.update({p + "self_attn.o_proj.weight": np.zeros((h, q), np.float32),
                    p + "mlp.down_proj.weight": np.zeros((h, inter), np.float32)})
        out.update({p + n + ".weight": np.ones(d, np.float32) for n, d in (
            ("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm", tiny_qwen.HEAD_DIM),
            ("self_attn.k_norm", tiny_qwen.HEAD_DIM))})
    out["model.norm.weight"] = np.ones(h, np.float32)
    out["lm_head.weight"] = lm_head
    return out


def build_checkpoint(out: Path, tokenizer_source: Path | None = None, layers: int = 3) -> Path:
    """Write the checkpoint (config, generation config, weights, Qwen BPE with the Qwen3.6-style
    template) into `out`; returns it."""
    from tokenizers import Tokenizer

    from dflash_pipeline.dev.qwen_tokenizer import copy_with_template

    out = out.expanduser()
    copy_with_template(out, "qwen3.6", source=tokenizer_source)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    config = {**tiny_qwen.config(), "num_hidden_layers": layers, "max_window_layers": layers}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(tiny_qwen.generation_config(), indent=1))
    write_safetensors(out / "model.safetensors", tensors(encode, layers))
    logger.info("cycle Qwen3 checkpoint (%d layers) written to %s", layers, out)
    return out
