"""DFlash drafter checkpoints in the format SpecForge 0.2.0 saves, for any Qwen3 target directory.

Why: the loop that proves our data makes a better drafter serves three kinds of drafter through
vLLM's DFlash path with the same settings: untrained (here, :func:`build_untrained`), trained by
SpecForge, and designed with a known answer (:func:`build_oracle`, for the engine tests). So the
untrained and designed ones are written exactly as SpecForge writes a trained one.

What SpecForge 0.2.0 writes (read in ``specforge/modeling/draft/dflash.py``,
``algorithms/model_providers.py`` and ``export/``): training keeps only ``training_state.pt``;
``specforge export --to hf`` turns it into a model directory with ``DFlashDraftModel.save_pretrained``
(then ``apply_legacy_rope_scaling``):

* ``config.json``: a Qwen3 config (``model_type`` ``qwen3``, ``architectures``
  ``["DFlashDraftModel"]``) whose architecture fields are copied from the target (hidden size,
  heads, KV heads, head_dim, intermediate size, vocab, RoPE, norms, token ids), plus
  ``num_hidden_layers`` (1 by default), ``num_target_layers``, ``block_size`` (16),
  ``layer_types`` (``full_attention`` each), ``dflash_config`` with ``target_layer_ids`` and
  ``mask_token_id``, ``draft_vocab_size``, ``tie_word_embeddings: false``, ``dtype``
  (``bfloat16``), ``rope_parameters`` and the legacy top-level ``rope_theta``.
* ``model.safetensors``: ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``…q_norm/k_norm``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm``,
  ``norm``, ``fc`` (``len(target_layer_ids) * hidden`` -> ``hidden``) and ``hidden_norm``;
  **no embedding and no lm_head**: the drafter uses the target's (SpecForge trains with the
  target's frozen ones; vLLM shares them, "Detected EAGLE model without its own embed_tokens /
  lm_head ... Sharing target model ... weights").
* ``mask_token_id`` is written only if the draft config the export is given has it (the trainer
  resolves it in memory: the tokenizer's mask token, else the first unused embedding row,
  ``len(tokenizer)``: 151,669 for Qwen3). vLLM refuses a DFlash drafter without it.
* ``target_layer_ids`` (SpecForge's default: ``[L // 2]`` for one draft layer) name target layers
  whose outputs feed ``fc``. vLLM reads layer ``i`` as its aux hidden state ``i + 1`` (the
  residual stream after layer ``i``). For the target's last layer the two differ: Hugging Face's
  last hidden state (what SpecForge trains on) is after the final norm, vLLM's is before it;
  ``hidden_norm`` after ``fc`` hides the difference only when the final norm's weights are all one.

:func:`check_drafter` states what vLLM needs of a drafter against its target, before a server
is started.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipeline.dev.engine.safetensors_np import Bf16, read_header, read_tensor, to_bf16, write_safetensors

logger = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"
DEFAULT_BLOCK_SIZE = 16
TARGET_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "max_position_embeddings", "rms_norm_eps", "hidden_act", "attention_bias", "attention_dropout",
    "head_dim", "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id", "pad_token_id",
    "sliding_window", "use_sliding_window", "max_window_layers",
)
"""The target config fields SpecForge copies into a generated draft config (its whitelist)."""
QWEN3_DEFAULTS: dict[str, Any] = {"initializer_range": 0.02, "attention_bias": False, "attention_dropout": 0.0,
                                  "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 1000000.0}
"""transformers' Qwen3Config defaults, which its save_pretrained writes when the target leaves them out."""
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM 0.32's CPU attention backend takes (``CPUAttentionBackend.get_supported_head_sizes``)."""
QWEN3_HEAD_DIM = 128
"""transformers' Qwen3Config default ``head_dim`` (not hidden / heads): what vLLM and SpecForge build
when a Qwen3 config leaves it out."""


def read_config(directory: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((Path(directory) / "config.json").read_text())
    return config


def target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SpecForge's default target layers for a draft of `num_draft_layers`: the middle layer for
    one, else spread evenly from layer 1 to layer L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def resolve_mask_token_id(target_dir: Path, vocab_size: int) -> int:
    """The mask token SpecForge's trainer picks for this target: the tokenizer's mask token, else the
    first embedding row the tokenizer does not use (``len(tokenizer)``), else pad, eos, unk."""
    from tokenizers import Tokenizer

    tok_file = Path(target_dir) / "tokenizer.json"
    tok_config_file = Path(target_dir) / "tokenizer_config.json"
    tok_config = json.loads(tok_config_file.read_text()) if tok_config_file.exists() else {}
    tok = Tokenizer.from_file(str(tok_file))

    def token_id(field: str) -> int | None:
        value = tok_config.get(field)
        content = value.get("content") if isinstance(value, dict) else value
        return None if content is None else tok.token_to_id(content)

    size = tok.get_vocab_size(with_added_tokens=True)
    for candidate in (token_id("mask_token"), size if size < vocab_size else None, token_id("pad_token"),
                      token_id("eos_token"), token_id("unk_token")):
        if candidate is not None and 0 <= candidate < vocab_size:
            return candidate
    raise ValueError(f"no mask token id within the vocabulary [0, {vocab_size}) for {target_dir}")


def drafter_config(target: Mapping[str, Any], *, mask_token_id: int, layers: int = 1,
                   block_size: int = DEFAULT_BLOCK_SIZE, layer_ids: list[int] | None = None,
                   dtype: str = "bfloat16", **overrides: Any) -> dict[str, Any]:
    """The ``config.json`` SpecForge's export writes for a DFlash draft of `target` (its config dict)."""
    cfg: dict[str, Any] = dict(QWEN3_DEFAULTS)
    cfg.update({k: target[k] for k in TARGET_FIELDS if target.get(k) is not None})
    cfg.setdefault("head_dim", QWEN3_HEAD_DIM)
    cfg.update(overrides)
    rope = {"rope_theta": cfg["rope_theta"], "rope_type": "default"}
    if cfg.get("rope_scaling"):
        rope.update({k: v for k, v in cfg["rope_scaling"].items() if k != "type"})
        rope["rope_type"] = cfg["rope_scaling"].get("rope_type") or cfg["rope_scaling"].get("type")
    ids = layer_ids if layer_ids is not None else target_layer_ids(int(target["num_hidden_layers"]), layers)
    cfg.update({
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": layers,
        "num_target_layers": int(target["num_hidden_layers"]),
        "block_size": block_size,
        "layer_types": ["full_attention"] * layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(ids)},
        "draft_vocab_size": cfg["vocab_size"],
        "tie_word_embeddings": False,
        "use_cache": True,
        "pad_token_id": 0 if cfg.get("pad_token_id") is None else cfg["pad_token_id"],
        "rope_parameters": rope,
        "dtype": dtype,
    })
    return dict(sorted(cfg.items()))


def head_dim(cfg: Mapping[str, Any]) -> int:
    """The attention head size as vLLM and SpecForge build it: ``head_dim``, else Qwen3Config's default."""
    return int(cfg.get("head_dim") or QWEN3_HEAD_DIM)


def weight_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DFlash drafter and its shape (``DFlashDraftModel``'s state dict)."""
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, inter = head_dim(cfg), cfg["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * hd, hidden),
            p + "self_attn.k_proj.weight": (kv * hd, hidden),
            p + "self_attn.v_proj.weight": (kv * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    shapes["norm.weight"] = (hidden,)
    shapes["fc.weight"] = (hidden, len(cfg["dflash_config"]["target_layer_ids"]) * hidden)
    shapes["hidden_norm.weight"] = (hidden,)
    return shapes


def untrained_tensors(cfg: Mapping[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """SpecForge's initialisation (transformers' ``_init_weights`` for Qwen3): every linear weight
    normal(0, initializer_range), every norm weight one; seeded."""
    rng = np.random.default_rng(seed)
    std = float(cfg.get("initializer_range", 0.02))
    return {name: np.ones(shape, np.float32) if len(shape) == 1
            else (rng.standard_normal(shape) * std).astype(np.float32)
            for name, shape in weight_shapes(cfg).items()}


def write_drafter(out: Path, cfg: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Path:
    """Write a drafter directory (config.json, model.safetensors in the config's ``dtype``)."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    expected = weight_shapes(cfg)
    if {k: tuple(v.shape) for k, v in tensors.items()} != expected:
        raise ValueError(f"tensors do not match the config's shapes: {sorted(set(tensors) ^ set(expected))}")
    named: dict[str, np.ndarray | Bf16] = {k: to_bf16(v) if cfg["dtype"] == "bfloat16" else v.astype(np.float32)
                                           for k, v in sorted(tensors.items())}
    write_safetensors(out / "model.safetensors", named)
    (out / "config.json").write_text(json.dumps(dict(cfg), indent=2, sort_keys=True) + "\n")
    return out


def build_untrained(target_dir: Path, out: Path, *, layers: int = 1, block_size: int = DEFAULT_BLOCK_SIZE,
                    seed: int = 0, dtype: str = "bfloat16") -> Path:
    """An untrained (seeded random) DFlash drafter for the Qwen3 checkpoint at `target_dir`, as
    SpecForge would export it before its first step; returns `out`."""
    target = read_config(target_dir)
    cfg = drafter_config(target, mask_token_id=resolve_mask_token_id(target_dir, target["vocab_size"]),
                         layers=layers, block_size=block_size, dtype=dtype)
    write_drafter(out, cfg, untrained_tensors(cfg, seed))
    logger.info("untrained DFlash drafter (%d layer(s), block %d, seed %d) for %s written to %s",
                layers, block_size, seed, target_dir, out)
    return Path(out)


def check_drafter(drafter_dir: Path, target_dir: Path) -> list[str]:
    """What keeps vLLM 0.32 from serving `drafter_dir` as a DFlash drafter of `target_dir` (empty: nothing)."""
    problems: list[str] = []
    try:
        cfg, target = read_config(drafter_dir), read_config(target_dir)
    except (OSError, ValueError) as e:
        return [f"cannot read config.json: {e}"]
    if cfg.get("architectures") != [ARCHITECTURE]:
        problems.append(f"architectures is {cfg.get('architectures')}, not [{ARCHITECTURE!r}]")
    dflash = cfg.get("dflash_config") or {}
    mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
    if not isinstance(mask, int) or not 0 <= mask < target.get("vocab_size", 0):
        problems.append(f"dflash_config.mask_token_id is {mask!r}: vLLM needs a token id of the target's vocabulary "
                        f"(SpecForge writes it only if the draft config given to the export has it)")
    ids = dflash.get("target_layer_ids")
    layers = target.get("num_hidden_layers", 0)
    if not ids or any(not isinstance(i, int) or not 0 <= i < layers for i in ids):
        problems.append(f"dflash_config.target_layer_ids {ids!r} must name layers of the target (0..{layers - 1})")
    for key in ("hidden_size", "vocab_size"):
        if cfg.get(key) != target.get(key):
            problems.append(f"{key} {cfg.get(key)} differs from the target's {target.get(key)} "
                            "(the drafter uses the target's embedding and lm_head)")
    if head_dim(cfg) not in CPU_HEAD_SIZES:
        problems.append(f"head size {head_dim(cfg)} is not one vLLM's CPU attention takes {CPU_HEAD_SIZES}")
    if problems:
        return problems
    weights = Path(drafter_dir) / "model.safetensors"
    if not weights.exists():
        return [f"{weights} not found (a sharded drafter is not checked here)"]
    header = {k: tuple(v["shape"]) for k, v in read_header(weights).items() if k != "__metadata__"}
    expected = weight_shapes(cfg)
    for name in sorted(set(expected) - set(header)):
        problems.append(f"missing weight {name}")
    for name in sorted(set(header) - set(expected)):
        problems.append(f"unexpected weight {name} (vLLM would refuse or ignore it)")
    for name in sorted(set(header) & set(expected)):
        if header[name] != expected[name]:
            problems.append(f"{name} has shape {list(header[name])}, the config implies {list(expected[name])}")
    return problems


def block_size(drafter_dir: Path) -> int:
    """The draft block a DFlash drafter was trained with (bonus token + drafts): ``block_size``."""
    return int(read_config(drafter_dir).get("block_size", DEFAULT_BLOCK_SIZE))


# --- a designed drafter with a known answer --------------------------------------------------------

@dataclass(frozen=True)
class ClassTarget:
    """What a designed target's weights say (see :func:`read_class_target`): each token's class
    (its embedding is a positive multiple of one basis vector, the class's dimension), and the
    target's greedy next token after a token of each class."""

    token_class: np.ndarray  # (vocab,) class dimension of each token
    greedy_next: dict[int, int]  # class dimension -> greedy next token id
    free_dims: tuple[int, ...]  # hidden dimensions no token's embedding uses

    def next_token(self, token: int) -> int:
        return self.greedy_next[int(self.token_class[token])]

    def chain(self, token: int, steps: int) -> list[int]:
        """`token` followed by `steps` greedy tokens."""
        out = [token]
        for _ in range(steps):
            out.append(self.next_token(out[-1]))
        return out


def read_class_target(target_dir: Path) -> ClassTarget:
    """Read a designed target (as ``dev/engine/tiny_qwen.py`` builds them): every layer adds nothing
    (``o_proj`` and ``down_proj`` zero) and the final norm is one, so the logits after a token are
    ``lm_head`` times its embedding, which is a multiple of one basis vector. Refuses other checkpoints."""
    cfg = read_config(target_dir)
    weights = Path(target_dir) / "model.safetensors"
    for i in range(cfg["num_hidden_layers"]):
        for name in (f"model.layers.{i}.self_attn.o_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"):
            if np.any(read_tensor(weights, name)):
                raise ValueError(f"{target_dir}: {name} is not zero: not a designed class target")
    if np.any(read_tensor(weights, "model.norm.weight") != 1):
        raise ValueError(f"{target_dir}: model.norm.weight is not all one: not a designed class target")
    embed = read_tensor(weights, "model.embed_tokens.weight")
    token_class = np.argmax(embed, axis=1)
    if np.any(np.count_nonzero(embed, axis=1) != 1) or np.any(embed[np.arange(len(embed)), token_class] <= 0):
        raise ValueError(f"{target_dir}: embeddings are not positive multiples of basis vectors")
    lm_head = read_tensor(weights, "lm_head.weight")
    used = sorted(set(int(c) for c in np.unique(token_class)))
    greedy = {c: int(np.argmax(lm_head[:, c])) for c in used}
    return ClassTarget(token_class, greedy, tuple(d for d in range(embed.shape[1]) if d not in used))


def _rope_inv_freq(size: int, theta: float) -> np.ndarray:
    """RoPE's angular frequency of each rotated pair (transformers' and vLLM's default RoPE)."""
    return 1.0 / (theta ** (np.arange(0, size, 2, dtype=np.float64) / size))


ORACLE_PAIRS = 8
"""RoPE frequency pairs the oracle's position-selecting heads use (the eight fastest)."""
ORACLE_NORM_WEIGHT = 6.0
"""q/k norm weight: the selected key scores 36 x 8 = 288, its neighbours about 29 less (e^-29)."""
ORACLE_GAIN = 50.0
"""o_proj gain: the drafted class outweighs the mask token's own embedding 50 to 1."""


def oracle_tensors(target: ClassTarget, cfg: Mapping[str, Any], k: int, wrong_classes: frozenset[int],
                   mask_class: int) -> dict[str, np.ndarray]:
    """A 1-layer DFlash drafter that drafts the target's greedy continuation of the bonus token.

    vLLM's DFlash step queries the bonus token (position p) and k mask tokens (p+1..p+k) at once,
    non-causally, over the context keys (positions < p, from the target's hidden states) and the
    block. Head h (of k, each with its own KV head) selects the key at distance h by position
    alone: every key is the same vector, and the mask token's query for head h is that key
    rotated back by h positions in the eight fastest RoPE pairs, so its score peaks at distance h
    (by 29 over any other distance up to 4,200). At mask offset i, head i therefore reads the
    bonus token; the others read mask tokens or context, whose values are zero. Head h's value
    maps a token's class c to the class of the (h-1)-th greedy token after it, so offset i holds
    the class of the (i-1)-th greedy token after the bonus and the target's own lm_head drafts the
    i-th. Classes in `wrong_classes` map one greedy step too far instead (a known miss at offset 1).
    """
    hidden, hd = cfg["hidden_size"], head_dim(cfg)
    if hidden > hd:
        raise ValueError(f"hidden size {hidden} exceeds the head size {hd}: the oracle keeps classes in one head")
    ctx_dim = target.free_dims[-1]
    t = {name: np.zeros(shape, np.float32) for name, shape in weight_shapes(cfg).items()}
    for name in ("layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight", "norm.weight",
                 "hidden_norm.weight"):
        t[name][:] = 1.0
    t["layers.0.self_attn.q_norm.weight"][:] = ORACLE_NORM_WEIGHT
    t["layers.0.self_attn.k_norm.weight"][:] = ORACLE_NORM_WEIGHT
    t["fc.weight"][ctx_dim, :] = 1.0  # every context state -> the context dimension
    inv_freq = _rope_inv_freq(hd, float(cfg["rope_theta"]))
    half = hd // 2
    classes = sorted(target.greedy_next)

    def after(c: int, steps: int) -> int:
        for _ in range(steps):
            c = int(target.token_class[target.greedy_next[c]])
        return c

    for h in range(1, k + 1):
        rows = slice((h - 1) * hd, h * hd)
        key = np.zeros(hd)
        key[:ORACLE_PAIRS] = 1.0  # (x1, x2) = (1, 0) in each selecting pair
        for c in classes + [ctx_dim]:
            t["layers.0.self_attn.k_proj.weight"][rows, c] = key
        query = np.zeros(hd)
        angle = inv_freq[:ORACLE_PAIRS] * h
        query[:ORACLE_PAIRS], query[half:half + ORACLE_PAIRS] = np.cos(angle), -np.sin(angle)
        t["layers.0.self_attn.q_proj.weight"][rows, mask_class] = query
        for c in classes:
            t["layers.0.self_attn.o_proj.weight"][c, (h - 1) * hd + c] = ORACLE_GAIN
            if c != mask_class:
                drafted = after(c, h if c in wrong_classes else h - 1)
                t["layers.0.self_attn.v_proj.weight"][(h - 1) * hd + drafted, c] = 1.0
    return t


def build_oracle(target_dir: Path, out: Path, *, k: int = 3, wrong_tokens: tuple[int, ...] = ()) -> Path:
    """A DFlash drafter that drafts exactly the greedy continuation of a designed class target
    (:func:`read_class_target`), except after a token whose class is one of `wrong_tokens`'
    (then its first draft is wrong): at temperature 0 each step accepts a number of drafts known
    in advance (:func:`oracle_accepts`). Same format and settings as any SpecForge drafter."""
    target_cfg = read_config(target_dir)
    target = read_class_target(target_dir)
    mask = resolve_mask_token_id(target_dir, target_cfg["vocab_size"])
    hd = target_cfg["hidden_size"]
    if hd not in CPU_HEAD_SIZES or not target.free_dims:
        raise ValueError(f"{target_dir}: the oracle needs a hidden size in {CPU_HEAD_SIZES} with a dimension no "
                         "class uses")
    cfg = drafter_config(target_cfg, mask_token_id=mask, block_size=k + 1, dtype="float32",
                         num_attention_heads=k, num_key_value_heads=k, head_dim=hd, intermediate_size=8)
    wrong = frozenset(int(target.token_class[t]) for t in wrong_tokens)
    tensors = oracle_tensors(target, cfg, k, wrong, int(target.token_class[mask]))
    write_drafter(out, cfg, tensors)
    logger.info("oracle DFlash drafter (k %d, wrong after %s) for %s written to %s", k, sorted(wrong), target_dir, out)
    return Path(out)


def oracle_accepts(target: ClassTarget, first_token: int, completion_tokens: int, k: int,
                   wrong_tokens: tuple[int, ...] = ()) -> list[int]:
    """The draft tokens accepted at each verify step of a greedy request whose first generated token
    is `first_token`, served with :func:`build_oracle`'s drafter, until `completion_tokens` tokens
    exist: all k, or 0 after a token of a wrong class (its first draft misses)."""
    wrong = {int(target.token_class[t]) for t in wrong_tokens}
    accepted: list[int] = []
    generated, token = 1, first_token
    while generated < completion_tokens:
        a = 0 if int(target.token_class[token]) in wrong else k
        accepted.append(a)
        token = target.chain(token, a + 1)[-1]
        generated += a + 1
    return accepted


def expected_histogram(accepted: list[int], k: int) -> list[int]:
    """vLLM's ``acceptance_histogram`` of those steps (index j: steps that accepted j drafts)."""
    return [sum(1 for a in accepted if a == j) for j in range(k + 1)]
