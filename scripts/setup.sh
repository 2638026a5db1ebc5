#!/usr/bin/env bash
# Create .venv and install persia-planner with the pinned, known-good stack.
#
# Why a script and not plain `pip install .`: torchrec 1.8 must be installed with --no-deps, otherwise pip pulls the
# CUDA fbgemm-gpu 1.9 that does not load on torch 2.13. torchrec/fbgemm 1.X pair strictly with torch 2.(X+5).
# On a machine with CUDA (nvidia-smi present) we install fbgemm-gpu instead of fbgemm-gpu-cpu.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0
FBGEMM_VERSION=1.8.0
TORCHREC_VERSION=1.8.0

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  FBGEMM_PKG="fbgemm-gpu==${FBGEMM_VERSION}"
else
  FBGEMM_PKG="fbgemm-gpu-cpu==${FBGEMM_VERSION}"
fi

pip install "torch==${TORCH_VERSION}"
pip install "${FBGEMM_PKG}"
# torchrec's own dependencies, then torchrec itself without them (see above).
pip install tensordict "torchmetrics==1.0.3" tqdm pyre-extensions iopath
pip install --no-deps "torchrec==${TORCHREC_VERSION}"
# The project itself (editable) with its test/dev extras.
pip install -e ".[dev]"
echo "setup done: $("$VENV/bin/python" -c 'import torch, torchrec; print("torch", torch.__version__, "torchrec", torchrec.__version__)' 2>/dev/null || echo 'torch stack not importable')"
