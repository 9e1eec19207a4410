#!/usr/bin/env bash
# One multi-process JAX job on this machine: N CPU processes with D fake devices each, joined over localhost
# (CPU collectives over gloo). What tests/test_multihost.py runs; also a way to try multi-host code on a laptop.
#
#   launch/local.sh [-n PROCESSES] [-d DEVICES_PER_PROCESS] -- python -m jaxlm.train --config=configs/palm_tiny.py
#
# Each process gets JAX_COORDINATOR_ADDRESS (a free port on 127.0.0.1), JAX_NUM_PROCESSES and JAX_PROCESS_ID,
# which jaxlm.distributed picks up. Exits with the first non-zero exit code among the processes (0 when all
# succeed). When one fails, the others get LOCAL_GRACE_S seconds (default 300) to end by themselves (a lost peer
# ends them) before they are killed. SIGTERM / SIGINT are passed on to every process.
set -euo pipefail

processes=2
devices=4
while [[ $# -gt 0 && "$1" != "--" ]]; do
  case "$1" in
    -n) processes="$2"; shift 2 ;;
    -d) devices="$2"; shift 2 ;;
    *) echo "usage: $0 [-n PROCESSES] [-d DEVICES_PER_PROCESS] -- COMMAND ..." >&2; exit 2 ;;
  esac
done
if [[ $# -lt 2 ]]; then
  echo "usage: $0 [-n PROCESSES] [-d DEVICES_PER_PROCESS] -- COMMAND ..." >&2
  exit 2
fi
shift  # the --
grace="${LOCAL_GRACE_S:-300}"

port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# Any device-count flag already set (e.g. by a test's environment) would fight ours: drop it.
xla_flags="$(sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g' <<< "${XLA_FLAGS:-}")"

pids=()
for ((i = 0; i < processes; i++)); do
  JAX_COORDINATOR_ADDRESS="127.0.0.1:${port}" JAX_NUM_PROCESSES="${processes}" JAX_PROCESS_ID="${i}" \
    JAX_PLATFORMS=cpu XLA_FLAGS="${xla_flags} --xla_force_host_platform_device_count=${devices}" \
    "$@" &
  pids+=("$!")
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM INT

status=0
live=("${pids[@]}")
while ((${#live[@]} > 0)); do
  finished=""
  code=0
  wait -n -p finished "${live[@]}" || code=$?
  # A trapped signal interrupts the wait and leaves `finished` unset (not empty): wait again.
  [[ -z "${finished:-}" ]] && continue
  for i in "${!live[@]}"; do [[ "${live[$i]}" == "${finished}" ]] && unset "live[$i]"; done
  live=("${live[@]}")
  if ((code != 0)); then
    status=${code}
    for i in "${!pids[@]}"; do [[ "${pids[$i]}" == "${finished}" ]] && index=$i; done
    echo "local.sh: process ${index} (pid ${finished}) exited with code ${code}; the others get up to ${grace}s" \
         "to end by themselves" >&2
    break
  fi
done
if ((status != 0)); then
  deadline=$((SECONDS + grace))
  while ((SECONDS < deadline)) && kill -0 "${live[@]}" 2>/dev/null; do sleep 1; done
  kill -KILL "${live[@]}" 2>/dev/null || true
  wait || true
fi
# JAX's coordination service aborts a process whose peer was lost (SIGABRT: 134) from a C++ thread, where jaxlm
# cannot catch it; report it as jaxlm's lost-peer failure, with its code (75: restart from the checkpoint).
if ((status == 134)); then
  echo "jaxlm: process ${index} was aborted by JAX's coordination service (SIGABRT, exit 134), which is how it" \
       "ends a process that lost a peer; restart the job from its newest checkpoint (jaxlm.cluster.supervise" \
       "does)" >&2
  status=75
fi
exit "${status}"
