#!/usr/bin/env bash
# OpenNMT-py trained beside attnzoo's Transformer on the same split, pieces, vocabulary and architecture,
# with the same threads, for a wall-clock budget; its own virtualenv (OpenNMT-py 3.5.1 needs torch < 2.3),
# not part of `make setup`.
#
#   bash scripts/peers/opennmt.sh [MINUTES] [WORKDIR]      (default 20 minutes, ~/.cache/attnzoo/peers/opennmt)
#   DROPOUT=0.1 bash scripts/peers/opennmt.sh ...           another dropout than models.transformer's
#
# Writes WORKDIR/{data,config.yaml,train.log,model_step_*.pt}. A checkpoint is saved every 100 steps, so
# that scripts/peers/peers.py picks the last one saved within the budget (the log's elapsed seconds).
set -euo pipefail
minutes=${1:-20}
cache=${ATTNZOO_CACHE:-$HOME/.cache/attnzoo}
work=${2:-$cache/peers/opennmt}
venv=$cache/peers/venv
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python}
threads=${THREADS:-$(nproc)}

if [ ! -x "$venv/bin/onmt_train" ]; then
  echo "building $venv (OpenNMT-py 3.5.1, torch 2.2, CTranslate2 4.8)"
  python3 -m venv "$venv"
  # numpy < 2: torch 2.2 was built against numpy 1.x
  "$venv/bin/pip" install -q "OpenNMT-py==3.5.1" "numpy<2" "ctranslate2==4.8.5" "sentencepiece==0.2.*"
fi
mkdir -p "$work"
rm -f "$work"/model_step_*.pt
"$python" "$root/scripts/peers/export_data.py" "$work/data"
# The recipe of models.transformer in params.yaml, in OpenNMT-py's words (pipeline/config.py resolves it).
"$python" "$root/scripts/peers/peers.py" onmt-config "$work" ${DROPOUT:+--dropout "$DROPOUT"} > "$work/config.yaml"
echo "training OpenNMT-py for $minutes min on $threads threads (log: $work/train.log)"
# SIGINT at the budget (+1 min for the checkpoint due then); exit 124/130 is the budget, not a failure.
OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads timeout -s INT "$((minutes + 1))m" \
  "$venv/bin/onmt_train" -config "$work/config.yaml" > "$work/train.log" 2>&1 || true
grep -E "Step [0-9]+/" "$work/train.log" | tail -3
ls "$work"/model_step_*.pt | wc -l | xargs echo "checkpoints:"
