#!/usr/bin/env bash
# Train on every worker of a Cloud TPU VM slice (v4-32, v5p-128, v6e-64, ...): copy this checkout to all workers,
# install it, and start the same supervised command on each, detached from the SSH session.
#
#   launch/tpu_pod.sh run  TPU_NAME ZONE -- --config=configs/palm_1b.py --workdir=gs://BUCKET/runs/palm_1b [--config.x=y]
#   launch/tpu_pod.sh logs TPU_NAME ZONE [WORKER]   # follow one worker's log (default: worker 0, which logs metrics)
#   launch/tpu_pod.sh stop TPU_NAME ZONE            # SIGTERM everywhere: the job checkpoints and exits
#
# Environment: PROJECT (gcloud project; default: gcloud's), REMOTE_DIR (default: jaxlm, in each worker's home),
# JAX_SPEC (pip requirement for JAX on TPU; default: jax[tpu]), SUPERVISE_ARGS (default: --max_restarts=10).
#
# The workdir is a gs:// bucket URL (no shared disk needed: every worker writes its part of each checkpoint to the
# bucket, worker 0 the markers, checksums and logs; README "Object storage"), or one directory shared by every
# worker (Filestore / NFS): Orbax writes each checkpoint from all workers together and all of them restore from it.
# Each worker runs its own supervisor: a lost worker ends every process (jaxlm.distributed), every supervisor
# restarts its own, and they meet again at worker 0's coordinator. Before each restart all workers run the health
# check together; one failing it names the bad chip or host: replace it (or recreate the slice), then `run` again.
# GCE TPU VMs list their workers only in the metadata server, so dist.initialize=always lets JAX find them.
set -euo pipefail

usage() { sed -n '2,8p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
action="$1" name="$2" zone="$3"
shift 3
remote_dir="${REMOTE_DIR:-jaxlm}"
gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone "${zone}")
[[ -n "${PROJECT:-}" ]] && where+=(--project "${PROJECT}")

on_all_workers() { "${gcloud_tpu[@]}" ssh "${name}" "${where[@]}" --worker=all --command "$1"; }

case "${action}" in
  run)
    [[ "${1:-}" == "--" ]] && shift
    [[ $# -gt 0 ]] || usage
    repo="$(cd "$(dirname "$0")/.." && pwd)"
    tarball="$(mktemp -d)/jaxlm.tar.gz"
    tar -C "${repo}" -czf "${tarball}" --exclude=./.git --exclude=./runs .
    "${gcloud_tpu[@]}" scp "${tarball}" "${name}:/tmp/jaxlm.tar.gz" "${where[@]}" --worker=all
    train_args="$(printf ' %q' "$@")"
    supervise_args="${SUPERVISE_ARGS:---max_restarts=10}"
    # setsid + nohup: the job outlives this SSH session; its output goes to ~/jaxlm.log on each worker.
    on_all_workers "set -e
      mkdir -p ~/${remote_dir} && tar -xzf /tmp/jaxlm.tar.gz -C ~/${remote_dir} && cd ~/${remote_dir}
      pip install -q -e '.[cloud]' '${JAX_SPEC:-jax[tpu]}'
      setsid nohup python3 -m jaxlm.cluster.supervise ${supervise_args} \
        --healthcheck_cmd 'python3 -m jaxlm.cluster.healthcheck --initialize=always' \
        -- python3 -m jaxlm.train ${train_args} --config.dist.initialize=always > ~/jaxlm.log 2>&1 < /dev/null &
      echo \$! > ~/jaxlm.pid
      echo \"started on \$(hostname): log in ~/jaxlm.log\""
    ;;
  logs)
    "${gcloud_tpu[@]}" ssh "${name}" "${where[@]}" --worker="${1:-0}" --command "tail -n 200 -F ~/jaxlm.log"
    ;;
  stop)
    # The supervisor passes SIGTERM on to training, which saves a checkpoint and exits 0.
    on_all_workers 'kill -TERM "$(cat ~/jaxlm.pid)" 2>/dev/null || true'
    ;;
  *)
    usage
    ;;
esac
