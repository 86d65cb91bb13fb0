#!/usr/bin/env bash
# Start (idempotently) a real Slurm cluster on this host that looks like N nodes: munged, MariaDB + slurmdbd
# (accounting, so sacct and submitit job states work), slurmctld and one slurmd per fake node (node1..nodeN),
# everything under $LAUNCHER_SLURM_ROOT. Root and Debian (Slurm 22.05 packages, installed when missing).
# Afterwards: source "$LAUNCHER_SLURM_ROOT/env.sh"  (sets SLURM_CONF).  Stop with slurm/stop-cluster.sh.
#
# LAUNCHER_SLURM_NETNS=1: each slurmd runs in its own network namespace (slurm-node<k>, address
# $LAUNCHER_SLURM_SUBNET.<k> on a bridge whose host side, .254, is slurmctld's address) under its own host name
# (UTS namespace), so a job's ranks on node2 reach node1 over a real link, as on a real cluster. Started with
# nsenter --net (ip netns exec remounts /sys and slurmd's cgroup plugin then fails to initialise).
set -euo pipefail

ROOT=${LAUNCHER_SLURM_ROOT:-/tmp/launcher-slurm}
NODES=${LAUNCHER_SLURM_NODES:-2}
CPUS=${LAUNCHER_SLURM_CPUS:-$(nproc)}        # per fake node; more than the real cores drains the node
MEM_MB=${LAUNCHER_SLURM_MEM_MB:-4000}
CTLD_PORT=${LAUNCHER_SLURM_CTLD_PORT:-16817}
DBD_PORT=${LAUNCHER_SLURM_DBD_PORT:-16819}
DB_PORT=${LAUNCHER_SLURM_DB_PORT:-13306}
SLURMD_PORT=${LAUNCHER_SLURM_SLURMD_PORT:-17001}   # node k listens on SLURMD_PORT + k - 1
CRED_EXPIRE=${LAUNCHER_SLURM_CRED_EXPIRE:-10}      # a requeued job restarts after this many seconds (default 120)
NETNS=${LAUNCHER_SLURM_NETNS:-0}
SUBNET=${LAUNCHER_SLURM_SUBNET:-10.96.0}
BRIDGE=lnchslurmbr0

need=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
if ! dpkg -s "${need[@]}" >/dev/null 2>&1; then
  echo "[slurm] installing ${need[*]}" >&2
  # one installer at a time: the test beds start side by side (pytest-xdist) and apt holds dpkg's lock
  flock /var/lib/dpkg sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends "$@" >/dev/null' sh "${need[@]}"
fi

running() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
until_ok() {  # until_ok SECONDS WHAT CMD...: retry CMD (each try bounded to 5 s) until it succeeds
  local limit=$1 what=$2; shift 2
  local end=$((SECONDS + limit))
  until timeout 5 "$@" >/dev/null 2>&1; do
    if ((SECONDS >= end)); then
      echo "[slurm] $what not ready after ${limit}s; logs under $ROOT/log" >&2
      tail -n 15 "$ROOT"/log/*.log >&2 || true
      exit 1
    fi
    sleep 0.2
  done
}

export SLURM_CONF=$ROOT/etc/slurm.conf
if running "$ROOT/run/slurmctld.pid"; then
  echo "[slurm] already running under $ROOT" >&2
  exit 0
fi

# From here on a failure (a daemon not ready in time, a command failing, SIGTERM / Ctrl-C) undoes what this run
# started: stop-cluster.sh stops its daemons and removes its /etc/hosts lines, namespaces and bridge, and the state
# dir goes too when this run created it. Nothing is left half-started for the next run to trip on.
fresh=0
[[ -e $ROOT ]] || fresh=1
undo() {
  local code=$?
  trap - EXIT INT TERM
  if ((code != 0)); then
    echo "[slurm] start failed (exit $code): undoing what it started" >&2
    if ((fresh)); then "$(dirname "$0")/stop-cluster.sh" --wipe; else "$(dirname "$0")/stop-cluster.sh"; fi
  fi
  exit "$code"
}
trap undo EXIT
trap 'echo "[slurm] failed at line $LINENO: $BASH_COMMAND" >&2' ERR  # (a silent set -e exit says where)
trap 'exit 143' TERM
trap 'exit 130' INT

mkdir -p "$ROOT"/{etc,state,log,run,munge,db}
for k in $(seq 1 "$NODES"); do mkdir -p "$ROOT/spool/node$k"; done
chmod 755 "$ROOT" "$ROOT/munge"   # munged wants every parent of its socket o+x
SOCK=$ROOT/munge/munge.socket.2
AUTH="socket=$SOCK,cred_expire=$CRED_EXPIRE"

if ((NETNS)); then
  CTLD_HOST="$(hostname -s)($SUBNET.254)"
  NODE_LINES=$(for k in $(seq 1 "$NODES"); do
    echo "NodeName=node$k NodeHostname=node$k NodeAddr=$SUBNET.$k Port=$((SLURMD_PORT + k - 1)) CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM_MB State=UNKNOWN"
  done)
else
  CTLD_HOST=localhost
  NODE_LINES="NodeName=node[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$SLURMD_PORT-$((SLURMD_PORT + NODES - 1))] CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM_MB State=UNKNOWN"
fi

cat > "$SLURM_CONF" <<CONF
ClusterName=launcher
SlurmctldHost=$CTLD_HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=$AUTH
SlurmctldPort=$CTLD_PORT
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
MailProg=/bin/true
MpiDefault=none
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$SOCK
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
JobRequeue=1
# Slurm's default KillWait: the launcher's failure report must not wait for it (tests/beds/test_slurm.py)
KillWait=30
MinJobAge=600
$NODE_LINES
PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP
CONF

cat > "$ROOT/etc/slurmdbd.conf" <<CONF
AuthType=auth/munge
AuthInfo=$AUTH
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$ROOT/run/slurmdbd.pid
LogFile=$ROOT/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=launcher_acct_db
CONF
chmod 600 "$ROOT/etc/slurmdbd.conf"
echo "export SLURM_CONF=$SLURM_CONF" > "$ROOT/env.sh"

# Jobs see node names (node1, ...) as hosts: they must resolve (loopback, or the namespace addresses). Marked,
# so stop-cluster.sh removes them (rewritten in place: /etc/hosts may be a bind mount).
kept=$(grep -v '# launcher-slurm$' /etc/hosts)
printf '%s\n' "$kept" > /etc/hosts
for k in $(seq 1 "$NODES"); do
  if ((NETNS)); then
    echo "$SUBNET.$k node$k # launcher-slurm" >> /etc/hosts
  elif ! getent hosts "node$k" >/dev/null; then
    echo "127.0.0.1 node$k # launcher-slurm" >> /etc/hosts
  fi
done

if ((NETNS)); then  # a bridge (slurmctld's side: .254) and one namespace per node; stop-cluster.sh removes them
  : > "$ROOT/run/netns"  # written before the bridge: its presence tells stop-cluster.sh to remove the bridge too
  ip link show "$BRIDGE" >/dev/null 2>&1 || {
    ip link add "$BRIDGE" type bridge
    ip addr add "$SUBNET.254/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
  }
  for k in $(seq 1 "$NODES"); do
    ns=slurm-node$k
    echo "$ns" >> "$ROOT/run/netns"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "lnchslurm${k}h" type veth peer name eth0 netns "$ns"
    ip link set "lnchslurm${k}h" master "$BRIDGE" up
    ip -n "$ns" addr add "$SUBNET.$k/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" route add default via "$SUBNET.254"
  done
fi

[[ -f $ROOT/munge/munge.key ]] || mungekey -c -k "$ROOT/munge/munge.key" -b 1024 ||
  { echo "[slurm] mungekey failed" >&2; exit 1; }
chmod 600 "$ROOT/munge/munge.key"
running "$ROOT/munge/munged.pid" || munged --key-file="$ROOT/munge/munge.key" --socket="$SOCK" \
  --pid-file="$ROOT/munge/munged.pid" --log-file="$ROOT/log/munged.log" --seed-file="$ROOT/munge/munged.seed"
until_ok 10 munged bash -c "munge -n -S '$SOCK' | unmunge -S '$SOCK'"

DB=$ROOT/db
if [[ ! -d $DB/data/mysql ]]; then
  mariadb-install-db --no-defaults --user=root --datadir="$DB/data" --auth-root-authentication-method=socket \
    --skip-test-db >"$ROOT/log/mariadb-install.log" 2>&1 ||
    { echo "[slurm] mariadb-install-db failed:" >&2; tail -n 20 "$ROOT/log/mariadb-install.log" >&2; exit 1; }
  new_db=1
fi
if ! running "$DB/mysqld.pid"; then
  setsid mariadbd --no-defaults --user=root --datadir="$DB/data" --socket="$DB/mysqld.sock" \
    --pid-file="$DB/mysqld.pid" --port="$DB_PORT" --bind-address=127.0.0.1 --log-error="$ROOT/log/mariadb.log" \
    --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 &
fi
until_ok 30 mariadb mariadb --no-defaults -S "$DB/mysqld.sock" -u root -e 'select 1'
if [[ -n ${new_db:-} ]]; then
  mariadb --no-defaults -S "$DB/mysqld.sock" -u root -e \
    "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm'; GRANT ALL ON launcher_acct_db.* TO 'slurm'@'127.0.0.1';"
fi
running "$ROOT/run/slurmdbd.pid" || slurmdbd
until_ok 60 slurmdbd sacctmgr -n list cluster

slurmctld
until_ok 15 slurmctld bash -c "scontrol ping | grep -q 'is UP'"
for k in $(seq 1 "$NODES"); do
  if ((NETNS)); then
    unshare --uts sh -c "hostname node$k; exec nsenter --net=/run/netns/slurm-node$k slurmd -N node$k"
  else
    slurmd -N "node$k"
  fi
done
until_ok 60 "idle nodes" bash -c "[[ \$(sinfo -h -N -t idle -o %N | sort -u | wc -l) -eq $NODES ]]"
until_ok 30 "cluster registration" bash -c "sacctmgr -n -P list cluster format=cluster,controlport | grep -q '^launcher|$CTLD_PORT'"
sinfo >&2
echo "[slurm] up under $ROOT$( ((NETNS)) && echo ", nodes in network namespaces on $SUBNET.0/24"): source $ROOT/env.sh" >&2
