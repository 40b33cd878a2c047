#!/usr/bin/env bash
# Installs dptrain and what it needs into the current Python environment.
# torch is installed explicitly only when missing: here the CPU build 2.13.0; on a GPU machine,
# install the torch build for your CUDA first (https://pytorch.org/get-started) and this keeps it.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==${DPTRAIN_TORCH_VERSION:-2.13.0}"
fi
"$PY" -m pip install -q -e '.[dev]'
"$PY" -c "import torch, dptrain; print(f'dptrain {dptrain.__version__} with torch {torch.__version__} installed')"
