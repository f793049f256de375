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
* ``vllm/v1/metrics/loggers.py``: ``/metrics`` in Prometheus text (none of the ``vllm:`` series with
  ``--disable-log-stats``: ``SimConfig.disable_log_stats``); ``vllm:generation_tokens_total``, ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (gauges; usage 1 = full),
  ``vllm:cache_config_info`` (info gauge with CacheConfig labels, e.g. ``num_gpu_blocks``,
  ``block_size``); no gauge carries ``max_num_seqs``. The slot count (``max_running_requests``,
  vLLM's ``--max-num-seqs``) is therefore hidden on this wire, as on vLLM's: only the sim-only
  ``/sim/stats`` and ``/sim/config`` show it, and ``POST /sim/config`` changes it at run time
  (running requests above a lowered figure finish; new ones wait), which stands for a vLLM server
  whose effective batch shrinks (KV-cache pressure).
* Context-length 400s: "This model's maximum context length is N tokens. However, your prompt
  contains at least N+1 input tokens, which exceeds this limit even without any output tokens.
  ..." (the prompt is tokenized with truncation at N+1, so the count is always "at least N+1");
  a ``max_tokens`` above ``max_model_len``: "max_tokens=X cannot be greater than max_model_len=N.
  ..."; a prompt of exactly N tokens: "max_tokens must be at least 1, got 0." A ``max_tokens`` that
  fits ``max_model_len`` but not beside the prompt is clamped to ``max_model_len - prompt``
  (``entrypoints/serve/utils/api_utils.get_max_tokens``): no error, the answer ends by ``length``.
  Validation messages end with "(parameter=P, value=V)" and the body's ``param`` is P
  (``vllm/exceptions.py`` ``VLLMValidationError``).
* An unknown ``model``: 404 ``NotFoundError``, "The model `x` does not exist. Valid aliases: ...",
  ``param: "model"`` (``entrypoints/serve/engine/serving.py``); no ``model`` means the served one.
* Without ``--enable-scale-out``, ``/v1/chat/completions/render`` and the other scale-out routes
  answer 403 ``PermissionDeniedError`` (``entrypoints/scale_out/factories.py``).
* There is no ``/get_server_info``, ``/server_info``, ``/get_load`` or ``/health_generate``
  (404 ``{"detail": "Not Found"}``); ``/health`` answers 200 with an empty body.

Each of these was also observed on a real vLLM 0.32.0 server (CPU build) by
tests/engine/test_vllm_wire.py, which runs the same checks against this flavour.

The reasoning split follows the server's ``--reasoning-parser`` (``SimConfig.reasoning_parser``)
alone: vLLM has no per-request ``separate_reasoning``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from dflash_pipeline.dev.sim import spec_vllm

VLLM_SIM_VERSION = "0.32.0+sim"
"""What ``/version`` answers: the vLLM release whose wire this flavour was checked against (a real
0.32.0 answers ``{"version": "0.32.0"}``)."""
SCALE_OUT_ROUTES = (
    "/v1/chat/completions/render", "/v1/completions/render", "/v1/chat/completions/derender",
    "/v1/completions/derender", "/v1/messages/render", "/v1/responses/render", "/inference/v1/generate",
    "/inference/v1/abort_requests",
)
SCALE_OUT_DISABLED_MSG = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."

SYSTEM_FINGERPRINT = f"vllm-{VLLM_SIM_VERSION.split('+')[0]}-{uuid.uuid4().hex[:8]}"
"""vLLM 0.32 answers `vllm-<version>-<8 hex>`, one per server start."""

GET_ROUTES = {
    "/health": "_health",
    "/version": "_vllm_version",
    "/metrics": "_vllm_metrics",
    "/v1/models": "_vllm_models",
    "/sim/stats": "_sim_stats",
    "/sim/requests": "_sim_requests",
}
POST_ROUTES = {
    "/v1/chat/completions": "_chat",
    "/sim/config": "_sim_config",
    "/sim/crash": "_sim_crash",
    "/sim/reset_stats": "_sim_reset_stats",
    "/tokenize": "_vllm_tokenize",
    **{route: "_vllm_scale_out_disabled" for route in SCALE_OUT_ROUTES},
}

INPUT_TOO_LONG_MSG = (
    "This model's maximum context length is {context_length} tokens. However, your prompt contains "
    "at least {input_tokens} input tokens, which exceeds this limit even without any output tokens. "
    "Please reduce the length of the input prompt. (parameter=input_tokens, value={input_tokens})"
)
MAX_TOKENS_TOO_LARGE_MSG = (
    "{field}={max_tokens} cannot be greater than max_model_len={context_length}. Please request fewer "
    "output tokens. (parameter={field}, value={max_tokens})"
)
MAX_TOKENS_TOO_SMALL_MSG = "{field} must be at least 1, got {max_tokens}. (parameter={field}, value={max_tokens})"
MODEL_NOT_FOUND_MSG = "The model `{model}` does not exist. Valid aliases: {served}."
_PARAM = re.compile(r"\(parameter=([A-Za-z_]+), value=[^)]*\)$")


def error_body(code: int, message: str, err_type: str) -> dict[str, Any]:
    """vLLM's nested ErrorResponse; `param` is the parameter a validation message names at its end."""
    m = _PARAM.search(message)
    if m:
        param: str | None = m.group(1)
    else:
        param = "model" if err_type == "NotFoundError" and message.startswith("The model `") else None
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def context_error(prompt_tokens: int, max_tokens: int | None, context_length: int) -> str | None:
    """vLLM's 400 message for a prompt longer than the context, else None (a `max_tokens` that does
    not fit beside the prompt was already clamped or refused by :func:`check_max_tokens`)."""
    del max_tokens
    if prompt_tokens > context_length:
        return INPUT_TOO_LONG_MSG.format(context_length=context_length, input_tokens=context_length + 1)
    return None


def check_max_tokens(field: str, max_tokens: int | None, prompt_tokens: int,
                     context_length: int) -> tuple[int | None, str | None]:
    """(the max_tokens vLLM generates with, None) or (None, its 400 message): above
    max_model_len or below 1 is refused; otherwise clamped to what fits beside the prompt (a
    prompt longer than the context is left to :func:`context_error`)."""
    if max_tokens is not None and max_tokens > context_length:
        return None, MAX_TOKENS_TOO_LARGE_MSG.format(field=field, max_tokens=max_tokens, context_length=context_length)
    if max_tokens is not None and max_tokens < 1:
        return None, MAX_TOKENS_TOO_SMALL_MSG.format(field=field, max_tokens=max_tokens)
    if prompt_tokens > context_length:
        return max_tokens, None
    room = context_length - prompt_tokens
    if room < 1:
        return None, MAX_TOKENS_TOO_SMALL_MSG.format(field="max_tokens", max_tokens=room)
    return room if max_tokens is None else min(max_tokens, room), None


def model_error(model: Any, served_model_name: str) -> str | None:
    """vLLM's 404 message for a `model` it does not serve (None or "" means the served one)."""
    if not model or model == served_model_name:
        return None
    return MODEL_NOT_FOUND_MSG.format(model=model, served=served_model_name)


def chat_response(model: str, created: int, completion: Any, prompt_tokens: int, cached_tokens: int = 0,
                  token_ids: tuple[list[int], list[int]] | None = None,
                  metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """A non-streaming ChatCompletionResponse as vLLM serialises it (`prompt_tokens_details` as
    with --enable-prompt-tokens-details and prefix caching: present only when tokens were cached;
    `prompt_token_ids` and the choice's `token_ids` with `return_token_ids`, else null; `metrics`:
    the per-request metrics a speculating server adds (spec_vllm.py), else null)."""
    prompt_ids, output_ids = token_ids if token_ids is not None else (None, None)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
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
            "routed_experts": None,
        }],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion.completion_tokens,
            "completion_tokens": completion.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens} if cached_tokens else None,
            # vLLM 0.32 with a reasoning parser: the ids before `</think>` (all of them when cut inside it).
            "completion_tokens_details": {"reasoning_tokens": completion.reasoning_tokens},
        },
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": metrics,
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


METRICS_CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
"""What a real vLLM 0.32 /metrics answers with (prometheus_client's exposition format 1.0.0)."""


def metrics_text(model: str, running: int, waiting: int, kv_blocks: int, block_size: int = 16,
                 kv_usage: float = 0.0) -> str:
    """The part of vLLM's Prometheus exposition a client can use: load gauges (labels `engine`,
    `model_name`), the KV-cache usage gauge and the CacheConfig info gauge (a subset of its labels,
    sorted as prometheus_client writes them)."""
    label = f'engine="0",model_name="{model}"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{label}}} {float(running)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{label}}} {float(waiting)}\n"
        "# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. Reason labels: "
        "'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints "
        "(LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.\n"
        "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
        f'vllm:num_requests_waiting_by_reason{{{label},reason="capacity"}} {float(waiting)}\n'
        f'vllm:num_requests_waiting_by_reason{{{label},reason="deferred"}} 0.0\n'
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{label}}} {float(kv_usage)}\n"
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
        f'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",'
        f'kv_cache_size_tokens="{kv_blocks * block_size}",num_gpu_blocks="{kv_blocks}"}} 1.0\n'
    )


def generation_tokens_lines(model: str, tokens: int, created: float) -> str:
    """vLLM's generated-token counter (`v1/metrics/loggers.py` `vllm:generation_tokens`, labels `engine`,
    `model_name`; increased by each engine step's new tokens, so a request's completion tokens in all)."""
    label = f'engine="0",model_name="{model}"'
    doc = "Number of generation tokens processed."
    return (f"# HELP vllm:generation_tokens_total {doc}\n# TYPE vllm:generation_tokens_total counter\n"
            f"vllm:generation_tokens_total{{{label}}} {float(tokens)}\n"
            f"# HELP vllm:generation_tokens_created {doc}\n# TYPE vllm:generation_tokens_created gauge\n"
            f"vllm:generation_tokens_created{{{label}}} {created}\n")


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
        if config.disable_log_stats:  # no stat logger: only the HTTP instrumentator's series (none here)
            self._send(200, b"", content_type=METRICS_CONTENT_TYPE)  # type: ignore[attr-defined]
            return
        usage = min(1.0, tokens / config.max_total_num_tokens) if config.max_total_num_tokens else 0.0
        text = metrics_text(config.served_model_name, running, waiting, config.max_total_num_tokens // 16,
                            kv_usage=usage)
        text += generation_tokens_lines(config.served_model_name, self.sim._sched.generated(), self.sim.created_t)
        text += spec_vllm.metrics_lines(config.served_model_name, self.sim.spec_counters, self.sim.created_t)
        self._send(200, text.encode(), content_type=METRICS_CONTENT_TYPE)  # type: ignore[attr-defined]

    def _vllm_tokenize(self, body: bytes) -> None:
        """vLLM's `POST /tokenize` for a text prompt ({"model", "prompt", "add_special_tokens"} ->
        {"count", "max_model_len", "tokens", "token_strs"}; entrypoints/serve/tokenize). Served with a
        tokenizer_dir (the word model has no ids): 404 without, as a server without the route."""
        from dflash_pipeline.dev.sim import tokens

        config = self.sim.config
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if not config.tokenizer_dir:
            self._send_json(404, {"detail": "Not Found"})  # type: ignore[attr-defined]
            return
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            self._send_json(400, error_body(400, "prompt: Field required", "BadRequestError"))  # type: ignore[attr-defined]
            return
        ids = tokens.load_token_model(config.tokenizer_dir).encode(obj["prompt"])
        self._send_json(200, {"count": len(ids), "max_model_len": config.context_length,  # type: ignore[attr-defined]
                              "tokens": ids, "token_strs": None})

    def _vllm_scale_out_disabled(self, _body: bytes) -> None:
        self._send_json(403, error_body(403, SCALE_OUT_DISABLED_MSG, "PermissionDeniedError"))  # type: ignore[attr-defined]
