#!/usr/bin/env bash
# Create .venv and install persia-planner editable with the pinned, known-good stack and the dev and docs tools.
#
# The pins are the `train` extra's (pyproject.toml): torch 2.13.0, fbgemm-gpu 1.8.0, torchrec 1.8.0 (torchrec / fbgemm
# 1.X pair with torch 2.(X+5) only). On a machine without CUDA (no working nvidia-smi), constraints/train-cpu.txt
# makes the fbgemm that torchrec requires the CPU build, fbgemm-gpu-cpu: README, "Install".
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
constraints=()
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; }; then
  constraints=(-c constraints/train-cpu.txt)
fi
"$VENV/bin/python" -m pip install --disable-pip-version-check -q "${constraints[@]}" -e ".[train,dev,docs]"
echo "setup done: $("$VENV/bin/python" -c 'import torch, torchrec; print("torch", torch.__version__, "torchrec", torchrec.__version__)' 2>/dev/null || echo 'torch stack not importable')"
