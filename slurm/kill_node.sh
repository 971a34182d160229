#!/usr/bin/env bash
# Lose an emulated node of slurm/start.sh the way a machine dies: SIGKILL, at once, to its slurmd,
# its slurmstepds and every job process on it (everything in the node's UTS namespace). Slurm finds
# out the way it would about a real node: the node stops answering.
#
#   slurm/kill_node.sh n2       # then: slurm/start.sh N brings it back (ReturnToService=2)
set -euo pipefail
S=${HPCTRAIN_SLURM_DIR:-/tmp/hpctrain-slurm}
node=${1:?usage: kill_node.sh nI}
case $node in n[0-9]*) ;; *) echo "kill_node.sh: not an emulated node name: $node" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { echo "kill_node.sh: must run as root" >&2; exit 1; }
ns_file="$S/pids/slurmd-$node.ns"
[ -s "$ns_file" ] || { echo "kill_node.sh: $node is not running (no $ns_file)" >&2; exit 1; }
ns=$(cat "$ns_file")
# Never this machine's own namespace: that would kill every process here, not one node's.
[ "$ns" != "$(readlink /proc/self/ns/uts)" ] || { echo "kill_node.sh: $ns_file names this machine's own namespace" >&2; exit 1; }
pids=""
for p in /proc/[0-9]*; do
  p=${p#/proc/}
  [ "$(readlink "/proc/$p/ns/uts" 2>/dev/null)" = "$ns" ] && pids="$pids $p"
done
[ -n "$pids" ] || { echo "kill_node.sh: nothing runs on $node" >&2; exit 1; }
# shellcheck disable=SC2086  # one kill for all: nothing on the node gets to react to the others dying
kill -KILL $pids 2>/dev/null || true
echo "kill_node.sh: $node is down (killed:$pids)"
