"""The Qwen BPE converted from qwen.tiktoken: known ids, round trips, and the same tokens as tiktoken's algorithm."""

from __future__ import annotations

import inspect
import json
import random
import textwrap
from pathlib import Path

import pytest

from dflash_pipeline.dev.qwen_tokenizer import FIRST_SPECIAL_ID, SPECIAL_TOKENS, bytes_to_unicode


@pytest.fixture(scope="module")
def tok(qwen_tokenizer: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(qwen_tokenizer / "tokenizer.json"))


def _real_text() -> str:
    """Real English and code available offline: stdlib sources with their docstrings."""
    import argparse
    import json as json_mod
    import textwrap as tw

    return "\n".join(inspect.getsource(m) for m in (argparse, json_mod.decoder, tw))


def test_known_qwen_ids(tok) -> None:
    assert tok.encode("Hello, world!", add_special_tokens=False).ids == [9707, 11, 1879, 0]
    assert tok.encode("<|im_start|>user\n", add_special_tokens=False).ids == [151644, 872, 198]
    assert tok.token_to_id("<|endoftext|>") == 151643 and tok.token_to_id("<|im_end|>") == 151645
    assert tok.token_to_id("<think>") == 151667 and tok.token_to_id("</think>") == 151668
    assert [tok.token_to_id(t) for t, _ in SPECIAL_TOKENS] == list(range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + 26))
    assert tok.get_vocab_size() == 151669


def test_round_trip_on_real_text(tok) -> None:
    text = _real_text() + "\nGröße, naïve café — 日本語のテキスト 😀 ١٢٣\n\t\r\n  x"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert len(enc.ids) < len(text.encode()) / 2.5  # real merges, not bytes


def _tiktoken_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm: merge the adjacent pair whose concatenation has the lowest rank."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, best_rank = -1, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return [ranks[p] for p in parts]


def test_same_tokens_as_the_tiktoken_algorithm_over_the_ranks(tok, qwen_tokenizer: Path) -> None:
    doc = json.loads((qwen_tokenizer / "tokenizer.json").read_text())
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    ranks = {bytes(u2b[c] for c in t): i for t, i in doc["model"]["vocab"].items()}
    assert len(ranks) == 151643
    text = _real_text()
    rng = random.Random(3)
    start = rng.randrange(0, len(text) - 20000)
    sample = text[start : start + 20000]
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(sample)]
    expected: list[int] = []
    for p in pieces:
        expected += _tiktoken_bpe(bytes(u2b[c] for c in p), ranks)
    assert tok.encode(sample, add_special_tokens=False).ids == expected


def test_chat_template_is_qwen3_style(qwen_tokenizer: Path) -> None:
    from dflash_pipeline.steps.validate.tokencount import fetch_tokenizer, _jinja_env

    files = fetch_tokenizer(str(qwen_tokenizer), lambda b, k: None, Path("."))
    assert files.template_source == "tokenizer_config.json"
    tpl = _jinja_env().from_string(files.chat_template)
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
    ]
    out = tpl.render(messages=msgs, add_generation_prompt=False)
    assert out == textwrap.dedent("""\
        <|im_start|>system
        S<|im_end|>
        <|im_start|>user
        Q1<|im_end|>
        <|im_start|>assistant
        A1<|im_end|>
        <|im_start|>user
        Q2<|im_end|>
        <|im_start|>assistant
        <think>
        R2
        </think>

        A2<|im_end|>
        """)
    gen = tpl.render(messages=msgs[:2], add_generation_prompt=True, enable_thinking=False)
    assert gen.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
