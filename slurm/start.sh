#!/usr/bin/env bash
# Bring up a real single-machine Slurm (controller, accounting, N emulated
# compute nodes n1..nN) for trying hpctrain and for its tests.
#
#   slurm/start.sh [N]        N emulated nodes, default 2
#
# Idempotent: daemons that are already up are left alone, dead ones are
# restarted, and if everything is up it only checks that the nodes are
# usable (well under a second).
# State (confs, spool, logs, pid files, database) lives in one directory,
# $HPCTRAIN_SLURM_DIR (default /tmp/hpctrain-slurm); slurm.conf and
# slurmdbd.conf go to /etc/slurm because that is where Debian's clients
# (srun, sbatch, sacct, ...) look.  slurm/stop.sh undoes it.
set -euo pipefail

N=${1:-2}
S=${HPCTRAIN_SLURM_DIR:-/tmp/hpctrain-slurm}
HERE=$(cd "$(dirname "$0")" && pwd)
CLUSTER=hpctrain
ETC=/etc/slurm
MUNGE_SOCK_DIR=/run/munge
# Debian's libmariadb and mariadb client look for the server here, so keeping
# the socket at the default path means neither slurmdbd nor a person needs
# to be told where it is.
MYSQL_SOCK=/run/mysqld/mysqld.sock
NODE_TIMEOUT=${HPCTRAIN_SLURM_TIMEOUT:-90}
# Each emulated node's private /dev/shm (a tmpfs: only what is written uses memory).
SHM_SIZE=${HPCTRAIN_SLURM_SHM:-2g}
PACKAGES="slurmctld slurmd slurm-client munge slurmdbd mariadb-server"

say() { echo "start.sh: $*"; }

# On failure show the tail of every daemon log: most start problems
# (bad conf line, port in use, munge key) are only visible there.
die() {
  echo "start.sh: ERROR: $*" >&2
  local f
  for f in "$S"/log/*.log "$S"/munge/munged.log "$S"/mysql/mariadbd.log; do
    [ -s "$f" ] || continue
    echo "----- $f (last 20 lines, without the harmless pmix errors)" >&2
    # Debian's slurm loads mpi/pmix although libpmix is not installed: three
    # error lines per daemon start that mean nothing here.
    grep -v -E 'pmix|MPI: Cannot create context' "$f" | tail -n 20 >&2 || true
  done
  exit 1
}

case $N in '' | *[!0-9]*) die "N must be a positive integer, got '$N'" ;; esac
# NodeAddr is 127.0.0.(I+1), so the last octet caps the node count.
[ "$N" -ge 1 ] && [ "$N" -le 250 ] || die "N must be 1..250, got $N"
[ "$(id -u)" = 0 ] || die "must run as root (daemons, namespaces, /etc/slurm)"

# alive NAME COMM [ARG]: true if the pid recorded for NAME is a live (not
# zombie) process named COMM (whose command line contains ARG).  Checking
# the name guards against a recycled pid; checking for zombies matters here
# because PID 1 on these VMs reaps orphans only lazily, so a dead daemon can
# linger as a zombie that `kill -0` still reports as present.
alive() {
  local pidf="$S/pids/$1.pid" pid st
  [ -s "$pidf" ] || return 1
  pid=$(tr -dc 0-9 <"$pidf")
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  st=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ "$st" != Z ] && [ "$st" != X ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  [ -z "${3:-}" ] || tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qw -- "$3"
}

# wait_for SECONDS CMD...: poll CMD every 0.2 s until it succeeds.
# Always tries at least once, so `wait_for 0 CMD` is a single check.
wait_for() {
  local end=$(($(date +%s) + $1)); shift
  while :; do
    "$@" >/dev/null 2>&1 && return 0
    [ "$(date +%s)" -lt $end ] || return 1
    sleep 0.2
  done
}

# wait_daemon SECONDS NAME COMM CMD...: like wait_for, but gives up at once
# when the daemon, having written its pid file, has exited (port in use, bad
# conf): no point waiting out the timeout for a dead process.
wait_daemon() {
  local end=$(($(date +%s) + $1)) name=$2 comm=$3; shift 3
  while :; do
    "$@" >/dev/null 2>&1 && return 0
    if [ -s "$S/pids/$name.pid" ] && ! alive "$name" "$comm"; then return 1; fi
    [ "$(date +%s)" -lt $end ] || return 1
    sleep 0.2
  done
}

# write_if_changed FILE MODE: replace FILE with stdin only when the content
# differs; returns 0 if it changed.  Lets a re-run detect "nothing to do".
write_if_changed() {
  local tmp
  tmp=$(mktemp "$1.XXXXXX")
  cat >"$tmp"
  chmod "$2" "$tmp"
  if [ -f "$1" ] && cmp -s "$tmp" "$1"; then rm -f "$tmp"; return 1; fi
  mv -f "$tmp" "$1"
}

T0=$(date +%s)

# ---------------------------------------------------------------- install
missing=""
for p in $PACKAGES; do
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)" = installed ] ||
    missing="$missing $p"
done
if [ -n "$missing" ]; then
  say "installing:$missing"
  # Without systemd the packages' postinst would start munge/mariadb through
  # init scripts, on default paths that then clash with ours; a temporary
  # policy-rc.d (the Debian-sanctioned switch) stops that.
  made_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    made_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    trap 'exit 130' INT TERM # so that Ctrl-C also runs the EXIT trap
  fi
  # --no-install-recommends: the recommended slurm-wlm-plugins pulls ~40
  # packages (hdf5, rocm, ipmi, influxdb plugins and their -dev files) that
  # none of this uses.
  rc=0
  { apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $PACKAGES; } \
    >"/tmp/hpctrain-slurm-apt.log" 2>&1 || rc=$?
  if [ -n "$made_policy" ]; then
    rm -f /usr/sbin/policy-rc.d
    trap - EXIT INT TERM
  fi
  [ $rc = 0 ] || { tail -n 30 /tmp/hpctrain-slurm-apt.log >&2; die "apt-get failed (rc=$rc)"; }
  say "installed in $(($(date +%s) - T0)) s"
fi

# ---------------------------------------------------------------- layout
mkdir -p "$S"/etc "$S"/log "$S"/pids "$S"/spool/slurmctld "$ETC"
chmod 755 "$S"
# munged and mariadbd drop to their own users and must write pid/log files.
install -d -o munge -g munge -m 700 "$S/munge"
install -d -o mysql -g mysql -m 750 "$S/mysql"
install -d -o munge -g munge -m 755 "$MUNGE_SOCK_DIR"
install -d -o mysql -g root -m 755 "$(dirname "$MYSQL_SOCK")"
for i in $(seq 1 "$N"); do mkdir -p "$S/spool/slurmd-n$i"; done # slurmd won't create it

# Jobs run inside the slurmd's mount namespace, where this file is bind-
# mounted over /etc/hosts, so code in a job can resolve the other "nodes"
# (e.g. MASTER_ADDR=n1).  The machine's own entries are kept.  Rewritten in
# place, not replaced: a bind mount pins the inode, so running slurmds see
# the new content.
hosts=$(
  grep -v -E '^[^#]*[[:space:]]n[0-9]+([[:space:]]|$)' /etc/hosts || true
  for i in $(seq 1 "$N"); do echo "127.0.0.$((i + 1)) n$i"; done
)
if [ "$(cat "$S/etc/hosts" 2>/dev/null || true)" != "$hosts" ]; then
  echo "$hosts" >"$S/etc/hosts"
  chmod 644 "$S/etc/hosts"
fi

# ---------------------------------------------------------------- configs
HOST=$(hostname -s)
[ -s "$S/etc/dbpass" ] || { (umask 077; head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$S/etc/dbpass"); }
DBPASS=$(cat "$S/etc/dbpass")

restart_ctld=""
{
  cat <<EOF
# Generated by hpctrain slurm/start.sh; hand edits are overwritten.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Short credential lifetime + fast scheduler passes: a requeued job restarts
# in ~8 s instead of ~164 s.
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=5,bf_interval=5
# No systemd/cgroups on these VMs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Let an emulated node claim more CPUs than the VM has.
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
ReturnToService=2
KillWait=5
# A node that stops answering is declared DOWN after 30 s (Slurm's default is 300): the node-loss
# tests need the job that lost it to end in reasonable time.
SlurmdTimeout=30
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobCompType=jobcomp/none
SlurmctldPort=6817
StateSaveLocation=$S/spool/slurmctld
SlurmdSpoolDir=$S/spool/slurmd-%n
SlurmctldPidFile=$S/pids/slurmctld.pid
SlurmdPidFile=$S/pids/slurmd-%n.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd-%n.log
EOF
  # One Port= per node: all slurmds share the machine's network stack.
  for i in $(seq 1 "$N"); do
    echo "NodeName=n$i NodeAddr=127.0.0.$((i + 1)) NodeHostname=n$i Port=$((17000 + i)) CPUs=4 RealMemory=4000 State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=n[1-$N] Default=YES MaxTime=INFINITE State=UP"
} | write_if_changed "$ETC/slurm.conf" 644 && touch "$S/restart-pending"
# The marker survives an interrupted run (Ctrl-C, SIGPIPE), so the next run
# still restarts the daemons that were started with the old slurm.conf.
[ ! -e "$S/restart-pending" ] || restart_ctld=1

restart_dbd=""
# slurmdbd refuses a slurmdbd.conf readable by others (it holds the password).
write_if_changed "$ETC/slurmdbd.conf" 600 <<EOF && touch "$S/restart-pending-dbd"
# Generated by hpctrain slurm/start.sh; hand edits are overwritten.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
LogFile=$S/log/slurmdbd.log
PidFile=$S/pids/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=$DBPASS
EOF
[ ! -e "$S/restart-pending-dbd" ] || restart_dbd=1

# ---------------------------------------------------------------- munge
munge_ok() { munge -n </dev/null | unmunge >/dev/null; }
if alive munged munged; then :
elif munge_ok 2>/dev/null; then
  # A munged started by someone else (e.g. by hand) serves the
  # same key; use it but do not record it, so stop.sh leaves it alone.
  say "using a munged not started by start.sh"
  rm -f "$S/pids/munged.pid"
else
  say "starting munged"
  if [ ! -s /etc/munge/munge.key ]; then
    su -s /bin/sh munge -c 'mungekey --create' || die "cannot create /etc/munge/munge.key"
  fi
  rm -f "$S/munge/munged.pid"
  # --force: clear a stale socket lock left by a munged that was killed.
  su -s /bin/sh munge -c "/usr/sbin/munged --force --pid-file=$S/munge/munged.pid --log-file=$S/munge/munged.log" ||
    die "munged failed to start"
  wait_for 10 munge_ok || die "munged does not answer"
  cp "$S/munge/munged.pid" "$S/pids/munged.pid"
fi

# ---------------------------------------------------------------- mariadb
db_started=""
if ! alive mariadbd mariadbd; then
  if wait_for 0 mariadb-admin --socket="$MYSQL_SOCK" ping; then
    die "a MariaDB not started by start.sh answers on $MYSQL_SOCK; stop it first"
  fi
  say "starting mariadbd"
  # Own data dir inside the state dir: wiping the state dir then resets job
  # ids AND accounting together (otherwise sacct shows old jobs under
  # re-used ids).  A 16 MB redo log instead of 96 MB keeps it small.
  DBOPTS="--no-defaults --user=mysql --datadir=$S/mysql/data --innodb-log-file-size=16M"
  if [ ! -d "$S/mysql/data/mysql" ]; then
    mariadb-install-db $DBOPTS --auth-root-authentication-method=socket --skip-test-db \
      >"$S/mysql/install.log" 2>&1 || die "mariadb-install-db failed (see $S/mysql/install.log)"
  fi
  rm -f "$S/mysql/mariadbd.pid" "$MYSQL_SOCK"
  # No systemd and no mysqld_safe: started directly, networking off (slurmdbd
  # uses the socket), lock wait timeout 900 because slurmdbd warns below it.
  setsid mariadbd $DBOPTS --skip-networking --socket="$MYSQL_SOCK" \
    --pid-file="$S/mysql/mariadbd.pid" --log-error="$S/mysql/mariadbd.log" \
    --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
  wait_for 60 mariadb-admin --socket="$MYSQL_SOCK" ping || die "mariadbd does not answer"
  wait_for 5 test -s "$S/mysql/mariadbd.pid" || die "mariadbd wrote no pid file"
  cp "$S/mysql/mariadbd.pid" "$S/pids/mariadbd.pid"
  db_started=1
fi
if [ -n "$db_started" ] || [ -n "$restart_dbd" ] || ! alive slurmdbd slurmdbd; then
  # Idempotent; also re-applies the password if dbpass was regenerated.
  mariadb --socket="$MYSQL_SOCK" -uroot <<EOF || die "cannot create slurm_acct_db / user"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
fi

# ---------------------------------------------------------------- slurmdbd
dbd_up() { (exec 3<>/dev/tcp/127.0.0.1/6819) 2>/dev/null; }
if [ -n "$restart_dbd" ] && alive slurmdbd slurmdbd; then
  "$HERE/stop.sh" slurmdbd
fi
dbd_started=""
if ! alive slurmdbd slurmdbd; then
  say "starting slurmdbd"
  rm -f "$S/pids/slurmdbd.pid"
  slurmdbd || die "slurmdbd failed to start"
  # First start creates the schema, which takes a few seconds.
  wait_daemon 60 slurmdbd slurmdbd dbd_up || die "slurmdbd does not listen on 6819"
  dbd_started=1
fi
rm -f "$S/restart-pending-dbd"
if [ -n "$dbd_started" ]; then
  # slurmctld would register the cluster itself, but only after its first
  # contact; doing it here means sacct works from the very first job.
  if ! sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
    sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster failed"
  fi
fi

# ---------------------------------------------------------------- slurmctld
if [ -n "$restart_ctld" ] && alive slurmctld slurmctld; then
  say "slurm.conf changed since the daemons started: restarting slurmctld and slurmds"
  "$HERE/stop.sh" slurmctld
fi
if ! alive slurmctld slurmctld; then
  say "starting slurmctld"
  rm -f "$S/pids/slurmctld.pid"
  slurmctld || die "slurmctld failed to start"
  wait_daemon 30 slurmctld slurmctld scontrol ping || die "slurmctld does not answer"
fi

# ---------------------------------------------------------------- slurmds
# Nodes beyond N from an earlier, larger start.
for f in "$S"/pids/slurmd-n*.pid "$S"/pids/slurmd-n*.ns; do
  [ -e "$f" ] || continue
  name=$(basename "$f"); name=${name%.*}; i=${name#slurmd-n}
  case $i in *[!0-9]*) continue ;; esac
  [ "$i" -le "$N" ] || "$HERE/stop.sh" "$name"
done
# own_shm I: the running slurmd of nI has its private /dev/shm (a slurmd started
# by an older start.sh shares the machine's, and is restarted).
own_shm() {
  local pid
  pid=$(tr -dc 0-9 <"$S/pids/slurmd-n$1.pid" 2>/dev/null) || return 1
  grep -qE "^[^ ]+ [^ ]+ [^ ]+ [^ ]+ /dev/shm .* - tmpfs shm-n$1 " "/proc/$pid/mountinfo" 2>/dev/null
}
for i in $(seq 1 "$N"); do
  if alive "slurmd-n$i" slurmd "n$i" && own_shm "$i" && [ -z "$restart_ctld" ]; then continue; fi
  # Also clears whatever job processes a dead slurmd left in its namespace:
  # the node "reboots".
  "$HERE/stop.sh" "slurmd-n$i"
  say "starting slurmd n$i"
  # Own UTS namespace so `hostname` in a job says nI; own mount namespace so
  # the hosts file can be bind-mounted over /etc/hosts for this node only,
  # and so that each node has its own RAM disk at /dev/shm (a tmpfs of up to
  # $SHM_SIZE, allocated as used): what a job leaves there is invisible to the
  # other nodes and gone with the node, as a real machine's memory is when it
  # dies (kill_node.sh kills every process in the namespace; the namespace and
  # its tmpfs end with the last of them). Without it all nodes would share the
  # machine's /dev/shm, and a "lost" node's in-memory checkpoints would stay
  # readable. slurmd daemonizes and keeps the namespaces.
  unshare --uts --mount --propagation private -- \
    sh -c "hostname n$i && mount --bind '$S/etc/hosts' /etc/hosts &&
      mount -t tmpfs -o size=$SHM_SIZE,mode=1777,nosuid,nodev shm-n$i /dev/shm && exec slurmd -N n$i" ||
    die "slurmd n$i failed to start"
  wait_for 10 alive "slurmd-n$i" slurmd "n$i" || die "slurmd n$i did not stay up"
  # Remember the namespace: stop.sh kills everything in it (slurmstepd and
  # job processes outlive slurmd by design).
  ns=$(readlink "/proc/$(cat "$S/pids/slurmd-n$i.pid")/ns/uts")
  [ "$ns" != "$(readlink /proc/self/ns/uts)" ] || die "slurmd n$i runs in this machine's own UTS namespace"
  echo "$ns" >"$S/pids/slurmd-n$i.ns"
done
rm -f "$S/restart-pending"

# ---------------------------------------------------------------- wait
# A node is usable once it has registered with the running slurmctld
# (SlurmdStartTime is None until then: right after a slurmctld restart sinfo
# still shows the saved state, e.g. "mix" for a node with a job, although
# srun would be refused) and its state has no flag (DRAIN, NOT_RESPONDING..).
node_table() {
  scontrol show node -o 2>/dev/null | awk '{
    n = s = t = ""
    for (i = 1; i <= NF; i++) {
      k = $i; sub(/=.*/, "", k); v = substr($i, length(k) + 2)
      if (k == "NodeName") n = v; else if (k == "State") s = v
      else if (k == "SlurmdStartTime") t = v
    }
    if (n != "") print n, s, t
  }' | sort
}
want=$(seq 1 "$N" | sed 's/^/n/' | sort | tr '\n' ' ')
resumed=""
deadline=$(($(date +%s) + NODE_TIMEOUT))
while :; do
  table=$(node_table || true)
  have=$(echo "$table" | awk 'NF {print $1}' | tr '\n' ' ')
  bad=$(echo "$table" | awk 'NF { s = $2; sub(/\+COMPLETING$/, "", s)
    if ($3 == "None" || s !~ /^(IDLE|MIXED|ALLOCATED|COMPLETING)$/) print $1 }')
  [ "$have" = "$want" ] && [ -z "$bad" ] && break
  # Fail fast when a daemon died (port taken, bad conf) instead of waiting.
  alive slurmctld slurmctld || die "slurmctld exited"
  for i in $(seq 1 "$N"); do alive "slurmd-n$i" slurmd "n$i" || die "slurmd n$i exited"; done
  # A drained node (e.g. "Kill task failed" after an earlier crash) never
  # comes back by itself; ReturnToService=2 only covers DOWN.
  for n in $(echo "$table" | awk '$2 ~ /DRAIN/ && $3 != "None" {print $1}'); do
    case " $resumed " in *" $n "*) continue ;; esac
    say "resuming drained node $n (reason: $(sinfo -h -n "$n" -o '%E'))"
    scontrol update nodename="$n" state=resume || true
    resumed="$resumed $n"
  done
  [ "$(date +%s)" -lt $deadline ] || {
    echo "$table" >&2
    die "nodes not usable after ${NODE_TIMEOUT}s (want: $want)"
  }
  sleep 0.5
done

say "Slurm up: $N node(s), cluster $CLUSTER, state in $S ($(($(date +%s) - T0)) s)"
cat <<EOF
Try:
  sinfo
  srun -N$N -n$N hostname          # prints n1..n$N
  sbatch --wrap 'sleep 1' && sacct
  scontrol requeue <jobid>
Logs: $S/log/   Stop: $HERE/stop.sh   Reset everything: stop.sh, then rm -rf $S
EOF
