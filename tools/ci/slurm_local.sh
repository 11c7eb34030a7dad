#!/usr/bin/env bash
# A single-node Slurm cluster on localhost, for tests/system/test_slurm.py (see docs/launch.md).
#
#   tools/ci/slurm_local.sh start    # installs Debian's munge + Slurm if missing, writes
#                                 # /etc/slurm/slurm.conf, starts munged, slurmctld, slurmd and
#                                 # waits until the node is idle (needs root)
#   tools/ci/slurm_local.sh stop     # stops the three daemons by the PIDs in their pid files
#   tools/ci/slurm_local.sh status
#
# Both are idempotent: `start` leaves running daemons alone, `stop` ignores stopped ones.
# Daemons are only ever stopped by the PID in their own pid file (checked against the
# process's name first, so a recycled PID is never signalled), never by name.
# slurmctld starts with -c (no saved job state): job ids restart at 1 on every fresh start.
set -euo pipefail

RUN_DIR=/run/slurm
MUNGE_PID=/run/munge/munged.pid
CTLD_PID=$RUN_DIR/slurmctld.pid
SLURMD_PID=$RUN_DIR/slurmd.pid
CONF=/etc/slurm/slurm.conf
PARTITION=${SLURM_LOCAL_PARTITION:-debug}

log() { echo "slurm_local: $*" >&2; }

# alive PIDFILE NAME: the pid in PIDFILE is a running process called NAME
alive() {
    local pid
    [ -s "$1" ] || return 1
    pid=$(tr -dc 0-9 <"$1")
    [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

install_if_missing() {
    if [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] \
        && command -v sbatch >/dev/null && command -v scontrol >/dev/null; then
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        log "Slurm is not installed and this is not root: cannot install it"
        return 1
    fi
    log "installing munge slurmctld slurmd slurm-client (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends munge slurmctld slurmd slurm-client >/dev/null
}

write_conf() {
    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    # leave 1 GiB to the system
    mem=$(awk '/^MemTotal:/ {m = int($2 / 1024) - 1024; if (m < 1024) m = 1024; print m}' /proc/meminfo)
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm "$RUN_DIR" /run/munge
    chown munge:munge /run/munge
    cat >"$CONF.tmp" <<EOF
# Written by tools/ci/slurm_local.sh: a single-node test cluster on localhost.
ClusterName=recsys-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MinJobAge=3600
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

start() {
    install_if_missing
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    if ! alive "$CTLD_PID" slurmctld || ! alive "$SLURMD_PID" slurmd; then
        write_conf
    fi
    mkdir -p /run/munge && chown munge:munge /run/munge
    if ! alive "$MUNGE_PID" munged; then
        log "starting munged"
        runuser -u munge -- /usr/sbin/munged
    fi
    if ! alive "$CTLD_PID" slurmctld; then
        log "starting slurmctld"
        /usr/sbin/slurmctld -c
    fi
    if ! alive "$SLURMD_PID" slurmd; then
        log "starting slurmd"
        /usr/sbin/slurmd 2>/dev/null
    fi
    local state="" i
    for i in $(seq 1 60); do
        state=$(sinfo -h -p "$PARTITION" -o %t 2>/dev/null | head -n1 || true)
        case "$state" in
            idle|mix|alloc) log "up: partition $PARTITION is $state (pids: munged $(cat $MUNGE_PID), slurmctld $(cat $CTLD_PID), slurmd $(cat $SLURMD_PID))"; return 0 ;;
            down*|drain*|drng*) [ "$i" = 5 ] && scontrol update nodename="$(hostname -s)" state=resume 2>/dev/null || true ;;
        esac
        sleep 1
    done
    log "the node did not become idle in 60 s (state: '${state:-none}'); see /var/log/slurm/"
    return 1
}

stop_one() {  # stop_one PIDFILE NAME
    local pid i
    if ! alive "$1" "$2"; then
        rm -f "$1"
        return 0
    fi
    pid=$(tr -dc 0-9 <"$1")
    log "stopping $2 (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do
        [ -d "/proc/$pid" ] || break
        sleep 0.1
    done
    if [ -d "/proc/$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; then
        log "$2 (pid $pid) ignored SIGTERM for 10 s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

stop() {
    stop_one "$SLURMD_PID" slurmd
    stop_one "$CTLD_PID" slurmctld
    stop_one "$MUNGE_PID" munged
}

status() {
    local f n rc=0
    for f in "$MUNGE_PID:munged" "$CTLD_PID:slurmctld" "$SLURMD_PID:slurmd"; do
        n=${f#*:}
        if alive "${f%%:*}" "$n"; then echo "$n: running (pid $(cat "${f%%:*}"))"; else echo "$n: stopped"; rc=1; fi
    done
    return $rc
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
