"""Multi-turn behaviour of the simulated server: a radix-cache model and a history audit.

- Radix cache (SGLang keeps the KV of every prompt and of what it generated, keyed by the token
  prefix): modelled at message granularity. A request whose first k messages were seen before
  (as a prompt, or as a prompt plus the answer this server generated for it) has the tokens of
  those k messages cached: they are not prefilled again (faster) and are reported in
  `usage.prompt_tokens_details.cached_tokens`, as SGLang does with `--enable-cache-report`.
  Bounded (least recently used prefixes go first), like a real KV pool.
- History audit (`track_history`): the server remembers a hash of every answer it generated and
  counts the assistant turns of incoming requests that are / are not among them. With
  regenerate=all_turns every history turn must be this very server's earlier answer: a non-zero
  `foreign_history_turns` means an original answer was sent back or a conversation changed
  servers. Exposed in `/sim/stats` under "conversation".
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from dflash_pipeline.dev.sim.lengths import PROMPT_TOKENS_PER_MESSAGE, count_tokens, message_text


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=12).digest()


def _message_key(message: Any) -> str:
    if not isinstance(message, dict):
        return repr(message)
    return f"{message.get('role')}\x1f{message_text(message.get('content'))}"


def _message_tokens(message: Any) -> int:
    text = message_text(message.get("content")) if isinstance(message, dict) else ""
    return count_tokens(text) + PROMPT_TOKENS_PER_MESSAGE


class ConversationModel:
    """Per-server prefix cache and audit of history turns (thread-safe)."""

    def __init__(self, cache_prefixes: int = 200_000) -> None:
        self.cache_prefixes = cache_prefixes
        self._lock = threading.Lock()
        self._prefixes: OrderedDict[bytes, None] = OrderedDict()
        self._own: set[bytes] = set()
        self.counts = {
            "requests": 0,
            "requests_with_history": 0,
            "own_history_turns": 0,
            "foreign_history_turns": 0,
            "answers_generated": 0,
            "cached_tokens": 0,
            "prompt_tokens": 0,
        }

    @staticmethod
    def _chain(messages: Sequence[Any]) -> list[tuple[bytes, int]]:
        """(hash of messages[:k+1], tokens of messages[:k+1]) for every k."""
        out: list[tuple[bytes, int]] = []
        h = hashlib.blake2b(digest_size=12)
        tokens = 0
        for m in messages:
            h.update(_message_key(m).encode("utf-8") + b"\x1e")
            tokens += _message_tokens(m)
            out.append((h.copy().digest(), tokens))
        return out

    def on_request(self, messages: Sequence[Any], prompt_tokens: int, track_history: bool) -> int:
        """Audit the history and return how many prompt tokens the cache already holds."""
        chain = self._chain(messages)
        with self._lock:
            self.counts["requests"] += 1
            self.counts["prompt_tokens"] += prompt_tokens
            if track_history:
                history = [m for m in messages[:-1] if isinstance(m, dict) and m.get("role") == "assistant"]
                if history:
                    self.counts["requests_with_history"] += 1
                for m in history:
                    own = _digest(message_text(m.get("content"))) in self._own
                    self.counts["own_history_turns" if own else "foreign_history_turns"] += 1
            cached = 0
            for key, tokens in reversed(chain):
                if key in self._prefixes:
                    self._prefixes.move_to_end(key)
                    cached = tokens
                    break
            # The last prompt token is always computed (it yields the first output token).
            cached = max(0, min(cached, prompt_tokens - 1))
            self.counts["cached_tokens"] += cached
            for key, _ in chain:
                self._insert(key)
        return cached

    def on_answer(self, messages: Sequence[Any], content: str, track_history: bool) -> None:
        """Remember an answer: its text (audit) and the prompt + answer prefix (cache)."""
        chain = self._chain([*messages, {"role": "assistant", "content": content}])
        with self._lock:
            self.counts["answers_generated"] += 1
            if track_history:
                self._own.add(_digest(content))
            self._insert(chain[-1][0])

    def _insert(self, key: bytes) -> None:
        self._prefixes[key] = None
        self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.cache_prefixes:
            self._prefixes.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.counts, "own_answers_known": len(self._own), "cached_prefixes": len(self._prefixes)}

    def reset(self) -> None:
        with self._lock:
            for k in self.counts:
                self.counts[k] = 0
