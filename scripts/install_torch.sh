#!/usr/bin/env bash
# Install torch (the one place its version is pinned) into the given venv: the CPU build unless an
# NVIDIA GPU is present or TORCH_BUILD=default (the Docker image: the CUDA build, for --gpus all).
# Never lets pip pick an unpinned torch (that pulls several GB of CUDA wheels).
set -euo pipefail
PY=${1:-.venv/bin/python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    echo "torch $TORCH_VERSION already installed"; exit 0
fi
if [ "${TORCH_BUILD:-}" = default ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    echo "installing the default (CUDA) torch==$TORCH_VERSION"
    exec "$PY" -m pip install "torch==$TORCH_VERSION"
fi
echo "no GPU: installing the CPU build torch==$TORCH_VERSION+cpu"
# pip's configured find-links/indexes first (a local CPU wheel); then PyTorch's CPU index.
"$PY" -m pip install "torch==$TORCH_VERSION+cpu" \
  || "$PY" -m pip install "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
