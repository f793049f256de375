"""The simulator's token-level model: a request rendered and encoded as an engine does, ids returned.

Why: the training data is built from the token ids the engine used (`return_token_ids` on vLLM),
and tests must show the pipeline keeps those ids, never a re-encoding of the text. With
``SimConfig.tokenizer_dir`` set, a simulated server behaves like an engine serving a model with
that tokenizer and chat template:

* the prompt is the chat template rendered with ``add_generation_prompt`` and the request's
  ``chat_template_kwargs`` (as vLLM and SGLang render it), encoded without added special tokens;
  ``usage.prompt_tokens`` is its length;
* the model "generates" what a thinking model emits after that prompt: the thinking, ``</think>``,
  ``\\n\\n``, the answer, then the end-of-turn token (``<|im_end|>``). When the prompt already
  opened the thinking (a Qwen3.6-style template ends it with ``<think>\\n``) the output starts
  inside it; when it carries the empty block (thinking off) the output is the answer alone; a
  Qwen3-style prompt (``<|im_start|>assistant\\n``) gets ``<think>\\n`` generated first;
* ``max_tokens`` cuts the token sequence (``finish_reason`` "length", no end-of-turn token);
  ``usage.completion_tokens`` is the number of ids generated, the end-of-turn token included,
  as vLLM counts it;
* ``noncanonical_rate``: the share of tokens emitted as two smaller tokens that decode to the same
  text (a sampled sequence need not be the canonical BPE encoding of its text). Re-encoding the
  decoded text then gives other ids than the ones generated: exactly what a pipeline that
  re-tokenizes gets wrong;
* the text is the decoded ids (special tokens skipped, as engines decode), split like the qwen3
  reasoning parser: the thinking is what precedes ``</think>`` (an opening ``<think>`` removed),
  the answer what follows it; no ``</think>`` with thinking on means all thinking.

The words themselves come from the simulator's length model (lengths.py), so lengths, seeds and
multi-turn behaviour stay those of the word-level simulator.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class Generated:
    """One simulated generation at token level."""

    prompt_ids: list[int]
    output_ids: list[int]
    reasoning: str | None
    content: str
    finish_reason: str
    reasoning_tokens: int
    matched_stop: int | None
    text: str = ""
    """The decoded output (special tokens skipped), before any reasoning split."""


class SimTokenModel:
    """A tokenizer directory (tokenizer.json + tokenizer_config.json's chat_template) used as an engine would."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        from dflash_pipeline.steps.validate.tokencount import _jinja_env

        folder = Path(directory).expanduser()
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        jinja = folder / "chat_template.jinja"
        source = jinja.read_text() if jinja.is_file() else config.get("chat_template")
        if not isinstance(source, str):
            raise ValueError(f"{folder}: no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
        self.template = _jinja_env().from_string(source)
        self.eos_text = str(config.get("eos_token") or "<|im_end|>")
        eos = self.tokenizer.token_to_id(self.eos_text)
        if eos is None:
            raise ValueError(f"{folder}: eos token {self.eos_text!r} is not in the vocabulary")
        self.eos_id = int(eos)
        close = self.tokenizer.token_to_id(THINK_CLOSE)
        self.think_close_id = None if close is None else int(close)
        self.vocab = self.tokenizer.get_vocab(with_added_tokens=False)
        self._id_to_token = {i: t for t, i in self.vocab.items()}

    def render(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> str:
        return str(self.template.render(messages=messages, add_generation_prompt=True, tools=None,
                                        **{k: v for k, v in template_kwargs.items() if k != "messages"}))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one model per server, lives as long as it
    def _split(self, token_id: int) -> tuple[int, int] | None:
        """Two vocabulary tokens whose concatenation is token `token_id`'s bytes, if any."""
        tok = self._id_to_token.get(token_id)
        if tok is None or len(tok) < 2:
            return None
        for cut in range(len(tok) - 1, 0, -1):
            left, right = self.vocab.get(tok[:cut]), self.vocab.get(tok[cut:])
            if left is not None and right is not None:
                return int(left), int(right)
        return None

    def generate(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any], thinking: str | None,
                 answer: str, max_tokens: int | None, noncanonical_rate: float, seed: int,
                 strip_parsed: bool) -> Generated:
        """Prompt ids, output ids and the parsed texts of one request (see the module docstring).

        `strip_parsed`: the reasoning and answer texts are stripped of surrounding whitespace (as
        SGLang's parser returns them); else the answer keeps the newlines after `</think>` (vLLM)."""
        prompt = self.render(messages, template_kwargs)
        prompt_ids = self.encode(prompt)
        opened = prompt.rstrip("\n").endswith(THINK_OPEN) and not prompt.endswith(f"{THINK_CLOSE}\n\n")
        empty_block = prompt.endswith(f"{THINK_CLOSE}\n\n")
        if thinking is None or empty_block:
            raw = answer
        elif opened and not thinking:  # thinking closed at once, right after the prompt's <think>
            raw = f"{THINK_CLOSE}\n\n{answer}"
        elif opened:
            raw = f"{thinking}\n{THINK_CLOSE}\n\n{answer}"
        else:
            raw = f"{THINK_OPEN}\n{thinking}\n{THINK_CLOSE}\n\n{answer}"
        ids = self.encode(raw)
        if noncanonical_rate > 0:
            rng = random.Random(seed)
            out: list[int] = []
            for t in ids:
                pair = self._split(t) if rng.random() < noncanonical_rate else None
                out.extend(pair if pair else (t,))
            ids = out
        ids.append(self.eos_id)
        finish = "stop"
        if max_tokens is not None and len(ids) > max_tokens:
            ids = ids[:max_tokens]
            finish = "length"
        generated = ids[:-1] if finish == "stop" else ids
        text = self.tokenizer.decode(generated, skip_special_tokens=False)
        reasoning_tokens = 0
        thinking_on = thinking is not None and not empty_block
        if THINK_CLOSE in text:
            before, _, after = text.partition(THINK_CLOSE)
            reasoning: str | None = before.split(THINK_OPEN, 1)[-1]
            content = after
            if self.think_close_id is not None and self.think_close_id in generated:
                reasoning_tokens = generated.index(self.think_close_id)
        elif thinking_on:
            reasoning, content = text.split(THINK_OPEN, 1)[-1], ""
            reasoning_tokens = len(generated)
        else:
            reasoning, content = None, text
        if strip_parsed:
            reasoning = reasoning.strip() if reasoning is not None else None
            content = content.strip()
        return Generated(prompt_ids, ids, reasoning or None, content, finish, reasoning_tokens,
                         self.eos_id if finish == "stop" else None, text)


@functools.lru_cache(maxsize=8)
def load_token_model(directory: str) -> SimTokenModel:
    """One SimTokenModel per directory per process (servers of one fleet share it)."""
    return SimTokenModel(directory)
