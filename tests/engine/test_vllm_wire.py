"""What our client reads from vLLM 0.32's OpenAI server: checked on a real server (the CPU build serving the
tiny designed Qwen3, see conftest.py) and, with the same tests, on the simulator's vLLM flavour.

The real server pins the facts (the REAL_* constants are what it answered; each test asserts them
on it); the simulator, "serving" the same tokenizer and chat template (dev/sim/tokens.py), is held to
the same facts: fields, token ids with the EOS, reasoning_tokens, the text split at `</think>`, prompt
ids equal to our rendering, error bodies, metrics.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from dflash_pipeline.config import Sampling
from dflash_pipeline.dev.engine.tiny_qwen import IM_END, THINK_END
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.dev.sim.vllm_wire import METRICS_CONTENT_TYPE, SCALE_OUT_DISABLED_MSG
from dflash_pipeline.serving.engines import vllm_kv_tokens
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

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-thinking"
CONTEXT = 2048

# Observed on vLLM 0.32.0 (CPU build) with return_token_ids and --reasoning-parser qwen3.
REAL_CHAT_KEYS = {"id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                  "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params",
                  "metrics"}
REAL_CHOICE_KEYS = {"index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"}
REAL_MESSAGE_KEYS = {"role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"}
REAL_USAGE_KEYS = {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                   "completion_tokens_details"}
REAL_MODEL_CARD_KEYS = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass(frozen=True)
class Target:
    name: str  # "vllm" (real) or "sim"
    base_url: str
    tokenizer_dir: Path | None  # the real server's; the simulator has no tokenizer

    @property
    def spec(self) -> ServerSpec:
        return ServerSpec(self.name, self.base_url)


@pytest.fixture(scope="module")
def _sim(tiny_qwen_checkpoint: Path) -> Iterator[SimServer]:
    """The simulator's vLLM flavour "serving" the tiny checkpoint's tokenizer and template (dev/sim/tokens.py)."""
    server = SimServer(SimConfig(engine="vllm", model_path="/models/tiny-qwen3", served_model_name=MODEL,
                                 context_length=CONTEXT, token_time_s=0.005, length_scale=0.05,
                                 tokenizer_dir=str(tiny_qwen_checkpoint))).start()
    yield server
    server.stop()


@pytest.fixture(params=["vllm", "sim"])
def target(request: pytest.FixtureRequest) -> Target:
    if request.param == "sim":
        return Target("sim", request.getfixturevalue("_sim").url, request.getfixturevalue("tiny_qwen_checkpoint"))
    real = request.getfixturevalue("vllm_server")
    assert real.model == MODEL and real.max_model_len == CONTEXT
    return Target("vllm", real.base_url, real.tokenizer_dir)


def post(target: Target, body: dict[str, Any], path: str = "/v1/chat/completions") -> requests.Response:
    return requests.post(target.base_url + path, json=body, timeout=120)


def chat_body(prompt_id: str, thinking: bool, max_tokens: int = 200, seed: int = 7,
              messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What the pipeline sends (build_chat_body for engine vllm), asking for the token ids."""
    sampling = Sampling(max_tokens=max_tokens, temperature=0.6, top_p=0.95, enable_thinking=thinking, seed=seed)
    body = build_chat_body(messages or [{"role": "user", "content": f"Question {prompt_id}: what is 2 + 2?"}],
                           MODEL, sampling, prompt_id, "vllm")
    body["return_token_ids"] = True
    return body


def chats(target: Target, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda b: post(target, b), bodies))
    assert all(r.status_code == 200 for r in responses), [r.text[:300] for r in responses if r.status_code != 200]
    return [r.json() for r in responses]


def words(n: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "word" + " word" * (n - 1)}]


def prompt_size(target: Target) -> tuple[int, int]:
    """(a, b) with prompt_tokens == a * n + b for `words(n)`, from the server's own usage."""
    p = [post(target, {"model": MODEL, "messages": words(n), "max_tokens": 1}).json()["usage"]["prompt_tokens"]
         for n in (10, 30)]
    a = (p[1] - p[0]) // 20
    assert a >= 1 and p[0] - 10 * a >= 0
    return a, p[0] - 10 * a


# -------------------------------------------------------------------------------- discovery


def test_probe_detects_vllm(target: Target) -> None:
    info = probe_server(new_session(), target.spec)
    assert info.engine == "vllm"
    assert info.version is not None and re.match(r"^0\.32\.\d+", info.version), info.version
    assert info.context_length == CONTEXT and info.served_model_name == MODEL
    assert info.max_running_requests is None and info.capacity_warning  # max_num_seqs is not published
    metrics = requests.get(target.base_url + "/metrics", timeout=10).text
    size = re.search(r'kv_cache_size_tokens="(\d+)"', metrics)
    assert size is not None and info.max_total_num_tokens == vllm_kv_tokens(metrics) == int(size.group(1))


def test_health_version_models(target: Target) -> None:
    health = requests.get(target.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.content == b""
    version = requests.get(target.base_url + "/version", timeout=10).json()
    assert set(version) == {"version"} and version["version"].startswith("0.32.")
    models = requests.get(target.base_url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and len(models["data"]) == 1
    card = models["data"][0]
    assert set(card) == REAL_MODEL_CARD_KEYS
    assert (card["id"], card["owned_by"], card["max_model_len"], card["parent"]) == (MODEL, "vllm", CONTEXT, None)
    for path in ("/get_server_info", "/server_info", "/get_load", "/health_generate"):
        r = requests.get(target.base_url + path, timeout=10)
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"}), path
    r = requests.get(target.base_url + "/v1/chat/completions", timeout=10)
    assert (r.status_code, r.json()) == (405, {"detail": "Method Not Allowed"})


# ------------------------------------------------------------------------------ completions


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_parsed_as_the_body_says(target: Target, thinking: bool) -> None:
    bodies = [chat_body(f"p{i}", thinking, seed=i) for i in range(12)]
    for raw in chats(target, bodies):
        c = parse_chat_response(raw)
        choice = raw["choices"][0]
        message, usage = choice["message"], raw["usage"]
        assert c.reasoning == (message["reasoning"] or None)
        assert c.content == (message["content"] or "")
        assert c.finish_reason == choice["finish_reason"] and c.finish_reason in ("stop", "length")
        assert (c.prompt_tokens, c.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert c.reasoning_tokens == (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
        assert c.model == MODEL
        if thinking:
            assert c.reasoning and c.reasoning_source == "field" and "<think>" not in (message["content"] or "")
        else:
            assert message["reasoning"] is None and c.reasoning is None and c.content


def test_seed_decides_the_output(target: Target) -> None:
    same = chats(target, [chat_body("s", True, seed=5), chat_body("s", True, seed=5)])
    assert same[0]["choices"][0]["message"] == same[1]["choices"][0]["message"]
    varied = chats(target, [chat_body("s", True, seed=s) for s in range(6)])
    assert len({json.dumps(b["choices"][0]["message"]) for b in varied}) >= 4


def test_response_fields(target: Target) -> None:
    for raw in chats(target, [chat_body("f", True, seed=3), chat_body("f", False, seed=3)]):
        choice = raw["choices"][0]
        assert set(raw) == REAL_CHAT_KEYS
        assert set(choice) == REAL_CHOICE_KEYS
        assert set(choice["message"]) == REAL_MESSAGE_KEYS
        assert set(raw["usage"]) == REAL_USAGE_KEYS
        assert raw["object"] == "chat.completion" and choice["stop_reason"] is None
        assert str(raw["system_fingerprint"]).startswith("vllm-0.32.")


def test_reasoning_tokens_reported(target: Target) -> None:
    on = chats(target, [chat_body(f"r{i}", True, max_tokens=120, seed=i) for i in range(16)])
    off = chats(target, [chat_body(f"r{i}", False, max_tokens=120, seed=i) for i in range(4)])
    for raw in on:
        ids = raw["choices"][0]["token_ids"]
        reported = raw["usage"]["completion_tokens_details"]["reasoning_tokens"]
        # the tokens before </think> (</think> itself is not counted); all of them when cut inside
        assert reported == (ids.index(THINK_END) if THINK_END in ids else len(ids))
    assert all(raw["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0 for raw in off)


def test_token_ids_and_eos(target: Target) -> None:
    """`return_token_ids: true` gives top-level `prompt_token_ids` and per-choice `token_ids`; on a
    `stop` the ids end with the EOS token the model sampled (<|im_end|>), counted in completion_tokens."""
    raws = chats(target, [chat_body(f"t{i}", True, max_tokens=96, seed=i) for i in range(24)])
    seen = set()
    for raw in raws:
        choice, usage = raw["choices"][0], raw["usage"]
        ids = choice["token_ids"]
        assert len(raw["prompt_token_ids"]) == usage["prompt_tokens"] and len(ids) == usage["completion_tokens"]
        if choice["finish_reason"] == "stop":
            assert ids[-1] == IM_END and IM_END not in ids[:-1]
        else:
            assert len(ids) == 96 and IM_END not in ids
        seen.add(choice["finish_reason"])
    assert seen == {"stop", "length"}


@pytest.mark.parametrize("thinking", [True, False])
def test_text_is_the_ids_split_at_think_end(target: Target, thinking: bool) -> None:
    """With --reasoning-parser qwen3, `reasoning` is the decoded ids before `</think>` and `content`
    the decoded ids after it, as generated: its leading "\\n\\n" is kept, the EOS is not text. Cut
    inside the thinking: all of it is `reasoning`, `content` is null."""
    if target.tokenizer_dir is None:
        pytest.skip("the simulator returns no token ids to decode (choices[].token_ids is null)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target.tokenizer_dir / "tokenizer.json"))
    raws = chats(target, [chat_body(f"x{i}", thinking, max_tokens=80, seed=i) for i in range(16)])
    kinds = set()
    for raw in raws:
        choice = raw["choices"][0]
        ids, message = choice["token_ids"], choice["message"]
        body = ids[:-1] if choice["finish_reason"] == "stop" else ids
        if not thinking:
            assert message["reasoning"] is None and message["content"] == tok.decode(body)
            kinds.add("answer")
        elif THINK_END in ids:
            k = ids.index(THINK_END)
            assert message["reasoning"] == tok.decode(ids[:k])
            assert message["content"] == tok.decode(body[k + 1 :]) and message["content"].startswith("\n\n")
            kinds.add("closed")
        else:
            assert choice["finish_reason"] == "length" and message["content"] is None
            assert message["reasoning"] == tok.decode(ids)
            kinds.add("cut in thinking")
    assert kinds == ({"closed", "cut in thinking"} if thinking else {"answer"})


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime.\nJust one."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke, é ü 漢字 🙂."}],
]


@pytest.mark.parametrize("thinking", [True, False])
def test_prompt_ids_are_our_template(target: Target, thinking: bool, tmp_path: Path) -> None:
    """The engine's prompt ids decode to the chat template as we render it (jinja2, the checkpoint's
    tokenizer_config.json), and are exactly our `tokenizers` encoding of that text."""
    if target.tokenizer_dir is None:
        pytest.skip("the simulator has no tokenizer: its prompt ids are not comparable")
    from dflash_pipeline.steps.validate.tokencount import Recounter, fetch_tokenizer
    from tokenizers import Tokenizer

    recounter = Recounter(fetch_tokenizer(str(target.tokenizer_dir), lambda b, k: None, tmp_path), thinking)
    tok = Tokenizer.from_file(str(target.tokenizer_dir / "tokenizer.json"))
    for i, messages in enumerate(CONVERSATIONS):
        raw = chats(target, [chat_body(f"c{i}", thinking, max_tokens=1, messages=messages)])[0]
        ids = raw["prompt_token_ids"]
        text = recounter.render_messages(messages, add_generation_prompt=True)
        assert text.endswith("<think>\n" if thinking else "<think>\n\n</think>\n\n")
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.encode(text, add_special_tokens=False).ids == ids


# ----------------------------------------------------------------------------------- errors


def test_context_length_errors(target: Target) -> None:
    a, b = prompt_size(target)
    client = new_chat_client()

    def fails(messages: list[dict[str, Any]], max_tokens: int) -> tuple[RequestFailure, dict[str, Any]]:
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
        r = post(target, body)
        assert r.status_code == 400, r.text[:300]
        with pytest.raises(RequestFailure) as info:
            chat_once(client, target.spec, body, 60)
        error = r.json()["error"]
        assert set(r.json()) == {"error"} and set(error) == ERROR_KEYS
        assert (error["type"], error["code"]) == ("BadRequestError", 400)
        return info.value, error

    # a prompt longer than the context
    failure, error = fails(words((CONTEXT + 50 - b) // a), 16)
    assert failure.error_class == "ContextLengthExceeded" and failure.kind == "permanent"
    assert error["param"] == "input_tokens"
    assert error["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. However, your "
                                       f"prompt contains at least {CONTEXT + 1} input tokens")
    # max_tokens alone larger than the context
    failure, error = fails(words(10), CONTEXT + 1)
    assert failure.error_class == "ContextLengthExceeded" and error["param"] == "max_tokens"
    assert error["message"].startswith(f"max_tokens={CONTEXT + 1} cannot be greater than max_model_len={CONTEXT}.")
    # a prompt that fills the context exactly: max_tokens is clamped to 0, and refused as such
    n_full = (CONTEXT - b) // a
    if a * n_full + b == CONTEXT:
        failure, error = fails(words(n_full), 16)
        assert failure.error_class == "ContextLengthExceeded" and error["param"] == "max_tokens"
        assert error["message"].startswith("max_tokens must be at least 1, got 0.")
    # prompt + max_tokens over the context, max_tokens under it: no error, max_tokens is clamped
    n = (CONTEXT - 8 - b) // a
    r = post(target, {"model": MODEL, "messages": words(n), "max_tokens": 500, "seed": 1})
    assert r.status_code == 200, r.text[:300]
    usage, finish = r.json()["usage"], r.json()["choices"][0]["finish_reason"]
    assert usage["prompt_tokens"] == a * n + b and usage["total_tokens"] <= CONTEXT
    assert finish == "stop" or usage["completion_tokens"] == CONTEXT - usage["prompt_tokens"]


def test_bad_requests(target: Target) -> None:
    client = new_chat_client()
    body = {"model": "no-such-model", "messages": words(3), "max_tokens": 4}
    r = post(target, body)
    assert r.status_code == 404
    assert r.json() == {"error": {"message": f"The model `no-such-model` does not exist. Valid aliases: {MODEL}.",
                                  "type": "NotFoundError", "param": "model", "code": 404}}
    with pytest.raises(RequestFailure) as info:
        chat_once(client, target.spec, body, 30)
    assert (info.value.error_class, info.value.kind) == ("NotFound", "config")
    # no model at all: the served one
    assert post(target, {"messages": words(3), "max_tokens": 2}).json()["model"] == MODEL
    r = post(target, {"model": MODEL, "messages": words(3), "max_tokens": -1})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)",
                                 "type": "BadRequestError", "param": "max_tokens", "code": 400}
    failure = classify_http_error(400, r.text)
    assert (failure.error_class, failure.kind) == ("BadRequest", "permanent")


# ----------------------------------------------------------------------------- the rest


def test_metrics(target: Target) -> None:
    r = requests.get(target.base_url + "/metrics", timeout=10)
    assert r.headers["content-type"] == METRICS_CONTENT_TYPE
    labels = f'engine="0",model_name="{MODEL}"'
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert re.search(rf"^{gauge}\{{{re.escape(labels)}\}} [0-9.]+$", r.text, re.M), gauge
    info = re.search(r"^vllm:cache_config_info\{([^}]*)\} 1\.0$", r.text, re.M)
    assert info is not None
    assert {"block_size", "num_gpu_blocks", "kv_cache_size_tokens", "engine"} <= set(re.findall(r'(\w+)="', info.group(1)))
    # the load gauges move: requests in flight are counted, and none once they are answered
    session = new_session()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, target, chat_body(f"m{i}", True, max_tokens=200, seed=i)) for i in range(6)]
        loads = []
        while not all(f.done() for f in futures):
            loads.append(server_load(session, target.spec, "vllm"))
            time.sleep(0.05)
        assert all(f.result().status_code == 200 for f in futures)
    assert max(x or 0 for x in loads) > 0
    assert server_load(session, target.spec, "vllm") == 0


def test_render_needs_scale_out(target: Target) -> None:
    r = post(target, {"model": MODEL, "messages": words(3)}, "/v1/chat/completions/render")
    assert r.status_code == 403
    assert r.json() == {"error": {"message": SCALE_OUT_DISABLED_MSG, "type": "PermissionDeniedError",
                                  "param": None, "code": 403}}
    assert classify_http_error(403, r.text).error_class == "Unauthorized"


def test_render_with_scale_out(vllm_scale_out_server: Any) -> None:
    """With --enable-scale-out, render answers the prompt ids a chat request would use, and shows the
    sampling vLLM would apply: the model's generation_config.json fills what the request leaves out
    (top_k 20 here, as in Qwen3's own generation config)."""
    target = Target("vllm", vllm_scale_out_server.base_url, vllm_scale_out_server.tokenizer_dir)
    for thinking in (True, False):
        body = chat_body("render", thinking, max_tokens=32, seed=9, messages=CONVERSATIONS[2])
        r = post(target, body, "/v1/chat/completions/render")
        assert r.status_code == 200, r.text[:300]
        rendered = r.json()
        chat = chats(target, [body])[0]
        assert rendered["token_ids"] == chat["prompt_token_ids"]
        params = rendered["sampling_params"]
        assert "top_k" not in body and params["top_k"] == 20
        assert (params["temperature"], params["top_p"], params["seed"], params["max_tokens"]) == (0.6, 0.95, body["seed"], 32)


# -------------------------------------------------------------------------------- preflight


def test_preflight_abilities(target: Target, s3_client: Any, bucket: str) -> None:
    """Preflight's abilities of a vLLM 0.32 server, from what it reports and its proof answer
    (serving/abilities.py): token ids in vLLM's fields (token-exact), reasoning split by its parser,
    no speculation, slots not published. require_token_exact lets it through."""
    from dflash_pipeline.config import RunConfig
    from dflash_pipeline.dataset.layout import DatasetLayout
    from dflash_pipeline.steps.plan import run_plan
    from dflash_pipeline.steps.preflight import run_preflight

    tag = f"abilities-{target.name}"
    s3_client.put_object(Bucket=bucket, Key=f"{tag}/p.jsonl",
                         Body=b'{"id": "a", "prompt": "What is 2 + 2?"}\n{"id": "b", "prompt": "Name a prime."}')
    cfg = RunConfig.from_params({"prompts_uri": f"s3://{bucket}/{tag}/p.jsonl", "output_uri": f"s3://{bucket}/{tag}/ds",
                                 "servers": [target.base_url], "max_tokens": 256, "require_token_exact": True})
    run_plan(s3_client, cfg, f"{tag}-run1")
    (out,) = run_preflight(s3_client, cfg, [target.spec], f"{tag}-run1")
    assert out["healthy"] and out["engine"] == "vllm"
    layout = DatasetLayout.from_uri(cfg.output_uri)
    manifest = json.loads(s3_client.get_object(Bucket=bucket, Key=layout.manifest_key)["Body"].read())
    (entry,) = manifest["servers"]
    found = entry["abilities"]
    assert re.match(r"^0\.32\.\d+", found["version"]), found
    assert {k: found[k] for k in ("engine", "token_ids", "token_ids_via", "token_exact", "token_ids_expected",
                                  "reasoning", "speculative", "spec_stats", "slots", "note")} == {
        "engine": "vllm", "token_ids": "prompt+output", "token_ids_via": "prompt_token_ids + choices[].token_ids",
        "token_exact": True, "token_ids_expected": "prompt+output", "reasoning": "separate", "speculative": None,
        "spec_stats": None, "slots": None, "note": None}
    assert "/metrics" in found["slots_source"]
    assert entry["proof"]["token_ids"] == {"prompt": "prompt_token_ids", "output": "choices[].token_ids"}
    assert "token_exact_warning" not in manifest["runs"][f"{tag}-run1"]
