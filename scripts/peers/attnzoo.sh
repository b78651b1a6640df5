#!/usr/bin/env bash
# attnzoo's Transformer for the Peers comparison: models.transformer (params.yaml) trained alone on all
# threads, stopped with SIGKILL at the budget, its `last` checkpoint (saved every 2 minutes) kept as the one
# that budget allowed, then resumed to the end of its steps: bit for bit the run without the stop
# (tests/test_kill_resume.py), so WORKDIR/run is also the whole run's budget point.
#
#   bash scripts/peers/attnzoo.sh [MINUTES] [WORKDIR]      (default 20 minutes, ~/.cache/attnzoo/peers/attnzoo)
#   DROPOUT=0.1 bash scripts/peers/attnzoo.sh ...           another dropout than models.transformer's
#
# Writes WORKDIR/run (train_summary.json, checkpoint/{best,last}) and WORKDIR/at_<MINUTES>min; then
#   python scripts/peers/peers.py attnzoo-speed WORKDIR/run
#   python scripts/peers/peers.py attnzoo-bleu WORKDIR/at_<MINUTES>min      (and WORKDIR/run/checkpoint/best)
# (the script ends by printing the kept checkpoint's step and training seconds: peers.py attnzoo-progress).
set -euo pipefail
minutes=${1:-20}
cache=${ATTNZOO_CACHE:-$HOME/.cache/attnzoo}
work=${2:-$cache/peers/attnzoo}
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python}
threads=${THREADS:-$(nproc)}
train=("$python" -m pipeline.stages.train transformer --out "$work/run" ${DROPOUT:+--set "dropout=$DROPOUT"})

mkdir -p "$work"
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:///$work/mlflow.db}
export OMP_NUM_THREADS=$threads PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
cd "$root"
if [ ! -f "$work/run/train_summary.json" ]; then
  echo "training attnzoo's Transformer for $minutes min on $threads threads (then resuming it to its end)"
  # exit 137 is the budget, not a failure
  timeout -s KILL "${minutes}m" "${train[@]}" || true
  last=$work/run/checkpoint/last
  [ -f "$last/trainer.pt" ] || last=$last.old   # killed between the save's two renames
  rm -rf "$work/at_${minutes}min"
  cp -r "$last" "$work/at_${minutes}min"
  "${train[@]}"
fi
"$python" "$root/scripts/peers/peers.py" attnzoo-progress "$work/at_${minutes}min"
