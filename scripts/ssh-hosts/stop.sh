#!/usr/bin/env bash
# Undo start.sh: kill every process left in the machines (sshd and anything started over ssh), delete the
# namespaces, the bridge, /etc/netns/<name>/, the marked blocks in /etc/hosts and ~/.ssh/config, the state dir.
set -u
STATE=${SSH_HOSTS_STATE:-${TMPDIR:-/tmp}/launcher-ssh-hosts}
MARK="# launcher ssh-hosts ($STATE)"
BR=${SSH_HOSTS_BRIDGE:-$(cat "$STATE/bridge" 2>/dev/null || echo lnchvmbr0)}
if [[ -f $STATE/hosts ]]; then
  while read -r name; do
    for pid in $(ip netns pids "$name" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$name" 2>/dev/null
    ip link del "${name}h" 2>/dev/null   # the namespace may outlive its processes a while (orphaned sockets)
    rm -rf "/etc/netns/$name"
  done < "$STATE/hosts"
fi
ip link del "$BR" 2>/dev/null
strip() {  # strip FILE: drop the marked block
  [[ -f $1 ]] && grep -qxF "$MARK" "$1" || return 0
  awk -v m="$MARK" '$0==m{skip=1} !skip{print} skip && $0=="# end launcher ssh-hosts"{skip=0}' "$1" > "$1.new"
  cat "$1.new" > "$1" && rm -f "$1.new"
}
strip /etc/hosts
strip ~/.ssh/config
rm -rf "$STATE"
echo "ssh-hosts: stopped"
