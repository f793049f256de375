"""The simulator's sampling fields: which ones each engine's request model takes, what it refuses, and a
record of what every chat request carried, so a test can check that settings reach the server as sent.

Checked against the engines' request models:

* SGLang ``python/sglang/srt/entrypoints/openai/protocol.py`` ``ChatCompletionRequest``: ``top_k:
  Optional[int]``, ``min_p: Optional[float]``, ``min_tokens: int``, ``repetition_penalty:
  Optional[float]``, ``stop: Optional[Union[str, List[str]]]``, ``stop_token_ids:
  Optional[List[int]]``, ``stop_regex``, ``no_stop_trim: bool``, ``ignore_eos: bool``,
  ``skip_special_tokens: bool``, ``presence_penalty: float``, ``frequency_penalty: float``.
* vLLM 0.32 ``vllm/entrypoints/openai/chat_completion/protocol.py`` ``ChatCompletionRequest`` (the
  "chat-completion-sampling-params" block): the same names (``stop`` is ``str | list[str] | None``)
  plus ``include_stop_str_in_output``, ``spaces_between_special_tokens``, ``bad_words``,
  ``allowed_token_ids``; ``SamplingParams._verify_args`` refuses out-of-range values with a 400
  (``top_k`` below -1, ``min_p`` outside [0, 1], penalties outside [-2, 2], ``repetition_penalty`` <= 0,
  ``min_tokens`` < 0 or above ``max_tokens``).
* Both accept fields they do not know and ignore them (SGLang: pydantic's default; vLLM:
  ``OpenAIBaseModel`` ``extra="allow"``, logged at debug level): so does the simulator.

A wrong type is refused by both as pydantic refuses it (a 400 naming the field; SGLang's text differs
from vLLM's, the status is the same). Simplification: pydantic's lax coercions (``"5"`` for an int) are
refused here; the pipeline never sends them.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _str_list(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))


_TYPES: dict[str, tuple[Any, str]] = {
    "temperature": (_is_num, "float"), "top_p": (_is_num, "float"), "top_k": (_is_int, "int"),
    "min_p": (_is_num, "float"), "presence_penalty": (_is_num, "float"), "frequency_penalty": (_is_num, "float"),
    "repetition_penalty": (_is_num, "float"), "min_tokens": (_is_int, "int"),
    "stop": (_str_list, "str | list[str]"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "list[int]"),
    "ignore_eos": (lambda v: isinstance(v, bool), "bool"), "skip_special_tokens": (lambda v: isinstance(v, bool), "bool"),
}
_SGLANG = {"stop_regex": (_str_list, "str | list[str]"), "no_stop_trim": (lambda v: isinstance(v, bool), "bool")}
_VLLM = {
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "bool"),
    "spaces_between_special_tokens": (lambda v: isinstance(v, bool), "bool"),
    "bad_words": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "list[str]"),
    "allowed_token_ids": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "list[int]"),
}

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", *_TYPES, *_SGLANG, *_VLLM)
"""The body fields a received-request record keeps (besides the thinking flag)."""


def refusal(obj: dict[str, Any], engine: str) -> str | None:
    """The 400 message the engine answers `obj`'s sampling fields with, or None when it takes them."""
    types = {**_TYPES, **(_VLLM if engine == "vllm" else _SGLANG)}
    for name, (ok, want) in types.items():
        value = obj.get(name)
        if value is not None and not ok(value):
            return f"1 validation error for ChatCompletionRequest\n{name}\n  Input should be a valid {want} " \
                   f"[input_value={value!r}]"
    if engine != "vllm":
        return None
    # vLLM 0.32 SamplingParams._verify_args (VLLMValidationError, 400; these name no parameter, so the
    # message has no "(parameter=P, value=V)" tail and the body's `param` is null).
    checks = (
        ("presence_penalty", lambda v: -2 <= v <= 2, "presence_penalty must be in [-2, 2], got {v}."),
        ("frequency_penalty", lambda v: -2 <= v <= 2, "frequency_penalty must be in [-2, 2], got {v}."),
        ("repetition_penalty", lambda v: v > 0, "repetition_penalty must be greater than zero, got {v}."),
        ("top_k", lambda v: v >= -1, "top_k must be 0 (disable), or at least 1, got {v}."),
        ("min_p", lambda v: 0 <= v <= 1, "min_p must be in [0, 1], got {v}."),
        ("min_tokens", lambda v: v >= 0, "min_tokens must be greater than or equal to 0, got {v}."),
    )
    for name, ok, msg in checks:
        value = obj.get(name)
        if value is not None and not ok(value):
            return msg.format(v=float(value) if name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                                                         "min_p") else value)
    max_tokens = obj.get("max_completion_tokens") or obj.get("max_tokens")
    min_tokens = obj.get("min_tokens")
    if _is_int(min_tokens) and _is_int(max_tokens) and min_tokens > max_tokens:
        return f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
    return None


class RequestLog:
    """The sampling fields of the last `limit` chat requests a server received (thread-safe), in order."""

    def __init__(self, limit: int = 100_000) -> None:
        self._rows: deque[dict[str, Any]] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def add(self, obj: dict[str, Any], request_id: str, refused: str | None = None) -> None:
        kwargs = obj.get("chat_template_kwargs")
        messages = obj.get("messages") or []
        last = messages[-1].get("content") if messages and isinstance(messages[-1], dict) else None
        row = {"request_id": request_id, "sampling": {k: obj[k] for k in SAMPLING_FIELDS if k in obj},
               "enable_thinking": kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None,
               "last_message": str(last)[:200] if last is not None else None,
               "unknown_fields": sorted(k for k in obj if k not in _KNOWN), "refused": refused}
        with self._lock:
            self._rows.append(row)

    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._rows)

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()


# Request fields the sim reads or that either engine knows besides sampling (not reported as unknown).
_KNOWN = set(SAMPLING_FIELDS) | {
    "model", "messages", "stream", "chat_template_kwargs", "separate_reasoning", "return_token_ids",
    "return_prompt_token_ids", "return_meta_info", "return_spec_tokens_details", "max_completion_tokens", "n",
    "logit_bias", "logprobs", "top_logprobs", "user",
}
