#!/usr/bin/env bash
# The loopback version of the cluster in docs/cluster.md, on this one machine: a Ray head, one
# Ray worker node and an MLflow tracking server (SQLite backend, artifacts proxied through the
# server), all bound to 127.0.0.1. State (pid files, logs, database, artifacts, the env file) goes
# to .cluster/ (ATTNZOO_CLUSTER_DIR to move it); scripts/cluster_down.sh stops exactly what this
# started. Prints, and writes to .cluster/env, the exports that point tune@/train@ stages at it:
#
#   scripts/cluster_up.sh && source .cluster/env && dvc repro tune@ntm && scripts/cluster_down.sh
#
# Knobs (environment): RAY_PORT, MLFLOW_PORT (default: free ports), NODE_CPUS (per node, default 1).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${ATTNZOO_CLUSTER_DIR:-$ROOT/.cluster}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
RAY="$(dirname "$PYTHON")/ray"
NODE_CPUS="${NODE_CPUS:-1}"
HOST=127.0.0.1

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

alive() {  # is the process in this pid file still running?
    [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

mkdir -p "$STATE/logs"
for f in "$STATE"/*.pid; do
    if alive "$f"; then
        echo "error: the cluster in $STATE is already up ($(basename "$f" .pid) runs); scripts/cluster_down.sh first" >&2
        exit 2
    fi
done
[ -x "$RAY" ] || { echo "error: no ray next to $PYTHON; install attnzoo (scripts/setup.sh) first" >&2; exit 2; }

RAY_PORT="${RAY_PORT:-$(free_port)}"
MLFLOW_PORT="${MLFLOW_PORT:-$(free_port)}"
# Ray puts Unix sockets under its temp dir and their paths are limited to ~107 bytes: keep it short.
RAY_TMP="$(mktemp -d /tmp/attnzoo-ray.XXXXXX)"
echo "$RAY_TMP" > "$STATE/ray-tmp"

# Started with setsid, each service leads its own session, which cluster_down.sh stops as a whole
# (Ray's worker processes take process groups of their own inside it).
start() {  # start NAME COMMAND...: in the background, its pid in $STATE/NAME.pid, output in logs/NAME.log
    local name="$1"
    shift
    setsid "$@" > "$STATE/logs/$name.log" 2>&1 < /dev/null &
    echo $! > "$STATE/$name.pid"
}

fail() {
    echo "error: $1; the logs:" >&2
    tail -n 20 "$STATE"/logs/*.log >&2 || true
    "$ROOT/scripts/cluster_down.sh" >&2 || true
    exit 1
}

# No token authentication on loopback (nothing but this machine can reach 127.0.0.1); a real
# cluster uses it (docs/cluster.md). Explicit, because Ray 2.60 turns it on for the head alone
# whenever ~/.ray/auth_token exists, and then the worker node cannot join.
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
# Every port a node would take from a fixed default (dashboard 8265, its agent 52365, ...) is a free
# one, so this cluster starts beside any other Ray on the machine.
node_ports() {
    echo --node-manager-port "$(free_port)" --object-manager-port "$(free_port)" \
        --metrics-export-port "$(free_port)" --runtime-env-agent-port "$(free_port)" \
        --dashboard-agent-listen-port "$(free_port)" --dashboard-agent-grpc-port "$(free_port)"
}
COMMON=(--block --node-ip-address "$HOST" --num-cpus "$NODE_CPUS" --num-gpus 0
        --object-store-memory 200000000 --disable-usage-stats --log-style record)

# shellcheck disable=SC2046  # node_ports: word splitting wanted
start ray-head "$RAY" start --head --port "$RAY_PORT" --include-dashboard false --dashboard-port "$(free_port)" \
    --temp-dir "$RAY_TMP/head" "${COMMON[@]}" $(node_ports)
for _ in $(seq 120); do  # the worker needs the head's GCS listening
    "$PYTHON" -c "import socket, sys; socket.create_connection(('$HOST', $RAY_PORT), timeout=1)" 2>/dev/null && break
    alive "$STATE/ray-head.pid" || fail "the Ray head exited"
    sleep 1
done
# shellcheck disable=SC2046
start ray-worker "$RAY" start --address "$HOST:$RAY_PORT" --temp-dir "$RAY_TMP/worker" "${COMMON[@]}" $(node_ports)

MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false start mlflow "$PYTHON" -m mlflow server --host "$HOST" --port "$MLFLOW_PORT" \
    --workers 1 --backend-store-uri "sqlite:///$STATE/mlflow.db" \
    --serve-artifacts --artifacts-destination "$STATE/mlartifacts"

# Up when both Ray nodes are alive (asked by a throwaway driver) and MLflow answers /health.
"$PYTHON" - "$HOST:$RAY_PORT" "http://$HOST:$MLFLOW_PORT" <<'EOF' || fail "the cluster did not come up within 120 s"
import subprocess, sys, time, urllib.request
address, url = sys.argv[1:]
probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False); "
         "print(sum(n['Alive'] for n in ray.nodes()))")
deadline, nodes, mlflow = time.monotonic() + 120, 0, False
while time.monotonic() < deadline and not (nodes >= 2 and mlflow):
    if nodes < 2:
        out = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True, timeout=60)
        nodes = int(out.stdout.split()[-1]) if out.returncode == 0 and out.stdout.split() else 0
    if not mlflow:
        try:
            mlflow = urllib.request.urlopen(f"{url}/health", timeout=2).status == 200
        except OSError:
            pass
    time.sleep(1)
print(f"ray nodes alive: {nodes}, mlflow healthy: {mlflow}", file=sys.stderr)
sys.exit(0 if nodes >= 2 and mlflow else 1)
EOF

cat > "$STATE/env" <<EOF
export RAY_ADDRESS=$HOST:$RAY_PORT
export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT
EOF
cat "$STATE/env"
