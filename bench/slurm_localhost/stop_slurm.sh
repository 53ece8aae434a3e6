#!/usr/bin/env bash
# Stop the daemons start_slurm.sh started (slurmd, slurmctld, munged), by their pid files.
# Queued or running jobs are cancelled first so no job step outlives its slurmd.
set -uo pipefail

if command -v scancel >/dev/null && pgrep -x slurmctld >/dev/null; then
    scancel --full --user root 2>/dev/null || true
fi
stop() { # name pidfile
    local pid
    pid=$(cat "$2" 2>/dev/null) || pid=$(pgrep -x "$1" || true)
    [[ -n $pid ]] || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 20); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.5
    done
    echo "stop_slurm.sh: $1 ($pid) ignored SIGTERM; sending SIGKILL" >&2
    kill -9 "$pid" 2>/dev/null || true
}
stop slurmd /run/slurmd.pid
stop slurmctld /run/slurmctld.pid
stop munged /run/munge/munged.pid
left=0
for name in slurmd slurmctld slurmstepd munged; do
    pgrep -a -x "$name" && left=1
done
[[ $left -eq 0 ]] || exit 1
echo "slurm and munge stopped"
