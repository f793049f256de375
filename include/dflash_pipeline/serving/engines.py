"""Which inference engine a server runs, and what differs on the wire between them.

Why: labs run SGLang and vLLM side by side (one server per GPU, either engine), and the two
OpenAI-compatible servers differ exactly where a thinking dataset breaks silently: vLLM returns
the thinking in `message.reasoning` (it replaced `reasoning_content` in vLLM 0.17), SGLang in
`message.reasoning_content` and only when asked with `separate_reasoning`. Everything
engine-specific lives here; `serving/sglang.py` keeps the HTTP client and calls these adapters.

Detection (from what the server serves, never from its name):
- SGLang: `/get_server_info` (or `/server_info` in newer SGLang) answers a JSON object;
- vLLM: no server-info endpoint, `/version` answers `{"version": ...}` and `/v1/models` cards
  carry `max_model_len` (vLLM `entrypoints/openai/basic/api_router.py`, `engine/protocol.py`);
- anything else that answers `/v1/models`: a generic OpenAI-compatible server.

Checked against vLLM's source: `entrypoints/openai/engine/protocol.py` (ErrorResponse is
`{"error": {"message", "type", "param", "code"}}`, ModelCard has `max_model_len`),
`entrypoints/openai/chat_completion/protocol.py` (ChatMessage `content: str | None`,
`reasoning: str | None`; `chat_template_kwargs` is a top-level request field),
`v1/metrics/loggers.py` (`/metrics` gauges: `vllm:num_requests_running`/`_waiting` are load,
not capacity; `vllm:kv_cache_usage_perc` (1 = full; `vllm:gpu_cache_usage_perc` before 0.9) is
the KV cache in use; the only config info gauge is `vllm:cache_config_info`, CacheConfig labels
such as `num_gpu_blocks` and `block_size`: the scheduler's `max_num_seqs` is not exposed, which
is why serving/concurrency.py discovers it from the load).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

# Concurrency slots assumed for a server that does not tell us its capacity (vLLM, generic).
# The same figure derive_concurrency falls back to; preflight warns in the log and the manifest.
DEFAULT_CAPACITY = 16


class Engine(str, enum.Enum):
    SGLANG = "sglang"
    VLLM = "vllm"
    OPENAI = "openai"  # generic OpenAI-compatible server

    @classmethod
    def parse(cls, value: str | None) -> Engine:
        """The engine named in preflight's per-server dict; unknown/None means SGLang (older manifests)."""
        try:
            return cls(value or cls.SGLANG.value)
        except ValueError:
            return cls.OPENAI


@dataclass(frozen=True)
class EngineAdapter:
    """The wire dialect of one engine."""

    engine: Engine
    # Send SGLang's `separate_reasoning`: only SGLang knows it (vLLM logs "ignored field" for it,
    # a strict generic server may refuse it).
    separate_reasoning: bool
    # Where the server reports its capacity; None: it does not (a default is used, with a warning).
    capacity_source: str | None
    # GET endpoint that tells how many requests the server holds (running + waiting), if any.
    load_path: str | None

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """Add the engine's extra fields to an OpenAI chat body (in place; returned for chaining)."""
        if self.separate_reasoning:
            body["separate_reasoning"] = True
        return body


ADAPTERS: dict[Engine, EngineAdapter] = {
    Engine.SGLANG: EngineAdapter(Engine.SGLANG, True, "max_running_requests", "/get_load"),
    Engine.VLLM: EngineAdapter(Engine.VLLM, False, None, "/metrics"),
    Engine.OPENAI: EngineAdapter(Engine.OPENAI, False, None, None),
}


def adapter(engine: Engine | str | None) -> EngineAdapter:
    return ADAPTERS[engine if isinstance(engine, Engine) else Engine.parse(engine)]


def reasoning_of(message: dict[str, Any]) -> str | None:
    """The separated thinking of a chat message: `reasoning_content` (SGLang, vLLM < 0.17) or
    `reasoning` (vLLM >= 0.17). An empty string counts as absent."""
    return message.get("reasoning_content") or message.get("reasoning") or None


def error_message(parsed: Any) -> str | None:
    """The human message of an error body in any of the shapes the engines send:
    vLLM `{"error": {"message": ...}}`, SGLang/older vLLM `{"object": "error", "message": ...}`,
    FastAPI `{"detail": ...}`, auth middlewares `{"error": "Unauthorized"}`."""
    if not isinstance(parsed, dict):
        return None
    err = parsed.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or "") or None
    value = parsed.get("message") or parsed.get("detail") or err
    return None if value is None else str(value)


def error_code(parsed: Any) -> int | None:
    """The status code carried inside an error body (SGLang may send one with HTTP 200)."""
    if not isinstance(parsed, dict):
        return None
    inner = parsed.get("error") if isinstance(parsed.get("error"), dict) else parsed
    try:
        return int(inner.get("code"))
    except (TypeError, ValueError):
        return None


def is_error_body(parsed: Any) -> bool:
    """An error object where a completion was expected (both shapes)."""
    return isinstance(parsed, dict) and (
        parsed.get("object") == "error" or (isinstance(parsed.get("error"), dict) and "choices" not in parsed)
    )


@dataclass(frozen=True)
class LoadSample:
    """What a server's load endpoint says at one moment: requests in its running batch, requests
    waiting in its queue (both summed over DP ranks / engines), and the share of its KV cache in
    use when it publishes one (vLLM; None otherwise)."""

    running: int
    waiting: int
    kv_usage: float | None = None

    @property
    def held(self) -> int:
        """Requests the server holds (running + waiting): what the deadline rules compare with ours."""
        return self.running + self.waiting


_GAUGE = re.compile(r"^(vllm:num_requests_(?:running|waiting))(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)
_KV_USAGE = re.compile(r"^vllm:(kv_cache_usage_perc|gpu_cache_usage_perc)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def vllm_load_sample(metrics_text: str) -> LoadSample | None:
    """Running and waiting requests (summed over engines) and KV cache usage (the fullest engine's)
    from a vLLM `/metrics` text; None when the load gauges are missing."""
    found = _GAUGE.findall(metrics_text)
    if not found:
        return None
    running = sum(float(v) for name, v in found if name.endswith("running"))
    waiting = sum(float(v) for name, v in found if name.endswith("waiting"))
    usages = _KV_USAGE.findall(metrics_text)
    pick = "kv_cache_usage_perc" if any(n == "kv_cache_usage_perc" for n, _ in usages) else "gpu_cache_usage_perc"
    values = [float(v) for n, v in usages if n == pick]  # one per engine: the fullest one limits
    return LoadSample(int(running), int(waiting), max(values) if values else None)


def vllm_load(metrics_text: str) -> int | None:
    """Requests a vLLM server holds (running + waiting, summed over engines) from `/metrics`."""
    sample = vllm_load_sample(metrics_text)
    return None if sample is None else sample.held


def vllm_kv_tokens(metrics_text: str) -> int | None:
    """KV cache size in tokens (num_gpu_blocks x block_size) from `vllm:cache_config_info`."""
    m = _CACHE_INFO.search(metrics_text)
    if not m:
        return None
    labels = dict(_LABEL.findall(m.group(1)))
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None


def sglang_load_sample(payload: Any) -> LoadSample | None:
    """Running and waiting requests of an SGLang server, from `/get_load` (a list per DP rank, or
    one dict): `num_reqs` is a rank's running + waiting, `num_waiting_reqs` the waiting part."""
    items = payload if isinstance(payload, list) else [payload]
    held = waiting = 0
    seen = False
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("num_reqs"), (int, float)):
            n = int(item["num_reqs"])
            w = item.get("num_waiting_reqs")
            w = min(n, int(w)) if isinstance(w, (int, float)) and not isinstance(w, bool) else 0
            held += n
            waiting += w
            seen = True
    return LoadSample(held - waiting, waiting) if seen else None


def sglang_load(payload: Any) -> int | None:
    """Requests an SGLang server holds, from `/get_load` (a list per DP rank, or one dict)."""
    sample = sglang_load_sample(payload)
    return None if sample is None else sample.held
