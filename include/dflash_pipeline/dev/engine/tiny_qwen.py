"""A tiny Qwen3ForCausalLM checkpoint whose weights are designed, not trained, so that a real vLLM
serving it answers like a thinking model: reasoning, ``</think>``, ``\\n\\n``, an answer, ``<|im_end|>``.

Why: nothing can be downloaded here, yet the real-engine tests need a model whose output has the
shape the pipeline must handle (both finish reasons, truncation inside and after the thinking,
thinking on and off), with Qwen's real vocabulary and a Qwen3.6-style chat template, decoded by
the real engine. Written with numpy only (safetensors written by hand: a little-endian u64 header
length, the JSON header, the raw little-endian buffers), so the pipeline's ``.venv`` builds it
without torch.

Architecture: Qwen3ForCausalLM, 1 layer, hidden 64, 2 query heads and 1 KV head of head_dim 64,
MLP 128, vocab 151,936 (Qwen3's), float32, untied ``lm_head``; the tokenizer directory is
``qwen_tokenizer.copy_with_template(dir, "qwen3.6")`` (generation prompt ``<|im_start|>assistant\\n
<think>\\n``; with ``enable_thinking: false`` it ends ``<think>\\n\\n</think>\\n\\n``);
``generation_config.json`` has ``eos_token_id: [151645, 151643]``.

Design (a bigram model that vLLM really runs):

* ``o_proj`` and ``down_proj`` are zero, so attention and the MLP are computed (q/k/v/gate/up
  are small random matrices) but add nothing: the residual stream leaving the layer is the
  current token's embedding, and ``logits = lm_head(RMSNorm(embed(token)))``.
* Every token belongs to one class; its embedding is ``sqrt(64)`` times the one-hot vector of
  its class, so RMSNorm leaves it unchanged (the norm weights are 1). ``lm_head[v, c]`` is
  ``T * log P(v | class c) / 8`` with ``T = 0.6``: at temperature 0.6 the sampler's
  distribution is exactly ``P`` before top-p. Tokens outside a class's support get
  ``P = e^-30``. The rank of the bigram table is the number of classes (12).
* vLLM's top-p drops the smallest tokens whose cumulative probability is <= 1 - top_p (0.05 at
  0.95). Each word class therefore carries a group of rare words whose total mass exceeds 0.05
  and each of which is less likely than the class's end token and word-piece prefix: the cut
  falls inside the rare group, never on ``</think>``'s or ``<|im_end|>``'s path.
  :func:`sampled_distribution` reproduces that rule and :func:`predict` samples the chain.
* Classes: ``\\n`` (198; ends the thinking-on generation prompt) -> a sentence start of
  reasoning mode A (70 %) or B (30 %); A words -> A words, ``.\\n`` (end, 2.2 %) or the
  word-piece `` t`` (1.2 %); B words -> B words, ``.\\n`` (0.6 %) or `` th`` (0.5 %);
  `` t`` -> ``he`` and `` th`` -> ``ink`` (both A resp. B words: `` t`` + ``he`` decodes to
  `` the``, one token in canonical BPE, likewise `` think``: rows holding such a pair are
  not the canonical encoding of their text); ``.\\n`` -> ``</think>`` -> ``\\n\\n`` (271; also
  ends the thinking-off prompt) -> an answer sentence start -> answer words -> ``.`` (3.5 %) ->
  ``<|im_end|>``. Answer words never lead back to reasoning, and no reasoning word leads to
  ``\\n\\n``. Any other token (a prompt's) behaves like an answer word.
* The prompt plays no part beyond its last token (the generation prompt's), so the shape does not
  depend on prompt length; the seed changes everything sampled.

Measured on a real vLLM 0.32.0 (CPU build, ``--dtype float32``), 300 rows per mode, seeds 0..299,
temperature 0.6, top_p 0.95, max_tokens 256 (``python -m dflash_pipeline.dev.engine.measure shape
--rows 300``; the same counts came out of two runs on two server starts):

* thinking on: 275 stop (91.7 %), 16 cut by ``length`` inside the thinking (5.3 %), 9 cut inside
  the answer (3.0 %); reasoning (rows that closed it) 57.8 tokens mean, 35 median, 246 max;
  answer of stopped rows (``\n\n`` to ``<|im_end|>``) 30.0 tokens mean; 98.7 completion tokens
  per row; 104 rows (34.7 %) are not the canonical BPE encoding of their decoded text (a word-piece
  pair). The design's prediction (:func:`predict`, 2,000 rows) is 91.4 % / 6.6 % / 2.1 % and 41 %.
* thinking off: 300 stop, 27.0 tokens mean, every row canonical.

The design is for temperature 0.6 / top_p 0.95 (and any top_k >= 20: vLLM applies the
generation_config's ``top_k: 20`` when a request sends none); other sampling changes the rates.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipeline.dev.engine.safetensors_np import write_safetensors

logger = logging.getLogger(__name__)

ENDOFTEXT, IM_START, IM_END, THINK, THINK_END = 151643, 151644, 151645, 151667, 151668
NEWLINE, DOUBLE_NEWLINE, PERIOD_NEWLINE, PERIOD = 198, 271, 624, 13
VOCAB_SIZE = 151936
TEMPERATURE = 0.6
TOP_P = 0.95
MODEL_NAME = "tiny-qwen3-thinking"

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 128, 2, 1, 64, 1
_UNLIKELY_LOG_P = -30.0

# Words (each one Qwen token: sentence starts bare, the others with their leading space). A class's
# support is at most TOP_K tokens, so vLLM's default top-k (generation_config's 20) cuts nothing.
A_STARTS = ("Okay", "So", "Let", "Alright", "Well")
B_STARTS = ("Hmm", "Wait", "First", "Actually")
A_WORDS = tuple(" " + w for w in "we need to find the answer it is simple just add two".split())
A_RARE = tuple(" " + w for w in "quick sure fine done easy plain".split())
B_WORDS = tuple(" " + w for w in "consider each case carefully maybe there could be another way about".split())
B_RARE = tuple(" " + w for w in "unsure revisit doubt subtle tricky hidden".split())
B_PAUSE = " hmm"  # B's sentence boundary: back to B words, or the end of the thinking
ANSWER_STARTS = ("The", "Answer", "Result", "In", "Yes")
ANSWER_WORDS = tuple(" " + w for w in "value equals final short form correct given above sum total shown brief here".split())
ANSWER_RARE = tuple(" " + w for w in "exact stated known agreed listed noted".split())
A_PIECES = (" t", "he")  # decodes to " the": canonical BPE encodes it as one token
B_PIECES = (" th", "ink")  # decodes to " think": likewise
TOP_K = 20

CLASSES = ("nl", "a", "a_piece", "b", "b_piece", "b_pause", "reason_end", "think_end", "nn", "answer",
           "answer_end", "eos", "other")
"""The states of the bigram model: a token's class decides the distribution of the next token."""


@dataclass(frozen=True)
class Rates:
    """The design's probabilities (before top-k/top-p; see the module docstring)."""

    a_start: float = 0.7  # after "\n": a sentence of mode A (else B)
    a_end: float = 0.022  # A word -> ".\n"
    a_piece: float = 0.01  # A word -> " t"
    b_pause: float = 0.06  # B word -> " hmm"
    b_end: float = 0.1  # " hmm" -> ".\n" (else a B word)
    b_piece: float = 0.01  # B word -> " th"
    answer_end: float = 0.035  # answer word -> "."
    rare_each: float = 0.009  # each rare word (6 per class: 0.054 > 1 - top_p, each below the rates above)


def _zipf(n: int, total: float) -> list[float]:
    w = [1.0 / (i + 3) for i in range(n)]
    s = sum(w)
    return [total * x / s for x in w]


def single_ids(encode: Any, words: Sequence[str]) -> list[int]:
    """The token id of each word, which must be exactly one token."""
    out = []
    for w in words:
        ids = encode(w)
        if len(ids) != 1:
            raise ValueError(f"{w!r} is {len(ids)} tokens {ids}, not one")
        out.append(ids[0])
    return out


@dataclass(frozen=True)
class Design:
    """Token classes and per-class next-token probabilities (before temperature, top-k, top-p)."""

    token_class: dict[int, str]  # tokens not listed are "other"
    next_probs: dict[str, dict[int, float]]
    non_canonical_pairs: tuple[tuple[int, int], ...]

    def class_of(self, token: int) -> str:
        return self.token_class.get(token, "other")


def design(encode: Any, rates: Rates = Rates()) -> Design:
    """The design for a tokenizer's `encode(text) -> ids` (Qwen's BPE: the ids are checked there)."""
    ids = {name: single_ids(encode, words) for name, words in {
        "a_starts": A_STARTS, "b_starts": B_STARTS, "a": A_WORDS, "a_rare": A_RARE, "b": B_WORDS,
        "b_rare": B_RARE, "b_pause": (B_PAUSE,), "ans_starts": ANSWER_STARTS, "ans": ANSWER_WORDS,
        "ans_rare": ANSWER_RARE, "a_pieces": A_PIECES, "b_pieces": B_PIECES}.items()}
    a_prefix, a_suffix = ids["a_pieces"]
    b_prefix, b_suffix = ids["b_pieces"]
    (pause,) = ids["b_pause"]
    for prefix, suffix, text in ((a_prefix, a_suffix, "".join(A_PIECES)), (b_prefix, b_suffix, "".join(B_PIECES))):
        if encode(text) == [prefix, suffix]:
            raise ValueError(f"{text!r} encodes as its two pieces: not a non-canonical pair")
    token_class: dict[int, str] = {NEWLINE: "nl", PERIOD_NEWLINE: "reason_end", THINK_END: "think_end",
                                   DOUBLE_NEWLINE: "nn", PERIOD: "answer_end", IM_END: "eos", a_prefix: "a_piece",
                                   b_prefix: "b_piece", pause: "b_pause"}
    groups = {"a": ids["a_starts"] + ids["a"] + ids["a_rare"] + [a_suffix],
              "b": ids["b_starts"] + ids["b"] + ids["b_rare"] + [b_suffix],
              "answer": ids["ans_starts"] + ids["ans"] + ids["ans_rare"]}
    for cls, members in groups.items():
        for t in members:
            if t in token_class:
                raise ValueError(f"token {t} is in class {token_class[t]!r} and {cls!r}")
            token_class[t] = cls

    def spread(words: list[int], total: float) -> dict[int, float]:
        return dict(zip(words, _zipf(len(words), total), strict=True))

    def rare(words: list[int]) -> dict[int, float]:
        return {t: rates.rare_each for t in words}

    r = rates
    rare_a, rare_b, rare_ans = (len(ids[k]) * r.rare_each for k in ("a_rare", "b_rare", "ans_rare"))
    a_next = {**spread(ids["a"], 1 - r.a_end - r.a_piece - rare_a), **rare(ids["a_rare"]),
              PERIOD_NEWLINE: r.a_end, a_prefix: r.a_piece}
    b_next = {**spread(ids["b"], 1 - r.b_pause - r.b_piece - rare_b), **rare(ids["b_rare"]),
              pause: r.b_pause, b_prefix: r.b_piece}
    answer_next = {**spread(ids["ans"], 1 - r.answer_end - rare_ans), **rare(ids["ans_rare"]), PERIOD: r.answer_end}
    next_probs = {
        "nl": {**spread(ids["a_starts"], r.a_start), **spread(ids["b_starts"], 1 - r.a_start)},
        "a": a_next,
        "a_piece": {a_suffix: 1.0},
        "b": b_next,
        "b_piece": {b_suffix: 1.0},
        "b_pause": {**spread(ids["b"], 1 - r.b_end), PERIOD_NEWLINE: r.b_end},
        "reason_end": {THINK_END: 1.0},
        "think_end": {DOUBLE_NEWLINE: 1.0},
        "nn": spread(ids["ans_starts"], 1.0),
        "answer": answer_next,
        "answer_end": {IM_END: 1.0},
        "eos": {ENDOFTEXT: 1.0},
        "other": answer_next,
    }
    for cls, probs in next_probs.items():
        if abs(sum(probs.values()) - 1.0) > 1e-9:
            raise ValueError(f"class {cls!r}: probabilities sum to {sum(probs.values())}")
        if len(probs) > TOP_K:
            raise ValueError(f"class {cls!r} has {len(probs)} next tokens: top-k {TOP_K} would cut some")
    return Design(token_class, next_probs, ((a_prefix, a_suffix), (b_prefix, b_suffix)))


def sampled_distribution(probs: Mapping[int, float], top_p: float = TOP_P) -> dict[int, float]:
    """What vLLM samples from at temperature T when the logits are `T * log p`: `p` itself, less
    the smallest tokens whose cumulative probability (ascending) is <= 1 - top_p, renormalised
    (vLLM's `apply_top_k_top_p`; top-k 20 keeps all of a class's support, see `design`; tokens
    outside it hold about e^-30 each and are cut first)."""
    order = sorted(probs.items(), key=lambda kv: kv[1])
    outside = (VOCAB_SIZE - len(probs)) * math.exp(_UNLIKELY_LOG_P)
    cum = outside
    kept: dict[int, float] = {}
    for i, (tok, p) in enumerate(order):
        cum += p
        if cum <= 1 - top_p and i < len(order) - 1:
            continue
        kept[tok] = p
    total = sum(kept.values())
    return {t: p / total for t, p in kept.items()}


def logits_table(d: Design, temperature: float = TEMPERATURE) -> np.ndarray:
    """(len(CLASSES), VOCAB_SIZE) float32: the logits after a token of each class."""
    table = np.full((len(CLASSES), VOCAB_SIZE), temperature * _UNLIKELY_LOG_P, dtype=np.float64)
    for ci, cls in enumerate(CLASSES):
        for tok, p in d.next_probs[cls].items():
            table[ci, tok] = temperature * math.log(p)
    return table.astype(np.float32)


def tensors(d: Design, seed: int = 0) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (names as Qwen3ForCausalLM's state dict)."""
    rng = np.random.default_rng(seed)
    scale = math.sqrt(HIDDEN)
    klass = np.full(VOCAB_SIZE, CLASSES.index("other"), dtype=np.int64)
    for tok, cls in d.token_class.items():
        klass[tok] = CLASSES.index(cls)
    embed = np.zeros((VOCAB_SIZE, HIDDEN), dtype=np.float32)
    embed[np.arange(VOCAB_SIZE), klass] = scale
    lm_head = np.zeros((VOCAB_SIZE, HIDDEN), dtype=np.float32)
    lm_head[:, : len(CLASSES)] = logits_table(d).T / scale

    def small(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        out.update({
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "self_attn.q_proj.weight": small(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": small(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": small(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": np.zeros((HIDDEN, HEADS * HEAD_DIM), np.float32),
            p + "self_attn.q_norm.weight": np.ones(HEAD_DIM, np.float32),
            p + "self_attn.k_norm.weight": np.ones(HEAD_DIM, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "mlp.gate_proj.weight": small(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": small(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": np.zeros((HIDDEN, INTERMEDIATE), np.float32),
        })
    out["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    out["lm_head.weight"] = lm_head
    return out


def config() -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "dtype": "float32",
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": LAYERS,
    }


def generation_config() -> dict[str, Any]:
    """As Qwen3's: both end tokens; the sampling the design is made for."""
    return {"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT,
            "do_sample": True, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": 20}


def build_checkpoint(out: Path, tokenizer_source: Path | None = None) -> Path:
    """Write the checkpoint (config, generation config, weights, Qwen BPE with the Qwen3.6-style
    template) into `out`; returns it. `tokenizer_source`: the Qwen BPE directory (default: built
    or found by qwen_tokenizer)."""
    from tokenizers import Tokenizer

    from dflash_pipeline.dev.qwen_tokenizer import copy_with_template

    out = out.expanduser()
    copy_with_template(out, "qwen3.6", source=tokenizer_source)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    d = design(lambda text: tok.encode(text, add_special_tokens=False).ids)
    (out / "config.json").write_text(json.dumps(config(), indent=1))
    (out / "generation_config.json").write_text(json.dumps(generation_config(), indent=1))
    write_safetensors(out / "model.safetensors", tensors(d))
    logger.info("tiny Qwen3 checkpoint written to %s", out)
    return out


@dataclass(frozen=True)
class Row:
    """One sampled completion of the chain (token ids as the engine would return them)."""

    token_ids: list[int]
    finish_reason: str  # "stop" (ended with <|im_end|>, which is in token_ids) or "length"


def predict(d: Design, rows: int, max_tokens: int, thinking: bool = True, seed: int = 0) -> list[Row]:
    """Sample the chain as vLLM would (temperature 0.6, top-p 0.95): the design's expected shape."""
    rng = np.random.default_rng(seed)
    dists = {}
    for cls in CLASSES:
        dist = sampled_distribution(d.next_probs[cls])
        dists[cls] = (np.array(list(dist)), np.cumsum(list(dist.values())))
    out = []
    for _ in range(rows):
        last = NEWLINE if thinking else DOUBLE_NEWLINE
        ids: list[int] = []
        finish = "length"
        while len(ids) < max_tokens:
            toks, cum = dists[d.class_of(last)]
            last = int(toks[min(int(np.searchsorted(cum, rng.random() * cum[-1])), len(toks) - 1)])
            ids.append(last)
            if last in (IM_END, ENDOFTEXT):
                finish = "stop"
                break
        out.append(Row(ids, finish))
    return out


@dataclass(frozen=True)
class Shape:
    """Output statistics of a set of rows generated with thinking on or off.

    `reasoning_tokens`: tokens before `</think>`, over rows that closed their thinking;
    `answer_tokens`: tokens after the thinking (`</think>` excluded; `\n\n`, the answer and
    `<|im_end|>` included; with thinking off, every token), over rows that stopped."""

    rows: int
    stop: int
    length_in_thinking: int
    length_in_answer: int
    non_canonical: int
    reasoning_tokens_mean: float
    reasoning_tokens_median: float
    reasoning_tokens_max: int
    answer_tokens_mean: float
    completion_tokens_mean: float

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def shape(rows: Sequence[Row], encode: Any, decode: Any, thinking: bool = True) -> Shape:
    """Statistics of `rows` (see Shape); a row is non-canonical when re-encoding its decoded text
    (without the final end token) does not give back its ids."""
    reasoning, answer, total = [], [], []
    stop = in_thinking = in_answer = non_canonical = 0
    for row in rows:
        ids = row.token_ids
        total.append(len(ids))
        closed = THINK_END in ids
        if closed:
            reasoning.append(ids.index(THINK_END))
        if row.finish_reason == "stop":
            stop += 1
            answer.append(len(ids) - ids.index(THINK_END) - 1 if closed else len(ids))
        elif thinking and not closed:
            in_thinking += 1
        else:
            in_answer += 1
        body = ids[:-1] if ids and ids[-1] in (IM_END, ENDOFTEXT) else ids
        if encode(decode(body)) != body:
            non_canonical += 1
    return Shape(
        rows=len(rows), stop=stop, length_in_thinking=in_thinking, length_in_answer=in_answer,
        non_canonical=non_canonical,
        reasoning_tokens_mean=float(np.mean(reasoning)) if reasoning else 0.0,
        reasoning_tokens_median=float(np.median(reasoning)) if reasoning else 0.0,
        reasoning_tokens_max=int(max(reasoning, default=0)),
        answer_tokens_mean=float(np.mean(answer)) if answer else 0.0,
        completion_tokens_mean=float(np.mean(total)) if total else 0.0,
    )
