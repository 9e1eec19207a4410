#!/usr/bin/env bash
# A one-machine Slurm cluster (munged, slurmctld, slurmd on localhost) in a directory of its own: to try
# launch/slurm_gpu.sbatch without a cluster. What tests/cluster/test_slurm.py brings up. Needs root and Debian's
# slurm-wlm and munge packages (apt-get install -y slurm-wlm munge).
#
#   launch/slurm_localhost.sh start DIR    # writes DIR/slurm.conf, starts the daemons, waits for the node
#   export SLURM_CONF=DIR/slurm.conf       # sbatch, squeue, scancel, scontrol, sinfo then use this cluster
#   launch/slurm_localhost.sh stop DIR     # cancels its jobs, stops its daemons
#
# Environment: CPUS (default 4: the node declares that many whatever the machine has, so that 2 tasks fit on a
# 2-core machine); FIRST_JOB_ID (default 1: give clusters that run side by side distinct ranges, since JAX derives a
# Slurm job's coordinator port from its job id). Nothing of the system's Slurm or munge set-up is used or changed:
# the key, the munge socket, the state and the logs (DIR/log) all live in DIR, and the ports are free ones picked at
# start.
# Plugins that need no cgroups (proctrack/linuxproc, task/none): containers often have no writable cgroup tree.
set -euo pipefail

usage() { sed -n '6,8p' "$0" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
action="$1"
dir="$(realpath -m "$2")"
conf="${dir}/slurm.conf"
export SLURM_CONF="${conf}"

# Runs "$@" until it succeeds, at most $1 seconds.
retry_for() {
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

fail() {
  echo "slurm_localhost.sh: $1" >&2
  for log in "${dir}"/log/*.log; do [[ -f "${log}" ]] && { echo "--- ${log}:" >&2; tail -n 20 "${log}" >&2; }; done
  exit 1
}

start() {
  [[ ${EUID} -eq 0 ]] || { echo "slurm_localhost.sh: needs root (slurmd starts job steps as their user)" >&2; exit 1; }
  for binary in munged slurmctld slurmd sbatch sinfo; do
    command -v "${binary}" >/dev/null || { echo "slurm_localhost.sh: ${binary} missing: apt-get install -y slurm-wlm munge" >&2; exit 1; }
  done
  alive "${dir}/slurmctld.pid" && { echo "slurm_localhost.sh: already running in ${dir}" >&2; exit 1; }
  mkdir -p "${dir}/munge" "${dir}/state" "${dir}/spool" "${dir}/log"
  chmod 700 "${dir}/munge"  # munged refuses a key or socket directory that others may write to
  if [[ ! -s "${dir}/munge/munge.key" ]]; then
    dd if=/dev/urandom of="${dir}/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "${dir}/munge/munge.key"
  fi
  local ports host
  read -r -a ports <<< "$(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
  s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')"
  host="$(hostname -s)"  # slurmd finds its node definition by this name
  cat > "${conf}" <<EOF
# Written by launch/slurm_localhost.sh: a one-node cluster on localhost.
ClusterName=localhost
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${ports[0]}
SlurmdPort=${ports[1]}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${dir}/munge/munge.socket
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd.pid
SlurmctldLogFile=${dir}/log/slurmctld.log
SlurmdLogFile=${dir}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
FirstJobId=${FIRST_JOB_ID:-1}
KillWait=5
# The node's CPUs as declared below, not as counted: more tasks than cores may run.
SlurmdParameters=config_overrides
# The machine's memory, so that jobs asking for memory per CPU (datatrove's stages: 2 GB) can be placed.
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${CPUS:-4} RealMemory=$(( $(awk '/^MemTotal/ {print $2}' /proc/meminfo) / 1024 )) State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
EOF
  # --force: munged as root, in a directory of its own.
  munged --force --key-file="${dir}/munge/munge.key" --socket="${dir}/munge/munge.socket" \
    --pid-file="${dir}/munge/munged.pid" --log-file="${dir}/log/munged.log" --seed-file="${dir}/munge/seed" \
    || fail "munged did not start"
  retry_for 10 test -S "${dir}/munge/munge.socket" || fail "munged did not start"
  slurmctld -f "${conf}" || fail "slurmctld did not start"
  retry_for 30 scontrol ping || fail "slurmctld does not answer"
  slurmd -f "${conf}" || fail "slurmd did not start"
  retry_for 60 bash -c '[[ "$(sinfo -h -N -o %t)" == idle ]]' || fail "the node did not become idle: $(sinfo -N 2>&1)"
  echo "export SLURM_CONF=${conf}"
}

stop() {
  if alive "${dir}/slurmctld.pid"; then
    scancel --partition=debug 2>/dev/null || true  # every job of this cluster
    retry_for 30 bash -c '[[ -z "$(squeue -h 2>/dev/null)" ]]' || echo "slurm_localhost.sh: jobs still listed" >&2
  fi
  # All three at once: each takes 1.5-2 s to stop, and nothing of this cluster outlives it.
  local pid_file pids=()
  for pid_file in "${dir}/slurmd.pid" "${dir}/slurmctld.pid" "${dir}/munge/munged.pid"; do
    alive "${pid_file}" && pids+=("$(cat "${pid_file}")")
  done
  ((${#pids[@]})) || return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  retry_for 10 bash -c "! kill -0 ${pids[*]} 2>/dev/null" || kill -KILL "${pids[@]}" 2>/dev/null || true
}

case "${action}" in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
