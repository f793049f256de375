"""Thinking and sampling mixes: which rows think, and what each request samples with.

Why: a drafter serves the traffic its target serves, thinking on and off, at the sampling settings of
that traffic; a dataset generated at one setting teaches it one. Three layers decide a request's
sampling, later ones winning key by key: the run (`temperature`, `top_p`, `max_tokens` and the
`sampling_extra` object), the sample (`sampling_ladder[sample % len]`, e.g. a temperature ladder) and
the input row (its `sampling` object). The seed is never overridden: it stays derived from the run's
`seed`, the id and the sample (serving/sglang.request_seed).

Keys are checked here, at config time, against the union of the engines' dialects (a key no engine
knows, or a value of the wrong type, is refused before any GPU is touched), and at preflight against
each server's own engine (`unsupported_keys`). The dialects were read from the engines' request models:
SGLang `python/sglang/srt/entrypoints/openai/protocol.py` (ChatCompletionRequest) and vLLM 0.32
`vllm/entrypoints/openai/chat_completion/protocol.py` (ChatCompletionRequest, the
"chat-completion-sampling-params" block). Both engines accept unknown fields silently (SGLang's pydantic
default, vLLM's `extra="allow"` with a debug log), so a misspelt key would be ignored by the server,
never reported: that is why we refuse it here.

Thinking mode per conversation: the row's own `enable_thinking` (or `thinking` when a bool) wins;
otherwise, with `thinking_fraction` set, `ThinkingQuota` decides in plan order; otherwise the run's
`enable_thinking`. A hash draw alone misses the fraction by binomial noise (at 2,000 conversations and
f = 0.3, 36 of 100 salts land outside ±1 %: bench/mix_quota.py); the quota is exact over each block of
`QUOTA_BLOCK` conversations (cumulative
floor(n*f)), and which conversations of a block think is decided by a hash of their id, so a file
sorted or interleaved by source does not alias with a fixed pattern.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _str_or_strs(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(_int(x) and x >= 0 for x in v)


# key -> (check, what the check wants). The value ranges are the engines' own where they have one
# (vLLM SamplingParams._verify_args: top_k -1 or >= 1 (0 = off), min_p in [0, 1], presence and
# frequency penalties in [-2, 2], repetition_penalty > 0, min_tokens >= 0).
_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "temperature": (lambda v: _num(v) and 0 <= v <= 2, "a number in [0, 2]"),
    "top_p": (lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _int(v) and (v >= -1), "an integer: -1 or 0 (off) or >= 1"),
    "min_p": (lambda v: _num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "presence_penalty": (lambda v: _num(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: _num(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "repetition_penalty": (lambda v: _num(v) and 0 < v <= 2, "a number in (0, 2]"),
    "stop": (_str_or_strs, "a string or a list of strings"),
    "stop_token_ids": (_ints, "a list of token ids (integers >= 0)"),
    "min_tokens": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "logit_bias": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and _num(x) for k, x in v.items()),
                   "an object of token id -> bias"),
    # SGLang only (ChatCompletionRequest's "extra parameters for SRT backend").
    "stop_regex": (_str_or_strs, "a string or a list of strings"),
    "no_stop_trim": (lambda v: isinstance(v, bool), "true or false"),
    # vLLM only (chat-completion-sampling-params).
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "true or false"),
    "spaces_between_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "bad_words": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "allowed_token_ids": (_ints, "a list of token ids (integers >= 0)"),
}

_OPENAI = frozenset({"max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "stop",
                     "logit_bias"})
_BOTH = _OPENAI | {"top_k", "min_p", "repetition_penalty", "stop_token_ids", "min_tokens", "ignore_eos",
                   "skip_special_tokens"}
DIALECTS: dict[str, frozenset[str]] = {
    "sglang": _BOTH | {"stop_regex", "no_stop_trim"},
    "vllm": _BOTH | {"include_stop_str_in_output", "spaces_between_special_tokens", "bad_words",
                     "allowed_token_ids"},
    # A generic OpenAI-compatible server: only the OpenAI API's own sampling fields.
    "openai": _OPENAI,
}
"""The sampling keys each engine's chat request accepts (engine names as serving/engines.Engine)."""

SAMPLING_KEYS = tuple(sorted(_KEYS))
# Fields of the request body that are not sampling overrides; named so the refusal says why.
_NOT_OVERRIDES = {
    "seed": "the seed is derived from the run's `seed` param, the id and the sample",
    "chat_template_kwargs": "give the thinking mode as the row's `enable_thinking` (or the run's)",
    "enable_thinking": "give the thinking mode as the row's `enable_thinking` (or the run's)",
    "n": "one row per request: use samples_per_prompt",
    "stream": "the pipeline reads whole answers",
    "model": "the model is the run's",
    "messages": "the messages are the row's",
}
QUOTA_BLOCK = 64


class SamplingError(ValueError):
    """A sampling override that no engine accepts (unknown key or wrong type)."""


def check_overrides(value: Any, where: str) -> dict[str, Any]:
    """The override object `value` checked key by key (a copy); raises SamplingError naming `where`."""
    if not isinstance(value, dict):
        raise SamplingError(f"{where} must be an object of sampling fields, got {type(value).__name__}")
    for key, v in value.items():
        if key in _NOT_OVERRIDES:
            raise SamplingError(f"{where}: {key!r} cannot be set here: {_NOT_OVERRIDES[key]}")
        if key not in _KEYS:
            raise SamplingError(f"{where}: unknown sampling key {key!r}; accepted keys are {list(SAMPLING_KEYS)}")
        ok, want = _KEYS[key]
        if not ok(v):
            raise SamplingError(f"{where}: {key}={v!r} must be {want}")
    return json.loads(json.dumps(value))  # a plain, JSON-safe copy


def unsupported_keys(keys: Iterable[str], engine: str) -> list[str]:
    """The keys `engine`'s chat request does not accept (sorted); unknown engines speak OpenAI's dialect."""
    dialect = DIALECTS.get(engine, DIALECTS["openai"])
    return sorted(set(keys) - dialect)


def parse_row_mix(row: Mapping[str, Any]) -> tuple[bool | None, dict[str, Any] | None] | str:
    """(thinking, sampling overrides) of an input row, or the reason they cannot be used.

    Thinking: `enable_thinking` (a bool), else `thinking` when it is a bool (a row may use `thinking`
    for something else, e.g. a text: then it is metadata). Sampling: the row's `sampling` object."""
    thinking: bool | None = None
    value = row.get("enable_thinking")
    if value is not None:
        if not isinstance(value, bool):
            return f"'enable_thinking' must be true or false, got {type(value).__name__}"
        thinking = value
    elif isinstance(row.get("thinking"), bool):
        thinking = row["thinking"]
    sampling = decode_json_text(row.get("sampling"), "sampling")
    if isinstance(sampling, JsonTextError):
        return str(sampling)
    if sampling is not None:
        try:
            sampling = check_overrides(sampling, "'sampling'") or None
        except SamplingError as exc:
            return str(exc)
    return thinking, sampling


class JsonTextError(str):
    """`decode_json_text`'s refusal, a message a person can act on."""


def decode_json_text(value: Any, name: str) -> Any:
    """A row field that may be a JSON-encoded object in a string (as a Parquet column carries one):
    decoded ("" is None); any other value as given; a string that is not JSON is a JsonTextError."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value) if value.strip() else None
    except json.JSONDecodeError:
        return JsonTextError(f"'{name}' is a string that is not a JSON object")


ROW_MIX_KEYS = ("enable_thinking", "sampling")
"""Input row keys `parse_row_mix` consumes (`thinking` only when a bool), kept out of the row's metadata."""


def row_mix_keys(row: Mapping[str, Any]) -> set[str]:
    """The keys of `row` that are its mix settings (not metadata)."""
    keys = {k for k in ROW_MIX_KEYS if row.get(k) is not None}
    if row.get("enable_thinking") is None and isinstance(row.get("thinking"), bool):
        keys.add("thinking")
    return keys


def _rank(key: str) -> bytes:
    return hashlib.sha256(f"dflash-thinking:{key}".encode()).digest()


class ThinkingQuota:
    """Thinking modes for the conversations that take theirs from `thinking_fraction`, in plan order.

    Of the first n such conversations, exactly floor(n * f) think at every block boundary (blocks of
    QUOTA_BLOCK), so the share is within one conversation per block of f, and never further than one
    conversation from it at the end. Deterministic: the same file, order and ids give the same modes."""

    def __init__(self, fraction: float, block: int = QUOTA_BLOCK) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"thinking_fraction {fraction} is not in [0, 1]")
        self.fraction = fraction
        self.block = block
        self.assigned = 0
        self.thinking = 0

    def assign(self, keys: list[str]) -> list[bool]:
        """Modes of the next block of conversations (their ids): the quota's count, lowest hashes think."""
        start = self.assigned
        end = start + len(keys)
        n_think = math.floor(end * self.fraction + 1e-9) - math.floor(start * self.fraction + 1e-9)
        order = sorted(range(len(keys)), key=lambda i: (_rank(keys[i]), i))
        thinks = set(order[:n_think])
        self.assigned = end
        self.thinking += n_think
        return [i in thinks for i in range(len(keys))]

    def stream(self, items: Iterable[T], key: Callable[[T], str | None]) -> Iterator[tuple[T, bool | None]]:
        """(item, mode) for every item; items whose `key` is None keep None (their mode is their own)."""
        pending: list[T] = []
        buf: list[tuple[T, bool | None]] = []

        def flush() -> Iterator[tuple[T, bool | None]]:
            modes = iter(self.assign([key(p) or "" for p in pending]))
            for item, _ in buf:
                yield item, (next(modes) if key(item) is not None else None)
            pending.clear()
            buf.clear()

        for item in items:
            buf.append((item, None))
            if key(item) is not None:
                pending.append(item)
            if len(pending) >= self.block:
                yield from flush()
        yield from flush()


def request_sampling(base: Mapping[str, Any], ladder: tuple[Mapping[str, Any], ...], sample: int,
                     row: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sampling fields of one request: the run's (`base`: max_tokens, temperature, top_p and its
    extras), then the sample's ladder entry, then the row's overrides, key by key."""
    out = dict(base)
    if ladder:
        out.update(ladder[sample % len(ladder)])
    if row:
        out.update(row)
    return out


def sampling_json(fields: Mapping[str, Any]) -> str:
    """The completion row's `sampling` column: the fields sent, JSON with sorted keys."""
    return json.dumps(dict(fields), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
