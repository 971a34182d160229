#!/usr/bin/env bash
# Stop exactly what slurm/start.sh started, from the pids it recorded in
# $HPCTRAIN_SLURM_DIR/pids (default /tmp/hpctrain-slurm), and nothing else.
#
#   slurm/stop.sh            everything, in reverse start order
#   slurm/stop.sh NAME...    only these: slurmd-nI, slurmctld, slurmdbd,
#                            mariadbd, munged (start.sh uses this to restart
#                            single daemons)
#
# Idempotent: what is not running is skipped.  Like powering the nodes off,
# it also kills the job processes still running on the emulated nodes; the
# state dir (queue, accounting database) is kept, so start.sh resumes it.
set -euo pipefail

S=${HPCTRAIN_SLURM_DIR:-/tmp/hpctrain-slurm}
[ "$(id -u)" = 0 ] || { echo "stop.sh: must run as root" >&2; exit 1; }

# live PID: exists and is not a zombie.  PID 1 on these VMs reaps orphans
# only lazily, so an exited daemon can stay a zombie for seconds and
# `kill -0` would still succeed on it.
live() {
  local st
  st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

# wait_gone SECONDS PID...: true once none of the PIDs is live.
wait_gone() {
  local t=$(($1 * 10)) p any; shift
  while :; do
    any=""
    for p in "$@"; do live "$p" && any=1 && break; done
    [ -z "$any" ] && return 0
    [ $t -gt 0 ] || return 1
    sleep 0.1; t=$((t - 1))
  done
}

# term_then_kill SECONDS PID...: SIGTERM, then SIGKILL what is left.
term_then_kill() {
  local secs=$1; shift
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  wait_gone "$secs" "$@" && return 0
  kill -KILL "$@" 2>/dev/null || true
  wait_gone 5 "$@" || echo "stop.sh: WARNING: still alive: $*" >&2
}

# ns_procs NS [EXCEPT]: live processes in UTS namespace NS, but EXCEPT.
ns_procs() {
  local p
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" != "${2:-}" ] && [ "$(readlink "/proc/$p/ns/uts" 2>/dev/null)" = "$1" ] && live "$p" && echo "$p"
  done
  return 0
}

# stop_one NAME: stop the daemon recorded as NAME if it still is that daemon
# (the command name is checked, so a recycled pid is never killed).
stop_one() {
  local name=$1 comm pid="" timeout=15 ns="" procs
  case $name in
    slurmd-n*) comm=slurmd ;;
    slurmctld | slurmdbd | mariadbd | munged) comm=$name ;;
    *) echo "stop.sh: unknown daemon '$name'" >&2; return 1 ;;
  esac
  # mariadbd flushes InnoDB and slurmctld saves its state on SIGTERM: give
  # them time rather than corrupt the state the next start resumes.
  case $name in mariadbd | slurmctld) timeout=60 ;; esac
  if [ -s "$S/pids/$name.pid" ]; then
    pid=$(tr -dc 0-9 <"$S/pids/$name.pid")
    if [ -z "$pid" ] || ! live "$pid" || [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != "$comm" ]; then
      pid=""
    fi
  fi
  # slurmstepd and job tasks outlive slurmd by design; they are exactly the
  # other processes in the UTS namespace start.sh created for this node.
  # They go first, while slurmd is still up: slurmstepd then reports the job
  # as ended at once, instead of retrying a dead slurmd until SIGKILL.
  [ ! -s "$S/pids/$name.ns" ] || ns=$(cat "$S/pids/$name.ns")
  if [ -n "$ns" ] && [ "$ns" = "$(readlink /proc/self/ns/uts)" ]; then
    # A namespace file naming this machine's own namespace would make every process here a "job
    # process" of the node (a test's ranks die of SIGTERM with nothing in their logs): never.
    echo "stop.sh: $S/pids/$name.ns names this machine's own UTS namespace: not killing by namespace" >&2
    ns=""
  fi
  if [ -n "$ns" ]; then
    procs=$(ns_procs "$ns" "$pid" | tr '\n' ' ')
    if [ -n "$procs" ]; then
      # shellcheck disable=SC2086  # word splitting of the pid list is wanted
      term_then_kill 5 $procs
      echo "stop.sh: killed job processes on ${name#slurmd-}: $procs"
    fi
  fi
  if [ -n "$pid" ]; then
    term_then_kill "$timeout" "$pid"
    echo "stop.sh: stopped $name (pid $pid)"
  fi
  if [ -n "$ns" ]; then
    # Anything a job started in the meantime.
    procs=$(ns_procs "$ns" | tr '\n' ' ')
    # shellcheck disable=SC2086
    [ -z "$procs" ] || term_then_kill 2 $procs
  fi
  rm -f "$S/pids/$name.pid" "$S/pids/$name.ns"
}

if [ $# -gt 0 ]; then
  names="$*"
else
  # Nodes first (highest first), then the controller, accounting, database,
  # auth: the reverse of the start order, so nobody loses a peer it needs
  # while shutting down.
  names=$(
    for f in "$S"/pids/slurmd-n*.pid "$S"/pids/slurmd-n*.ns; do
      [ -e "$f" ] || continue
      f=$(basename "$f"); echo "${f%.*}"
    done | sort -u -t n -k 2,2nr
  )
  names="$names slurmctld slurmdbd mariadbd munged"
fi
for n in $names; do stop_one "$n"; done
