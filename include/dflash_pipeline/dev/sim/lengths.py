"""Deterministic length and text model of a Qwen3-like thinking model.

Why: the simulator has to return completions that are reproducible per prompt (so retries and
resumes can be checked byte for byte), heavy-tailed in length (so dispatch and ETA logic meet
the long requests that dominate real runs), and countable with a trivial tokenizer: every
whitespace-separated word of the generated text is exactly one token, so a word-level tokenizer
reproduces ``usage`` exactly.

Token accounting (the contract client tests can rely on):

* ``prompt_tokens`` = words in all message texts + ``PROMPT_TOKENS_PER_MESSAGE`` per message
  + ``PROMPT_TOKENS_PRIMING`` (the chat-template overhead, OpenAI-cookbook style).
* ``completion_tokens`` = thinking words + answer words.  With a reasoning parser the think
  markers are not counted (they are special tokens the parser strips).  Inline (no parser, or
  ``separate_reasoning`` false) the markers ``<think>`` and ``</think>`` appear in ``content``
  and count as one token each, so ``len(content.split()) == completion_tokens`` still holds.
* ``reasoning_tokens`` = thinking words returned in ``reasoning_content`` (0 inline, as SGLang
  reports without a parser).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

PROMPT_TOKENS_PER_MESSAGE = 3
PROMPT_TOKENS_PRIMING = 3
"""prompt_tokens = sum(words per message text) + 3 * len(messages) + 3."""

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
IM_END_TOKEN_ID = 151645
"""Qwen's ``<|im_end|>``: what SGLang reports as ``matched_stop`` on a natural stop."""

LENGTH_SIGMA = 1.0
"""Log-space spread of the total length; sigma 1 gives ~9% of completions over 4096 tokens at
mean 1800 (median ~1100), the long tail thinking models show."""
MAX_RAW_TOKENS = 32768
"""Cap on the sampled length before ``length_scale``, like a model's max output."""
THINKING_FRACTION = (0.80, 0.90)
"""Per-prompt share of the total that is thinking, drawn uniformly."""

VOCAB: tuple[str, ...] = (
    "the", "a", "we", "so", "then", "now", "first", "next", "check", "value", "number", "sum",
    "let", "me", "think", "about", "this", "that", "step", "case", "because", "therefore",
    "answer", "result", "equation", "term", "factor", "prime", "even", "odd", "list", "order",
    "count", "total", "each", "every", "some", "none", "maybe", "wait", "actually", "hmm",
    "right", "wrong", "correct", "again", "compute", "solve", "find", "given", "assume", "note",
    "since", "if", "and", "or", "not", "is", "are", "was", "be", "it", "of", "to", "in", "on",
    "for", "with", "from", "by", "as", "at", "one", "two", "three", "four", "five", "ten",
    "small", "large", "more", "less", "equal", "greater", "function", "variable", "string",
    "array", "loop", "index", "return", "code", "test", "input", "output", "simple", "final",
)


def canonical_messages(messages: Sequence[Any]) -> str:
    """The canonical JSON of ``messages``: the identity of a prompt for seeding and hashing."""
    return json.dumps(list(messages), sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def prompt_hash(messages: Sequence[Any]) -> str:
    """sha256 hex of the canonical messages (seed-independent; used for duplicate counting)."""
    return hashlib.sha256(canonical_messages(messages).encode("utf-8")).hexdigest()


def message_text(content: Any) -> str:
    """Text of one message ``content``: a string, or the text parts of an OpenAI parts list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return " ".join(parts)
    return str(content)


def count_tokens(text: str) -> int:
    """Word-level token count: one token per whitespace-separated word."""
    return len(text.split())


def count_prompt_tokens(messages: Sequence[Any]) -> int:
    """``prompt_tokens`` as the simulator reports it (formula in the module docstring)."""
    words = 0
    for message in messages:
        if isinstance(message, dict):
            words += count_tokens(message_text(message.get("content")))
    return words + PROMPT_TOKENS_PER_MESSAGE * len(messages) + PROMPT_TOKENS_PRIMING


@dataclass(frozen=True)
class LengthPlan:
    """What the model "wants" to generate for one prompt, before ``max_tokens`` applies."""

    thinking_tokens: int
    """Thinking words (0 when thinking is disabled)."""
    answer_tokens: int
    """Answer words (always >= 1)."""
    text_seed: int
    """Seed of the word streams; the same seed yields the same words, so truncation is a prefix."""

    @property
    def total_tokens(self) -> int:
        """Wanted completion length in parser mode (markers not counted)."""
        return self.thinking_tokens + self.answer_tokens


def _seed_for(messages: Sequence[Any], seed: int) -> int:
    digest = hashlib.sha256(f"{seed}\n{canonical_messages(messages)}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def plan_lengths(
    messages: Sequence[Any],
    *,
    seed: int = 0,
    mean_tokens: float = 1800.0,
    length_scale: float = 1.0,
    enable_thinking: bool = True,
) -> LengthPlan:
    """Draw the deterministic lengths for ``messages``.

    The total is lognormal with mean ``mean_tokens`` (capped at ``MAX_RAW_TOKENS``) times
    ``length_scale``; thinking takes a per-prompt 80-90% of it.  With thinking disabled the
    answer is the same length as it would have been after thinking.
    """
    base = _seed_for(messages, seed)
    rng = random.Random(base)
    mean = max(float(mean_tokens), 1.0)
    mu = math.log(mean) - LENGTH_SIGMA**2 / 2.0
    raw = min(rng.lognormvariate(mu, LENGTH_SIGMA), float(MAX_RAW_TOKENS))
    fraction = rng.uniform(*THINKING_FRACTION)
    total = max(1, int(round(raw * float(length_scale))))
    thinking = max(1, int(round(total * fraction)))
    answer = max(1, total - thinking)
    return LengthPlan(
        thinking_tokens=thinking if enable_thinking else 0,
        answer_tokens=answer,
        text_seed=base,
    )


LOOP_START = 60
"""Words of ordinary thinking before a looping model starts repeating itself."""
LOOP_UNIT = 24
"""Words of the unit a looping model repeats until max_tokens."""


def words(text_seed: int, stream: str, count: int) -> str:
    """``count`` deterministic words of one stream ("thinking" or "answer"; "thinking-loop": a thinking that
    starts normally and then repeats one LOOP_UNIT-word sentence, as a looping model does); prefix-stable."""
    if count <= 0:
        return ""
    rng = random.Random(f"{text_seed}:{stream}")
    if stream == "thinking-loop":
        start = rng.choices(VOCAB, k=LOOP_START)
        unit = rng.choices(VOCAB, k=LOOP_UNIT)
        out = start + unit * (1 + max(0, count - LOOP_START) // LOOP_UNIT)
        return " ".join(out[:count])
    return " ".join(rng.choices(VOCAB, k=count))


@dataclass(frozen=True)
class Completion:
    """One rendered choice, in the shape SGLang's chat endpoint fills in."""

    content: str
    reasoning_content: str | None
    completion_tokens: int
    reasoning_tokens: int
    finish_reason: str
    """"stop" when the answer ended naturally, "length" when ``max_tokens`` cut it."""
    matched_stop: int | None


def render_completion(
    plan: LengthPlan, *, max_tokens: int | None, separate_reasoning: bool, loop: bool = False,
    empty_think: bool = False,
) -> Completion:
    """Apply the ``max_tokens`` budget to ``plan`` and produce the message texts.

    Parser mode (``separate_reasoning``): thinking goes to ``reasoning_content``; a budget that
    runs out inside the thinking (or exactly at its end) gives ``content == ""`` (SGLang's
    parser returns an empty answer there; we choose "" over None) and ``finish_reason
    "length"``.  Inline mode: ``content = "<think>\\n" + thinking + "\\n</think>\\n\\n" +
    answer``; cut inside the thinking, the closing tag is missing. `empty_think` (the plan has no
    thinking because the model closed it at once): inline, the empty block precedes the answer.
    """
    budget = math.inf if max_tokens is None else max(0, int(max_tokens))
    thinking_n, answer_n = plan.thinking_tokens, plan.answer_tokens
    thinking = "thinking"
    if loop and thinking_n:  # a looping model: its thinking never ends, max_tokens cuts it
        thinking, thinking_n = "thinking-loop", max(thinking_n, int(min(budget, 1 << 30)) + 1)

    if thinking_n == 0 and empty_think and not separate_reasoning:
        # a thinking model that closed its thinking at once, no parser: the empty block stays inline
        used = int(min(answer_n + 2, budget))
        if used <= 2:
            return _finish(" ".join([f"{THINK_OPEN}\n", f"\n{THINK_CLOSE}"][:used]), None, used, 0, False)
        return _finish(f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n" + words(plan.text_seed, "answer", used - 2), None, used, 0,
                       used == answer_n + 2)
    if thinking_n == 0:
        used = int(min(answer_n, budget))
        return _finish(words(plan.text_seed, "answer", used), None, used, 0, used == answer_n)

    if separate_reasoning:
        t_used = int(min(thinking_n, budget))
        a_used = int(min(answer_n, max(0.0, budget - t_used)))
        reasoning = words(plan.text_seed, thinking, t_used) if t_used else None
        content = words(plan.text_seed, "answer", a_used)
        done = t_used == thinking_n and a_used == answer_n
        return _finish(content, reasoning, t_used + a_used, t_used, done)

    full = thinking_n + answer_n + 2  # the two markers count as one token each
    used = int(min(full, budget))
    if used == 0:
        content = ""
    elif used <= thinking_n + 1:
        content = f"{THINK_OPEN}\n" + words(plan.text_seed, thinking, used - 1)
    else:
        content = (
            f"{THINK_OPEN}\n"
            + words(plan.text_seed, thinking, thinking_n)
            + f"\n{THINK_CLOSE}\n\n"
            + words(plan.text_seed, "answer", used - thinking_n - 2)
        )
    return _finish(content, None, used, 0, used == full)


def _finish(
    content: str, reasoning: str | None, tokens: int, reasoning_tokens: int, done: bool
) -> Completion:
    return Completion(
        content=content,
        reasoning_content=reasoning,
        completion_tokens=tokens,
        reasoning_tokens=reasoning_tokens,
        finish_reason="stop" if done else "length",
        matched_stop=IM_END_TOKEN_ID if done else None,
    )
