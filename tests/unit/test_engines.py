"""Engine detection and adapters, against the simulator's SGLang and vLLM flavours over HTTP."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests
from dflash_pipeline.config import Sampling
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.serving.engines import Engine, error_message, vllm_kv_tokens, vllm_load
from dflash_pipeline.serving.probe import probe_server, server_load
from dflash_pipeline.serving.sglang import (
    RequestFailure,
    ServerSpec,
    build_chat_body,
    chat_once,
    classify_http_error,
    new_chat_client,
    new_session,
    parse_chat_response,
)

FAST = {"token_time_s": 0.0005, "length_scale": 0.02}
MSGS = [{"role": "user", "content": "what is two plus two"}]


@pytest.fixture(scope="module")
def sims() -> Any:
    sg = SimServer(SimConfig(**FAST)).start()
    vl = SimServer(SimConfig(engine="vllm", context_length=8192, **FAST)).start()
    inline = SimServer(SimConfig(engine="vllm", reasoning_parser=None, **FAST)).start()
    yield {"sglang": sg, "vllm": vl, "inline": inline}
    for s in (sg, vl, inline):
        s.stop()


def test_detects_each_engine(sims: Any) -> None:
    session = new_session()
    sg = probe_server(session, ServerSpec("sg", sims["sglang"].url))
    vl = probe_server(session, ServerSpec("vl", sims["vllm"].url))
    assert (sg.engine, sg.max_running_requests, sg.capacity_warning) == ("sglang", 16, None)
    assert vl.engine == "vllm" and vl.version == "0.32.0+sim"
    assert vl.context_length == 8192 and vl.served_model_name == "Qwen/Qwen3-8B"
    assert vl.max_running_requests is None and "max_num_seqs" in (vl.capacity_warning or "")
    assert vl.max_total_num_tokens == 200000 // 16 * 16  # num_gpu_blocks x block_size from /metrics
    assert vl.to_dict()["engine"] == "vllm"


def test_generic_openai_server() -> None:
    """A server with /health and /v1/models but no server info and no /version is generic OpenAI."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = {"/health": b"", "/v1/models": b'{"object":"list","data":[{"id":"m","object":"model"}]}'}
            data = body.get(self.path)
            self.send_response(200 if data is not None else 404)
            self.send_header("Content-Length", str(len(data or b"")))
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        info = probe_server(new_session(), ServerSpec("g", f"http://127.0.0.1:{httpd.server_port}"))
    finally:
        httpd.shutdown()
    assert (info.engine, info.served_model_name, info.context_length) == ("openai", "m", None)
    assert info.capacity_warning
    assert Engine.parse("weird") is Engine.OPENAI and Engine.parse(None) is Engine.SGLANG


def test_request_body_per_engine() -> None:
    s = Sampling(max_tokens=64, temperature=0.6, top_p=0.95, enable_thinking=True, seed=None)
    sg = build_chat_body(MSGS, "m", s, "p1", "sglang")
    vl = build_chat_body(MSGS, "m", s, "p1", "vllm")
    assert sg["separate_reasoning"] is True and "separate_reasoning" not in vl
    assert sg["chat_template_kwargs"] == vl["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.parametrize("flavour", ["sglang", "vllm", "inline"])
def test_reasoning_split_on_each_engine(sims: Any, flavour: str) -> None:
    engine = "sglang" if flavour == "sglang" else "vllm"
    s = Sampling(max_tokens=4000, temperature=0.6, top_p=0.95, enable_thinking=True, seed=None)
    body = build_chat_body(MSGS, "Qwen/Qwen3-8B", s, "p1", engine)
    completion, _ = chat_once(new_chat_client(), ServerSpec(flavour, sims[flavour].url), body, 30)
    assert completion.reasoning and completion.content
    assert "<think>" not in completion.content and completion.finish_reason == "stop"


def test_vllm_wire_shape(sims: Any) -> None:
    r = requests.post(sims["vllm"].url + "/v1/chat/completions", timeout=10, json={
        "messages": MSGS, "max_tokens": 4000, "chat_template_kwargs": {"enable_thinking": True}})
    msg = r.json()["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["reasoning"]
    assert "matched_stop" not in r.json()["choices"][0]
    assert requests.get(sims["vllm"].url + "/get_server_info", timeout=5).status_code == 404


def test_vllm_context_error_is_permanent(sims: Any) -> None:
    s = Sampling(max_tokens=9000, temperature=0.6, top_p=0.95, enable_thinking=True, seed=None)
    body = build_chat_body(MSGS, "Qwen/Qwen3-8B", s, "p1", "vllm")
    with pytest.raises(RequestFailure) as info:
        chat_once(new_chat_client(), ServerSpec("vl", sims["vllm"].url), body, 30)
    assert info.value.error_class == "ContextLengthExceeded" and info.value.kind == "permanent"
    # vLLM 0.32's wording (tests/engine/test_vllm_wire.py sees it on a real server)
    assert "max_tokens=9000 cannot be greater than max_model_len=8192" in info.value.message


def test_nested_error_bodies() -> None:
    nested = json.dumps({"error": {"message": "EngineCore died", "type": "InternalServerError",
                                   "param": None, "code": 500}})
    f = classify_http_error(500, nested)
    assert f.transient and "EngineCore died" in f.message
    f = classify_http_error(503, json.dumps({"error": {"message": "busy", "type": "x", "code": 503}}))
    assert f.error_class == "ServiceUnavailable"
    assert error_message({"error": "Unauthorized"}) == "Unauthorized"
    with pytest.raises(RequestFailure) as info:  # an error object where a completion was expected
        parse_chat_response({"error": {"message": "This model's maximum context length is 10 tokens",
                                       "type": "BadRequestError", "code": 400}})
    assert info.value.error_class == "ContextLengthExceeded"


def test_vllm_content_null_and_reasoning_field() -> None:
    c = parse_chat_response({"choices": [{"message": {"role": "assistant", "content": None,
                                                      "reasoning": "cut short"},
                                          "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 9}})
    assert (c.reasoning, c.content, c.finish_reason) == ("cut short", "", "length")


def test_load_from_metrics_and_get_load(sims: Any) -> None:
    session = new_session()
    assert server_load(session, ServerSpec("vl", sims["vllm"].url), "vllm") == 0
    assert server_load(session, ServerSpec("sg", sims["sglang"].url), "sglang") == 0
    assert server_load(session, ServerSpec("sg", sims["sglang"].url), "openai") is None
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n')
    assert vllm_load(text) == 5 and vllm_kv_tokens(text) == 1600


def test_token_ids_in_each_engines_shape() -> None:
    from dflash_pipeline.serving.engines import token_ids_of

    vllm = {"prompt_token_ids": [1, 2, 3], "choices": [{"token_ids": [7, 8, 151645]}]}
    sglang_0_5_17 = {"choices": [{"prompt_token_ids": [1, 2, 3], "token_ids": [7, 8, 151645]}]}
    sglang_0_5_18 = {"choices": [{"prompt_token_ids": [1, 2, 3], "response_token_ids": [7, 8, 151645]}]}
    for body in (vllm, sglang_0_5_17, sglang_0_5_18):
        assert token_ids_of(body, body["choices"][0]) == ([1, 2, 3], [7, 8, 151645])
    assert token_ids_of({"prompt_token_ids": None}, {"token_ids": None}) == (None, None)
    assert token_ids_of({}, {"token_ids": [1, "2"]}) == (None, None)  # never half-trusted
    both = {"model": "m", "prompt_token_ids": [1, 2, 3],
            "choices": [{"message": {"content": "x"}, "finish_reason": "stop", "token_ids": [5, 151645]}]}
    c = parse_chat_response(both)
    assert c.prompt_token_ids.tolist() == [1, 2, 3] and c.output_token_ids.tolist() == [5, 151645]
    assert str(c.output_token_ids.dtype) == "int32"


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_both_engines_are_asked_for_their_token_ids_and_return_them(engine: str, qwen_tokenizer: Any) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(qwen_tokenizer / "tokenizer.json"))
    with SimServer(SimConfig(engine=engine, tokenizer_dir=str(qwen_tokenizer), **FAST)) as srv:
        body = build_chat_body(MSGS, "Qwen/Qwen3-8B", Sampling(max_tokens=300, seed=3), "p", engine=engine)
        assert body["return_token_ids"] is True
        assert ("return_prompt_token_ids" in body) == (engine == "sglang")
        assert ("separate_reasoning" in body) == (engine == "sglang")
        c, _ = chat_once(new_chat_client(), ServerSpec("s", srv.url), body, 10)
        assert c.finish_reason == "stop" and int(c.output_token_ids[-1]) == tok.token_to_id("<|im_end|>")
        assert len(c.prompt_token_ids) == c.prompt_tokens and len(c.output_token_ids) == c.completion_tokens
        assert tok.decode(c.prompt_token_ids.tolist(), skip_special_tokens=False).endswith("<|im_start|>assistant\n")
        srv.update_config(token_ids_supported=False)  # an engine version before return_token_ids
        c, _ = chat_once(new_chat_client(), ServerSpec("s", srv.url), body, 10)
        assert c.prompt_token_ids is None and c.output_token_ids is None and c.completion_tokens


def test_sglang_load_from_v1_loads_and_from_get_load_on_older_servers() -> None:
    from dflash_pipeline.serving.engines import sglang_load

    assert sglang_load({"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2},
                                  {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0}]}) == 6
    assert sglang_load([{"dp_rank": 0, "num_reqs": 4, "num_waiting_reqs": 1}]) == 4
    assert sglang_load({"loads": []}) is None

    class Old(BaseHTTPRequestHandler):  # a server with /get_load only (/v1/loads answers 404)
        hits: list[str] = []

        def do_GET(self) -> None:  # noqa: N802
            Old.hits.append(self.path)
            ok = self.path == "/get_load"
            body = json.dumps([{"dp_rank": 0, "num_reqs": 5}] if ok else {"detail": "Not Found"}).encode()
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        spec = ServerSpec("old", f"http://127.0.0.1:{httpd.server_port}")
        session = new_session()
        assert server_load(session, spec, "sglang") == 5
        assert server_load(session, spec, "sglang") == 5
        assert Old.hits == ["/v1/loads", "/get_load", "/get_load"]  # the answering one is asked first after
    finally:
        httpd.shutdown()


def test_load_samples_split_running_from_waiting_with_kv_usage(sims: Any) -> None:
    """What the concurrency controller reads: running and waiting apart, and KV cache usage."""
    from dflash_pipeline.serving.engines import LoadSample, sglang_load_sample, vllm_load_sample
    from dflash_pipeline.serving.probe import server_load_sample

    text = ('vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 4.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
            'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n')
    assert vllm_load_sample(text) == LoadSample(7, 2, 0.75)  # the fullest engine's KV cache limits
    assert vllm_load_sample(text.replace("kv_cache_usage_perc", "other")).kv_usage == 0.1  # vLLM < 0.9
    assert vllm_load_sample("# nothing\n") is None
    assert sglang_load_sample({"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 2, "token_usage": 0.2},
                                         {"num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.9}]}) \
        == LoadSample(4, 2, 0.9)
    assert sglang_load_sample([{"num_reqs": 4, "num_waiting_reqs": 1}]) == LoadSample(3, 1, None)
    session = new_session()
    for engine in ("vllm", "sglang"):
        sample = server_load_sample(session, ServerSpec(engine, sims[engine].url), engine)
        assert sample is not None and (sample.running, sample.waiting) == (0, 0) and sample.kv_usage == 0.0
