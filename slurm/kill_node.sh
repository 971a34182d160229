#!/usr/bin/env bash
# Lose emulated nodes of slurm/start.sh the way machines die: SIGKILL, at once, to their slurmd, their
# slurmstepds and every job process on them (everything in each node's UTS namespace). Slurm finds out
# the way it would about a real node: the node stops answering.
#
#   slurm/kill_node.sh n2       # then: slurm/start.sh N brings it back (ReturnToService=2)
#   slurm/kill_node.sh n2 n3    # both in one kill: nothing on either gets to react to the other's loss
set -euo pipefail
S=${HPCTRAIN_SLURM_DIR:-/tmp/hpctrain-slurm}
[ $# -ge 1 ] || { echo "usage: kill_node.sh nI [nJ ...]" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "kill_node.sh: must run as root" >&2; exit 1; }
self_ns=$(readlink /proc/self/ns/uts)
declare -A want=()
for node in "$@"; do
  case $node in n[0-9]*) ;; *) echo "kill_node.sh: not an emulated node name: $node" >&2; exit 2 ;; esac
  ns_file="$S/pids/slurmd-$node.ns"
  [ -s "$ns_file" ] || { echo "kill_node.sh: $node is not running (no $ns_file)" >&2; exit 1; }
  ns=$(cat "$ns_file")
  # Never this machine's own namespace: that would kill every process here, not one node's.
  [ "$ns" != "$self_ns" ] || { echo "kill_node.sh: $ns_file names this machine's own namespace" >&2; exit 1; }
  want[$ns]=$node
done
pids=""
declare -A found=()
for p in /proc/[0-9]*; do
  p=${p#/proc/}
  ns=$(readlink "/proc/$p/ns/uts" 2>/dev/null) || continue
  if [ -n "${want[$ns]+x}" ]; then
    pids="$pids $p"
    found[$ns]=1
  fi
done
for ns in "${!want[@]}"; do
  [ -n "${found[$ns]+x}" ] || { echo "kill_node.sh: nothing runs on ${want[$ns]}" >&2; exit 1; }
done
# shellcheck disable=SC2086  # one kill for all: nothing on the nodes gets to react to the others dying
kill -KILL $pids 2>/dev/null || true
echo "kill_node.sh: $* down (killed:$pids)"
