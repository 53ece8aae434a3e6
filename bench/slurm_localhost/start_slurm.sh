#!/usr/bin/env bash
# Start a one-node Slurm (munged, slurmctld, slurmd) on this machine, by hand (no systemd), for
# exercising profiles/slurm. Idempotent: rewrites /etc/slurm/slurm.conf and starts only the
# daemons that are not already running. Needs root and Debian's `slurm-wlm munge` packages
# (installed here when missing). No slurmdbd: accounting is off, so the executor plugin must poll
# with squeue (--slurm-status-command squeue); MinJobAge keeps finished jobs visible to squeue.
# Finished jobs are also written to JOBCOMP_LOG (jobcomp/filetxt), which is what run_smoke.sh
# counts. Stop everything with stop_slurm.sh.
set -euo pipefail

JOBCOMP_LOG=/var/log/slurm/jobcomp.log
PARTITION=${RPB_SLURM_PARTITION:-local}

if [[ $(id -u) -ne 0 ]]; then
    echo "start_slurm.sh: must run as root (writes /etc/slurm, starts daemons)" >&2
    exit 1
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge
fi

running() { pgrep -x "$1" >/dev/null; }

# munge: the key comes with the package; munged refuses to start without its runtime dir.
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile /etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
fi
if ! running munged; then
    runuser -u munge -- munged
fi
munge -n | unmunge >/dev/null # fails loudly if munged does not answer

# slurm.conf: this host as controller and only node, sized by `slurmd -C`.
NODE=$(hostname -s)
read -r CPUS MEM < <(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*RealMemory=\([0-9]*\).*/\1 \2/p')
install -d -m 0755 /etc/slurm /var/log/slurm /var/spool/slurmctld /var/spool/slurmd
cat > /etc/slurm/slurm.conf.new <<CONF
# Written by bench/slurm_localhost/start_slurm.sh: one-node test cluster, no accounting.
ClusterName=localhost
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# No mail on this box; the default /bin/mail is absent and slurmctld logs an error for it.
MailProg=/bin/true
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# No cgroups in this container (no systemd, read-only cgroupfs): track processes via /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
# No slurmdbd: sacct cannot answer, so finished jobs must stay in squeue long enough for the
# plugin's status polls (it wants MinJobAge >= 120 s); the job completion log is the record.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=${JOBCOMP_LOG}
MinJobAge=900
NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${MEM} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP
CONF
if ! cmp -s /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf; then
    mv /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf
    changed=1
else
    rm /etc/slurm/slurm.conf.new
    changed=0
fi

if ! running slurmctld; then
    slurmctld
elif [[ $changed -eq 1 ]]; then
    scontrol reconfigure
fi
if ! running slurmd; then
    slurmd
fi

# Wait until the node takes jobs.
for _ in $(seq 30); do
    state=$(sinfo -h -n "$NODE" -o %t 2>/dev/null || true)
    [[ $state == idle* || $state == mix* || $state == alloc* ]] && break
    sleep 1
done
if [[ $state == drain* || $state == down* ]]; then
    scontrol update NodeName="$NODE" State=RESUME || true
    sleep 2
fi
sinfo
[[ $(sinfo -h -n "$NODE" -o %t) =~ ^(idle|mix|alloc) ]] || {
    echo "start_slurm.sh: node $NODE is not up; see /var/log/slurm/slurmd.log" >&2
    exit 1
}
