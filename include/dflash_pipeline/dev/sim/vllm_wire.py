"""The simulator's vLLM flavour: what a client sees from vLLM's OpenAI server instead of SGLang's.

Why: labs mix engines in one fleet; the pipeline must detect and speak both. The batcher, faults
and text model are shared (server.py); only the wire differs, and all of it is here, selected by
``SimConfig.engine == "vllm"``.

Checked against vLLM's source (vllm-project/vllm, main):

* ``vllm/entrypoints/openai/basic/api_router.py``: ``GET /version`` -> ``{"version": ...}``.
* ``vllm/entrypoints/openai/engine/protocol.py``: ``ErrorResponse`` is
  ``{"error": {"message", "type", "param", "code"}}`` (nested, recent vLLM); ``ModelCard`` has
  ``owned_by: "vllm"``, ``root``, ``parent``, ``max_model_len``, ``permission``.
* ``vllm/entrypoints/openai/chat_completion/protocol.py``: ``ChatMessage`` has ``content: str |
  None`` and ``reasoning: str | None`` (``reasoning_content`` was removed, vLLM >= 0.17);
  ``tool_calls`` is dropped when empty; choices carry ``stop_reason`` (no ``matched_stop``);
  ``chat_template_kwargs`` is a top-level field; unknown fields (``separate_reasoning``) are
  ignored with a warning.
* ``vllm/v1/metrics/loggers.py``: ``/metrics`` in Prometheus text; ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (gauges; usage 1 = full),
  ``vllm:cache_config_info`` (info gauge with CacheConfig labels, e.g. ``num_gpu_blocks``,
  ``block_size``); no gauge carries ``max_num_seqs``. The slot count (``max_running_requests``,
  vLLM's ``--max-num-seqs``) is therefore hidden on this wire, as on vLLM's: only the sim-only
  ``/sim/stats`` and ``/sim/config`` show it, and ``POST /sim/config`` changes it at run time
  (running requests above a lowered figure finish; new ones wait), which stands for a vLLM server
  whose effective batch shrinks (KV-cache pressure).
* Context-length 400s: "This model's maximum context length is N tokens. However, your request
  has M input tokens. ..." and "'max_tokens' or 'max_completion_tokens' is too large: ...".
* There is no ``/get_server_info``, ``/server_info``, ``/get_load`` or ``/health_generate``
  (404 ``{"detail": "Not Found"}``); ``/health`` answers 200 with an empty body.

The reasoning split follows the server's ``--reasoning-parser`` (``SimConfig.reasoning_parser``)
alone: vLLM has no per-request ``separate_reasoning``.
"""

from __future__ import annotations

import uuid
from typing import Any

VLLM_SIM_VERSION = "0.17.1-sim"
"""What ``/version`` answers (a vLLM version in which ``reasoning`` replaced ``reasoning_content``)."""

GET_ROUTES = {
    "/health": "_health",
    "/version": "_vllm_version",
    "/metrics": "_vllm_metrics",
    "/v1/models": "_vllm_models",
    "/sim/stats": "_sim_stats",
}
POST_ROUTES = {
    "/v1/chat/completions": "_chat",
    "/sim/config": "_sim_config",
    "/sim/crash": "_sim_crash",
    "/sim/reset_stats": "_sim_reset_stats",
}

INPUT_TOO_LONG_MSG = (
    "This model's maximum context length is {context_length} tokens. However, your request has "
    "{input_tokens} input tokens. Please reduce the length of the input messages."
)
MAX_TOKENS_TOO_LARGE_MSG = (
    "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
    "context length is {context_length} tokens and your request has {input_tokens} input tokens "
    "({max_tokens} > {context_length} - {input_tokens}). (parameter=max_tokens, value={max_tokens})"
)


def error_body(code: int, message: str, err_type: str) -> dict[str, Any]:
    """vLLM's nested ErrorResponse."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}}


def context_error(prompt_tokens: int, max_tokens: int | None, context_length: int) -> str | None:
    """vLLM's 400 message when the request cannot fit, else None."""
    if prompt_tokens >= context_length:
        return INPUT_TOO_LONG_MSG.format(context_length=context_length, input_tokens=prompt_tokens)
    if max_tokens is not None and prompt_tokens + max_tokens > context_length:
        return MAX_TOKENS_TOO_LARGE_MSG.format(max_tokens=max_tokens, context_length=context_length,
                                               input_tokens=prompt_tokens)
    return None


def chat_response(model: str, created: int, completion: Any, prompt_tokens: int, cached_tokens: int = 0,
                  token_ids: tuple[list[int], list[int]] | None = None) -> dict[str, Any]:
    """A non-streaming ChatCompletionResponse as vLLM serialises it (`prompt_tokens_details` as
    with --enable-prompt-tokens-details and prefix caching: present only when tokens were cached;
    `prompt_token_ids` and the choice's `token_ids` with `return_token_ids`, else null)."""
    prompt_ids, output_ids = token_ids if token_ids is not None else (None, None)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": completion.content or None,
                        "refusal": None, "annotations": None, "audio": None, "function_call": None,
                        "reasoning": completion.reasoning_content or None},
            "logprobs": None,
            "finish_reason": completion.finish_reason,
            "stop_reason": None,
            "token_ids": output_ids,
        }],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion.completion_tokens,
            "completion_tokens": completion.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens} if cached_tokens else None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids,
        "kv_transfer_params": None,
    }


def models_body(served_model_name: str, model_path: str, created: int, context_length: int) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": served_model_name, "object": "model", "created": created, "owned_by": "vllm",
        "root": model_path, "parent": None, "max_model_len": context_length,
        "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                        "created": created, "allow_create_engine": False, "allow_sampling": True,
                        "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                        "allow_fine_tuning": False, "organization": "*", "group": None,
                        "is_blocking": False}],
    }]}


def metrics_text(model: str, running: int, waiting: int, kv_blocks: int, block_size: int = 16,
                 kv_usage: float = 0.0) -> str:
    """The part of vLLM's Prometheus exposition a client can use (load, KV cache use and config)."""
    label = f'engine="0",model_name="{model}"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{label}}} {float(running)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{label}}} {float(waiting)}\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{label}}} {float(kv_usage)}\n"
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
        f'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
        f'num_gpu_blocks="{kv_blocks}"}} 1.0\n'
    )


class VllmEndpoints:
    """Handler methods for the endpoints only the vLLM flavour serves (mixed into the handler)."""

    sim: Any

    def _vllm_version(self, _body: bytes) -> None:
        self._send_json(200, {"version": VLLM_SIM_VERSION})  # type: ignore[attr-defined]

    def _vllm_models(self, _body: bytes) -> None:
        config = self.sim.config
        self._send_json(200, models_body(config.served_model_name, config.model_path,  # type: ignore[attr-defined]
                                         int(self.sim.created_t), config.context_length))

    def _vllm_metrics(self, _body: bytes) -> None:
        running, waiting, tokens = self.sim._sched.load()
        config = self.sim.config
        usage = min(1.0, tokens / config.max_total_num_tokens) if config.max_total_num_tokens > 0 else 0.0
        text = metrics_text(config.served_model_name, running, waiting, config.max_total_num_tokens // 16,
                            kv_usage=round(usage, 4))
        self._send(200, text.encode(), content_type="text/plain; version=0.0.4; charset=utf-8")  # type: ignore[attr-defined]
