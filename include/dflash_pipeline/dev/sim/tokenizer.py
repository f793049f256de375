"""A real `tokenizers` tokenizer that counts exactly what the simulator counts.

Why: validation recounts output tokens with the training tokenizer and compares them with the
servers' usage. Tests and the demo need a tokenizer file that exists offline and agrees with the
simulator by construction: a WordLevel model over the simulator's VOCAB (plus the words the
callers' prompts use), split on whitespace, with Qwen/ChatML special tokens. Every
whitespace-separated word is one token (unknown words become ``[UNK]``, still one token), and
``<think>``/``</think>``/``<|im_start|>``/``<|im_end|>`` are one token each wherever they appear.

    from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer
    path = build_sim_tokenizer(tmp_path / "tok")   # writes tokenizer.json + tokenizer_config.json
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from dflash_pipeline.dev.sim.lengths import THINK_CLOSE, THINK_OPEN, VOCAB
from dflash_pipeline.steps.validate.tokencount import FALLBACK_CHAT_TEMPLATE

UNK = "[UNK]"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS: tuple[str, ...] = (UNK, END_OF_TEXT, IM_START, IM_END, THINK_OPEN, THINK_CLOSE)
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

CHATML_THINK_TEMPLATE = FALLBACK_CHAT_TEMPLATE
"""ChatML with Qwen3's reasoning block: what `build_sim_tokenizer` puts in tokenizer_config.json."""


def build_sim_tokenizer(
    path: str | Path,
    extra_words: Iterable[str] = (),
    *,
    chat_template: str | None = CHATML_THINK_TEMPLATE,
) -> Path:
    """Write tokenizer.json (+ tokenizer_config.json) into directory `path`; return the directory.

    `chat_template=None` leaves the template out of tokenizer_config.json, so a reader falls back
    to its own default template.
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    vocab: dict[str, int] = {}
    for word in (*SPECIAL_TOKENS, *ROLES, *VOCAB, *extra_words):
        if word and word not in vocab:
            vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": UNK,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out
