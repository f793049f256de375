"""Recount a dataset's tokens with the training tokenizer.

Why: servers report `usage`, but the drafter is trained on what *our* tokenizer makes of the saved
text. Two figures come out of one pass:

* output tokens per row (reasoning + answer as saved), compared with the server's
  `completion_tokens`: a tokenizer that is not the served model's, or text that was mangled on the
  way (parser mis-filing, truncation, encoding), shows up as mismatches;
* `training_tokens`: the whole conversation (prompt, reasoning, answer) rendered with the model's
  chat template and tokenized, which is what tokenization downstream produces.

Each conversation is rendered and encoded once, with offsets; the output counts are the tokens that
start inside the reasoning and answer spans of that encoding (`Recounter.recount`). Texts whose
span is not found in the rendered conversation are encoded alone (the previous method, kept as
`Recounter.recount_separately`). The encoding runs in Rust on all cores (`encode_batch`); the
Python side per row is a render and a few binary searches.

The tokenizer is a `tokenizer.json` (local file, model directory, `s3://…/tokenizer.json`, an S3
prefix holding it, or a Hugging Face id through the hub cache: dataset/tokenizer_source.py). The chat template comes from `chat_template.jinja` or
`tokenizer_config.json`'s `chat_template` next to it; without one, `FALLBACK_CHAT_TEMPLATE`
(ChatML with Qwen3's `<think>` block) is used and the report says so.
"""

from __future__ import annotations

import bisect
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipeline.config import ConfigError
from dflash_pipeline.dataset import tokenizer_source
from dflash_pipeline.dataset.tokenizer_source import TokenizerError, TokenizerFiles, jinja_env

logger = logging.getLogger(__name__)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
STOP_TOKEN_ALLOWANCE = 1
"""SGLang may count the stop token (`<|im_end|>`) in completion_tokens; the saved text never has it."""

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'].strip('\\n') + '\\n</think>\\n\\n' }}"
    "{{ message['content'].lstrip('\\n') }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML as Qwen2/Qwen3 render it, with the reasoning in `<think>\\n…\\n</think>\\n\\n` before the answer."""


_jinja_env = jinja_env


def fetch_tokenizer(spec: str, s3_get: Callable[[str, str], Any], workdir: Path) -> TokenizerFiles:
    """`tokenizer_source.fetch_tokenizer`, its failures as ConfigError (a run's configuration is wrong)."""
    try:
        return tokenizer_source.fetch_tokenizer(spec, s3_get, workdir)
    except TokenizerError as exc:
        raise ConfigError(str(exc)) from exc


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@dataclass
class RecountResult:
    """Per-row figures of one batch (numpy int64 arrays, one entry per row given)."""

    reasoning: np.ndarray
    content: np.ndarray
    training: np.ndarray
    rows_encoded_alone: int = 0
    """Rows whose reasoning or answer was encoded alone: its span was not found in the rendered
    conversation (every row, with `recount_separately`)."""

    @property
    def output(self) -> np.ndarray:
        return self.reasoning + self.content


@dataclass(frozen=True)
class _TurnShape:
    """What the chat template writes around the assistant turn's texts, learnt from a probe render."""

    tail: str
    """Template text after the answer (ChatML: `<|im_end|>\\n`)."""
    gap: str | None
    """Template text between the reasoning and the answer (`\\n</think>\\n\\n`); None when the
    template does not render the reasoning."""


_PROBE_REASONING = "probe reasoning text"
_PROBE_CONTENT = "probe answer text"


def text_variants(text: str) -> list[str]:
    """`text` as a template may have written it: as is, then with '\\n' (then all whitespace) stripped."""
    out = [text]
    for v in (text.lstrip("\n"), text.strip("\n"), text.strip()):
        if v not in out:
            out.append(v)
    return out


def first_token_at(enc: Any, pos: int, lo: int, hi: int) -> int:
    """Index of the first token in [lo, hi) whose start offset is >= `pos` (hi if none).

    A binary search through `token_to_chars`: ~11 calls for 2,000 tokens, where `enc.offsets`
    would build a Python tuple per token (slower than the encoding itself).
    """
    return bisect.bisect_left(range(hi), pos, lo, hi, key=lambda t: enc.token_to_chars(t)[0])


class Recounter:
    """Counts tokens of saved rows with one tokenizer and one chat template (batch encoding)."""

    def __init__(self, files: TokenizerFiles, enable_thinking: bool = True) -> None:
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(files.tokenizer_json))
        except Exception as exc:  # noqa: BLE001 - the Rust error says what is wrong with the file
            raise ConfigError(f"tokenizer {files.spec!r}: not a tokenizers file: {exc}") from exc
        # A tokenizer.json may carry training-time padding/truncation: either would falsify counts.
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.files = files
        self.enable_thinking = enable_thinking
        source = files.chat_template or FALLBACK_CHAT_TEMPLATE
        self.template = _jinja_env().from_string(source)
        self.template_source = files.template_source
        # A template that knows nothing of reasoning_content gets the reasoning inline, as generated.
        self.inline_reasoning = "reasoning_content" not in source
        self.special = {k: v for k, v in ((k, _token_text(v)) for k, v in files.config.items() if k.endswith("_token")) if v is not None}
        self.marker_tokens = self.count([f"{THINK_OPEN}\n"])[0] + self.count([f"\n{THINK_CLOSE}\n\n"])[0]
        self.shape = self._probe_shape()

    def _probe_shape(self) -> _TurnShape | None:
        """Where the template puts the assistant's texts; None: the answer cannot be found (no single pass)."""
        try:
            conv = self.render([{"role": "user", "content": "probe question"}], _PROBE_REASONING, _PROBE_CONTENT)
        except Exception as exc:  # noqa: BLE001 - a template that fails here fails on the rows too, with context
            logger.warning("chat template: probe render failed (%s); every text is encoded separately", exc)
            return None
        c_start = conv.rfind(_PROBE_CONTENT)
        if c_start < 0:
            logger.warning("chat template does not render the answer as given; every text is encoded separately")
            return None
        r_start = conv.rfind(_PROBE_REASONING, 0, c_start)
        gap = conv[r_start + len(_PROBE_REASONING) : c_start] if r_start >= 0 else None
        if gap is None:
            logger.warning("chat template does not render the reasoning; reasoning is encoded separately")
        return _TurnShape(tail=conv[c_start + len(_PROBE_CONTENT) :], gap=gap)

    def count(self, texts: Sequence[str]) -> np.ndarray:
        """Token counts of `texts` (no special tokens added), encoded as one parallel batch."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        encs = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(texts))

    def render(self, messages: list[dict[str, Any]], reasoning: str | None, content: str,
               enable_thinking: bool | None = None) -> str:
        """The whole conversation as training sees it: prompt messages + the assistant turn (rendered in
        `enable_thinking`'s mode; None: the recounter's)."""
        if reasoning and self.inline_reasoning:
            turn: dict[str, Any] = {"role": "assistant", "content": f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"}
        else:
            turn = {"role": "assistant", "content": content}
            if reasoning:
                turn["reasoning_content"] = reasoning
        return self.render_messages([*(dict(m) for m in messages), turn], enable_thinking=enable_thinking)

    def render_messages(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                        enable_thinking: bool | None = None) -> str:
        """`messages` (assistant turns may carry `reasoning_content`) rendered with the chat template, with
        `enable_thinking` (a row's own mode: a run may mix modes per row), or the recounter's when None."""
        return str(
            self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=self.enable_thinking if enable_thinking is None else bool(enable_thinking),
                tools=None,
                **self.special,
            )
        )

    def spans(self, conv: str, reasoning: str, content: str) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """Char spans of the reasoning and of the answer in the rendered `conv` (None: not found).

        Searched from the end, where the template puts the assistant turn: the answer ends right
        before the template's tail, the reasoning right before the gap. Each text is tried as is
        and stripped, as templates strip '\\n' around it.
        """
        shape = self.shape
        if shape is None or not conv.endswith(shape.tail):
            return None, None
        end = len(conv) - len(shape.tail)
        first: tuple[int, int] | None = None
        for c in text_variants(content):
            if not conv.endswith(c, 0, end):
                continue
            c_span = (end - len(c), end)
            if not reasoning:
                return None, c_span
            first = first or c_span
            if shape.gap is None or not conv.endswith(shape.gap, 0, c_span[0]):
                continue
            r_end = c_span[0] - len(shape.gap)
            for r in text_variants(reasoning):
                if r and conv.endswith(r, 0, r_end):
                    return (r_end - len(r), r_end), c_span
        return None, first

    def recount(
        self,
        messages: Sequence[list[dict[str, Any]] | None],
        reasoning: Sequence[str | None],
        content: Sequence[str | None],
        thinking: Sequence[bool | None] | None = None,
    ) -> RecountResult:
        """Reasoning, answer and whole-conversation tokens per row, encoding each conversation once.

        The conversation is rendered with the chat template and encoded with offsets; the
        reasoning (answer) count is the number of tokens whose *start* offset lies in the
        reasoning (answer) span of the rendered text, the training count the length of the
        encoding. Counting in context is closer to what the server counted than encoding the text
        alone: the model generated those tokens after the preceding text, so a token that spans
        a boundary (say `.\\n` merging the reasoning's last '.' with the template's '\\n') counts
        once, on the side where the model emitted it. A text whose span is not found (a template
        that drops the reasoning, whitespace the template changed) is encoded alone, as before.
        `thinking`: each row's mode (None, or a None entry: the recounter's `enable_thinking`).
        """
        n = len(content)
        r_texts = [r or "" for r in reasoning]
        c_texts = [c or "" for c in content]
        modes = list(thinking) if thinking is not None else [None] * n
        convs = [self.render(list(m or []), r or None, c, enable_thinking=k)
                 for m, r, c, k in zip(messages, reasoning, c_texts, modes)]
        encs = self.tokenizer.encode_batch(convs, add_special_tokens=False)
        training = np.fromiter((len(e) for e in encs), dtype=np.int64, count=n)
        r_n = np.zeros(n, dtype=np.int64)
        c_n = np.zeros(n, dtype=np.int64)
        alone: list[tuple[np.ndarray, int, str]] = []
        for i, (conv, enc, r, c) in enumerate(zip(convs, encs, r_texts, c_texts)):
            r_span, c_span = self.spans(conv, r, c)
            size = len(enc)
            if c_span is None:
                alone.append((c_n, i, c))
            elif c_span[0] < c_span[1]:
                first = first_token_at(enc, c_span[0], 0, size)
                c_n[i] = first_token_at(enc, c_span[1], first, size) - first
            if not r:
                continue
            if r_span is None:
                alone.append((r_n, i, r))
            else:
                first = first_token_at(enc, r_span[0], 0, size)
                r_n[i] = first_token_at(enc, r_span[1], first, size) - first
        if alone:
            for (target, i, _), k in zip(alone, self.count([t for _, _, t in alone])):
                target[i] = k
        fallback = len({i for _, i, _ in alone})
        if fallback:
            logger.debug("recount: %d of %d rows had a text encoded alone (span not found)", fallback, n)
        return RecountResult(r_n, c_n, training, fallback)

    def recount_separately(
        self,
        messages: Sequence[list[dict[str, Any]] | None],
        reasoning: Sequence[str | None],
        content: Sequence[str | None],
        thinking: Sequence[bool | None] | None = None,
    ) -> RecountResult:
        """The reference method: reasoning, answer and conversation each encoded on its own (twice the work)."""
        n = len(content)
        r_texts = [r or "" for r in reasoning]
        c_texts = [c or "" for c in content]
        modes = list(thinking) if thinking is not None else [None] * n
        convs = [self.render(list(m or []), r or None, c, enable_thinking=k)
                 for m, r, c, k in zip(messages, reasoning, c_texts, modes)]
        counts = self.count([*r_texts, *c_texts, *convs])
        return RecountResult(counts[:n], counts[n : 2 * n], counts[2 * n :], n)

    def allowed_overhead(self, has_reasoning: np.ndarray) -> np.ndarray:
        """Most tokens a server may count beyond the saved text: think markers (+ newlines) and the stop token."""
        return np.where(has_reasoning, self.marker_tokens, 0) + STOP_TOKEN_ALLOWANCE


def load_recounter(
    spec: str, s3_get: Callable[[str, str], bytes | None], enable_thinking: bool, workdir: Path | None = None
) -> Recounter:
    """Fetch (if on S3) and load the tokenizer named by the `tokenizer` param."""
    work = workdir or Path(tempfile.mkdtemp(prefix="dflash-tokenizer-"))
    files = fetch_tokenizer(spec, s3_get, work)
    rec = Recounter(files, enable_thinking=enable_thinking)
    logger.info(
        "tokenizer %s: vocab %d, chat template from %s, think markers = %d token(s)",
        spec, rec.tokenizer.get_vocab_size(), rec.template_source, rec.marker_tokens,
    )
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("0", "false", "off", "no"):
        logger.warning("TOKENIZERS_PARALLELISM=%s: the recount encodes on one core only",
                       os.environ["TOKENIZERS_PARALLELISM"])
    return rec
