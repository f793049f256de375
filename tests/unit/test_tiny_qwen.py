"""The tiny designed Qwen3 checkpoint (dev/engine/tiny_qwen.py): its design holds, its file is valid
safetensors, and its weights compute the designed bigram logits. What vLLM makes of it is measured by
dev/engine/measure.py and checked in tests/engine/."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dflash_pipeline.dev.engine import tiny_qwen as tq


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer: Path):  # noqa: ANN201 - tokenizers.Tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(qwen_tokenizer / "tokenizer.json"))


@pytest.fixture(scope="module")
def design(tokenizer) -> tq.Design:  # noqa: ANN001
    return tq.design(lambda text: tokenizer.encode(text, add_special_tokens=False).ids)


def reachable(d: tq.Design, start: str) -> set[str]:
    """Classes reachable from a token of class `start` through what is sampled (after top-p)."""
    seen, todo = {start}, [start]
    while todo:
        for tok in tq.sampled_distribution(d.next_probs[todo.pop()]):
            cls = d.class_of(tok)
            if cls not in seen:
                seen.add(cls)
                todo.append(cls)
    return seen


def test_chain_has_a_thinking_models_shape(design: tq.Design) -> None:
    reasoning = {"a", "a_piece", "b", "b_piece", "b_pause", "reason_end"}
    answer = {"nn", "answer", "answer_end", "eos"}
    assert reachable(design, "answer") == {"answer", "answer_end", "eos", "other"}  # never back to reasoning
    assert reachable(design, "nn") & reasoning == set()  # thinking off: an answer only
    assert reachable(design, "nl") >= reasoning | {"think_end"} | answer  # thinking on: all of it, in order
    for cls in ("a", "b", "b_pause", "a_piece", "b_piece"):
        assert not any(design.class_of(t) == "nn" for t in tq.sampled_distribution(design.next_probs[cls]))
    # what ends each part survives top-p
    assert tq.PERIOD_NEWLINE in tq.sampled_distribution(design.next_probs["a"])
    assert tq.PERIOD_NEWLINE in tq.sampled_distribution(design.next_probs["b_pause"])
    assert tq.PERIOD in tq.sampled_distribution(design.next_probs["answer"])
    assert set(tq.sampled_distribution(design.next_probs["reason_end"])) == {tq.THINK_END}
    assert set(tq.sampled_distribution(design.next_probs["think_end"])) == {tq.DOUBLE_NEWLINE}
    assert set(tq.sampled_distribution(design.next_probs["answer_end"])) == {tq.IM_END}
    assert all(len(p) <= tq.TOP_K for p in design.next_probs.values())


def test_word_pieces_are_not_canonical(design: tq.Design, tokenizer) -> None:  # noqa: ANN001
    for prefix, suffix in design.non_canonical_pairs:
        text = tokenizer.decode([prefix, suffix])
        assert tokenizer.encode(text, add_special_tokens=False).ids != [prefix, suffix]
        assert prefix in tq.sampled_distribution(design.next_probs[design.class_of(suffix)])


def test_predicted_shape(design: tq.Design, tokenizer) -> None:  # noqa: ANN001
    def enc(t: str) -> list[int]:
        return tokenizer.encode(t, add_special_tokens=False).ids

    def dec(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    on = tq.shape(tq.predict(design, 1000, 256, thinking=True, seed=3), enc, dec, thinking=True)
    off = tq.shape(tq.predict(design, 300, 256, thinking=False, seed=3), enc, dec, thinking=False)
    assert 0.8 < on.stop / on.rows < 0.97 and on.length_in_thinking > 10 and on.length_in_answer > 5
    assert 0.1 < on.non_canonical / on.rows < 0.6
    assert off.stop == off.rows and off.non_canonical == 0 and off.reasoning_tokens_mean == 0


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0 and header.pop("__metadata__") == {"format": "pt"}
    out = {}
    for name, meta in header.items():
        start, end = meta["data_offsets"]
        assert meta["dtype"] == "F32"
        out[name] = np.frombuffer(raw[8 + n + start : 8 + n + end], dtype="<f4").reshape(meta["shape"])
    return out


def test_checkpoint_computes_the_design(tmp_path: Path, qwen_tokenizer: Path, design: tq.Design) -> None:
    out = tq.build_checkpoint(tmp_path / "ckpt", tokenizer_source=qwen_tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == 151936
    assert config["head_dim"] == 64
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [tq.IM_END, tq.ENDOFTEXT]
    from dflash_pipeline.dev.qwen_tokenizer import CHAT_TEMPLATES

    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATES["qwen3.6"]
    w = read_safetensors(out / "model.safetensors")
    assert not w["model.layers.0.self_attn.o_proj.weight"].any() and not w["model.layers.0.mlp.down_proj.weight"].any()
    eps = config["rms_norm_eps"]
    for token in (tq.NEWLINE, tq.DOUBLE_NEWLINE, tq.THINK_END, tq.PERIOD, 279, 12345):
        x = w["model.embed_tokens.weight"][token].astype(np.float64)
        h = x / np.sqrt(np.mean(x * x) + eps) * w["model.norm.weight"]
        logits = w["lm_head.weight"].astype(np.float64) @ h
        probs = np.exp((logits - logits.max()) / tq.TEMPERATURE)
        probs /= probs.sum()
        for tok, p in design.next_probs[design.class_of(token)].items():
            assert math.isclose(probs[tok], p, rel_tol=1e-4), (token, tok)
