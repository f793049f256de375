"""Fixtures for the trainers' side: their own loaders, run in .venv-trainers as subprocesses.

``trainers_python`` is that venv's interpreter (``make trainers-venv`` builds it; ``make test`` does it
first). Without it the tests skip, unless ``DFLASH_REQUIRE_TRAINERS_VENV=1`` (set by .ci/run): then they fail.
``run_loaders(jobs)`` runs tests/trainers/loaders.py there and returns (summary, rows dumped) per job.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
LOADERS = Path(__file__).with_name("loaders.py")


@pytest.fixture(scope="session")
def trainers_python() -> Path:
    python = REPO / ".venv-trainers" / "bin" / "python"
    if not (python.is_file() and (REPO / ".venv-trainers" / ".installed").is_file()):
        message = "no .venv-trainers: run `make trainers-venv` (SpecForge, speculators, datasets)"
        if os.environ.get("DFLASH_REQUIRE_TRAINERS_VENV") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture
def run_loaders(trainers_python: Path, tmp_path: Path) -> Callable[..., list[tuple[dict[str, Any], list[dict[str, Any]]]]]:
    """run_loaders([(command, [args...]), ...]): the commands in one .venv-trainers process (one import of
    torch and the trainers); per command, its summary and the rows it dumped."""

    def run(jobs: list[tuple[str, list[str]]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        outs = [tmp_path / f"{i}-{command}.dump.jsonl" for i, (command, _) in enumerate(jobs)]
        spec = tmp_path / "jobs.json"
        spec.write_text(json.dumps([[command, *args, "--out", str(out)] for (command, args), out in zip(jobs, outs)]))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HOME": str(tmp_path / "hf-home"), "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
        proc = subprocess.run([str(trainers_python), str(LOADERS), "batch", "--jobs", str(spec)],
                              capture_output=True, text=True, env=env, timeout=900, check=False)
        assert proc.returncode == 0, f"loaders failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
        summaries = json.loads(proc.stdout.strip().splitlines()[-1])
        return [(summary, [json.loads(line) for line in out.read_text().splitlines()])
                for summary, out in zip(summaries, outs)]

    return run
