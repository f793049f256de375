"""Thinking and sampling mixes (config/sampling.py and where they reach): the thinking quota, the
sampling keys' checks, the request body, the rows' labels, the pins."""

from __future__ import annotations

import json
import random

import pytest

from dflash_pipeline.config import ConfigError, RunConfig
from dflash_pipeline.config.sampling import (
    DIALECTS,
    ThinkingQuota,
    check_overrides,
    parse_row_mix,
    SamplingError,
    unsupported_keys,
)
from dflash_pipeline.dataset.prompts import Prompt, Reject, normalize_row
from dflash_pipeline.dataset.records import decode_inputs, decode_part, encode_inputs, encode_part
from dflash_pipeline.dev.sim import sampling_wire
from dflash_pipeline.serving.sglang import ServerInfo, build_chat_body, sent_sampling
from dflash_pipeline.steps.plan import check_pins, pinned_settings, thinking_modes, PlanError
from dflash_pipeline.steps.preflight import refuse_sampling_keys

BASE = {"prompts_uri": "s3://in-bucket/p.jsonl", "output_uri": "s3://out-bucket/ds", "servers": ["http://h:1"]}


def _prompts(n: int, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(f"id-{rng.getrandbits(48):x}-{i}", [{"role": "user", "content": str(i)}], bytes(16), i)
            for i in range(n)]


@pytest.mark.parametrize("fraction", [0.0, 0.013, 0.25, 0.3, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("n", [1000, 2500, 4321])
def test_quota_hits_the_fraction_within_one_percent_and_is_deterministic(fraction: float, n: int) -> None:
    prompts = _prompts(n, seed=n)
    modes = [m for _, m in thinking_modes(iter(prompts), fraction)]
    assert len(modes) == n and all(m is not None for m in modes)
    share = sum(modes) / n
    assert abs(share - fraction) <= 0.01, (share, fraction)
    assert sum(modes) == int(n * fraction + 1e-9), "exact: floor(n f) conversations think"
    again = [m for _, m in thinking_modes(iter(prompts), fraction)]
    assert again == modes, "the same plan order and ids give the same modes"
    # every prefix stays within one conversation per 64-block of the fraction
    for k in range(64, n, 64):
        assert sum(modes[:k]) == int(k * fraction + 1e-9)


def test_quota_is_not_a_fixed_pattern_and_a_hash_draw_would_miss() -> None:
    """Interleaved sources (A, B, A, B...) must not all land in one mode at f = 0.5, and the quota beats a
    plain hash draw, whose share wanders by binomial noise."""
    prompts = _prompts(4000, seed=1)
    modes = [m for _, m in thinking_modes(iter(prompts), 0.5)]
    even = sum(modes[0::2]) / 2000
    assert 0.4 < even < 0.6, even
    import hashlib
    worst = 0.0
    for salt in range(20):
        draws = [int(hashlib.sha256(f"{salt}:{p.id}".encode()).hexdigest()[:8], 16) / 2**32 < 0.5 for p in prompts[:2000]]
        worst = max(worst, abs(sum(draws) / 2000 - 0.5))
    assert worst > 0.01, "a hash draw alone misses +-1 % on some salt (why the quota exists)"


def test_rows_with_their_own_mode_keep_it_and_stay_out_of_the_quota() -> None:
    prompts = _prompts(1000)
    own = [Prompt(p.id, p.messages, p.content_hash, p.line, thinking=(i % 10 == 0) if i % 5 == 0 else None)
           for i, p in enumerate(prompts)]
    out = list(thinking_modes(iter(own), 0.25))
    for p, m in out:
        if p.thinking is not None:
            assert m is p.thinking
    quota = [m for p, m in out if p.thinking is None]
    assert sum(quota) == int(len(quota) * 0.25)
    assert [m for _, m in thinking_modes(iter(own), None)] == [p.thinking for p in own], "no fraction: row or null"


def test_quota_refuses_a_fraction_outside_0_1() -> None:
    with pytest.raises(ValueError):
        ThinkingQuota(1.5)


def test_row_mix_parsing() -> None:
    assert parse_row_mix({"enable_thinking": False}) == (False, None)
    assert parse_row_mix({"thinking": True}) == (True, None)
    assert parse_row_mix({"thinking": "a long text"}) == (None, None), "a non-bool thinking is metadata"
    assert parse_row_mix({"sampling": {"top_k": 20, "stop": ["x"]}}) == (None, {"top_k": 20, "stop": ["x"]})
    assert parse_row_mix({"sampling": '{"min_p": 0.1}'}) == (None, {"min_p": 0.1})
    assert "must be true or false" in parse_row_mix({"enable_thinking": "yes"})
    assert "unknown sampling key 'topk'" in parse_row_mix({"sampling": {"topk": 3}})
    p = normalize_row({"prompt": "hi", "enable_thinking": False, "sampling": {"top_k": 5}, "source": "s", "x": 1}, 1)
    assert isinstance(p, Prompt) and p.thinking is False and p.sampling == {"top_k": 5}
    assert p.metadata == {"x": 1}, "mix keys are settings, not metadata"
    q = normalize_row({"prompt": "hi", "thinking": "kept as metadata"}, 2)
    assert isinstance(q, Prompt) and q.thinking is None and q.metadata == {"thinking": "kept as metadata"}
    bad = normalize_row({"prompt": "hi", "sampling": {"top_k": "twenty"}}, 3)
    assert isinstance(bad, Reject) and "top_k='twenty' must be an integer" in bad.reason
    # the same prompt in both modes is two conversations, not a duplicate
    on = normalize_row({"prompt": "hi", "enable_thinking": True}, 4)
    off = normalize_row({"prompt": "hi", "enable_thinking": False}, 5)
    plain = normalize_row({"prompt": "hi"}, 6)
    assert len({on.content_hash, off.content_hash, plain.content_hash}) == 3
    assert len({on.id, off.id}) == 2 and plain.id == normalize_row({"prompt": "hi"}, 7).id


@pytest.mark.parametrize(("value", "needle"), [
    ({"top_k": 1.5}, "top_k=1.5 must be an integer"),
    ({"min_p": 2}, "min_p=2 must be a number in [0, 1]"),
    ({"stop": 3}, "stop=3 must be a string or a list"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos=1 must be true or false"),
    ({"repetiton_penalty": 1.1}, "unknown sampling key 'repetiton_penalty'"),
    ({"seed": 3}, "'seed' cannot be set here"),
    ({"chat_template_kwargs": {}}, "'chat_template_kwargs' cannot be set here"),
    ("top_k=3", "is not of type null or object"),
])
def test_bad_sampling_is_refused_at_config_time(value: object, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_params({**BASE, "sampling_extra": value})
    assert needle in str(info.value)
    if isinstance(value, dict):
        with pytest.raises(ConfigError) as info:
            RunConfig.from_params({**BASE, "sampling_ladder": [{"temperature": 0.6}, value]})
        assert "sampling_ladder[1]" in str(info.value) and needle in str(info.value)


def test_config_accepts_every_engine_key_and_the_fraction_bounds() -> None:
    every = {"top_k": 20, "min_p": 0.0, "presence_penalty": 1.5, "frequency_penalty": 0.1, "repetition_penalty": 1.05,
             "stop": ["</answer>"], "stop_token_ids": [151643], "min_tokens": 2, "ignore_eos": False,
             "skip_special_tokens": True}
    cfg = RunConfig.from_params({**BASE, "sampling_extra": every, "thinking_fraction": 0.3,
                                 "sampling_ladder": [{"temperature": 0.6}, {"temperature": 1.0, "top_p": 1.0}]})
    assert cfg.sampling.extra == every and cfg.sampling.thinking_fraction == 0.3 and len(cfg.sampling.ladder) == 2
    for bad in (-0.1, 1.5, "half"):
        with pytest.raises(ConfigError):
            RunConfig.from_params({**BASE, "thinking_fraction": bad})


def test_request_body_carries_run_ladder_and_row_fields_exactly() -> None:
    cfg = RunConfig.from_params({**BASE, "seed": 7, "sampling_extra": {"top_k": 20, "stop": ["END"]},
                                 "sampling_ladder": [{"temperature": 0.6}, {"temperature": 1.1, "min_p": 0.05}]})
    msgs = [{"role": "user", "content": "q"}]
    b0 = build_chat_body(msgs, "m", cfg.sampling, "p1", "vllm", sample=0, thinking=False)
    b1 = build_chat_body(msgs, "m", cfg.sampling, "p1", "vllm", sample=1, thinking=True,
                         overrides={"top_k": 5, "presence_penalty": 0.5})
    b2 = build_chat_body(msgs, "m", cfg.sampling, "p1", "vllm", sample=2)
    assert b0["temperature"] == 0.6 and b0["top_k"] == 20 and b0["stop"] == ["END"] and "min_p" not in b0
    assert b0["chat_template_kwargs"] == {"enable_thinking": False}
    assert b1["temperature"] == 1.1 and b1["min_p"] == 0.05 and b1["top_k"] == 5 and b1["presence_penalty"] == 0.5
    assert b1["chat_template_kwargs"] == {"enable_thinking": True}
    assert b2["temperature"] == 0.6, "sample 2 wraps to ladder entry 0"
    assert b2["chat_template_kwargs"] == {"enable_thinking": True}, "no row mode: the run's enable_thinking"
    assert b0["seed"] != b1["seed"]
    sent = sent_sampling(b1)
    assert sent == {"max_tokens": 4096, "temperature": 1.1, "top_p": 0.95, "top_k": 5, "min_p": 0.05,
                    "presence_penalty": 0.5, "stop": ["END"], "seed": b1["seed"]}
    assert list(sent) == sorted(sent)
    capped = build_chat_body(msgs, "m", RunConfig.from_params({**BASE, "sampling_extra": {"min_tokens": 50},
                             "sampling_ladder": [{"max_tokens": 9000}]}).sampling, "x", "vllm", max_tokens_cap=1)
    assert capped["max_tokens"] == 1 and capped["min_tokens"] == 1, "a probe stays a 1-token request"


def test_preflight_refuses_keys_the_engine_would_ignore() -> None:
    def info(name: str, engine: str) -> ServerInfo:
        return ServerInfo(name, name, None, None, None, None, None, None, engine=engine)

    cfg = RunConfig.from_params({**BASE, "sampling_extra": {"top_k": 20}})
    refuse_sampling_keys(cfg, [info("a", "sglang"), info("b", "vllm")], [])
    with pytest.raises(ConfigError) as exc:
        refuse_sampling_keys(cfg, [info("a", "sglang"), info("g", "openai")], [])
    assert "server g (openai) does not accept ['top_k']" in str(exc.value) and "server a" not in str(exc.value)
    with pytest.raises(ConfigError, match=r"server a \(sglang\) does not accept \['bad_words'\]"):
        refuse_sampling_keys(RunConfig.from_params(BASE), [info("a", "sglang"), info("b", "vllm")], ["bad_words"])
    assert unsupported_keys(["stop_regex", "top_k"], "vllm") == ["stop_regex"]
    assert DIALECTS["openai"] < DIALECTS["sglang"]


def test_inputs_and_parts_carry_the_mix() -> None:
    rows = [{"id": "a", "messages": [{"role": "user", "content": "x"}], "thinking": True,
             "sampling_override": {"top_k": 3}},
            {"id": "b", "messages": [{"role": "user", "content": "y"}], "thinking": None}]
    back = decode_inputs(encode_inputs(rows))
    assert back[0]["thinking"] is True and back[0]["sampling_override"] == {"top_k": 3}
    assert back[1]["thinking"] is None and back[1]["sampling_override"] is None
    table = decode_part(encode_part([{"id": "a", "thinking": False, "sampling": '{"max_tokens":8}'}]))
    assert table.column("sampling").to_pylist() == ['{"max_tokens":8}'] and table.column("thinking").to_pylist() == [False]


def test_pins() -> None:
    plain = RunConfig.from_params(BASE)
    assert "thinking_fraction" not in pinned_settings(plain, "e", 1)["input"], "old roots still match"
    assert "extra" not in pinned_settings(plain, "e", 1)["sampling"]
    mixed = RunConfig.from_params({**BASE, "thinking_fraction": 0.4, "sampling_extra": {"top_k": 20}})
    pins = pinned_settings(mixed, "e", 1)
    assert pins["input"]["thinking_fraction"] == 0.4 and pins["sampling"]["extra"] == {"top_k": 20}
    other = RunConfig.from_params({**BASE, "thinking_fraction": 0.5, "accept_pin_changes": True})
    with pytest.raises(PlanError, match="input.thinking_fraction"):
        check_pins({"pinned": pins}, pinned_settings(other, "e", 1), other)
    extra_changed = RunConfig.from_params({**BASE, "thinking_fraction": 0.4, "sampling_extra": {"top_k": 40},
                                           "accept_pin_changes": True})
    assert check_pins({"pinned": pins}, pinned_settings(extra_changed, "e", 1), extra_changed)


def test_simulator_refuses_what_the_engines_refuse() -> None:
    assert sampling_wire.refusal({"top_k": 20, "stop": ["a"], "min_p": 0.1}, "sglang") is None
    assert "top_k" in (sampling_wire.refusal({"top_k": "x"}, "sglang") or "")
    assert "min_p must be in [0, 1]" in (sampling_wire.refusal({"min_p": 1.5}, "vllm") or "")
    assert sampling_wire.refusal({"min_p": 1.5}, "sglang") is None, "SGLang's request model has no range check"
    assert "min_tokens must be less than or equal to max_tokens=4" in (
        sampling_wire.refusal({"min_tokens": 5, "max_tokens": 4}, "vllm") or "")
    assert sampling_wire.refusal({"made_up": 1}, "vllm") is None, "unknown fields are ignored, as the engines do"
    log = sampling_wire.RequestLog()
    log.add({"messages": [{"role": "user", "content": "q"}], "top_k": 3, "made_up": 1,
             "chat_template_kwargs": {"enable_thinking": False}}, "r1")
    assert log.rows() == [{"request_id": "r1", "sampling": {"top_k": 3}, "enable_thinking": False,
                           "last_message": "q", "unknown_fields": ["made_up"], "refused": None}]


def test_check_overrides_copies() -> None:
    src = {"stop": ["a"]}
    out = check_overrides(src, "x")
    out["stop"].append("b")
    assert src == {"stop": ["a"]}
    with pytest.raises(SamplingError):
        check_overrides({"top_p": 0}, "x")
    assert json.dumps(out)
