"""Multi-process jobs: join the other processes before any JAX call, and never wait forever for a lost one.

Every process of a job runs the same command. `initialize(cfg.dist)` decides from the config and the
environment whether this process is one of many and, if so, calls jax.distributed.initialize: process 0 hosts
JAX's coordination service and every process connects to it. Recognised without any setting:
  explicit  dist.coordinator / num_processes / process_id, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
            JAX_PROCESS_ID (launch/local.sh, Kubernetes JobSet);
  Slurm     srun with more than one task (launch/slurm_gpu.sbatch);
  Open MPI  mpirun with more than one rank;
  TPU       Cloud TPU on GKE (TPU_WORKER_HOSTNAMES) and multi-slice (MEGASCALE_*). On TPU VMs created with
            gcloud the worker list is only in the metadata server: launch/tpu_pod.sh passes dist.initialize=always.
Anything else is a single process and stays exactly as before (no coordination service).

Lost peers (tests/test_multihost.py runs both with real processes):
  dead or frozen  JAX's service expects a heartbeat from every process; after dist.peer_timeout_s without one,
                  every other process is ended by JAX ("Terminating process because the JAX distributed service
                  detected fatal errors. This most likely indicates that another task died", SIGABRT, exit code
                  134) instead of waiting in a collective forever. That abort happens in a C++ thread and cannot
                  be caught in Python, so the launchers map it: launch/local.sh and jaxlm.cluster.supervise report
                  exit 134 as a lost peer, and local.sh exits HUNG_EXIT with one `jaxlm:` line.
  hung            a process stuck in Python (a deadlock, a stuck read) keeps heartbeating, so JAX sees nothing and
                  its peers would wait in the next collective forever. The step watchdog ends each process once
                  no training step has finished for dist.step_timeout_s (exit code HUNG_EXIT, with a message and
                  every thread's stack).
Either way every process exits non-zero, and `python -m jaxlm.cluster.supervise` restarts the job from its newest
checkpoint. Preemption: a SIGTERM that reaches some processes only is shared (any_process), so that all of them
checkpoint the same step and exit 0.
"""

import dataclasses
import faulthandler
import glob
import os
import socket
import re
import sys
import threading
import time
from typing import Callable, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxlm import errors, perf

from jaxlm.errors import HUNG_EXIT  # no step finished in time; a restart from the checkpoint may work
COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV = 'JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'
_SLURM_ENV = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')  # what JAX reads


from jaxlm.errors import DistributedError  # noqa: F401  (joining failed: a peer never came up, ...)

MODES = ('auto', 'always', 'never')  # dist.initialize


def dist_errors(n) -> list[str]:
  """Problems with the `dist` section (checked by distributed.initialize too, before any device work)."""
  e = []
  if n.initialize not in MODES:
    e.append(f'dist.initialize={n.initialize!r} is unknown; use one of {", ".join(MODES)}.')
  if n.num_processes < 0 or n.process_id < -1 or (n.num_processes and n.process_id >= n.num_processes):
    e.append(f'dist.process_id={n.process_id} must be in [0, dist.num_processes={n.num_processes}) '
             f'(or -1 and 0 to take both from the environment).')
  if n.coordinator and ':' not in n.coordinator:
    e.append(f'dist.coordinator={n.coordinator!r} must be host:port (process 0\'s address, a free port).')
  if n.init_timeout_s < 1 or n.peer_timeout_s < 1 or n.step_timeout_s < 0:
    e.append('dist.init_timeout_s and dist.peer_timeout_s must be >= 1; dist.step_timeout_s >= 0 (0 = off).')
  if not re.fullmatch(r'(\d+:\d+)?(,(\d+:\d+)?)*', n.stall):
    e.append(f'dist.stall={n.stall!r} must be comma-separated "process:step" (one per attempt), e.g. "1:12,,0:5".')
  return e


@dataclasses.dataclass(frozen=True)
class Plan:
  """What initialize() does: `kwargs` for jax.distributed.initialize, or None to stay a single process."""
  kwargs: dict | None
  source: str  # where the job's shape comes from, for the start-up line and error messages


def _int_env(environ: Mapping[str, str], name: str, default: int) -> int:
  try:
    return int(environ.get(name, default))
  except ValueError:
    raise errors.ConfigError(f'{name}={environ[name]!r} must be an integer.') from None


def _gpus_for_one_process_per_host(environ: Mapping[str, str], per_host: int) -> list[int] | None:
  """All local GPU ids when one process drives a whole host, else None (JAX's own choice stands).

  JAX's Slurm and Open MPI detection assumes one process per GPU and shows each process only GPU <local rank>;
  one process per host must see all of them.
  """
  if per_host != 1:
    return None
  count = _int_env(environ, 'SLURM_GPUS_ON_NODE', 0)
  if not count and environ.get('CUDA_VISIBLE_DEVICES'):
    count = len(environ['CUDA_VISIBLE_DEVICES'].split(','))  # ids are relative to the visible set
  if not count:
    count = len(glob.glob('/dev/nvidia[0-9]*'))
  return list(range(count)) if count else None


def plan(dist_cfg, environ: Mapping[str, str] = os.environ) -> Plan:
  """Decides from `dist_cfg` and the environment whether and how this process joins a multi-process job."""
  if problems := dist_errors(dist_cfg):
    raise errors.ConfigError('invalid config:\n  - ' + '\n  - '.join(problems))
  if dist_cfg.initialize == 'never':
    return Plan(None, 'dist.initialize=never')
  timeouts = dict(initialization_timeout=int(dist_cfg.init_timeout_s),
                  heartbeat_timeout_seconds=int(dist_cfg.peer_timeout_s),
                  shutdown_timeout_seconds=int(dist_cfg.peer_timeout_s))
  coordinator = dist_cfg.coordinator or environ.get(COORDINATOR_ENV, '')
  num = dist_cfg.num_processes or _int_env(environ, NUM_PROCESSES_ENV, 0)
  pid = dist_cfg.process_id if dist_cfg.process_id >= 0 else _int_env(environ, PROCESS_ID_ENV, -1)
  given = dict(coordinator_address=coordinator or None, num_processes=num or None,
               process_id=pid if pid >= 0 else None)

  if coordinator and num and pid >= 0:
    if num == 1:
      return Plan(None, 'explicit settings: 1 process')
    # Explicit settings win; no detection, so JAX does not narrow the visible GPUs to one (see above).
    return Plan(dict(given, cluster_detection_method='deactivate', **timeouts),
                f'explicit settings (coordinator {coordinator})')
  if all(k in environ for k in _SLURM_ENV) and _int_env(environ, 'SLURM_NTASKS', 1) > 1:
    tasks, nodes = _int_env(environ, 'SLURM_NTASKS', 1), _int_env(environ, 'SLURM_STEP_NUM_NODES', 0)
    per_host = _int_env(environ, 'SLURM_NTASKS_PER_NODE', tasks // nodes if nodes and tasks % nodes == 0 else 0)
    return Plan(dict(given, local_device_ids=_gpus_for_one_process_per_host(environ, per_host), **timeouts),
                f'Slurm job {environ["SLURM_JOB_ID"]}, {tasks} tasks')
  if _int_env(environ, 'OMPI_COMM_WORLD_SIZE', 1) > 1:
    if not coordinator and 'OMPI_MCA_orte_hnp_uri' not in environ:
      raise errors.ConfigError(
          'Open MPI job without OMPI_MCA_orte_hnp_uri (Open MPI 5 / PRRTE): JAX cannot find process 0 by itself. '
          f'Set {COORDINATOR_ENV}=<host of rank 0>:<free port> (or --config.dist.coordinator) for every rank.')
    per_host = _int_env(environ, 'OMPI_COMM_WORLD_LOCAL_SIZE', 0)
    return Plan(dict(given, num_processes=_int_env(environ, 'OMPI_COMM_WORLD_SIZE', 1),
                     process_id=_int_env(environ, 'OMPI_COMM_WORLD_RANK', 0),
                     local_device_ids=_gpus_for_one_process_per_host(environ, per_host), **timeouts),
                f'Open MPI, {environ["OMPI_COMM_WORLD_SIZE"]} ranks')
  workers = environ.get('TPU_PROCESS_ADDRESSES') or environ.get('TPU_WORKER_HOSTNAMES') or ''
  if ',' in workers or environ.get('MEGASCALE_COORDINATOR_ADDRESS'):
    return Plan(dict(given, **timeouts), 'Cloud TPU worker environment')
  if dist_cfg.initialize == 'always':
    return Plan(dict(given, **timeouts), 'dist.initialize=always (JAX detects the cluster)')
  if any(v is not None for v in given.values()):
    missing = [name for name, key in (('coordinator', 'coordinator_address'), ('num_processes', 'num_processes'),
                                      ('process_id', 'process_id')) if given[key] is None]
    raise errors.ConfigError(
        f'a multi-process job needs dist.coordinator, dist.num_processes and dist.process_id (or '
        f'{COORDINATOR_ENV}, {NUM_PROCESSES_ENV}, {PROCESS_ID_ENV}); missing: {", ".join(missing)}.')
  return Plan(None, 'no cluster detected: single process')


class Watchdog:
  """Ends the process when beat() has not been called for `timeout_s`, counting from the first beat.

  A daemon thread: the main thread may be blocked inside a collective that will never finish, so only another
  thread can act, and only os._exit works then (a normal exit would wait at JAX's shutdown barrier).
  """

  def __init__(self, timeout_s: float, what: str, exit_code: int = HUNG_EXIT,
               exit_fn: Callable[[int], None] = os._exit):
    self.timeout_s, self.what, self.exit_code, self.exit_fn = timeout_s, what, exit_code, exit_fn
    self.last: float | None = None  # monotonic time of the newest beat; None = not armed yet
    self.label = ''
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name='jaxlm-watchdog', daemon=True)
    self._thread.start()

  def beat(self, label: str = '') -> None:
    """Records progress (arming the watchdog on the first call); `label` names it in the message."""
    self.last, self.label = time.monotonic(), label

  def stop(self) -> None:
    """Disarms the watchdog for good."""
    self._stop.set()

  def _run(self) -> None:
    while not self._stop.wait(min(1.0, self.timeout_s / 10)):
      if self.last is not None and time.monotonic() - self.last > self.timeout_s:
        self._fire()
        return

  def _fire(self) -> None:
    process = f'process {jax.process_index()} of {jax.process_count()}'
    print(f'jaxlm: {process}: {self.what} for {self.timeout_s:g}s (the last was {self.label or "the start"}): a '
          f'peer process is hung, or the network or a device is stuck. Exiting with code {self.exit_code} so '
          f'that the job can be restarted from its newest checkpoint. Stacks of this process follow.',
          file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    print(f'jaxlm: {process}: {self.what} for {self.timeout_s:g}s; restart the job from its newest checkpoint '
          f'(jaxlm.cluster.supervise does)', file=sys.stderr, flush=True)  # the last line, after the stacks
    self.exit_fn(self.exit_code)


_watchdog: Watchdog | None = None
_stall: tuple[int, int] | None = None  # (process, step) of the stall drill in this attempt


def _wait_for_coordinator(address: str, timeout_s: float, source: str) -> None:
  """Waits until process 0's coordinator port accepts connections; a DistributedError after `timeout_s`."""
  host, port = address.rsplit(':', 1)
  deadline, error = time.monotonic() + timeout_s, None
  while time.monotonic() < deadline:
    try:
      socket.create_connection((host.strip('[]'), int(port)), timeout=2).close()
      return
    except OSError as e:
      error = e
      time.sleep(0.5)
  raise DistributedError(f'could not reach the coordinator {address} (process 0, {source}) within '
                         f'dist.init_timeout_s={timeout_s:g}s ({error}); start every process of the job with the same '
                         f'command, and make process 0\'s port reachable from this host')


def initialize(dist_cfg) -> bool:
  """Joins the job's other processes when there are any; call before any other JAX call. True if it did."""
  global _watchdog, _stall
  p = plan(dist_cfg)
  # The drill's i-th entry is for the supervisor's i-th attempt, so a restarted job gets past its stall.
  stalls = dist_cfg.stall.split(',') if dist_cfg.stall else []
  attempt = int(os.environ.get('JAXLM_ATTEMPT', '1'))
  if attempt <= len(stalls) and stalls[attempt - 1]:
    _stall = tuple(int(x) for x in stalls[attempt - 1].split(':'))
  if p.kwargs is None:
    return False
  # CPU collectives across processes go over TCP with gloo (the default in JAX 0.10; set so it stays explicit).
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if p.kwargs.get('coordinator_address') and p.kwargs.get('process_id', 0):
    # JAX aborts the process (SIGABRT, a C++ stack) when it cannot reach the coordinator: find out first.
    _wait_for_coordinator(p.kwargs['coordinator_address'], dist_cfg.init_timeout_s, p.source)
  try:
    jax.distributed.initialize(**p.kwargs)
  except Exception as e:  # pylint: disable=broad-except  -- JAX raises several types; all mean the same here
    raise DistributedError(
        f'could not join the other processes ({p.source}): {type(e).__name__}: {e}. Every process must run the '
        f'same command within dist.init_timeout_s={dist_cfg.init_timeout_s}s, and process 0\'s coordinator port '
        f'must be reachable from all of them.') from e
  # Whoever asked for the persistent cache (the trainer, JAX_COMPILATION_CACHE_DIR for a tool): several CPU
  # processes aborted in a collective reading executables back from it (perf.CPU_MESH_CACHE_OFF).
  perf.keep_compilation_cache_safe()
  if jax.process_index() == 0:
    print(f'distributed: {jax.process_count()} processes, {jax.device_count()} devices ({p.source}); a process '
          f'that loses a peer exits within ~{dist_cfg.peer_timeout_s}s'
          + (f', or {dist_cfg.step_timeout_s}s without a finished step' if dist_cfg.step_timeout_s else ''),
          flush=True)
  if dist_cfg.step_timeout_s and jax.process_count() > 1:
    _watchdog = Watchdog(dist_cfg.step_timeout_s, 'no training step finished')
  return True


def beat(step: int) -> None:
  """Marks training step `step` as finished: feeds the step watchdog and runs the stall drill (no-op else)."""
  if _watchdog is not None:
    _watchdog.beat(f'step {step}')
  if _stall and _stall == (jax.process_index(), step):
    print(f'jaxlm: drill: process {_stall[0]} hangs after step {step} (dist.stall)', file=sys.stderr, flush=True)
    threading.Event().wait()  # like a deadlock: the heartbeat thread keeps running, so JAX notices nothing


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any; a collective, so every process must call it in step.

  A preemption notice (SIGTERM) may reach one process, or reach them a step apart. Were each to act on its own,
  one would stop to checkpoint while the others wait in the next step's collectives: all must stop after the
  same step.
  """
  if jax.process_count() == 1:
    return flag
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def disarm() -> None:
  """Stops the step watchdog (after the training loop: the final save may take longer than a step)."""
  if _watchdog is not None:
    _watchdog.stop()
