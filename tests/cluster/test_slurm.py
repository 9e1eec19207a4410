"""launch/slurm_gpu.sbatch under a real Slurm: a one-node cluster on localhost (launch/slurm_localhost.sh).

The batch script runs in its CPU form, the same file with the GPU defaults overridden on the sbatch command line:
2 tasks on the one node, 2 fake CPU devices each (tests/test_multihost.py: DEVICES), one 4-device job. Each job
must train exactly like a 1-process run of the same config on as many devices (the global batches do not depend
on the process count): preempted with Slurm's SIGTERM to the batch shell and submitted again, and with one task
SIGKILLed so that the supervisor inside the allocation restarts srun. (An uninterrupted job is the first one of the
SIGTERM test up to its signal, and the killed-task job's second attempt to the end: a job of its own would train
the same steps a third time.)

Needs root and Debian's slurm-wlm and munge (installed here with apt-get when missing); skipped otherwise.
"""

import os
import pathlib
import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from tests.conftest import ROOT
from tests.helpers import read_records, train_command, train_env
from tests.test_multihost import DEVICES, PROCESSES, overrides, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow(reason='a real Slurm cluster on localhost schedules, preempts and restarts two-process jobs')]

BINARIES = ('munged', 'slurmctld', 'slurmd', 'sbatch', 'scancel', 'scontrol', 'sinfo', 'squeue')
STEPS, CHECKPOINT_EVERY = 20, 5
ENDED = ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL', 'OUT_OF_MEMORY', 'PREEMPTED', 'BOOT_FAIL',
         'DEADLINE')


def train_args(data_cache) -> list[str]:
  # Every step logged, so that a step lost or repeated across a restart shows in metrics.jsonl.
  return overrides(data_cache, f'--config.train.steps={STEPS}', '--config.train.log_every=1',
                   f'--config.checkpoint.every={CHECKPOINT_EVERY}')


def _install_slurm() -> str:
  """'' once the binaries are there (installing Debian's packages if need be), else why not."""
  if all(shutil.which(b) for b in BINARIES):
    return ''
  if not shutil.which('apt-get'):
    return 'Slurm is not installed and there is no apt-get to install it (slurm-wlm, munge)'
  env = dict(os.environ, DEBIAN_FRONTEND='noninteractive')
  try:
    for command in (['apt-get', 'update'], ['apt-get', 'install', '-y', 'slurm-wlm', 'munge']):
      subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
  except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
    return f'Slurm is not installed and `apt-get install slurm-wlm munge` failed: {e}'
  missing = [b for b in BINARIES if not shutil.which(b)]
  return f'{", ".join(missing)} still missing after installing slurm-wlm and munge' if missing else ''


@pytest.fixture(scope='module')
def slurm(tmp_path_factory):
  """A running one-node cluster; yields the environment for its commands (SLURM_CONF) and the jobs."""
  if os.geteuid() != 0:
    pytest.skip('a Slurm cluster on localhost needs root (slurmd starts job steps as their user)')
  if reason := _install_slurm():
    pytest.skip(reason)
  cluster = tmp_path_factory.mktemp('slurm')
  # Each xdist worker's clusters number their jobs from a range of their own: JAX derives a Slurm job's coordinator
  # port from its job id, so two clusters that both started at job 1 had their job 1s join one coordinator and
  # abort (seen when both workers ran tests of this module at once).
  worker = int(os.environ.get('PYTEST_XDIST_WORKER', 'gw0').removeprefix('gw') or 0)
  start = subprocess.run(['launch/slurm_localhost.sh', 'start', str(cluster)], cwd=ROOT, capture_output=True,
                         text=True, timeout=180, env=dict(os.environ, FIRST_JOB_ID=str(1 + 1000 * worker)))
  try:
    if start.returncode != 0:
      pytest.skip(f'the Slurm cluster on localhost did not start: {start.stderr[-3000:]}')
    # Not the caller's Slurm job (were the tests run inside one): only this cluster's.
    env = {k: v for k, v in train_env(DEVICES).items() if not k.startswith('SLURM_')}
    yield dict(env, SLURM_CONF=str(cluster / 'slurm.conf'),
               # `python` in the batch script: the interpreter running the tests.
               PATH=f'{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get("PATH", "")}',
               SUPERVISE_ARGS='--max_restarts=3 --backoff=1',
               # Timing noise of 8 fake devices on 2 shared cores: a host's all-reduce 3× the other's is no
               # fault here (CI once saw 3.0×); the wrong-checksum and real-slowdown drills run in
               # test_healthcheck.py.
               HEALTHCHECK_ARGS='--slow_factor=10')
  finally:
    subprocess.run(['launch/slurm_localhost.sh', 'stop', str(cluster)], cwd=ROOT, timeout=120)


@pytest.fixture(scope='module')
def reference(tmp_path_factory, data_cache):
  """({step: loss}, final eval loss) of the same config as one process on the job's devices: the data stream does
  not depend on the process count (jaxlm/data/stream.py), so the 2-task Slurm job must match it."""
  workdir = tmp_path_factory.mktemp('single') / 'run'
  run = subprocess.run(train_command(workdir, *train_args(data_cache)), cwd=ROOT, env=train_env(PROCESSES * DEVICES),
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
  records = read_records(workdir)
  assert [r['step'] for r in records] == list(range(1, STEPS + 1))
  return {r['step']: r['loss'] for r in records}, read_records(workdir, 'eval')[-1]['eval_loss']


def sbatch_command(workdir, out_dir, data_cache) -> list[str]:
  """The README's one-machine command: the GPU defaults of the #SBATCH lines overridden for 2 CPU tasks."""
  return ['sbatch', '--parsable', f'--output={out_dir}/%x-%j.out', '--nodes=1', f'--ntasks-per-node={PROCESSES}',
          '--cpus-per-task=1', '--gpus-per-node=0', 'launch/slurm_gpu.sbatch', '--config=configs/palm_tiny.py',
          f'--workdir={workdir}', *train_args(data_cache)]


def submit(command, env) -> str:
  """The job id; sbatch runs from the repository root, which the script changes to (SLURM_SUBMIT_DIR)."""
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True)
  return done.stdout.strip().split(';')[0]


@contextlib.contextmanager
def cancelled_on_error(job: str, env):
  """Cancels `job` when the block fails, so that a failed test leaves the node to the next one."""
  try:
    yield
  except BaseException:
    subprocess.run(['scancel', job], env=env, timeout=30)
    raise


def job_info(job: str, env) -> dict:
  out = subprocess.run(['scontrol', 'show', 'job', '-o', job], env=env, capture_output=True, text=True,
                       timeout=30, check=True).stdout
  return dict(re.findall(r'(\w+)=(\S*)', out))


def wait_job(job: str, env, out_dir, timeout_s: float = 400) -> tuple[str, str, str]:
  """(state, exit code "code:signal", the job's output) once the job has ended; cancels it on time-out."""
  deadline = time.monotonic() + timeout_s
  while (info := job_info(job, env))['JobState'] not in ENDED:
    if time.monotonic() > deadline:
      subprocess.run(['scancel', job], env=env, timeout=30)
      raise TimeoutError(f'job {job} still {info["JobState"]} after {timeout_s}s:\n{output(job, out_dir)[-5000:]}')
    time.sleep(1)
  return info['JobState'], info['ExitCode'], output(job, out_dir)


def output(job: str, out_dir) -> str:
  path = pathlib.Path(out_dir, f'jaxlm-{job}.out')
  return path.read_text(errors='replace') if path.exists() else ''


def task_process(job: str, task: int) -> psutil.Process:
  """Task `task`'s jaxlm.train process of `job` (a child of slurmstepd, not of this test)."""
  for p in psutil.process_iter():
    try:
      if 'jaxlm.train' in p.cmdline() and p.environ().get('SLURM_JOB_ID') == job and \
          p.environ().get('SLURM_PROCID') == str(task):
        return p
    except psutil.Error:
      continue
  raise LookupError(f'no training process for task {task} of job {job}')


def assert_trajectory(workdir, reference, redone: bool = False):
  """Every step exactly once (the later record of a redone step counts), with the reference's numbers."""
  losses, eval_loss = reference
  records = read_records(workdir)
  steps = [r['step'] for r in records]
  if redone:
    records = list({r['step']: r for r in records}.values())  # a dict keeps the first position, the last value
    steps = [r['step'] for r in records]
  assert steps == list(range(1, STEPS + 1)), steps
  np.testing.assert_allclose([r['loss'] for r in records], [losses[s] for s in steps], rtol=1e-5)
  np.testing.assert_allclose(read_records(workdir, 'eval')[-1]['eval_loss'], eval_loss, rtol=1e-5)


def test_batch_script_trains_like_one_process_and_after_sigterm_to_its_shell_the_same_command_resumes(
    tmp_path, slurm, reference, data_cache):
  # --signal=B:TERM@300 at the time limit: SIGTERM to the batch shell only, as `scancel --batch` sends it.
  workdir, command = tmp_path / 'run', sbatch_command(tmp_path / 'run', tmp_path, data_cache)
  job = submit(command, slurm)
  with cancelled_on_error(job, slurm):
    wait_for(lambda: len(read_records(workdir)) >= CHECKPOINT_EVERY + 2, 300, 'training steps')
    subprocess.run(['scancel', '--signal=TERM', '--batch', job], env=slurm, timeout=30, check=True)
  state, code, log = wait_job(job, slurm, tmp_path)
  assert (state, code) == ('COMPLETED', '0:0'), log[-5000:]
  # The README's one-machine command: one job of 2 tasks, one attempt, which ends 0 when preempted too.
  assert f'distributed: 2 processes, {PROCESSES * DEVICES} devices (Slurm job {job}, 2 tasks)' in log, log[-5000:]
  assert 'jaxlm.cluster.supervise: attempt 1 finished (exit code 0)' in log, log[-5000:]
  [event] = [r for r in read_records(workdir, 'event') if r['event'] == 'preempted']
  assert 'checkpoint saved' in event['message'] and event['step'] < STEPS, event
  saved = workdir / 'checkpoints' / str(event['step'])
  assert sorted(p.name for p in (saved / 'data').glob('process_*')) == ['process_0-of-2.json', 'process_1-of-2.json']

  again = submit(command, slurm)
  state, code, log = wait_job(again, slurm, tmp_path)
  assert (state, code) == ('COMPLETED', '0:0'), log[-5000:]
  resumed = [r['step'] for r in read_records(workdir, 'event') if r['event'] == 'resumed']
  assert resumed == [event['step']]
  assert_trajectory(workdir, reference)  # like one process, no step lost, none repeated


def test_a_killed_task_is_restarted_by_the_supervisor_after_a_health_check(tmp_path, slurm, reference, data_cache):
  workdir = tmp_path / 'run'
  job = submit(sbatch_command(workdir, tmp_path, data_cache), slurm)
  with cancelled_on_error(job, slurm):
    wait_for(lambda: (workdir / 'checkpoints' / str(CHECKPOINT_EVERY)).is_dir()
             and len(read_records(workdir)) >= CHECKPOINT_EVERY + 2, 300, 'a checkpoint and steps after it')
    task_process(job, 1).send_signal(signal.SIGKILL)
  state, code, log = wait_job(job, slurm, tmp_path)
  assert (state, code) == ('COMPLETED', '0:0'), log[-5000:]
  attempts = log.split('jaxlm.cluster.supervise: attempt ')
  assert 'task 1: Killed' in attempts[1] and '1 failed with exit code' in attempts[2], log[-5000:]
  assert 'jaxlm.cluster.supervise: health check before attempt 2' in log and 'healthcheck: all healthy' in log, log[-5000:]
  assert '2 finished (exit code 0)' in attempts[-1], log[-5000:]
  [resumed] = [r['step'] for r in read_records(workdir, 'event') if r['event'] == 'resumed']
  assert resumed >= CHECKPOINT_EVERY and resumed % CHECKPOINT_EVERY == 0
  assert_trajectory(workdir, reference, redone=True)
