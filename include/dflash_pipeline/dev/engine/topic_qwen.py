"""A tiny Qwen3 target a small drafter can learn: peaked, context-dependent text, thinking that lasts.

Why (issue 38): the designed targets so far make poor targets for training a drafter. ``tiny_qwen``'s
sampled text is close to random (its own checkpoint as a perfect drafter accepts 1.06-1.49 at
temperature 0.6), and at temperature 0 one of them closes its thinking at once; ``cycle_qwen`` never
ends and never thinks. Here a perfect drafter accepts most drafts at temperature 0 and 0.6 and an
untrained one almost none, the next token depends on the prompt (not only on the last token), a
``<think>`` block of about a dozen tokens precedes every answer at any temperature, answers end with
``<|im_end|>``, and temperature 0.6 is peaked but not deterministic. Original answers
(:func:`prompt_rows`) follow another order of the same words, as a human or another model would
write them: training on them teaches transitions the target never makes.

Text (Qwen's BPE, every word one token; the Qwen3.6-style template, so thinking on opens ``<think>\\n``
in the prompt):

* thinking: ``Okay let me think about this topic first and then answer it`` (:data:`THINKING`), then
  ``.\\n``, ``</think>``, ``\\n\\n``;
* answer: the **topic's** words (:data:`TOPICS`: the prompt names one of ``animals``, ``colors``,
  ``numbers``, ``fruits``), e.g. ``Dog cat cow pig horse bird fish goat``, then ``.``, ``<|im_end|>``.
  Thinking off (the prompt ends ``</think>\\n\\n``) starts at the answer.

Every step of a sequence goes to the next word with probability ``1 - SKIP`` and skips one word with
``SKIP`` (0.1), both at temperature 0.6 (the skip survives top-p 0.95); the last word goes to the end
mark. So at temperature 0 the text is exactly the sequences (12 thinking words, 8 answer words), and
at 0.6 a drafter that drafts the greedy text is accepted ~0.9 per token.

Design (``tiny_qwen``'s class trick, plus one attention head that carries the topic):

* token classes: each sequence word, ``\\n``, ``\\n\\n``, ``.\\n``, ``</think>``, ``.``, ``<|im_end|>``,
  "other" and each topic word; a class's embedding is ``sqrt(hidden)`` times its basis vector.
* layer 0's attention: every token's query, and only topic words' keys, sit in the slowest RoPE pair
  (so the score does not depend on distance: under 0.01 rad over 4,096 positions); q/k norm weights
  make a topic word's score 40 and every other key's 0, so every position reads the prompt's topic
  word; its value, through ``o_proj``, writes the topic's dimension into the residual stream. The MLP
  and every other layer add nothing (``o_proj``/``down_proj`` zero), so the state after layer ``i >= 0``
  is ``8 e_class + 8 e_topic``: SpecForge's default target layer for one draft layer (``L // 2`` = 1
  of 3) carries both, the token and the prompt's topic.
* ``lm_head``: logit = ``0.6 log P(next | class)`` (class part) plus ``-GAP`` for the other topics'
  answer words (topic part). ``\\n\\n`` (and "other") lead to the first answer word of every topic
  alike: only the topic part picks the prompt's, which is where the drafter needs the context.
  Without a topic word in the prompt the topic part is absent: any topic's answer, and the logits
  are sqrt(2) sharper.

Measured on vLLM 0.32 (CPU build), k 3, 8 requests per cell, max_tokens 64 (``python -m
dflash_pipeline.dev.engine.dflash_measure --target topic --drafters self untrained``): acceptance length
of the target as its own draft model (a perfect, greedily drafting drafter) 4.00 / 3.42 (thinking on,
temperature 0 / 0.6) and 4.00 / 3.38 (off); of an untrained DFlash drafter 1.01 / 1.01 and 1.00 / 1.00.
SpecForge-trained drafters: docs/trainers.md "SpecForge DFlash on CPU".
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipeline.dev.engine import tiny_qwen
from dflash_pipeline.dev.engine.safetensors_np import write_safetensors

logger = logging.getLogger(__name__)

MODEL_NAME = "topic-qwen3"
LAYERS = 3
THINKING = ("Okay",) + tuple(" " + w for w in "let me think about this topic first and then answer it".split())
TOPICS: dict[str, tuple[str, ...]] = {
    "animals": ("Dog",) + tuple(" " + w for w in "cat cow pig horse bird fish goat".split()),
    "colors": ("Red",) + tuple(" " + w for w in "green blue black white brown pink gray".split()),
    "numbers": ("One",) + tuple(" " + w for w in "two three four five six seven eight".split()),
    "fruits": ("Apple",) + tuple(" " + w for w in "pear plum grape lemon peach berry lime".split()),
}
"""Topic (its word in a prompt is `` <topic>``) -> the target's answer words, in order."""
ORIGINAL_ORDER = (0, 5, 2, 7, 4, 1, 6, 3)
"""The original answers' order of a topic's words (the same first word, then another order)."""
SKIP = 0.1
TOPIC_GAP = 40.0
"""How far the topic part lowers another topic's answer words (logits, after the final norm)."""
TOPIC_SCORE = 40.0
"""Attention score of a topic word's key (every other key scores 0)."""
UNLIKELY = -30.0
"""log P of tokens outside a class's support (as tiny_qwen)."""


def _ids(encode: Callable[[str], list[int]], words: Sequence[str]) -> list[int]:
    return tiny_qwen.single_ids(encode, words)


@dataclass(frozen=True)
class Design:
    """Token classes (their hidden dimension) and each class's next-token probabilities."""

    token_dim: dict[int, int]  # listed tokens -> dimension; every other token is "other"
    other_dim: int
    topic_dims: dict[str, int]  # topic -> its dimension (the topic part of the residual)
    topic_tokens: dict[str, int]  # topic -> its prompt word's token id
    next_probs: dict[int, dict[int, float]]  # dimension -> next token -> P at temperature 0.6
    thinking: list[int]
    answers: dict[str, list[int]]

    def dim_of(self, token: int) -> int:
        return self.token_dim.get(token, self.other_dim)

    def greedy(self, topic: str | None, thinking: bool) -> list[int]:
        """The temperature-0 completion (thinking on: the thinking, then the answer)."""
        answer = self.answers[topic] if topic else self.answers[next(iter(self.answers))]
        head = [*self.thinking, tiny_qwen.PERIOD_NEWLINE, tiny_qwen.THINK_END, tiny_qwen.DOUBLE_NEWLINE] \
            if thinking else []
        return head + answer + [tiny_qwen.PERIOD, tiny_qwen.IM_END]


def _chain(words: list[int], end: int) -> dict[int, dict[int, float]]:
    """Word i -> word i+1 (1 - SKIP) or word i+2 (SKIP); the second last skips to `end`, the last goes there."""
    out: dict[int, dict[int, float]] = {}
    seq = words + [end]
    for i, w in enumerate(words):
        nxt, skip = seq[i + 1], seq[i + 2] if i + 2 < len(seq) else None
        out[w] = {nxt: 1.0} if skip is None else {nxt: 1 - SKIP, skip: SKIP}
    return out


def design(encode: Callable[[str], list[int]]) -> Design:
    """The design for a tokenizer's `encode(text) -> ids` (Qwen's BPE: every word must be one token)."""
    thinking = _ids(encode, THINKING)
    answers = {t: _ids(encode, words) for t, words in TOPICS.items()}
    topic_tokens = dict(zip(TOPICS, _ids(encode, [" " + t for t in TOPICS]), strict=True))
    listed = thinking + [w for a in answers.values() for w in a]
    if len(set(listed)) != len(listed) or set(listed) & set(topic_tokens.values()):
        raise ValueError("thinking words, answer words and topic words must be distinct tokens")
    structural = [tiny_qwen.NEWLINE, tiny_qwen.DOUBLE_NEWLINE, tiny_qwen.PERIOD_NEWLINE, tiny_qwen.THINK_END,
                  tiny_qwen.PERIOD, tiny_qwen.IM_END]
    tokens = listed + structural
    token_dim = {t: i for i, t in enumerate(tokens)}
    other_dim = len(tokens)
    topic_dims = {t: other_dim + 1 + i for i, t in enumerate(TOPICS)}
    token_dim.update({tok: topic_dims[t] for t, tok in topic_tokens.items()})  # a topic word's own class
    if max(topic_dims.values()) >= tiny_qwen.HIDDEN:
        raise ValueError(f"{max(topic_dims.values()) + 1} dimensions do not fit hidden size {tiny_qwen.HIDDEN}")
    starts = {a[0]: 1.0 / len(answers) for a in answers.values()}
    by_token: dict[int, dict[int, float]] = {
        tiny_qwen.NEWLINE: {thinking[0]: 1 - SKIP, thinking[1]: SKIP},
        tiny_qwen.DOUBLE_NEWLINE: starts,
        tiny_qwen.PERIOD_NEWLINE: {tiny_qwen.THINK_END: 1.0},
        tiny_qwen.THINK_END: {tiny_qwen.DOUBLE_NEWLINE: 1.0},
        tiny_qwen.PERIOD: {tiny_qwen.IM_END: 1.0},
        tiny_qwen.IM_END: {tiny_qwen.ENDOFTEXT: 1.0},
        **_chain(thinking, tiny_qwen.PERIOD_NEWLINE),
    }
    for a in answers.values():
        by_token.update(_chain(a, tiny_qwen.PERIOD))
    next_probs = {token_dim[t]: p for t, p in by_token.items()}
    next_probs[other_dim] = starts  # a topic word's own dimension is its topic part: no class part
    return Design(token_dim, other_dim, topic_dims, topic_tokens, next_probs, thinking, answers)


def _slowest_component(head_dim: int) -> int:
    """The first component of the slowest RoPE pair (neox layout: pair i is (i, i + head_dim / 2))."""
    return head_dim // 2 - 1


def tensors(d: Design, seed: int = 0) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (Qwen3ForCausalLM's names)."""
    hidden, hd, heads, kv = tiny_qwen.HIDDEN, tiny_qwen.HEAD_DIM, tiny_qwen.HEADS, tiny_qwen.KV_HEADS
    inter = tiny_qwen.INTERMEDIATE
    scale = math.sqrt(hidden)
    vocab = tiny_qwen.VOCAB_SIZE
    dims = np.full(vocab, d.other_dim, dtype=np.int64)
    for tok, dim in d.token_dim.items():
        dims[tok] = dim
    embed = np.zeros((vocab, hidden), np.float32)
    embed[np.arange(vocab), dims] = scale
    # After layer 0 a position holds scale * (e_class + e_topic); the final RMSNorm makes each sqrt(hidden / 2).
    normed = math.sqrt(hidden / 2)
    lm_head = np.zeros((vocab, hidden), np.float32)
    used = sorted(d.next_probs)
    lm_head[:, used] = tiny_qwen.TEMPERATURE * UNLIKELY / normed
    for dim, probs in d.next_probs.items():
        for tok, p in probs.items():
            lm_head[tok, dim] = tiny_qwen.TEMPERATURE * math.log(p) / normed
    for topic, tdim in d.topic_dims.items():
        for other, words in d.answers.items():
            if other != topic:
                lm_head[words, tdim] = -TOPIC_GAP / normed
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    slow = _slowest_component(hd)
    # q/k norm weight w: a normalised one-hot query or key is 8 w at the slowest component; the score
    # (scaled by 1/sqrt(hd)) of a topic key is (8 w)^2 / 8 = 8 w^2.
    w = math.sqrt(TOPIC_SCORE / math.sqrt(hd))
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        q = np.zeros((heads * hd, hidden), np.float32)
        k = np.zeros((kv * hd, hidden), np.float32)
        v = np.zeros((kv * hd, hidden), np.float32)
        o = np.zeros((hidden, heads * hd), np.float32)
        if i == 0:
            for h in range(heads):
                q[h * hd + slow, :] = 1.0  # every class -> the same query
            for t, tdim in d.topic_dims.items():
                k[slow, tdim] = 1.0
                v[tdim, tdim] = 1.0  # value: the topic's dimension (in head space, same index)
                o[tdim, tdim] = 1.0  # head 0 writes it into the residual stream (scale * e_topic)
        else:
            q[:] = rng.standard_normal(q.shape) * 0.02
            k[:] = rng.standard_normal(k.shape) * 0.02
            v[:] = rng.standard_normal(v.shape) * 0.02
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": o,
                    p + "mlp.gate_proj.weight": (rng.standard_normal((inter, hidden)) * 0.02).astype(np.float32),
                    p + "mlp.up_proj.weight": (rng.standard_normal((inter, hidden)) * 0.02).astype(np.float32),
                    p + "mlp.down_proj.weight": np.zeros((hidden, inter), np.float32),
                    p + "input_layernorm.weight": np.ones(hidden, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                    p + "self_attn.q_norm.weight": np.full(hd, w if i == 0 else 1.0, np.float32),
                    p + "self_attn.k_norm.weight": np.full(hd, w if i == 0 else 1.0, np.float32)})
    out["model.norm.weight"] = np.ones(hidden, np.float32)
    out["lm_head.weight"] = lm_head
    return out


def build_checkpoint(out: Path, tokenizer_source: Path | None = None) -> Path:
    """Write the checkpoint (config, generation config, weights, Qwen BPE with the Qwen3.6-style template)."""
    from tokenizers import Tokenizer

    from dflash_pipeline.dev.qwen_tokenizer import copy_with_template

    out = Path(out).expanduser()
    copy_with_template(out, "qwen3.6", source=tokenizer_source)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    d = design(lambda text: tok.encode(text, add_special_tokens=False).ids)
    config = {**tiny_qwen.config(), "num_hidden_layers": LAYERS, "max_window_layers": LAYERS}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(tiny_qwen.generation_config(), indent=1))
    write_safetensors(out / "model.safetensors", tensors(d))
    logger.info("topic Qwen3 checkpoint (%d layers) written to %s", LAYERS, out)
    return out


def answer_text(topic: str, original: bool = False) -> str:
    """A topic's answer as text: the target's greedy answer, or the original answers' order."""
    words = TOPICS[topic]
    order = ORIGINAL_ORDER if original else range(len(words))
    return "".join(words[i] for i in order) + "."


PROMPT_FORMS = ("Tell me about {}.", "Name some {}, please.", "What {} do you know?", "List {} for me.")


def prompt_rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` prompt rows in dflash_generate's OpenAI-chat input format, each naming one topic, with
    its original answer (another order of the topic's words) as the assistant turn."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        topic = list(TOPICS)[i % len(TOPICS)]
        text = rng.choice(PROMPT_FORMS).format(topic)
        rows.append({"id": f"topic-{i:05d}", "messages": [
            {"role": "user", "content": f"Question {i}: {text}"},
            {"role": "assistant", "content": answer_text(topic, original=True)}]})
    return rows


def sampled_distribution(probs: dict[int, float]) -> dict[int, float]:
    """What vLLM samples from at temperature 0.6, top-p 0.95 (tiny_qwen's rule)."""
    return tiny_qwen.sampled_distribution(probs)


def predict(d: Design, topic: str, thinking: bool, max_tokens: int, rng: np.random.Generator) -> list[int]:
    """One completion sampled as vLLM would at temperature 0.6 / top-p 0.95 (a prompt naming `topic`)."""
    last = tiny_qwen.NEWLINE if thinking else tiny_qwen.DOUBLE_NEWLINE
    banned = {w for t, a in d.answers.items() if t != topic for w in a}
    out: list[int] = []
    while len(out) < max_tokens and last not in (tiny_qwen.IM_END, tiny_qwen.ENDOFTEXT):
        probs = {t: p for t, p in d.next_probs[d.dim_of(last)].items() if t not in banned}
        total = sum(probs.values())
        dist = sampled_distribution({t: p / total for t, p in probs.items()})
        toks, ps = list(dist), list(dist.values())
        last = int(toks[rng.choice(len(toks), p=np.array(ps) / sum(ps))])
        out.append(last)
    return out


def specforge_files(target: Path, root: Path, count: int, *, seed: int = 0, max_length: int = 512,
                    original: bool = False, thinking: bool = True) -> list[Path]:
    """``<root>/tokenized/specforge/part-00000N.jsonl`` (N: 0 thinking on, 1 off) for `count` prompts of
    :func:`prompt_rows`, made by the tokenize step's own functions (``dflash_ready``,
    ``build_profile_files``) from rows built as ``dflash_tokenize`` builds them: the prompt as the chat
    template renders it (`thinking` on or off), then the completion, then the template's trained ``\\n``. The completion is the target's own, sampled from
    the design (:func:`predict`, as vLLM samples it at temperature 0.6), or with `original` the row's
    original answer as ``answers: original`` encodes it (the thinking-on template's empty think block,
    then the answer text). For the trainer tests and bench: no engine is started."""
    import pyarrow as pa

    from dflash_pipeline.steps.tokenize.dflash import dflash_ready
    from dflash_pipeline.steps.tokenize.profiles import TRAINING_ROW_SCHEMA, build_profile_files
    from dflash_pipeline.steps.validate.tokencount import load_recounter

    rec = load_recounter(str(target), lambda b, k: None, enable_thinking=thinking, workdir=Path(root) / ".tokenizer")
    tok = rec.tokenizer
    d = design(lambda text: tok.encode(text, add_special_tokens=False).ids)
    newline = tok.encode("\n", add_special_tokens=False).ids
    rng = np.random.default_rng([seed, int(thinking)])
    rows, conversations = [], []
    for prompt_row in prompt_rows(count, seed=seed + (0 if thinking else 1_000_003)):
        user, answer = prompt_row["messages"]
        topic = next(t for t in TOPICS if t in user["content"])
        prompt = rec.render_messages([user], add_generation_prompt=True)
        prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
        if original:
            full = rec.render_messages([user, answer])
            gen = tok.encode(full[len(prompt):-1], add_special_tokens=False).ids
            reply = {"role": "assistant", "content": answer["content"], "reasoning": None}
        else:
            gen = predict(d, topic, thinking, max_length, rng)
            text = tok.decode(gen, skip_special_tokens=False)
            reasoning, _, content = text.partition("</think>") if thinking else ("", "", text)
            reply = {"role": "assistant", "content": content.strip().removesuffix("<|im_end|>"),
                     "reasoning": reasoning.strip() or None}
        conversations.append([{**user, "reasoning": None}, reply])
        ids, mask = prompt_ids + gen + newline, [0] * len(prompt_ids) + [1] * (len(gen) + 1)
        rows.append({"id": prompt_row["id"], "sample": 0, "turn": 0, "key": prompt_row["id"], "input_ids": ids,
                     "loss_mask": mask, "num_tokens": len(ids), "num_loss_tokens": sum(mask),
                     "truncated_to_max_length": False, "finish_reason": "stop",
                     "ids_source": "original" if original else "engine", "thinking": thinking})
    ready = dflash_ready(pa.Table.from_pylist(rows, schema=TRAINING_ROW_SCHEMA), max_length=max_length,
                         min_loss_tokens=2)
    kept = set(ready.table.column("key").to_pylist())
    convs = [c for r, c in zip(rows, conversations, strict=True) if r["key"] in kept]
    written = []
    for key, data in build_profile_files(ready.table, 0 if thinking else 1, ["specforge"], thinking=thinking,
                                         conversations=convs).files.items():
        if key.startswith("tokenized/specforge/"):
            path = Path(root) / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    """``python -m dflash_pipeline.dev.engine.topic_qwen checkpoint DIR`` writes the target;
    ``... prompts FILE [--count N] [--seed S]`` writes a prompt set (dflash_generate's OpenAI-chat JSONL, each
    row with its original answer as the trailing assistant turn: what ``answers: original`` trains on)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.dev.engine.topic_qwen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("checkpoint").add_argument("out", type=Path)
    prompts = sub.add_parser("prompts")
    prompts.add_argument("out", type=Path)
    prompts.add_argument("--count", type=int, default=400)
    prompts.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "checkpoint":
        build_checkpoint(args.out)
    else:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(args.count, args.seed)))
        logger.info("%d prompts with original answers written to %s", args.count, args.out)


if __name__ == "__main__":
    main()
