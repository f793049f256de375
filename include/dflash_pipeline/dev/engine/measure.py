"""Measure the tiny Qwen3 checkpoint on a real vLLM server: its output shape and the server's speed.

Why: the tiny model's docstring and the real-engine tests state what the model produces and how
long a run of N rows takes; those figures come from here, never from the design's prediction.

    python -m dflash_pipeline.dev.engine.measure shape [--rows 300] [--max-tokens 256]
    python -m dflash_pipeline.dev.engine.measure speed [--concurrency 8 16] [--requests 48]

Each builds the checkpoint in a temporary directory, starts ``vllm serve`` from ``.venv-vllm``
(dev/stack/vllm_server.py), measures, stops it, and logs one JSON line per result. ``--base-url``
uses a running server instead (its model must be the tiny checkpoint for ``shape``).

* ``shape``: rows with thinking on and off (seeds 0..N-1, temperature 0.6, top_p 0.95,
  ``return_token_ids``); per mode: finish reasons, where ``length`` cut (inside the thinking or the
  answer), reasoning/answer lengths in tokens, rows whose ids are not the canonical BPE encoding of
  their decoded text.
* ``speed``: the server's start time (spawn to ``/health`` 200), then for each concurrency C,
  ``requests`` chat requests of ``max_tokens`` 256 with ``ignore_eos`` (every request decodes exactly
  256 tokens), C in flight at a time: completion tokens per second of wall time. Also the same
  without ``ignore_eos`` (the model's own lengths, as a pipeline run sees them).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

from dflash_pipeline.dev.engine import tiny_qwen
from dflash_pipeline.dev.stack.vllm_server import VllmServer, VllmSettings

logger = logging.getLogger(__name__)


@contextmanager
def served(base_url: str | None, env: dict[str, str]) -> Iterator[tuple[str, str, Path | None, float | None]]:
    """(base URL, model name, checkpoint dir, start seconds): `base_url`'s, or a new server's."""
    if base_url:
        models = requests.get(f"{base_url}/v1/models", timeout=10).json()
        yield base_url, models["data"][0]["id"], None, None
        return
    with tempfile.TemporaryDirectory(prefix="tiny-qwen-") as tmp:
        ckpt = tiny_qwen.build_checkpoint(Path(tmp) / "ckpt")
        server = VllmServer(ckpt, VllmSettings(env=env), workdir=Path(tmp) / "server")
        with server:
            yield server.base_url, server.settings.served_model_name, ckpt, server.started_in_s


def chat(base_url: str, model: str, seed: int, thinking: bool, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": f"Question number {seed}: what is {seed} + 2?"}],
            "max_tokens": max_tokens, "temperature": tiny_qwen.TEMPERATURE, "top_p": tiny_qwen.TOP_P, "seed": seed,
            "chat_template_kwargs": {"enable_thinking": thinking}, "return_token_ids": True, **extra}
    r = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def run_rows(base_url: str, model: str, seeds: range, thinking: bool, max_tokens: int, concurrency: int,
             **extra: Any) -> tuple[list[dict[str, Any]], float]:
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        bodies = list(pool.map(lambda s: chat(base_url, model, s, thinking, max_tokens, **extra), seeds))
    return bodies, time.monotonic() - t0


def shape_of(bodies: list[dict[str, Any]], tokenizer_dir: Path, thinking: bool) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    rows = [tiny_qwen.Row(b["choices"][0]["token_ids"], b["choices"][0]["finish_reason"]) for b in bodies]
    stats = tiny_qwen.shape(rows, lambda t: tok.encode(t, add_special_tokens=False).ids,
                            lambda ids: tok.decode(ids, skip_special_tokens=False), thinking=thinking)
    return {"thinking": thinking, **stats.to_dict()}


def cmd_shape(args: argparse.Namespace) -> None:
    with served(args.base_url, {}) as (url, model, ckpt, _):
        tokenizer_dir = ckpt or Path(args.tokenizer_dir)
        for thinking in (True, False):
            bodies, secs = run_rows(url, model, range(args.rows), thinking, args.max_tokens, args.concurrency)
            result = {**shape_of(bodies, tokenizer_dir, thinking), "max_tokens": args.max_tokens,
                      "seconds": round(secs, 1)}
            logger.info("%s", json.dumps(result))


def cmd_speed(args: argparse.Namespace) -> None:
    env = {"VLLM_CPU_OMP_THREADS_BIND": args.omp_bind} if args.omp_bind else {}
    with served(args.base_url, env) as (url, model, _, start_s):
        logger.info("%s", json.dumps({"server_start_s": None if start_s is None else round(start_s, 1)}))
        chat(url, model, 0, True, 8)  # warm-up
        for conc in args.concurrency:
            for fixed in (True, False):
                extra = {"ignore_eos": True} if fixed else {}
                bodies, secs = run_rows(url, model, range(args.requests), True, 256, conc, **extra)
                tokens = sum(b["usage"]["completion_tokens"] for b in bodies)
                logger.info("%s", json.dumps({
                    "concurrency": conc, "requests": args.requests, "max_tokens": 256, "ignore_eos": fixed,
                    "completion_tokens": tokens, "seconds": round(secs, 1),
                    "tokens_per_s": round(tokens / secs, 1), "requests_per_s": round(args.requests / secs, 2)}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.dev.engine.measure", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running server instead of a new one")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("shape")
    p.add_argument("--rows", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokenizer-dir", default=str(Path("~/.cache/dflash-pipeline/qwen-bpe").expanduser()))
    p.set_defaults(func=cmd_shape)
    s = sub.add_parser("speed")
    s.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    s.add_argument("--requests", type=int, default=48)
    s.add_argument("--omp-bind", help="VLLM_CPU_OMP_THREADS_BIND for the server (default: vLLM's auto)")
    s.set_defaults(func=cmd_speed)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("urllib3", "dflash_pipeline.dev.stack"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args.func(args)


if __name__ == "__main__":
    main()
