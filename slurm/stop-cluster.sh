#!/usr/bin/env bash
# Stop what start-cluster.sh started (jobs cancelled first), each daemon by its pidfile: SIGTERM, then SIGKILL
# after 15 s. Leaves nothing running; removes the /etc/hosts lines and (LAUNCHER_SLURM_NETNS) the nodes' network
# namespaces and bridge. --wipe also deletes $LAUNCHER_SLURM_ROOT.
set -uo pipefail
ROOT=${LAUNCHER_SLURM_ROOT:-/tmp/launcher-slurm}
export SLURM_CONF=$ROOT/etc/slurm.conf

stop() {  # stop PIDFILE...
  local f pid pids=()
  for f in "$@"; do
    [[ -f $f ]] || continue
    pid=$(cat "$f" 2>/dev/null) || continue
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" && pids+=("$pid")
  done
  local end=$((SECONDS + 15))
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < end)); do sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  done
  rm -f "$@"
}

if [[ -f $ROOT/run/slurmctld.pid ]] && kill -0 "$(cat "$ROOT/run/slurmctld.pid")" 2>/dev/null; then
  timeout 10 scancel --quiet --user="$(id -un)" 2>/dev/null || true
  end=$((SECONDS + 10))
  while [[ -n $(timeout 5 squeue -h 2>/dev/null) ]] && ((SECONDS < end)); do sleep 0.2; done
fi
stop "$ROOT"/run/slurmd-*.pid "$ROOT/run/slurmctld.pid"
stop "$ROOT/run/slurmdbd.pid" "$ROOT/db/mysqld.pid" "$ROOT/munge/munged.pid"
rm -f "$ROOT/munge/munge.socket.2" "$ROOT/munge/munge.socket.2.lock"
if [[ -f $ROOT/run/netns ]]; then
  k=0
  while read -r ns; do
    k=$((k + 1))
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
    ip link del "lnchslurm${k}h" 2>/dev/null
  done < "$ROOT/run/netns"
  ip link del lnchslurmbr0 2>/dev/null
  rm -f "$ROOT/run/netns"
fi
kept=$(grep -v '# launcher-slurm$' /etc/hosts)   # rewrite in place: /etc/hosts may be a bind mount
printf '%s\n' "$kept" > /etc/hosts
[[ ${1:-} == --wipe ]] && rm -rf "$ROOT"
echo "[slurm] stopped" >&2
