"""Measure DFlash drafters through a real vLLM 0.32 (CPU build): start-up time and acceptance.

Why: docs/engines.md states what vLLM's DFlash path does on this machine kind with drafters whose
answer is known; the figures come from here.

    python -m dflash_pipeline.dev.engine.dflash_measure [--drafters oracle untrained self] [--requests 8]
        [--max-tokens 128] [--k 3] [--target cycle|tiny|topic] [--drafter-dir DIR]

It builds the target (``cycle``: dev/engine/cycle_qwen.py, whose greedy text is known; ``tiny``:
dev/engine/tiny_qwen.py; ``topic``: dev/engine/topic_qwen.py, the learnable one, asked with prompts
that name a topic) and, per drafter, a DFlash drafter in SpecForge's format
(dev/engine/dflash_drafter.py: ``oracle`` drafts the greedy text except after the cycle's second
half, the engine tests' drafter; ``untrained`` is a seeded random one, as SpecForge initialises it; ``self`` is not DFlash: the
target as its own draft model (``method: draft_model``), a perfect drafter of any target, drafting greedily
as vLLM's drafters do; ``--drafter-dir`` serves a given one, e.g. SpecForge-trained), then starts ``vllm serve`` with
``dflash_spec`` for each in turn and logs one JSON line per (thinking, temperature): requests sent
4 at a time, token-weighted acceptance length 1 + accepted / steps from the per-request figures,
their mean, and whether their sums equal the ``/metrics`` delta. Start-up is spawn to ``/health`` 200.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from dflash_pipeline.dev.engine import cycle_qwen, dflash_drafter, tiny_qwen, topic_qwen
from dflash_pipeline.dev.stack.vllm_server import VllmServer, VllmSettings, dflash_spec, draft_model_spec, spec_counters

logger = logging.getLogger(__name__)


def build(kind: str, target: Path, out: Path, k: int) -> Path:
    """The drafter `kind` for `target` in `out`."""
    if kind == "oracle":
        words = cycle_qwen.word_ids(target)
        return dflash_drafter.build_oracle(target, out, k=k, wrong_tokens=tuple(words[len(words) // 2:]))
    return dflash_drafter.build_untrained(target, out, block_size=max(k + 1, dflash_drafter.DEFAULT_BLOCK_SIZE))


def question(target: str, seed: int) -> str:
    """The measured prompt: for the topic target one of its held-out-style prompts (names a topic)."""
    if target == "topic":
        return str(topic_qwen.prompt_rows(seed + 1, seed=10_000 + seed)[seed]["messages"][0]["content"])
    return f"Question {seed}: what is {seed} + 2?"


def acceptance(base_url: str, model: str, thinking: bool, temperature: float, count: int,
               max_tokens: int, target: str = "cycle") -> dict[str, Any]:
    """`count` chat requests (4 at a time): acceptance from the per-request figures, against /metrics."""
    def ask(seed: int) -> dict[str, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": question(target, seed)}],
                "max_tokens": max_tokens, "temperature": temperature, "top_p": tiny_qwen.TOP_P, "seed": seed,
                "chat_template_kwargs": {"enable_thinking": thinking}}
        r = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        spec: dict[str, Any] = r.json()["metrics"]["speculative_decoding"]
        return spec

    before = spec_counters(base_url)
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        specs = list(pool.map(ask, range(count)))
    seconds = time.monotonic() - started
    time.sleep(1.0)
    delta = spec_counters(base_url) - before
    steps = sum(s["num_spec_steps"] for s in specs)
    accepted = sum(s["num_accepted_draft_tokens"] for s in specs)
    return {"thinking": thinking, "temperature": temperature, "requests": count, "max_tokens": max_tokens,
            "steps": steps, "accepted": accepted, "acceptance_length": round(1 + accepted / max(steps, 1), 3),
            "mean_of_requests": round(sum(s["mean_acceptance_length"] for s in specs) / count, 3),
            "sums_equal_metrics_delta": (steps, accepted) == (delta.drafts, delta.accepted_tokens),
            "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.dev.engine.dflash_measure", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("cycle", "tiny", "topic"), default="cycle")
    parser.add_argument("--drafters", nargs="*", choices=("oracle", "untrained", "self"),
                        default=["oracle", "untrained"])
    parser.add_argument("--drafter-dir", type=Path, help="also serve this drafter directory")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("urllib3", "dflash_pipeline.dev.stack", "dflash_pipeline.dev.engine"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Not "dflash" in the path: vLLM 0.32 takes a draft model whose path contains "dflash" for a DFlash drafter
    # (SpeculativeConfig's method detection), which would turn the `self` draft model into one.
    with tempfile.TemporaryDirectory(prefix="drafter-measure-") as tmp:
        builder = {"cycle": cycle_qwen.build_checkpoint, "tiny": tiny_qwen.build_checkpoint,
                   "topic": topic_qwen.build_checkpoint}[args.target]
        target = builder(Path(tmp) / "target")
        drafters = [(kind, target if kind == "self" else build(kind, target, Path(tmp) / kind, args.k))
                    for kind in args.drafters]
        if args.drafter_dir:
            drafters.append(("given", args.drafter_dir))
        for kind, drafter in drafters:
            spec = draft_model_spec(drafter, args.k) if kind == "self" else dflash_spec(drafter, args.k)
            settings = VllmSettings(served_model_name="target", speculative_config=spec)
            server = VllmServer(target, settings, workdir=Path(tmp) / f"server-{kind}")
            with server.start(timeout_s=args.start_timeout):
                logger.info("%s", json.dumps({"target": args.target, "drafter": kind, "k": args.k,
                                              "server_start_s": round(server.started_in_s or 0, 1)}))
                for thinking in (True, False):
                    for temperature in (0.0, tiny_qwen.TEMPERATURE):
                        figures = acceptance(server.base_url, "target", thinking, temperature, args.requests,
                                             args.max_tokens, args.target)
                        logger.info("%s", json.dumps({"drafter": kind, **figures}))


if __name__ == "__main__":
    main()
