"""Capture what a real vLLM 0.32 server answers when it speculates: response bodies and `/metrics` counters.

Why: the pipeline stores each request's speculative-decoding statistics and the simulator plays
vLLM's dialect; both are aligned to what a real server wrote, captured here, not to a guess.

    python -m dflash_pipeline.dev.engine.spec_wire --out /work/scratch/vllm_spec_wire.json
    python -m dflash_pipeline.dev.engine.spec_wire --url ngram=http://127.0.0.1:8001 --url plain=...

Without ``--url`` it builds the tiny checkpoint and starts three servers (``ngram``, ``draft_model``
with the checkpoint as its own draft, both ``--per-request-spec-decode-metrics summary``, and
``plain`` without speculation), one after another. For each server, one request at a time with the
spec counters of ``/metrics`` read before and after each: thinking on and off at temperature 0 and
0.6 (n = 1, ``return_token_ids``), n = 2, a streaming request with ``include_usage`` and one
without; then ``--concurrent`` requests at once, whose per-request counters are summed and compared
with the ``/metrics`` delta. Texts and token ids are trimmed in the file (lengths kept).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import requests

from dflash_pipeline.dev.engine import tiny_qwen
from dflash_pipeline.dev.stack.vllm_server import (
    SpecCounters,
    VllmServer,
    VllmSettings,
    draft_model_spec,
    ngram_spec,
    spec_counters,
)

logger = logging.getLogger(__name__)

KINDS = ("ngram", "draft_model", "plain")
TRIM = 60


def settings_for(kind: str, checkpoint: Path, **overrides: Any) -> VllmSettings:
    """The dev stack's settings of a speculating (`ngram`, `draft_model`) or plain server."""
    spec = {"ngram": ngram_spec(), "draft_model": draft_model_spec(checkpoint), "plain": None}[kind]
    return VllmSettings(speculative_config=spec, **overrides)


def _trim(value: Any) -> Any:
    """Long strings and id lists shortened (their length kept beside them)."""
    if isinstance(value, str) and len(value) > TRIM:
        return value[:TRIM] + f"…[{len(value)} chars]"
    if isinstance(value, list) and len(value) > 8 and all(isinstance(v, int) for v in value):
        return value[:8] + [f"…[{len(value)} ids]"]
    if isinstance(value, list):
        return [_trim(v) for v in value]
    if isinstance(value, dict):
        return {k: _trim(v) for k, v in value.items()}
    return value


def settle(base_url: str, expected_drafts: int | None = None, timeout_s: float = 5.0) -> SpecCounters:
    """The counters once two reads 0.2 s apart agree (and reach `expected_drafts` when given)."""
    deadline = time.monotonic() + timeout_s
    last = spec_counters(base_url)
    while True:
        time.sleep(0.2)
        now = spec_counters(base_url)
        done = now == last and (expected_drafts is None or now.drafts >= expected_drafts)
        if done or time.monotonic() > deadline:
            return now
        last = now


def body(model: str, i: int, thinking: bool, temperature: float, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"Question {i}: what is {i} + 2?"}],
            "max_tokens": max_tokens, "temperature": temperature, "top_p": tiny_qwen.TOP_P, "seed": i,
            "chat_template_kwargs": {"enable_thinking": thinking}, "return_token_ids": True, **extra}


def post(base_url: str, payload: dict[str, Any]) -> dict[str, Any]:
    r = requests.post(f"{base_url}/v1/chat/completions", json=payload, timeout=600)
    r.raise_for_status()
    return r.json()


def post_stream(base_url: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The `data:` events of a streamed chat completion, parsed (`[DONE]` left out)."""
    events = []
    with requests.post(f"{base_url}/v1/chat/completions", json=payload, timeout=600, stream=True) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def spec_of(response: dict[str, Any]) -> dict[str, Any] | None:
    metrics = response.get("metrics")
    return None if metrics is None else metrics.get("speculative_decoding")


def one_at_a_time(base_url: str, model: str, name: str, payload: dict[str, Any]) -> dict[str, Any]:
    before = settle(base_url)
    if payload.get("stream"):
        events = post_stream(base_url, payload)
        final = events[-1]
        shown: Any = {"events": len(events), "first": _trim(events[0]), "last": _trim(final),
                      "events_with_metrics": sum(1 for e in events if "metrics" in e)}
        spec = spec_of(final)
        usage = final.get("usage")
    else:
        response = post(base_url, payload)
        shown = _trim(response)
        spec = spec_of(response)
        usage = response["usage"]
    after = settle(base_url)
    delta = after - before
    out = {"name": name, "request": _trim(payload), "response": shown, "metrics_delta": asdict(delta)}
    if spec is not None:
        out["per_request_equals_delta"] = (spec["num_spec_steps"], spec["num_accepted_draft_tokens"],
                                           spec["num_draft_tokens"]) == (delta.drafts, delta.accepted_tokens,
                                                                         delta.draft_tokens)
        if usage:
            out["completion_tokens"] = usage["completion_tokens"]
            out["steps_plus_accepted"] = spec["num_spec_steps"] + spec["num_accepted_draft_tokens"]
    return out


def concurrent(base_url: str, model: str, count: int, max_tokens: int) -> dict[str, Any]:
    """`count` requests at once (thinking on and off, T 0 and 0.6): Σ per-request vs the `/metrics` delta."""
    before = settle(base_url)
    payloads = [body(model, 100 + i, i % 2 == 0, (0.0, tiny_qwen.TEMPERATURE)[i // 2 % 2], max_tokens)
                for i in range(count)]
    with ThreadPoolExecutor(count) as pool:
        responses = list(pool.map(lambda p: post(base_url, p), payloads))
    specs = [spec_of(r) for r in responses]
    after = settle(base_url)
    delta = after - before
    out: dict[str, Any] = {"requests": count, "max_tokens": max_tokens, "metrics_delta": asdict(delta),
                           "with_spec_metrics": sum(s is not None for s in specs)}
    if all(s is not None for s in specs):
        summed = {k: sum(s[k] for s in specs if s) for k in ("num_spec_steps", "num_accepted_draft_tokens",
                                                              "num_draft_tokens")}
        hist = [sum(col) for col in zip(*(s["acceptance_histogram"] for s in specs if s))]
        per_pos = [sum(hist[j:]) for j in range(1, len(hist))]
        out.update({"summed": summed, "summed_histogram": hist, "per_pos_from_histogram": per_pos,
                    "equal": (summed["num_spec_steps"], summed["num_accepted_draft_tokens"],
                              summed["num_draft_tokens"], tuple(per_pos))
                    == (delta.drafts, delta.accepted_tokens, delta.draft_tokens, delta.accepted_per_pos),
                    "token_weighted_acceptance_length": 1 + summed["num_accepted_draft_tokens"]
                    / max(summed["num_spec_steps"], 1),
                    "mean_of_per_request_acceptance_length": sum(s["mean_acceptance_length"] for s in specs if s)
                    / count})
    return out


def capture(base_url: str, model: str, concurrent_requests: int = 8, max_tokens: int = 128) -> dict[str, Any]:
    """Every request of the module docstring against one server."""
    t = tiny_qwen.TEMPERATURE
    single = [
        ("thinking_on_t0", body(model, 1, True, 0.0, max_tokens)),
        ("thinking_on_t0.6", body(model, 2, True, t, max_tokens)),
        ("thinking_off_t0", body(model, 3, False, 0.0, max_tokens)),
        ("thinking_off_t0.6", body(model, 4, False, t, max_tokens)),
        ("thinking_on_t0_max_tokens_5", body(model, 5, True, 0.0, 5)),
        ("n2_t0.6", body(model, 6, True, t, max_tokens, n=2)),
        ("stream_include_usage", body(model, 7, True, 0.0, max_tokens, stream=True,
                                      stream_options={"include_usage": True})),
        ("stream_without_usage", body(model, 8, True, 0.0, max_tokens, stream=True)),
    ]
    return {"requests": [one_at_a_time(base_url, model, n, p) for n, p in single],
            "concurrent": concurrent(base_url, model, concurrent_requests, max_tokens),
            "metrics_text_spec_lines": [line for line in requests.get(f"{base_url}/metrics", timeout=10).text
                                        .splitlines() if "spec_decode" in line and not line.startswith("#")]}


@contextmanager
def _servers(urls: dict[str, str], kinds: list[str]) -> Iterator[Iterator[tuple[str, str, dict[str, Any]]]]:
    def each() -> Iterator[tuple[str, str, dict[str, Any]]]:
        if urls:
            for kind, url in urls.items():
                yield kind, url, {}
            return
        with tempfile.TemporaryDirectory(prefix="tiny-qwen-spec-") as tmp:
            ckpt = tiny_qwen.build_checkpoint(Path(tmp) / "ckpt")
            for kind in kinds:
                settings = settings_for(kind, ckpt)
                with ExitStack() as stack:
                    server = stack.enter_context(VllmServer(ckpt, settings, workdir=Path(tmp) / kind))
                    yield kind, server.base_url, {"started_in_s": round(server.started_in_s or 0, 1),
                                                  "argv": server.argv(0)[1:]}
    yield each()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.dev.engine.spec_wire", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", default=[], help="KIND=URL of a running server (repeatable)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    urls = dict(u.split("=", 1) for u in args.url)
    result: dict[str, Any] = {"vllm": None, "servers": {}}
    with _servers(urls, args.kinds) as servers:
        for kind, url, info in servers:
            result["vllm"] = requests.get(f"{url}/version", timeout=10).json()["version"]
            model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            logger.info("capturing %s at %s", kind, url)
            result["servers"][kind] = {**info, "model": model,
                                       **capture(url, model, args.concurrent, args.max_tokens)}
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
