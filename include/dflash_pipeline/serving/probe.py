"""What a server is and how loaded it is: the preflight probe (engine, model, server info) and
live load samples (SGLang /v1/loads or /get_load, vLLM /metrics), and the concurrency a client
should keep from what a server declares. The wire itself (chat requests and their outcomes) is
sglang.py; what differs between engines is engines.py.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import requests

from dflash_pipeline.serving.engines import (
    DEFAULT_CAPACITY,
    Engine,
    LoadSample,
    adapter,
    sglang_load_sample,
    vllm_kv_tokens,
    vllm_load_sample,
)
from dflash_pipeline.serving.sglang import (
    RequestFailure,
    ServerInfo,
    ServerSpec,
    _short,
    classify_http_error,
)
from dflash_pipeline.serving.specwire import sglang_spec_config, vllm_spec_config

logger = logging.getLogger(__name__)


def _get_json(session: requests.Session, server: ServerSpec, path: str, timeout_s: float) -> Any:
    resp = session.get(f"{server.base_url}{path}", headers=server.headers(), timeout=timeout_s)
    if resp.status_code != 200:
        raise classify_http_error(resp.status_code, resp.text[:2000])
    return resp.json()


def _get_text(session: requests.Session, server: ServerSpec, path: str, timeout_s: float) -> str | None:
    """GET `path` as text; None when the server does not serve it (or it fails)."""
    try:
        resp = session.get(f"{server.base_url}{path}", headers=server.headers(), timeout=timeout_s)
    except requests.RequestException:
        return None
    return resp.text if resp.status_code == 200 else None


def think_token_ids(session: requests.Session, server: ServerSpec, model: str, timeout_s: float = 10.0
                    ) -> dict[str, int] | None:
    """The ids of `<think>` and `</think>` in the served tokenizer, from vLLM's `POST /tokenize`
    (a text prompt, no special tokens added); None when the server has no such route or either tag
    is not one token. Preflight looks for them among an answer's generated ids."""
    out: dict[str, int] = {}
    for tag in ("<think>", "</think>"):
        try:
            r = session.post(f"{server.base_url}/tokenize", headers=server.headers(), timeout=timeout_s,
                             json={"model": model, "prompt": tag, "add_special_tokens": False})
            ids = r.json().get("tokens") if r.status_code == 200 else None
        except (requests.RequestException, ValueError, AttributeError):
            return None
        if not (isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], int)):
            return None
        out[tag] = ids[0]
    return out


def probe_server(session: requests.Session, server: ServerSpec, timeout_s: float = 10.0) -> ServerInfo:
    """Health, engine, server info and served models of one server. Raises RequestFailure.

    The engine is detected from what the server serves (see serving/engines.py): SGLang answers
    /get_server_info or /server_info; vLLM does not, but answers /version and lists models with
    `max_model_len`; anything else answering /v1/models is a generic OpenAI-compatible server."""
    try:
        health = session.get(f"{server.base_url}/health", timeout=timeout_s)
    except requests.RequestException as exc:
        raise RequestFailure("ConnectionError", _short(exc), kind="transient") from exc
    if health.status_code != 200:
        raise RequestFailure(
            "Unhealthy", f"/health answered HTTP {health.status_code}", kind="transient", status=health.status_code
        )
    info: dict[str, Any] = {}
    for path in ("/get_server_info", "/server_info"):
        try:
            got = _get_json(session, server, path, timeout_s)
            if isinstance(got, dict):
                info = got
                break
        except RequestFailure as exc:
            if exc.error_class != "NotFound":
                raise
        except (requests.RequestException, ValueError) as exc:
            raise RequestFailure("ConnectionError", _short(exc), kind="transient") from exc
    served: str | None = info.get("served_model_name")
    cards: list[dict[str, Any]] = []
    try:
        models = _get_json(session, server, "/v1/models", timeout_s)
        cards = [m for m in models.get("data", []) if isinstance(m, dict)]
        served = served or (cards[0].get("id") if cards else None)
    except RequestFailure as exc:
        if exc.kind == "config" and exc.error_class == "Unauthorized":
            raise
    except (requests.RequestException, ValueError, AttributeError):
        pass
    internal = (info.get("internal_states") or [{}])[0] if isinstance(info.get("internal_states"), list) else {}

    def num(v: Any) -> int | None:
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    if info:
        spec = sglang_spec_config(info)
        return ServerInfo(
            name=server.name,
            base_url=server.base_url,
            model_path=info.get("model_path"),
            served_model_name=served,
            max_running_requests=num(info.get("max_running_requests")) or num(internal.get("max_running_requests")),
            max_total_num_tokens=num(info.get("max_total_num_tokens")) or num(internal.get("max_total_num_tokens")),
            context_length=num(info.get("context_length")),
            version=info.get("version"),
            engine=Engine.SGLANG.value,
            speculative=spec.to_manifest() if spec else None,
            reasoning_parser=str(info["reasoning_parser"]) if info.get("reasoning_parser") else None,
            reasoning_parser_reported="reasoning_parser" in info,
        )
    version: str | None = None
    raw_version = _get_text(session, server, "/version", timeout_s)
    if raw_version:
        try:
            parsed = json.loads(raw_version)
            version = str(parsed.get("version")) if isinstance(parsed, dict) and parsed.get("version") else None
        except ValueError:
            version = None
    card = next((c for c in cards if c.get("id") == served), cards[0] if cards else {})
    max_model_len = num(card.get("max_model_len"))
    is_vllm = version is not None and (max_model_len is not None or card.get("owned_by") == "vllm")
    engine = Engine.VLLM if is_vllm else Engine.OPENAI
    kv_tokens = None
    vllm_spec = None
    if engine is Engine.VLLM:
        metrics = _get_text(session, server, "/metrics", timeout_s)
        kv_tokens = vllm_kv_tokens(metrics) if metrics else None
        vllm_spec = vllm_spec_config(metrics, version)
    how = ("its /metrics load gauges" if engine is Engine.VLLM
           else "the latency of its answers (it has no load endpoint)")
    warning = (
        f"{engine.value} server does not report how many requests it runs at once (vLLM's "
        f"max_num_seqs is not exposed on its HTTP API): starting from {DEFAULT_CAPACITY} slots and "
        f"discovering its capacity from {how}, up to max_concurrency_per_server. Set "
        "concurrency_per_server to fix it instead."
    )
    return ServerInfo(
        name=server.name,
        base_url=server.base_url,
        model_path=card.get("root") or served,
        served_model_name=served,
        max_running_requests=None,
        max_total_num_tokens=kv_tokens,
        context_length=max_model_len,
        version=version,
        engine=engine.value,
        capacity_warning=warning,
        speculative=vllm_spec.to_manifest() if vllm_spec else None,
    )


def server_load_sample(session: requests.Session, server: ServerSpec, engine: Engine | str | None,
                       timeout_s: float = 5.0) -> LoadSample | None:
    """Requests the server runs and queues now (and its KV cache usage if published), or None if
    it cannot tell us (generic server, endpoint missing, server not answering)."""
    paths = adapter(engine).load_paths
    known = _LOAD_PATH.get(server.base_url)
    for path in sorted(paths, key=lambda p: p != known):  # the one that answered last, first
        text = _get_text(session, server, path, timeout_s)
        if text is None:
            continue
        if path == "/metrics":
            load = vllm_load_sample(text)
        else:
            try:
                load = sglang_load_sample(json.loads(text))
            except ValueError:
                load = None
        if load is not None:
            _LOAD_PATH[server.base_url] = path
            return load
    return None


_LOAD_PATH: dict[str, str] = {}
"""The load endpoint that answered last, per server: an older SGLang is not asked `/v1/loads` every probe."""


def server_load(session: requests.Session, server: ServerSpec, engine: Engine | str | None,
                timeout_s: float = 5.0) -> int | None:
    """How many requests the server holds now (running + waiting), or None if it cannot tell us."""
    sample = server_load_sample(session, server, engine, timeout_s)
    return None if sample is None else sample.held


def derive_concurrency(max_running_requests: int | None) -> int:
    """Enough in flight that a freed slot is refilled from the server's own queue, not much more.

    A small queue at the server (a quarter of the slots, at least 2) hides the client's round trip;
    a larger one only makes requests wait, and that wait counts against the request timeout.
    """
    mrr = max_running_requests or DEFAULT_CAPACITY
    return mrr + max(2, -(-mrr // 4))


def concurrency_warning(concurrency: int, max_running_requests: int | None, timeout_s: float) -> str | None:
    if not max_running_requests or concurrency <= 2 * max_running_requests:
        return None
    queued = concurrency - max_running_requests
    return (
        f"concurrency_per_server={concurrency} is {concurrency / max_running_requests:.1f}x the server's "
        f"max_running_requests={max_running_requests}: about {queued} requests will wait in the server's "
        f"queue, their wait counts against request_timeout_s={timeout_s:g}, and a request that times out "
        "while queued is sent again from scratch. Throughput does not improve; leave "
        "concurrency_per_server null to derive it from the server."
    )
