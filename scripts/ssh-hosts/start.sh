#!/usr/bin/env bash
# Start N "machines" on this host for the ssh launch mode and its tests: each is a network namespace with its own
# address on a bridge, its own host name (UTS namespace) and its own sshd. Processes started over ssh live in
# that machine's network and UTS namespaces; the file system and PIDs stay shared (like machines on NFS).
# Root, iproute2; installs Debian's openssh-server when missing.
#
#   scripts/ssh-hosts/start.sh                       # vm1 vm2 on 10.98.0.0/24, bridge address .254
#   SSH_HOSTS_N=3 SSH_HOSTS_RATE=1gbit scripts/ssh-hosts/start.sh   # three machines, links shaped by tbf
#   SSH_HOSTS_RATES="1gbit 100mbit" ...              # one rate per machine (the doctor names the slow one)
#   ssh -F "$STATE/ssh_config" vm1 hostname          # -> vm1
#   scripts/ssh-hosts/start.sh --global              # also add marked blocks to /etc/hosts and ~/.ssh/config,
#                                                    # so plain `ssh vm1` works (stop.sh removes them)
#   scripts/ssh-hosts/stop.sh                        # every process in the machines, namespaces, bridge, files
#
# Inside a machine /etc/hosts is /etc/netns/<name>/hosts (ip netns exec): every machine's name and address.
# Without --global nothing outside the state dir and /etc/netns/<name>/ is touched.
set -euo pipefail
N=${SSH_HOSTS_N:-2}
PREFIX=${SSH_HOSTS_PREFIX:-vm}
SUBNET=${SSH_HOSTS_SUBNET:-10.98.0}
RATE=${SSH_HOSTS_RATE:-}
read -r -a RATES <<< "${SSH_HOSTS_RATES:-}"
STATE=${SSH_HOSTS_STATE:-${TMPDIR:-/tmp}/launcher-ssh-hosts}
BR=${SSH_HOSTS_BRIDGE:-lnchvmbr0}
MARK="# launcher ssh-hosts ($STATE)"
GLOBAL=0; [[ ${1:-} == --global ]] && GLOBAL=1

[[ $(id -u) == 0 ]] || { echo "ssh-hosts: needs root (network namespaces)" >&2; exit 1; }
if [[ ! -x /usr/sbin/sshd ]]; then
  # one installer at a time: the test beds start side by side (pytest-xdist) and apt holds dpkg's lock
  flock /var/lib/dpkg sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends openssh-server openssh-client >/dev/null'
fi
[[ -e $STATE/hosts ]] && { echo "ssh-hosts: already running under $STATE (stop.sh first)" >&2; exit 1; }
mkdir -p "$STATE" /run/sshd
chmod 755 "$STATE"
trap 'echo "ssh-hosts: start failed; undoing" >&2; SSH_HOSTS_STATE=$STATE SSH_HOSTS_BRIDGE=$BR "$(dirname "$0")/stop.sh" >/dev/null' ERR
ssh-keygen -q -t ed25519 -N '' -f "$STATE/id_ed25519"
cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"; chmod 600 "$STATE/authorized_keys"
echo "$BR" > "$STATE/bridge"

ip link add "$BR" type bridge
ip addr add "$SUBNET.254/24" dev "$BR"
ip link set "$BR" up
names=()
for i in $(seq 1 "$N"); do names+=("$PREFIX$i"); done
hosts_lines="127.0.0.1 localhost"$'\n'"::1 localhost"$'\n'
for i in $(seq 1 "$N"); do hosts_lines+="$SUBNET.$i $PREFIX$i"$'\n'"::ffff:$SUBNET.$i $PREFIX$i"$'\n'; done
# the head as the machines see it (the bridge): c10d looks up each store peer, and a keeper on the head
# (healing in place) is one; unnamed, each look-up would wait for a DNS server the machines cannot reach
hosts_lines+="$SUBNET.254 ${PREFIX}head"$'\n'"::ffff:$SUBNET.254 ${PREFIX}head"$'\n'
: > "$STATE/ssh_config"
for i in $(seq 1 "$N"); do
  name=$PREFIX$i addr=$SUBNET.$i
  echo "$name" >> "$STATE/hosts"   # first: stop.sh undoes what is listed, even after a failure below
  ip netns add "$name"
  ip -n "$name" link set lo up
  ip link add "${name}h" type veth peer name eth0 netns "$name"
  ip link set "${name}h" master "$BR" up
  ip -n "$name" addr add "$addr/24" dev eth0
  ip -n "$name" link set eth0 up
  ip -n "$name" route add default via "$SUBNET.254"
  rate=${RATES[$((i - 1))]:-$RATE}
  if [[ -n $rate ]]; then
    ip netns exec "$name" tc qdisc add dev eth0 root tbf rate "$rate" burst 2mbit latency 50ms
    tc qdisc add dev "${name}h" root tbf rate "$rate" burst 2mbit latency 50ms
  fi
  mkdir -p "/etc/netns/$name"
  printf '%s' "$hosts_lines" > "/etc/netns/$name/hosts"
  ssh-keygen -q -t ed25519 -N '' -f "$STATE/$name.key"
  cat > "$STATE/$name.sshd_config" <<CFG
ListenAddress $addr
Port 22
HostKey $STATE/$name.key
PidFile $STATE/$name.sshd.pid
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxStartups 64:30:128
MaxSessions 64
CFG
  # own host name (UTS namespace) and network namespace; sshd's sessions inherit both
  unshare --uts sh -c "hostname $name; exec ip netns exec $name /usr/sbin/sshd -f $STATE/$name.sshd_config -E $STATE/$name.sshd.log"
  cat >> "$STATE/ssh_config" <<CFG
Host $name
  HostName $addr
  User root
  IdentityFile $STATE/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
CFG
done
if ((GLOBAL)); then
  { echo "$MARK"; for i in $(seq 1 "$N"); do echo "$SUBNET.$i $PREFIX$i"; done; echo "# end launcher ssh-hosts"; } >> /etc/hosts
  mkdir -p ~/.ssh && chmod 700 ~/.ssh
  # prepended: the first matching Host block wins
  { echo "$MARK"; cat "$STATE/ssh_config"; echo "# end launcher ssh-hosts"; cat ~/.ssh/config 2>/dev/null || true; } > ~/.ssh/config.new
  mv ~/.ssh/config.new ~/.ssh/config && chmod 600 ~/.ssh/config
  touch "$STATE/global"
fi
for name in "${names[@]}"; do
  got=
  for _ in $(seq 100); do
    got=$(ssh -F "$STATE/ssh_config" -o BatchMode=yes -o ConnectTimeout=2 "$name" hostname 2>/dev/null) && break
    sleep 0.1
  done
  [[ $got == "$name" ]] || { echo "ssh-hosts: ssh $name did not answer (see $STATE/$name.sshd.log)" >&2; false; }
done
trap - ERR
echo "ssh-hosts: ${names[*]} on $SUBNET.0/24${RATE:+, links $RATE}${RATES:+, links ${RATES[*]}}; ssh -F $STATE/ssh_config NAME"
