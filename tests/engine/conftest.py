"""The real-engine tier: a real ``vllm serve`` (CPU build, ``make vllm-venv``) serving the tiny designed
Qwen3 checkpoint (``dflash_pipeline.dev.engine.tiny_qwen``).

Fixtures:

* ``tiny_qwen_checkpoint`` (session): the checkpoint directory (config, generation_config,
  model.safetensors, Qwen's BPE with the Qwen3.6-style template), built in a temporary folder.
* ``vllm_server`` (session): a :class:`VllmEndpoint` (``base_url``, ``model``, ``checkpoint_dir``,
  ``tokenizer_dir``, ``log_path``, ``started_in_s``) of one server started for the session
  (``--reasoning-parser qwen3``, max_model_len 2048, 16 sequences; see dev/stack/vllm_server.py) and
  stopped at its end. Start-up takes about a minute, so every engine test shares it.
* ``vllm_scale_out_server`` (session): the same with ``--enable-scale-out`` (the ``/render`` family
  of endpoints answers instead of 403), started only by the tests that ask for it.
* ``vllm_ngram_server``, ``vllm_draft_model_server`` (session): the same server speculating, with
  ``--per-request-spec-decode-metrics summary``: vLLM's n-gram drafter (k 3, lookup 1-3), and the
  tiny checkpoint as its own draft model (k 3). ``vllm_server`` is the no-speculation baseline.
  Each is started once, by the first test that asks for it, and shared by every later one;
  ``speculative`` on the endpoint holds the speculative config (None for the plain servers).
* ``cycle_checkpoint`` (session): a second designed target whose greedy text is a known cycle of
  words (``dev/engine/cycle_qwen.py``, 3 layers); ``dflash_oracle`` (session): a DFlash drafter for
  it in SpecForge's format that drafts exactly that text, except after a word of the cycle's second
  half (``oracle_wrong_tokens``), where its first draft misses (``dev/engine/dflash_drafter.py``).
* ``vllm_dflash_server`` (session): the cycle target served through vLLM's DFlash path with that
  drafter (k 3, ``--per-request-spec-decode-metrics summary``): every verify step's acceptance is
  known in advance.
* ``topic_checkpoint`` (session): the learnable tiny target (``dev/engine/topic_qwen.py``);
  ``vllm_topic_self_server`` (session): it served with itself as its draft model (k 3), a perfect
  drafter.

Skips when ``.venv-vllm`` is absent, unless ``DFLASH_REQUIRE_VLLM=1`` (set by .ci/run): then it fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.dev.engine import cycle_qwen, topic_qwen
from dflash_pipeline.dev.engine.dflash_drafter import build_oracle
from dflash_pipeline.dev.stack.vllm_server import (
    VllmServer,
    VllmSettings,
    dflash_spec,
    draft_model_spec,
    ngram_spec,
    vllm_unavailable,
)

ORACLE_K = 3
START_TIMEOUT_S = 540.0
"""Spawn to /health 200: 38-80 s on an idle runner, 200-412 s seen when other jobs load the 2 cores."""


@dataclass(frozen=True)
class VllmEndpoint:
    """What a test needs of the session's real vLLM server."""

    base_url: str
    model: str  # the served model name (send it as "model")
    checkpoint_dir: Path
    tokenizer_dir: Path  # tokenizer.json + tokenizer_config.json (the chat template); same as checkpoint_dir
    log_path: Path
    max_model_len: int
    max_num_seqs: int
    started_in_s: float
    speculative: dict[str, Any] | None = None  # the --speculative-config, None when not speculating


def _require_vllm() -> None:
    why = vllm_unavailable()
    if why is None:
        return
    if os.environ.get("DFLASH_REQUIRE_VLLM") == "1":
        pytest.fail(f"the real vLLM server is required (DFLASH_REQUIRE_VLLM=1) but unavailable: {why}")
    pytest.skip(f"real vLLM unavailable: {why}")


@pytest.fixture(scope="session")
def tiny_qwen_checkpoint(qwen_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny designed Qwen3 checkpoint with Qwen's BPE and the Qwen3.6-style template."""
    from dflash_pipeline.dev.engine.tiny_qwen import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen") / "ckpt", tokenizer_source=qwen_tokenizer)


def _serve(checkpoint: Path, settings: VllmSettings, workdir: Path) -> Iterator[VllmEndpoint]:
    _require_vllm()
    server = VllmServer(checkpoint, settings, workdir=workdir)
    server.start(timeout_s=START_TIMEOUT_S)
    assert server.log_path is not None and server.started_in_s is not None
    try:
        spec = None if settings.speculative_config is None else dict(settings.speculative_config)
        yield VllmEndpoint(server.base_url, settings.served_model_name, checkpoint, checkpoint, server.log_path,
                           settings.max_model_len, settings.max_num_seqs, server.started_in_s, spec)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(tiny_qwen_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEndpoint]:
    """One real ``vllm serve`` for the session (see the module docstring)."""
    yield from _serve(tiny_qwen_checkpoint, VllmSettings(), tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="session")
def vllm_scale_out_server(tiny_qwen_checkpoint: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEndpoint]:
    """A second real server, with ``--enable-scale-out`` (see the module docstring)."""
    yield from _serve(tiny_qwen_checkpoint, VllmSettings(enable_scale_out=True), tmp_path_factory.mktemp("vllm-so"))


@pytest.fixture(scope="session")
def vllm_ngram_server(tiny_qwen_checkpoint: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEndpoint]:
    """A real server speculating with vLLM's n-gram drafter (see the module docstring)."""
    yield from _serve(tiny_qwen_checkpoint, VllmSettings(speculative_config=ngram_spec()),
                      tmp_path_factory.mktemp("vllm-ngram"))


@pytest.fixture(scope="session")
def vllm_draft_model_server(tiny_qwen_checkpoint: Path,
                            tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEndpoint]:
    """A real server speculating with the tiny checkpoint as its own draft model (see the module docstring)."""
    yield from _serve(tiny_qwen_checkpoint, VllmSettings(speculative_config=draft_model_spec(tiny_qwen_checkpoint)),
                      tmp_path_factory.mktemp("vllm-draft"))


@pytest.fixture(scope="session")
def cycle_checkpoint(qwen_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cycle target (see the module docstring)."""
    return cycle_qwen.build_checkpoint(tmp_path_factory.mktemp("cycle-qwen") / "ckpt", tokenizer_source=qwen_tokenizer)


@pytest.fixture(scope="session")
def oracle_wrong_tokens(cycle_checkpoint: Path) -> tuple[int, ...]:
    """The words after which the oracle's first draft misses: the cycle's second half."""
    words = cycle_qwen.word_ids(cycle_checkpoint)
    return tuple(words[len(words) // 2:])


@pytest.fixture(scope="session")
def dflash_oracle(cycle_checkpoint: Path, oracle_wrong_tokens: tuple[int, ...],
                  tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The designed DFlash drafter of the cycle target (see the module docstring)."""
    return build_oracle(cycle_checkpoint, tmp_path_factory.mktemp("dflash-oracle") / "drafter", k=ORACLE_K,
                        wrong_tokens=oracle_wrong_tokens)


@pytest.fixture(scope="session")
def vllm_dflash_server(cycle_checkpoint: Path, dflash_oracle: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEndpoint]:
    """The cycle target speculating with vLLM's DFlash path and the oracle drafter (see the module docstring)."""
    settings = VllmSettings(served_model_name=cycle_qwen.MODEL_NAME, speculative_config=dflash_spec(dflash_oracle, ORACLE_K))
    yield from _serve(cycle_checkpoint, settings, tmp_path_factory.mktemp("vllm-dflash"))


@pytest.fixture(scope="session")
def topic_checkpoint(qwen_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The learnable tiny target (see the module docstring)."""
    return topic_qwen.build_checkpoint(tmp_path_factory.mktemp("topic-qwen") / "ckpt", tokenizer_source=qwen_tokenizer)


@pytest.fixture(scope="session")
def vllm_topic_self_server(topic_checkpoint: Path,
                           tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEndpoint]:
    """The topic target speculating with itself as its draft model, k 3 (see the module docstring)."""
    settings = VllmSettings(served_model_name=topic_qwen.MODEL_NAME,
                            speculative_config=draft_model_spec(topic_checkpoint, ORACLE_K))
    yield from _serve(topic_checkpoint, settings, tmp_path_factory.mktemp("vllm-topic"))
