"""The learnable tiny target's design (dev/engine/topic_qwen.py): what its weights compute, by numpy.

Layer 0 is run here as Qwen3 runs it (RMSNorm, q/k/v, per-head q/k RMSNorm, neox RoPE, causal
softmax, o_proj); the other layers add nothing by construction (o_proj, down_proj zero, checked).
vLLM runs the checkpoint in tests/engine/test_topic_target.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash_pipeline.dev.engine import tiny_qwen, topic_qwen

HD = tiny_qwen.HEAD_DIM


@pytest.fixture(scope="module")
def built(qwen_tokenizer: Path) -> tuple[Any, Any, dict[str, np.ndarray]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(qwen_tokenizer / "tokenizer.json"))
    d = topic_qwen.design(lambda text: tok.encode(text, add_special_tokens=False).ids)
    return tok, d, topic_qwen.tensors(d)


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def _rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    inv = 1.0 / (1e6 ** (np.arange(0, HD, 2) / HD))
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)
    rot = np.concatenate([-x[..., HD // 2:], x[..., :HD // 2]], -1)
    return x * cos + rot * sin


def _logits_last(t: dict[str, np.ndarray], ids: list[int], offset: int = 0) -> np.ndarray:
    """The target's logits after `ids` (positions from `offset`)."""
    x = t["model.embed_tokens.weight"][ids].astype(np.float64)
    p = "model.layers.0."
    h = _rms(x, t[p + "input_layernorm.weight"])
    q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(len(ids), tiny_qwen.HEADS, HD)
    k = (h @ t[p + "self_attn.k_proj.weight"].T).reshape(len(ids), tiny_qwen.KV_HEADS, HD)
    v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(len(ids), tiny_qwen.KV_HEADS, HD)
    pos = np.arange(offset, offset + len(ids), dtype=np.float64)
    q = _rope(_rms(q, t[p + "self_attn.q_norm.weight"]).transpose(1, 0, 2), pos)
    k = _rope(_rms(k, t[p + "self_attn.k_norm.weight"]).transpose(1, 0, 2), pos)
    scores = q[:, -1:, :] @ k[0].T[None] / math.sqrt(HD)  # the last query, every key (causal: all before it)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    heads = (w @ v.transpose(1, 0, 2)[0][None])[:, 0, :].reshape(-1)
    x_last = x[-1] + heads @ t[p + "self_attn.o_proj.weight"].T
    for i in range(topic_qwen.LAYERS):
        assert not t[f"model.layers.{i}.mlp.down_proj.weight"].any()
        if i:
            assert not t[f"model.layers.{i}.self_attn.o_proj.weight"].any()
    return np.asarray(_rms(x_last, t["model.norm.weight"]) @ t["lm_head.weight"].T.astype(np.float64))


def _prompt(tok: Any, text: str, thinking: bool) -> list[int]:
    tail = "<think>\n" if thinking else "<think>\n\n</think>\n\n"
    ids: list[int] = tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n{tail}",
                                add_special_tokens=False).ids
    return ids


@pytest.mark.parametrize("topic", list(topic_qwen.TOPICS))
@pytest.mark.parametrize("thinking", [True, False])
def test_greedy_text_follows_the_prompts_topic(built: Any, topic: str, thinking: bool) -> None:
    tok, d, t = built
    ids = _prompt(tok, f"Question 3: Tell me about {topic}.", thinking)
    expected = d.greedy(topic, thinking)
    out: list[int] = []
    for want in expected:
        logits = _logits_last(t, ids + out, offset=0)
        probs = np.exp((logits - logits.max()) / tiny_qwen.TEMPERATURE)
        probs /= probs.sum()
        assert int(np.argmax(logits)) == want, (tok.decode(out), tok.decode([int(np.argmax(logits))]))
        assert 0.89 < probs.max() <= 1.0
        out.append(want)
    text = tok.decode(out, skip_special_tokens=False)
    assert text.endswith(topic_qwen.answer_text(topic) + "<|im_end|>")
    assert ("</think>" in text) == thinking and (text.startswith("Okay let me think") == thinking)


def test_peaked_not_deterministic_and_far_positions(built: Any) -> None:
    """At temperature 0.6 the greedy word is 0.9 likely inside a sequence, the skip 0.1; the topic word is
    read the same 4,000 positions later."""
    tok, d, t = built
    ids = _prompt(tok, "Question 5: Tell me about colors.", False) + d.answers["colors"][:3]
    for offset in (0, 4000):
        logits = _logits_last(t, ids, offset=offset)
        probs = np.exp((logits - logits.max()) / tiny_qwen.TEMPERATURE)
        probs /= probs.sum()
        top = np.argsort(probs)[::-1][:3]
        assert list(top[:2]) == [d.answers["colors"][3], d.answers["colors"][4]]
        assert probs[top[0]] == pytest.approx(0.9, abs=1e-3) and probs[top[1]] == pytest.approx(0.1, abs=1e-3)
        assert probs[top[2]] < 1e-6


def test_sampled_rows_think_then_answer_and_end(built: Any) -> None:
    tok, d, _ = built
    rng = np.random.default_rng(1)
    rows = [topic_qwen.predict(d, topic, True, 256, rng) for topic in list(topic_qwen.TOPICS) * 50]
    think_len = [r.index(tiny_qwen.THINK_END) for r in rows]
    assert all(r[-1] == tiny_qwen.IM_END for r in rows)
    assert min(think_len) >= 6 and 10 <= float(np.mean(think_len)) <= 13
    greedy_next = sum(1 for r in rows for a, b in zip(r, r[1:]) if b == max(
        d.next_probs[d.dim_of(a)], key=lambda x: d.next_probs[d.dim_of(a)][x]))
    steps = sum(len(r) - 1 for r in rows)
    assert 0.88 < greedy_next / steps < 0.95  # a perfect greedy drafter's per-token acceptance


def test_original_answers_take_other_transitions(built: Any) -> None:
    tok, d, _ = built
    rows = topic_qwen.prompt_rows(8)
    assert [r["messages"][-1]["role"] for r in rows] == ["assistant"] * 8
    for r in rows:
        topic = next(t for t in topic_qwen.TOPICS if t in r["messages"][0]["content"])
        original = tok.encode(r["messages"][-1]["content"], add_special_tokens=False).ids
        ours = tok.encode(topic_qwen.answer_text(topic), add_special_tokens=False).ids
        assert sorted(original) == sorted(ours) and original[0] == ours[0]
        shared = set(zip(original, original[1:])) & set(zip(ours, ours[1:]))
        assert not shared, "the original order shares none of the target's greedy transitions"
