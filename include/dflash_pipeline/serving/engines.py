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
    # GET endpoints that tell how many requests the server holds (running + waiting), newest first.
    load_paths: tuple[str, ...]
    # Request fields that make the engine return the token ids it used (prompt and generated):
    # the training data is built from them, never from re-encoded text, where an engine gives them.
    token_id_fields: tuple[tuple[str, Any], ...] = ()

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """Add the engine's extra fields to an OpenAI chat body (in place; returned for chaining)."""
        if self.separate_reasoning:
            body["separate_reasoning"] = True
        for name, value in self.token_id_fields:
            body[name] = value
        return body


ADAPTERS: dict[Engine, EngineAdapter] = {
    # SGLang: `/v1/loads` (every release checked, 0.5.9-0.5.23); `/get_load` was removed in 0.5.21.
    # Token ids: `return_prompt_token_ids` (>= 0.5.13) and `return_token_ids` (>= 0.5.17) give
    # `choices[].prompt_token_ids` and `choices[].response_token_ids` (`token_ids` in 0.5.17 only);
    # older versions ignore both fields silently (then the answer simply has no ids).
    Engine.SGLANG: EngineAdapter(Engine.SGLANG, True, "max_running_requests", ("/v1/loads", "/get_load"),
                                 (("return_prompt_token_ids", True), ("return_token_ids", True))),
    # vLLM >= 0.10.2: top-level `prompt_token_ids` and per-choice `token_ids` (older versions ignore the field).
    Engine.VLLM: EngineAdapter(Engine.VLLM, False, None, ("/metrics",), (("return_token_ids", True),)),
    Engine.OPENAI: EngineAdapter(Engine.OPENAI, False, None, ()),
}


def _ints(v: Any) -> list[int] | None:
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    return None


def token_ids_of(data: dict[str, Any], choice: dict[str, Any]) -> tuple[list[int] | None, list[int] | None]:
    """(prompt ids, generated ids) an engine returned with a chat completion, each None when absent.

    vLLM: top-level `prompt_token_ids`, per-choice `token_ids`. SGLang: per-choice
    `prompt_token_ids` and `response_token_ids` (`token_ids` in 0.5.17). Both engines' generated ids
    are the raw output (before the reasoning split), the stop token included. A list that is not
    all ints is treated as absent (never half-trusted)."""
    prompt = _ints(data.get("prompt_token_ids"))
    if prompt is None:
        prompt = _ints(choice.get("prompt_token_ids"))
    output = _ints(choice.get("response_token_ids"))
    if output is None:
        output = _ints(choice.get("token_ids"))
    return prompt, output


def token_id_sources(data: dict[str, Any], choice: dict[str, Any]) -> tuple[str | None, str | None]:
    """Where `token_ids_of` found the prompt ids and the generated ids of an answer (e.g.
    `prompt_token_ids` top-level for vLLM, `choices[].prompt_token_ids` for SGLang), None where it found
    none: the evidence preflight records of how a server returns token ids (serving/abilities.py)."""
    prompt = "prompt_token_ids" if _ints(data.get("prompt_token_ids")) is not None else (
        "choices[].prompt_token_ids" if _ints(choice.get("prompt_token_ids")) is not None else None)
    output = "choices[].response_token_ids" if _ints(choice.get("response_token_ids")) is not None else (
        "choices[].token_ids" if _ints(choice.get("token_ids")) is not None else None)
    return prompt, output


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
    """Running and waiting requests of an SGLang server (summed over DP ranks) and its KV cache
    usage (the fullest rank's `token_usage`, when given): from `/v1/loads`
    (`{"loads": [{"num_running_reqs", "num_waiting_reqs", "token_usage", ...}]}`) or the older
    `/get_load` (a list per DP rank, or one dict, with `num_reqs` = running + waiting and
    `num_waiting_reqs` the waiting part)."""
    if isinstance(payload, dict) and isinstance(payload.get("loads"), list):
        items = payload["loads"]
    else:
        items = payload if isinstance(payload, list) else [payload]

    def num(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    running = waiting = 0
    usages: list[float] = []
    seen = False
    for item in items:
        if not isinstance(item, dict):
            continue
        w = int(num(item.get("num_waiting_reqs")) or 0)
        if num(item.get("num_reqs")) is not None:
            held = int(item["num_reqs"])
            w = min(held, w)
            running, waiting = running + held - w, waiting + w
            seen = True
        elif num(item.get("num_running_reqs")) is not None:
            running, waiting = running + int(item["num_running_reqs"]), waiting + w
            seen = True
        usage = num(item.get("token_usage"))
        if usage is not None:
            usages.append(usage)
    return LoadSample(running, waiting, max(usages) if usages else None) if seen else None


def sglang_load(payload: Any) -> int | None:
    """Requests an SGLang server holds (running + waiting, summed over DP ranks)."""
    sample = sglang_load_sample(payload)
    return None if sample is None else sample.held
