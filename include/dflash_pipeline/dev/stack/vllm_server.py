"""A real vLLM OpenAI server of the dev stack: ``vllm serve <checkpoint>`` from ``.venv-vllm`` on loopback.

Why: the simulator must behave like vLLM on the wire, and the pipeline must be proven against the
engine itself. vLLM's CPU build (``make vllm-venv``) serves a local checkpoint directory (the tiny
designed one, ``dev/engine/tiny_qwen.py``) on this machine without a GPU.

What the command line carries and why:

* ``VLLM_TARGET_DEVICE=cpu``: platform detection also works without it (the ``vllm`` alias
  distribution's version ends in ``+cpu``), but naming the device makes it independent of that.
* ``--reasoning-parser qwen3`` (the thinking comes back in ``message.reasoning``), ``--dtype
  float32`` (vLLM downcasts a float32 checkpoint to bfloat16 under ``auto``; the tiny model's
  designed logits are exact in float32), ``--enforce-eager`` (no torch.compile/inductor C++ build
  at start), ``--max-model-len``, ``--max-num-seqs``, ``--kv-cache-memory-bytes`` (0.32's flag;
  ``VLLM_CPU_KVCACHE_SPACE`` in GiB is its legacy form), loopback host, a free port,
  ``--served-model-name``.
* Speculating (``VllmSettings.speculative_config``: :func:`ngram_spec`, :func:`draft_model_spec`,
  :func:`dflash_spec`, :func:`eagle3_spec`; a DFlash drafter is checked against the target first):
  ``--speculative-config <json>`` and ``--per-request-spec-decode-metrics summary`` (0.32's flag,
  ``none|summary|detailed``; vLLM refuses it without a speculative config), so each response carries
  ``metrics.speculative_decoding``. Such a server also gets ``PYTHONPATH=dev/engine/vllm_cpu_fix``,
  whose ``sitecustomize`` fixes the CPU build's rejection-sampler expand kernel (without it any
  request with temperature > 0 kills the engine; see that file). ``preload_iomp`` puts the venv's
  ``libiomp5.so`` in ``LD_PRELOAD`` (vLLM warns that speculation on CPU wants it; off by default,
  docs/engines.md has what it changed). :func:`spec_counters` reads the ``/metrics`` counters.
* No network: ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``, and ``VLLM_NO_USAGE_STATS`` /
  ``DO_NOT_TRACK`` (vLLM otherwise reports usage statistics over the network).
* vLLM's caches go under the server's work directory, not ``~/.cache/vllm``.

The process (API server, engine core, worker) runs in its own process group with its output in
``<workdir>/vllm.log``; :meth:`VllmServer.stop` signals the whole group (SIGTERM, then SIGKILL).
Owner: whoever called :meth:`start` (a session fixture, a measurement script) stops it; nothing
else does.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from dflash_pipeline.dev.stack.procs import LOOPBACK, StackError, free_port, spawn, stop_process_groups, tail
from dflash_pipeline.serving.specwire import vllm_spec_counters

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[4]
VENV_ENV = "DFLASH_VLLM_VENV"
"""Environment variable naming another vLLM venv than the repository's ``.venv-vllm``."""
CPU_FIX_DIR = Path(__file__).resolve().parents[1] / "engine" / "vllm_cpu_fix"
"""Holds the ``sitecustomize`` that fixes vLLM 0.32 CPU's rejection-sampler expand kernel (speculating servers)."""
_DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")


def vllm_venv() -> Path:
    """The venv vLLM runs from: ``$DFLASH_VLLM_VENV`` or the repository's ``.venv-vllm``."""
    return Path(os.environ.get(VENV_ENV) or REPO / ".venv-vllm")


def vllm_unavailable(venv: Path | None = None) -> str | None:
    """Why vLLM cannot be started from `venv`, or None when it can (built by ``make vllm-venv``)."""
    venv = venv or vllm_venv()
    if not (venv / "bin" / "vllm").exists():
        return f"{venv}/bin/vllm not found (run `make vllm-venv`)"
    if not (venv / ".installed").exists():
        return f"{venv} is incomplete: no .installed stamp (run `make vllm-venv`)"
    return None


def ngram_spec(k: int = 3) -> dict[str, Any]:
    """vLLM's n-gram (prompt lookup) drafter: proposes up to `k` tokens that followed the last 1-3
    tokens where they occurred before in the prompt or output (no model). On the tiny model,
    whose thinking repeats, it is accepted often at temperature 0."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def draft_model_spec(draft: Path, k: int = 3) -> dict[str, Any]:
    """A separate draft model (`draft`: a checkpoint directory; the tiny checkpoint can be its own
    draft, then every greedy draft token is accepted)."""
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def dflash_spec(drafter: Path, k: int | None = None) -> dict[str, Any]:
    """A DFlash drafter (`drafter`: a directory in SpecForge's format, ``dev/engine/dflash_drafter.py``):
    vLLM 0.32's ``method: dflash`` drafts `k` tokens in one pass (a bonus query and k mask queries,
    ``DFlashProposer``). `k` defaults to the drafter's ``block_size`` - 1, what it was trained to
    draft; more is refused (vLLM would query positions the drafter never learned). vLLM reads
    ``dflash_config.mask_token_id`` and ``target_layer_ids`` from the drafter's own config.json."""
    from dflash_pipeline.dev.engine.dflash_drafter import block_size

    limit = block_size(Path(drafter)) - 1
    k = limit if k is None else k
    if not 1 <= k <= limit:
        raise ValueError(f"{drafter}: k={k} outside 1..{limit} (the drafter's block_size {limit + 1} minus the bonus token)")
    return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k}


def eagle3_spec(drafter: Path, k: int = 3) -> dict[str, Any]:
    """An EAGLE-3 drafter (`drafter`: a directory as SpecForge or speculators write it, e.g.
    ``LlamaForCausalLMEagle3``): vLLM 0.32's ``method: eagle3`` runs it `k` times in a chain, each
    step reading the target's aux hidden states (``eagle_aux_hidden_state_layer_ids`` in the
    drafter's config, else the model's defaults)."""
    return {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k}


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's `/metrics` speculative-decoding counters (summed over engines): verify steps with a
    draft (`vllm:spec_decode_num_drafts_total`), draft tokens proposed and accepted, and accepted
    tokens per draft position (0-based). All zero on a server that does not speculate."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        pad = lambda t: tuple(t) + (0,) * (width - len(t))  # noqa: E731
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted_tokens - before.accepted_tokens,
                            tuple(a - b for a, b in zip(pad(self.accepted_per_pos), pad(before.accepted_per_pos))))


def parse_spec_counters(metrics_text: str) -> SpecCounters:
    """The spec-decode counters of a vLLM `/metrics` text (serving/specwire.py parses them); all
    zero when the server publishes none."""
    c = vllm_spec_counters(metrics_text)
    if c is None:
        return SpecCounters()
    return SpecCounters(c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_position)


def spec_counters(base_url: str, timeout_s: float = 10.0) -> SpecCounters:
    """GET `base_url`/metrics and parse its spec-decode counters."""
    r = requests.get(f"{base_url}/metrics", timeout=timeout_s)
    r.raise_for_status()
    return parse_spec_counters(r.text)


def settled_spec_counters(base_url: str, reads: int = 25, interval_s: float = 0.2) -> SpecCounters:
    """The spec-decode counters once two reads `interval_s` apart agree (vLLM updates them as a
    response is sent, so a read right after one may miss it), or the last of `reads` reads."""
    last = spec_counters(base_url)
    for _ in range(reads):
        time.sleep(interval_s)
        now = spec_counters(base_url)
        if now == last:
            return now
        last = now
    return last


@dataclass(frozen=True)
class VllmSettings:
    """The server's knobs (defaults sized for the tiny model on a 2-core machine)."""

    served_model_name: str = "tiny-qwen3-thinking"
    max_model_len: int = 2048
    max_num_seqs: int = 16
    kv_cache_bytes: int = 64 * 1024 * 1024
    dtype: str = "float32"
    reasoning_parser: str | None = "qwen3"
    enable_scale_out: bool = False  # registers /render, /v1/chat/completions/render etc. (403 without)
    speculative_config: Mapping[str, Any] | None = None  # --speculative-config (JSON); None: no speculation
    spec_decode_metrics: str = "summary"  # --per-request-spec-decode-metrics when speculating (none|summary|detailed)
    preload_iomp: bool = False  # LD_PRELOAD the venv's libiomp5.so (vLLM's CPU advice for speculation)
    cpu_expand_fix: bool = True  # speculating servers load dev/engine/vllm_cpu_fix (see its docstring)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # e.g. VLLM_CPU_OMP_THREADS_BIND


class VllmServer:
    """``vllm serve`` as a subprocess; :attr:`base_url` once :meth:`start` returned."""

    def __init__(self, checkpoint: Path, settings: VllmSettings = VllmSettings(), *,
                 workdir: Path | None = None, venv: Path | None = None) -> None:
        self.checkpoint = Path(checkpoint)
        self.settings = settings
        self.venv = venv or vllm_venv()
        self.workdir = workdir
        self.port: int | None = None
        self.started_in_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path | None:
        return None if self.workdir is None else self.workdir / "vllm.log"

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise StackError("vLLM server not started")
        return f"http://{LOOPBACK}:{self.port}"

    def argv(self, port: int) -> list[str]:
        s = self.settings
        argv = [
            str(self.venv / "bin" / "vllm"), "serve", str(self.checkpoint),
            "--host", LOOPBACK, "--port", str(port),
            "--served-model-name", s.served_model_name,
            "--max-model-len", str(s.max_model_len),
            "--max-num-seqs", str(s.max_num_seqs),
            "--kv-cache-memory-bytes", str(s.kv_cache_bytes),
            "--dtype", s.dtype,
            "--enforce-eager",
        ]  # fmt: skip
        if s.reasoning_parser:
            argv += ["--reasoning-parser", s.reasoning_parser]
        if s.enable_scale_out:
            argv.append("--enable-scale-out")
        if s.speculative_config is not None:
            argv += ["--speculative-config", json.dumps(dict(s.speculative_config), sort_keys=True),
                     "--per-request-spec-decode-metrics", s.spec_decode_metrics]
        return argv + list(s.extra_args)

    def environment(self, workdir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        env.update({
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(workdir / "cache"),
            "VLLM_CONFIG_ROOT": str(workdir / "config"),
            "PATH": f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        })
        if self.settings.speculative_config is not None and self.settings.cpu_expand_fix:
            env["PYTHONPATH"] = str(CPU_FIX_DIR)
        if self.settings.preload_iomp:
            env["LD_PRELOAD"] = str(self.venv / "lib" / "libiomp5.so")
        env.update(self.settings.env)
        return env

    def start(self, timeout_s: float = 300.0) -> VllmServer:
        """Start the server and wait until ``/health`` answers 200; StackError (with the log's
        tail) when it exits or is not healthy within `timeout_s`."""
        if self._proc is not None:
            return self
        why = vllm_unavailable(self.venv)
        if why:
            raise StackError(why)
        self._check_drafter()
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="dflash-vllm-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        started = time.monotonic()
        self._proc = spawn(self.argv(self.port), env=self.environment(self.workdir), log_path=self.log_path)
        deadline = started + timeout_s
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise StackError(f"vllm serve exited with {code}:\n{tail(self.log_path, 60)}")
            try:
                if requests.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise StackError(f"vllm serve not healthy within {timeout_s:.0f} s:\n{tail(self.log_path, 60)}")
            time.sleep(0.5)
        self.started_in_s = time.monotonic() - started
        log.info("vllm serve %s at %s (healthy in %.1f s, log %s)", self.checkpoint, self.base_url,
                 self.started_in_s, self.log_path)
        return self

    def _check_drafter(self) -> None:
        """Refuse a DFlash drafter vLLM cannot serve for this target, naming what is wrong (vLLM's own
        errors come a minute later, from deep inside the engine)."""
        spec = self.settings.speculative_config
        if spec is None or spec.get("method") != "dflash":
            return
        from dflash_pipeline.dev.engine.dflash_drafter import check_drafter

        problems = check_drafter(Path(spec["model"]), self.checkpoint)
        if problems:
            raise StackError(f"DFlash drafter {spec['model']} cannot serve {self.checkpoint}: " + "; ".join(problems))

    def stop(self) -> None:
        """Stop the server and its engine processes (SIGTERM to the group, then SIGKILL)."""
        if self._proc is None:
            return
        stop_process_groups([self._proc], name="vllm serve", first_signal=signal.SIGTERM, grace_s=20)
        self._proc = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
