#!/usr/bin/env bash
# Stop exactly what scripts/cluster_up.sh started: the sessions led by the pids in .cluster/*.pid
# (SIGTERM, then SIGKILL after 15 s). Never `ray stop`, which would stop every Ray on the machine.
# The MLflow database and artifacts in .cluster/ stay; the Ray temp dir and pid files go.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${ATTNZOO_CLUSTER_DIR:-$ROOT/.cluster}"

members() {  # live pids in session $1 (cluster_up.sh started each service with setsid: its pid is the session id)
    ps -eo pid=,sid=,stat= | awk -v sid="$1" '$2 == sid && $3 !~ /^Z/ { print $1 }'
}

sessions=()
for f in "$STATE"/*.pid; do
    [ -f "$f" ] || continue
    sid="$(cat "$f")"
    if [ -n "$(members "$sid")" ]; then
        sessions+=("$sid")
        # the group of the leader (raylet, GCS, the MLflow workers); Ray's workers follow their raylet
        kill -TERM -- "-$sid" 2>/dev/null || kill -TERM "$sid" 2>/dev/null
        echo "stopping $(basename "$f" .pid) (session $sid)"
    fi
done

for _ in $(seq 30); do
    left=""
    for sid in "${sessions[@]}"; do left+="$(members "$sid")"; done
    [ -z "$left" ] && break
    sleep 0.5
done
for sid in "${sessions[@]}"; do
    pids="$(members "$sid")"
    [ -n "$pids" ] && echo "killing what is left of session $sid:" $pids && kill -KILL $pids 2>/dev/null
done

rm -f "$STATE"/*.pid "$STATE/env"
if [ -f "$STATE/ray-tmp" ]; then
    tmp="$(cat "$STATE/ray-tmp")"
    case "$tmp" in /tmp/attnzoo-ray.?*) rm -rf "$tmp" ;; esac  # only the dir cluster_up.sh made
    rm -f "$STATE/ray-tmp"
fi
echo "cluster down (MLflow data kept in $STATE)"
