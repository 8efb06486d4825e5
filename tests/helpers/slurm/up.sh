#!/bin/bash
# up.sh [lo|netns] -- bring up a throwaway but real Slurm (22.05) cluster on one
# machine: munged + slurmctld ("head") + N slurmd ("n1".."nN").  Idempotent:
# if the same cluster is already up and healthy it returns at once; if a
# half-dead one is found it is torn down (down.sh) and rebuilt.  The test fixture: tests/helpers/slurm_cluster.py.
#
#   lo    (default) all daemons share the host network; Debian's slurm is built
#         with MULTIPLE_SLURMD, so each slurmd gets its own address 127.0.1.I
#         and port SLURMD_PORT+I.
#   netns one network namespace per node + one for head, joined by a bridge
#         that lives inside the head namespace (no interface in the host's
#         namespace).  Each node has its own IP (SUBNET.11, .12, ...) and the
#         same slurmd port.  Clients must run inside the head namespace:
#         source $BASE/env.sh puts wrappers for srun/sbatch/... first in PATH
#         (or call $BASE/bin/sbatch etc. by path).
#
# In both modes every daemon runs with its own hostname (UTS namespace) and a
# private /etc/hosts (bind mount) naming head and n1..nN, and all processes
# (daemons, slurmstepd, job tasks) live in cgroup $CG/<name>, which down.sh
# and bin/node-kill use to kill exactly those pids.
#
# Needs root and: apt-get install slurmctld slurmd slurm-client munge
# Knobs (env): SLURM_TEST_DIR (default /tmp/slurm-test) SLURM_TEST_CGROUP
#   NNODES CPUS_PER_NODE CTLD_PORT SLURMD_PORT SUBNET NETNS_PREFIX
#   SLURMD_TIMEOUT CRED_EXPIRE KILL_WAIT GRACE_TIME (defaults below)
set -euo pipefail

BASE=${SLURM_TEST_DIR:-/tmp/slurm-test}
MODE=${1:-${SLURM_TEST_MODE:-lo}}
N=${NNODES:-3}
CPUS=${CPUS_PER_NODE:-2}
CTLD_PORT=${CTLD_PORT:-16817}
SLURMD_PORT=${SLURMD_PORT:-17000}      # lo: node i listens on SLURMD_PORT+i
SUBNET=${SUBNET:-10.77.0}              # netns: head=.1, node i=.(10+i)
PFX=${NETNS_PREFIX:-slt}
SLURMD_TIMEOUT=${SLURMD_TIMEOUT:-10}   # seconds until a dead node is DOWN
CRED_EXPIRE=${CRED_EXPIRE:-10}         # also the requeue delay (min 5)
KILL_WAIT=${KILL_WAIT:-10}             # SIGTERM -> SIGKILL on cancel/timeout
GRACE_TIME=${GRACE_TIME:-10}           # preemption grace time (batch part.)
HERE=$(cd "$(dirname "$0")" && pwd)

case $MODE in lo|netns) ;; *) echo "usage: $0 [lo|netns]" >&2; exit 2;; esac
[ "$(id -u)" = 0 ] || { echo "up.sh: must run as root" >&2; exit 1; }
for b in munged slurmctld slurmd sinfo scontrol unshare nsenter ip; do
  command -v $b >/dev/null || { echo "up.sh: $b missing (apt-get install slurmctld slurmd slurm-client munge)" >&2; exit 1; }
done

mkdir -p "$BASE"; BASE=$(cd "$BASE" && pwd)   # absolute: the wrappers embed it
export SLURM_TEST_DIR=$BASE                      # for down.sh
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then CGROOT=/sys/fs/cgroup
elif [ -f /sys/fs/cgroup/unified/cgroup.procs ]; then CGROOT=/sys/fs/cgroup/unified
else echo "up.sh: no cgroup2 hierarchy found" >&2; exit 1; fi
CG=$CGROOT/${SLURM_TEST_CGROUP:-slurm${BASE//[^A-Za-z0-9]/-}}   # one per BASE

export SLURM_CONF=$BASE/slurm.conf
NODES=$(seq -f 'n%g' 1 "$N" | tr '\n' ' ')

# ---------- already up? ----------
healthy() {
  [ -f "$BASE/run/mode" ] && [ "$(cat "$BASE/run/mode")" = "$MODE $N" ] || return 1
  local p; for p in "$BASE"/munge/munged.pid "$BASE"/run/slurmctld.pid; do
    [ -f "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null || return 1; done
  local st; st=$(timeout 10 "$BASE/bin/sinfo" -h -N -p batch -o '%N %t' 2>/dev/null) || return 1
  [ "$(echo "$st" | grep -cE ' (idle|alloc|mix|comp)$')" = "$N" ]
}
if healthy; then echo "up.sh: cluster already up ($MODE, $N nodes)"; exit 0; fi
"$HERE/down.sh" >/dev/null 2>&1 || true

T0=$(date +%s.%N)
mkdir -p "$BASE"/{run,log,bin,etc,munge}
rm -rf "$BASE"/state "$BASE"/spool "$BASE"/log/*
mkdir -p "$BASE"/state; for n in $NODES; do mkdir -p "$BASE/spool/$n"; done

# ---------- cgroups (tracking only, no controllers) ----------
# a cgroup or namespace of that name still in use belongs to another cluster
for g in "$CG"/*/; do [ -n "$(cat "$g/cgroup.procs" 2>/dev/null)" ] && {
  echo "up.sh: cgroup $CG is in use (another cluster?): set SLURM_TEST_CGROUP" >&2; exit 1; }; done
if [ "$MODE" = netns ]; then for h in head $NODES; do [ -e "/run/netns/$PFX-$h" ] && {
  echo "up.sh: network namespace $PFX-$h exists (another cluster?): set NETNS_PREFIX" >&2; exit 1; }; done; fi
mkdir -p "$CG"; for g in munge head $NODES; do mkdir -p "$CG/$g"; done
echo "$CG" > "$BASE/run/cgroup"
in_cg() { local g=$1; shift; sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$CG/$g" "$@"; }

# ---------- munge (private key + socket) ----------
chmod 755 "$BASE/munge"
[ -s "$BASE/munge/munge.key" ] || { dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none; chmod 400 "$BASE/munge/munge.key"; }
in_cg munge munged --socket="$BASE/munge/munge.sock" --key-file="$BASE/munge/munge.key" \
  --log-file="$BASE/munge/munged.log" --pid-file="$BASE/munge/munged.pid" \
  --seed-file="$BASE/munge/munged.seed" --num-threads=2
for i in $(seq 50); do [ -S "$BASE/munge/munge.sock" ] && break; sleep 0.1; done

# ---------- addresses, /etc/hosts ----------
addr() { # addr head|nI
  if [ "$MODE" = lo ]; then [ "$1" = head ] && echo 127.0.0.1 || echo "127.0.1.${1#n}"
  else [ "$1" = head ] && echo "$SUBNET.1" || echo "$SUBNET.$((10 + ${1#n}))"; fi; }
{ echo "127.0.0.1 localhost"; echo "::1 localhost ip6-localhost ip6-loopback"
  for h in head $NODES; do echo "$(addr $h) $h"; done; } > "$BASE/etc/hosts"

if [ "$MODE" = netns ]; then
  : > "$BASE/run/netns"
  for h in head $NODES; do ip netns add "$PFX-$h"; echo "$PFX-$h" >> "$BASE/run/netns"
    ip -n "$PFX-$h" link set lo up; done
  ip -n "$PFX-head" link add br0 type bridge
  ip -n "$PFX-head" addr add "$SUBNET.1/24" dev br0
  ip -n "$PFX-head" link set br0 up
  for n in $NODES; do
    ip link add "v-$n" netns "$PFX-head" type veth peer name eth0 netns "$PFX-$n"
    ip -n "$PFX-head" link set "v-$n" master br0 up
    ip -n "$PFX-$n" addr add "$(addr $n)/24" dev eth0
    ip -n "$PFX-$n" link set eth0 up
  done
fi

# ---------- "on NODE cmd..." : run a command inside a node ----------
cat > "$BASE/bin/on" <<EOF
#!/bin/sh
# on head|nI CMD... : run CMD with that node's hostname, /etc/hosts and network
h=\$1; shift
set -- unshare --uts --mount --propagation private sh -c 'hostname "\$0" && mount --bind $BASE/etc/hosts /etc/hosts && exec "\$@"' "\$h" "\$@"
# nsenter, not "ip netns exec": the latter remounts /sys and hides /sys/fs/cgroup,
# which slurmd 22.05 needs ("No filesystem mounted on /sys/fs/cgroup")
[ "$MODE" = netns ] && exec nsenter --net=/run/netns/$PFX-\$h "\$@"
exec "\$@"
EOF
chmod +x "$BASE/bin/on"
# client wrappers: always use this cluster's config; in netns mode run on head
# (resolve the real binaries with $BASE/bin removed from PATH: a wrapper must
#  never exec itself)
realbin() { local d IFS=:; for d in $PATH /usr/bin /usr/local/bin; do
  [ "$d" != "$BASE/bin" ] && [ -x "$d/$1" ] && { echo "$d/$1"; return; }; done; echo "/usr/bin/$1"; }
for c in srun sbatch salloc squeue scancel scontrol sinfo sacct sattach sstat sprio sshare; do
  if [ "$MODE" = netns ]; then
    printf '#!/bin/sh\nSLURM_CONF=%s exec %s/bin/on head %s "$@"\n' "$SLURM_CONF" "$BASE" "$(realbin $c)"
  else
    printf '#!/bin/sh\nSLURM_CONF=%s exec %s "$@"\n' "$SLURM_CONF" "$(realbin $c)"
  fi > "$BASE/bin/$c"; chmod +x "$BASE/bin/$c"
done
cat > "$BASE/bin/node-kill" <<EOF
#!/bin/sh
# node-kill nI : SIGKILL the node's slurmd, slurmstepds and job tasks (= crash)
for i in 1 2 3 4 5 6 7 8 9 10; do
  p=\$(cat $CG/\$1/cgroup.procs); [ -z "\$p" ] && exit 0; kill -9 \$p 2>/dev/null; sleep 0.1
done
EOF
cat > "$BASE/bin/node-start" <<EOF
#!/bin/sh
# node-start nI : (re)start the node's slurmd
export SLURM_CONF=$SLURM_CONF
exec sh -c 'echo \$\$ > "\$0/cgroup.procs" && exec "\$@"' $CG/\$1 $BASE/bin/on \$1 slurmd -N \$1 -f $SLURM_CONF
EOF
chmod +x "$BASE/bin/node-kill" "$BASE/bin/node-start"
cat > "$BASE/env.sh" <<EOF
export SLURM_CONF=$SLURM_CONF
case ":\$PATH:" in *":$BASE/bin:"*) ;; *) export PATH=$BASE/bin:\$PATH;; esac
EOF

# ---------- slurm.conf ----------
{
cat <<EOF
# written by $HERE/up.sh ($MODE mode)
ClusterName=test
SlurmctldHost=head($(addr head))
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$BASE/munge/munge.sock,cred_expire=$CRED_EXPIRE
SlurmUser=root
SlurmdUser=root
MailProg=/bin/true
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout=$SLURMD_TIMEOUT
KillWait=$KILL_WAIT
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=5,bf_interval=5
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
EOF
for n in $NODES; do
  if [ "$MODE" = lo ]; then port=$((SLURMD_PORT + ${n#n})); else port=$SLURMD_PORT; fi
  echo "NodeName=$n NodeHostname=$n NodeAddr=$(addr $n) Port=$port CPUs=$CPUS RealMemory=1000 State=UNKNOWN"
done
echo "PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_TIME"
echo "PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF"
} > "$SLURM_CONF"

# ---------- daemons ----------
in_cg head "$BASE/bin/on" head slurmctld -f "$SLURM_CONF"
for i in $(seq 100); do timeout 5 "$BASE/bin/scontrol" ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
for n in $NODES; do "$BASE/bin/node-start" "$n"; done
for i in $(seq 300); do
  [ "$(timeout 5 "$BASE/bin/sinfo" -h -N -p batch -o '%t' 2>/dev/null | grep -c '^idle$')" = "$N" ] && break; sleep 0.1
done
echo "$MODE $N" > "$BASE/run/mode"
if ! healthy; then
  echo "up.sh: cluster did not come up; see $BASE/log" >&2; "$BASE/bin/sinfo" -N >&2 || true; exit 1
fi
echo "up.sh: $MODE cluster with $N nodes up in $(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $T0}")s; source $BASE/env.sh"
