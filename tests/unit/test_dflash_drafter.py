"""DFlash drafter checkpoints (dev/engine/dflash_drafter.py), the cycle target and the vLLM speculative configs.

What vLLM serves and SpecForge reads is checked against the real tools elsewhere
(tests/engine/test_vllm_dflash.py, tests/trainers/test_dflash_drafter_format.py); here: the rules
those files follow, the refusals, and the arithmetic of the oracle's known answer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash_pipeline.dev.engine import cycle_qwen, tiny_qwen
from dflash_pipeline.dev.engine.dflash_drafter import (
    ClassTarget,
    build_oracle,
    build_untrained,
    check_drafter,
    drafter_config,
    expected_histogram,
    oracle_accepts,
    read_class_target,
    read_config,
    resolve_mask_token_id,
    target_layer_ids,
    weight_shapes,
)
from dflash_pipeline.dev.engine.safetensors_np import read_header, read_tensor, to_bf16, write_safetensors
from dflash_pipeline.dev.stack.vllm_server import dflash_spec, eagle3_spec


@pytest.fixture(scope="module")
def cycle_target(qwen_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cycle_qwen.build_checkpoint(tmp_path_factory.mktemp("cycle") / "ckpt", tokenizer_source=qwen_tokenizer)


def test_target_layer_ids_follow_specforge() -> None:
    assert target_layer_ids(1, 1) == [0] and target_layer_ids(3, 1) == [1] and target_layer_ids(36, 1) == [18]
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # spread from layer 1 to L - 3


def test_mask_token_is_the_first_unused_row(cycle_target: Path) -> None:
    assert resolve_mask_token_id(cycle_target, 151936) == 151669  # Qwen3: 151,643 ranks + 26 added tokens
    assert resolve_mask_token_id(cycle_target, 151669) == 151643  # no unused row: the pad token (<|endoftext|>)


def test_config_copies_the_target() -> None:
    target = {**tiny_qwen.config(), "num_hidden_layers": 5}
    cfg = drafter_config(target, mask_token_id=7, layers=2)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": target_layer_ids(5, 2)}
    assert (cfg["num_hidden_layers"], cfg["num_target_layers"], cfg["block_size"]) == (2, 5, 16)
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["dtype"] == "bfloat16"
    assert cfg["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"} and cfg["rope_theta"] == 1e6
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "rms_norm_eps", "max_position_embeddings"):
        assert cfg[key] == target[key], key
    assert cfg["draft_vocab_size"] == target["vocab_size"] and cfg["tie_word_embeddings"] is False
    shapes = weight_shapes(cfg)
    assert shapes["fc.weight"] == (64, 2 * 64) and "layers.1.mlp.down_proj.weight" in shapes
    assert not any("embed" in k or "lm_head" in k for k in shapes)


def test_untrained_drafter_files(cycle_target: Path, tmp_path: Path) -> None:
    a = build_untrained(cycle_target, tmp_path / "a", seed=3)
    b = build_untrained(cycle_target, tmp_path / "b", seed=3)
    c = build_untrained(cycle_target, tmp_path / "c", seed=4)
    assert check_drafter(a, cycle_target) == []
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    header = read_header(a / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    q = read_tensor(a / "model.safetensors", "layers.0.self_attn.q_proj.weight")
    assert q.dtype == np.float32 and 0.015 < q.std() < 0.025  # normal(0, initializer_range)
    assert np.all(read_tensor(a / "model.safetensors", "norm.weight") == 1)
    assert read_config(a)["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1]}


def _edited(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = {**read_config(dst), **changes}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_check_drafter_names_what_vllm_would_refuse(cycle_target: Path, tmp_path: Path) -> None:
    good = build_untrained(cycle_target, tmp_path / "good")
    no_mask = _edited(good, tmp_path / "no-mask", dflash_config={"target_layer_ids": [1]})
    assert any("mask_token_id" in p for p in check_drafter(no_mask, cycle_target))
    bad_layer = _edited(good, tmp_path / "bad-layer", dflash_config={"mask_token_id": 151669, "target_layer_ids": [3]})
    assert any("target_layer_ids" in p for p in check_drafter(bad_layer, cycle_target))
    wider = _edited(good, tmp_path / "wider", hidden_size=128)
    assert any("hidden_size 128" in p for p in check_drafter(wider, cycle_target))
    assert any("head size 48" in p for p in check_drafter(_edited(good, tmp_path / "hd", head_dim=48), cycle_target))
    no_head_dim = _edited(good, tmp_path / "no-head-dim")
    (no_head_dim / "config.json").write_text(json.dumps({k: v for k, v in read_config(good).items() if k != "head_dim"}))
    assert "layers.0.self_attn.q_norm.weight has shape [64], the config implies [128]" in check_drafter(
        no_head_dim, cycle_target)  # Qwen3Config's default head_dim is 128, not hidden / heads: vLLM fails to load it
    assert any("architectures" in p for p in check_drafter(_edited(good, tmp_path / "arch",
                                                                    architectures=["Qwen3ForCausalLM"]), cycle_target))
    weights = {k: read_tensor(good / "model.safetensors", k) for k in read_header(good / "model.safetensors")
               if k != "__metadata__"}
    extra = _edited(good, tmp_path / "extra")
    write_safetensors(extra / "model.safetensors", {**{k: v for k, v in weights.items() if k != "fc.weight"},
                                                    "embed_tokens.weight": np.zeros((4, 64), np.float32)})
    problems = check_drafter(extra, cycle_target)
    assert "missing weight fc.weight" in problems and any("unexpected weight embed_tokens" in p for p in problems)


def test_speculative_configs(cycle_target: Path, tmp_path: Path) -> None:
    drafter = build_untrained(cycle_target, tmp_path / "d", block_size=8)
    assert dflash_spec(drafter) == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7}
    assert dflash_spec(drafter, 3)["num_speculative_tokens"] == 3
    with pytest.raises(ValueError, match="outside 1..7"):
        dflash_spec(drafter, 8)
    assert eagle3_spec(tmp_path / "e", 4) == {"method": "eagle3", "model": str(tmp_path / "e"),
                                              "num_speculative_tokens": 4}


def test_class_targets_read_back(cycle_target: Path, qwen_tokenizer: Path, tmp_path: Path) -> None:
    cycle = read_class_target(cycle_target)
    words = cycle_qwen.word_ids(cycle_target)
    assert cycle.chain(tiny_qwen.NEWLINE, 3) == [tiny_qwen.NEWLINE, *words[:3]]
    assert cycle.next_token(tiny_qwen.DOUBLE_NEWLINE) == words[len(words) // 2]
    assert cycle.next_token(words[-1]) == words[0] and cycle.next_token(151669) == words[0]
    tiny = read_class_target(tiny_qwen.build_checkpoint(tmp_path / "tiny", tokenizer_source=qwen_tokenizer))
    assert len(tiny.greedy_next) == 13 and tiny.next_token(tiny_qwen.PERIOD) == tiny_qwen.IM_END
    untrained = build_untrained(cycle_target, tmp_path / "u")
    with pytest.raises((ValueError, KeyError)):
        read_class_target(untrained)  # not a designed target


def test_oracle_known_answer(cycle_target: Path, tmp_path: Path) -> None:
    words = cycle_qwen.word_ids(cycle_target)
    half = tuple(words[len(words) // 2:])
    target = read_class_target(cycle_target)
    assert oracle_accepts(target, words[0], 21, 3, half) == [3] * 5  # 1 + 5 x 4 tokens
    assert oracle_accepts(target, words[0], 7, 3, half) == [3, 3]  # the last step may pass max_tokens
    assert oracle_accepts(target, words[24], 20, 3, half) == [0] * 19
    assert oracle_accepts(target, words[0], 1, 3, half) == []
    assert oracle_accepts(target, words[20], 12, 3, half) == [3, 0, 0, 0, 0, 0, 0, 0]  # word 24 is the next bonus
    assert expected_histogram([3, 0, 0, 3, 1], 3) == [2, 1, 0, 2]
    drafter = build_oracle(cycle_target, tmp_path / "oracle", k=3, wrong_tokens=half)
    assert check_drafter(drafter, cycle_target) == []
    cfg = read_config(drafter)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["block_size"], cfg["dtype"]) == (
        3, 3, 4, "float32")


def test_class_target_chain() -> None:
    target = ClassTarget(np.zeros(4, np.int64), {0: 1}, ())
    assert target.chain(2, 2) == [2, 1, 1]


def test_bf16_rounds_to_nearest_even(tmp_path: Path) -> None:
    values = np.array([1.0, 3.14159, -2.5e-3, 1.00390625, 1.01171875], np.float32)
    bits = to_bf16(values).bits
    assert [hex(b) for b in bits] == ["0x3f80", "0x4049", "0xbb24", "0x3f80", "0x3f82"]  # ties to even
    write_safetensors(tmp_path / "x.safetensors", {"x": to_bf16(values)})
    assert read_tensor(tmp_path / "x.safetensors", "x").tolist() == [1.0, 3.140625, -0.00250244140625, 1.0, 1.015625]


def test_oracle_heads_select_by_distance(cycle_target: Path, tmp_path: Path) -> None:
    """Head h's mask query scores the key at distance h highest, by a wide margin, over every distance a
    2,048-token context and the draft block can hold (RMSNorm, then neox RoPE, as vLLM's DFlash layer)."""
    drafter = build_oracle(cycle_target, tmp_path / "oracle", k=3)
    cfg, w = read_config(drafter), drafter / "model.safetensors"
    hd, eps = cfg["head_dim"], cfg["rms_norm_eps"]
    mask_class = int(read_class_target(cycle_target).token_class[cfg["dflash_config"]["mask_token_id"]])
    norm = lambda x, g: x / np.sqrt((x * x).mean() + eps) * g  # noqa: E731
    inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd))

    def rotate(x: np.ndarray, pos: int) -> np.ndarray:
        c, s = np.cos(pos * inv), np.sin(pos * inv)
        return np.concatenate([x[: hd // 2] * c - x[hd // 2:] * s, x[hd // 2:] * c + x[: hd // 2] * s])

    embed = np.zeros(cfg["hidden_size"])
    embed[mask_class] = 8.0
    distances = np.concatenate([np.arange(-8, 0), np.arange(0, 2100)])
    for h in (1, 2, 3):
        rows = slice((h - 1) * hd, h * hd)
        q = norm(read_tensor(w, "layers.0.self_attn.q_proj.weight")[rows] @ embed,
                 read_tensor(w, "layers.0.self_attn.q_norm.weight"))
        k = norm(read_tensor(w, "layers.0.self_attn.k_proj.weight")[rows] @ embed,
                 read_tensor(w, "layers.0.self_attn.k_norm.weight"))
        scores = np.array([rotate(q, 3000) @ rotate(k, 3000 - d) / np.sqrt(hd) for d in distances])
        assert distances[scores.argmax()] == h
        assert scores.max() - np.sort(scores)[-2] > 25  # every other key weighs < e^-25 as much
