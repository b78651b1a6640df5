#!/usr/bin/env bash
# GPU readiness: CUDA-EP parity of every published model, ORT CUDA vs PyTorch CUDA inference time,
# and a short bf16 Transformer training through `accelerate launch` (tokens/s, MFU).
# On a machine without a CUDA device it says so in one line and exits 0. Details: scripts/gpu_check.py.
#   bash scripts/gpu_check.sh [--steps 300] [--write]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to PyTorch on this machine; nothing to check"
  exit 0
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
