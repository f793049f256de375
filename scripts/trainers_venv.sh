#!/usr/bin/env bash
# Create/refresh .venv-trainers: the trainers' own packages (SpecForge, vLLM speculators, Hugging Face datasets)
# for tests/trainers. Idempotent: `make trainers-venv` runs this only when its inputs change (stamp file).
#
#   1. torch==2.13.0 alone: the CPU wheel from local disk (pip's find-links); never a CUDA build.
#   2. requirements-trainers.txt under constraints-trainers.txt (exact pins; torch is already satisfied).
#   3. specforge==0.2.0 and speculators==0.9.0 with --no-deps (their declared requirements would pull a CUDA
#      torch: specforge pins torch==2.11.0 + sglang==0.5.14, speculators needs torchaudio + torchvision).
# pip's cache is used as usual (no --no-cache-dir), so a rerun after a change reinstalls from the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TRAINERS_VENV:-.venv-trainers}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
PIP_Q=(--disable-pip-version-check -q)

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
  echo "trainers_venv: $PYTHON is $("$PYTHON" -V 2>&1); specforge and speculators need Python >= 3.11" >&2; exit 1; }
start=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install "${PIP_Q[@]}" torch==2.13.0
"$VENV/bin/python" -W ignore -c 'import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith("2.13.0") and torch.version.cuda is None else f"torch {v} (cuda {torch.version.cuda}) is not the 2.13.0 CPU build")'
"$VENV/bin/python" -m pip install "${PIP_Q[@]}" -r requirements-trainers.txt -c constraints-trainers.txt
"$VENV/bin/python" -m pip install "${PIP_Q[@]}" --no-deps -c constraints-trainers.txt specforge==0.2.0 speculators==0.9.0
# The CUDA-free torch must have survived step 2 and 3.
"$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else "a CUDA torch got installed")'
"$VENV/bin/python" -c 'import specforge.data.prompt_builder, specforge.data.preprocessing, speculators.data_generation.preprocessing, datasets'
echo "trainers_venv: $VENV ready in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
