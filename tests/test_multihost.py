"""Multi-host training with real processes on localhost (launch/local.sh: CPU devices, collectives over gloo).

The reference is a 1-process run computed in this process on 8 devices: the global batches are a function of the
data, the seed and the step only (data/stream.py), so "the same losses" means a 2-process run equals a 1-process one.
"""

import os
import signal
import subprocess
import sys
import time
import uuid

import flax.linen as nn
import jax
import numpy as np
import psutil
import pytest

from jaxlm import config as config_lib
from jaxlm.data import pipeline as data_lib
from jaxlm.data import storage
from jaxlm import distributed
from jaxlm import rundir
from jaxlm import sharding
from jaxlm import step
from jaxlm import train
from tests.conftest import ROOT
from tests.helpers import load_config, read_records, train_env
from tests.stores import BUCKET, gcs_emulator, store_env  # noqa: F401  pylint: disable=unused-import

# 2 devices per process: each step of a two-process job runs its collectives as gloo ranks over loopback TCP,
# one per device, so 2 × 2 costs about half the CPU of 2 × 4 (bench/RESULTS.md, "Test suite") and still shards
# inside each process.
PROCESSES, DEVICES = 2, 2
SHORT_STEPS, SHORT_WARMUP = 4, 2  # short_reference: steps and warmup steps (palm_tiny's 5 would not fit in 4)
# The short runs' overrides: their schedule, and a loss logged at every step.
SHORT = (f'--config.train.steps={SHORT_STEPS}', f'--config.optim.warmup_steps={SHORT_WARMUP}',
         '--config.train.log_every=1')


def overrides(data_cache, *extra) -> list[str]:
  """palm_tiny as every run here uses it: the plain AdamW step (no stability machinery), fast peer detection."""
  return [f'--config.data.cache_dir={data_cache}', '--config.stability.policy=off', '--config.log.tensorboard=False',
          '--config.dist.peer_timeout_s=15', *extra]


def local_command(workdir, *args) -> list[str]:
  return ['launch/local.sh', '-n', str(PROCESSES), '-d', str(DEVICES), '--', sys.executable, '-m', 'jaxlm.train',
          '--config=configs/palm_tiny.py', f'--workdir={workdir}', *args]


def one_process_run(data_cache, steps: int, warmup_steps: int | None = None) -> tuple[dict, float]:
  """Per-step losses and the final eval loss of palm_tiny for `steps` steps as one process on 8 local devices."""
  cfg = load_config('palm_tiny')
  cfg.data.cache_dir = str(data_cache)
  cfg.stability.policy = 'off'  # as overrides() says
  cfg.train.steps = steps  # the learning-rate schedule spans them
  if warmup_steps is not None:
    cfg.optim.warmup_steps = warmup_steps
  t, vocab = cfg.train, cfg.model.vocab_size
  mesh = sharding.make_mesh(cfg.mesh)
  it = data_lib.make_train_iterator(cfg.data, batch_size=t.batch_size, seed=t.seed, vocab_size=vocab,
                                    process_index=0, process_count=1)
  losses = {}
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    program = step.build_program(cfg, mesh)
    state = program.init()
    for i in range(1, t.steps + 1):
      state, metrics = program.train_step(state, train.global_batch(next(it), program.batch_sharding))
      losses[i] = float(metrics['loss'])
    eval_data = data_lib.eval_batches(cfg.data, batch_size=t.batch_size, num_batches=t.eval_batches,
                                      vocab_size=vocab, process_index=0, process_count=1)
    eval_loss = train.evaluate(program, state.params, eval_data)
  return losses, eval_loss


@pytest.fixture(scope='module')
def reference(data_cache):
  """palm_tiny's configured 30 steps as one process (one_process_run)."""
  return one_process_run(data_cache, 30)


@pytest.fixture(scope='module')
def short_reference(data_cache):
  """4 steps as one process: the pipeline and context drills train 4 steps, not palm_tiny's 30, since a step
  across 2 processes costs ~3x one in 1 (gloo over loopback) and their program is the same from the first step."""
  return one_process_run(data_cache, SHORT_STEPS, SHORT_WARMUP)


def assert_matches(workdir, reference, steps):
  losses, eval_loss = reference
  records = read_records(workdir)
  assert [r['step'] for r in records] == steps
  np.testing.assert_allclose([r['loss'] for r in records], [losses[s] for s in steps], rtol=2e-5)
  np.testing.assert_allclose(read_records(workdir, 'eval')[-1]['eval_loss'], eval_loss, rtol=2e-5)


def process_of(root: psutil.Process, index: int) -> psutil.Process:
  """The jaxlm.train process with JAX_PROCESS_ID=index among root's descendants."""
  for p in root.children(recursive=True):
    try:
      if 'jaxlm.train' in p.cmdline() and p.environ().get('JAX_PROCESS_ID') == str(index):
        return p
    except psutil.NoSuchProcess:
      continue
  raise LookupError(f'no training process {index}')


def wait_for(predicate, timeout_s: float, what: str) -> None:
  deadline = time.monotonic() + timeout_s
  while not predicate():
    if time.monotonic() > deadline:
      raise TimeoutError(f'gave up waiting for {what}')
    time.sleep(0.2)


# --- Fast checks: no second process. ---------------------------------------------------------------------------

def dist(**kw):
  cfg = load_config('palm_tiny').dist
  cfg.update(kw)
  return cfg


def test_plan_single_process_is_untouched():
  assert distributed.plan(dist(), {}).kwargs is None
  assert distributed.plan(dist(), {'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '1'}).kwargs is None
  assert distributed.plan(dist(initialize='never'), {'JAX_COORDINATOR_ADDRESS': 'h:1', 'JAX_NUM_PROCESSES': '2',
                                                     'JAX_PROCESS_ID': '0'}).kwargs is None


def test_plan_explicit_settings_and_env():
  kwargs = distributed.plan(dist(peer_timeout_s=30), {'JAX_COORDINATOR_ADDRESS': 'h:1234', 'JAX_NUM_PROCESSES': '4',
                                                      'JAX_PROCESS_ID': '3'}).kwargs
  assert kwargs['coordinator_address'] == 'h:1234' and (kwargs['num_processes'], kwargs['process_id']) == (4, 3)
  assert kwargs['cluster_detection_method'] == 'deactivate'  # so JAX does not narrow a host's GPUs to one
  assert kwargs['heartbeat_timeout_seconds'] == 30
  kwargs = distributed.plan(dist(coordinator='c:9', num_processes=2, process_id=1), {}).kwargs
  assert (kwargs['coordinator_address'], kwargs['num_processes'], kwargs['process_id']) == ('c:9', 2, 1)
  with pytest.raises(config_lib.ConfigError, match='missing: num_processes, process_id'):
    distributed.plan(dist(), {'JAX_COORDINATOR_ADDRESS': 'h:1'})


def test_plan_detects_clusters():
  slurm = {'SLURM_JOB_ID': '7', 'SLURM_STEP_NODELIST': 'n[1-2]', 'SLURM_NTASKS': '2', 'SLURM_PROCID': '1',
           'SLURM_LOCALID': '0', 'SLURM_STEP_NUM_NODES': '2', 'SLURM_GPUS_ON_NODE': '8'}
  kwargs = distributed.plan(dist(), slurm).kwargs
  assert kwargs['local_device_ids'] == list(range(8))  # one process per node drives all its GPUs
  assert kwargs['coordinator_address'] is None  # JAX derives it from the node list
  kwargs = distributed.plan(dist(), dict(slurm, SLURM_NTASKS='16')).kwargs  # one process per GPU
  assert kwargs['local_device_ids'] is None
  assert distributed.plan(dist(), {'TPU_WORKER_HOSTNAMES': 'w0,w1,w2,w3'}).kwargs is not None
  ompi = {'OMPI_COMM_WORLD_SIZE': '2', 'OMPI_COMM_WORLD_RANK': '1', 'OMPI_COMM_WORLD_LOCAL_SIZE': '2'}
  with pytest.raises(config_lib.ConfigError, match='JAX_COORDINATOR_ADDRESS'):
    distributed.plan(dist(), ompi)
  kwargs = distributed.plan(dist(), dict(ompi, JAX_COORDINATOR_ADDRESS='h:5')).kwargs
  assert (kwargs['num_processes'], kwargs['process_id']) == (2, 1)
  assert distributed.plan(dist(initialize='always'), {}).kwargs is not None
  with pytest.raises(config_lib.ConfigError, match='dist.initialize'):
    distributed.plan(dist(initialize='sometimes'), {})


def test_dcn_mesh_sizes_are_validated():
  cfg = load_config('palm_tiny')
  cfg.mesh.update(dcn_data=2, fsdp=-1)
  assert sharding.MeshShape.resolve(cfg.mesh, 8).sizes == (2, 4, 1, 1)  # (data, fsdp, tensor, context): the dcn factor times the per-host size
  config_lib.validate(cfg, 8, num_processes=2)
  with pytest.raises(config_lib.ConfigError, match=r'dcn_data×dcn_fsdp×dcn_tensor×dcn_context = 2×1×1×1 = 2 must equal the '
                                                   r'number of processes \(1\)'):
    config_lib.validate(cfg, 8)
  with pytest.raises(config_lib.ConfigError, match='dcn_data'):
    sharding.make_mesh(cfg.mesh)  # one process here: nothing to span
  cfg.mesh.update(fsdp=8)
  with pytest.raises(config_lib.ConfigError, match=r'each of the 2 hosts/slices has 4 devices'):
    config_lib.validate(cfg, 8, num_processes=2)


def test_watchdog_fires_without_beats():
  fired = []
  watchdog = distributed.Watchdog(0.3, 'no training step finished', exit_fn=fired.append)
  time.sleep(0.5)
  assert not fired  # not armed before the first beat (compiles and restores may take long)
  watchdog.beat('step 1')
  wait_for(lambda: fired, 5, 'the watchdog')
  assert fired == [distributed.HUNG_EXIT]


# --- Real processes. --------------------------------------------------------------------------------------------

@pytest.mark.slow(reason='three supervised attempts of two processes; the step watchdog and JAX heartbeat waits are the point')
def test_supervised_job_survives_a_hung_and_a_lost_peer_and_matches_one_process(tmp_path, data_cache, reference):
  """One job, three attempts under the supervisor (one test: each attempt starts and compiles two processes).

  1. Process 1 hangs in Python after step 12 (heartbeats go on, so JAX sees nothing): the step watchdogs end
     the processes (exit 75).
  2. Resumed from checkpoint 10; process 1 hangs after step 22 and is SIGKILLed there: the survivor is ended by
     JAX's heartbeat check, well within 60 s.
  3. Resumed from checkpoint 20; runs to the end.
  The mesh is HSDP (parameters sharded over each process's 2 devices, replicated across the 2 processes), and the
  logged losses (steps 5-10 from attempt 1, 15-20 from 2, 25-30 from 3) equal the 1-process reference.
  """
  workdir, log = tmp_path / 'run', tmp_path / 'out.log'
  # Waits as short as a loaded 2-core machine allows: a step takes well under a second here, a heartbeat less.
  train_args = overrides(data_cache, '--config.mesh.dcn_data=2', '--config.dist.stall=1:12,1:22',
                         '--config.dist.step_timeout_s=10', '--config.dist.peer_timeout_s=10')
  command = [sys.executable, '-m', 'jaxlm.cluster.supervise', '--backoff=1', '--max_restarts=2', '--',
             *local_command(workdir, *train_args)]
  with open(log, 'w') as out:
    supervisor = subprocess.Popen(command, cwd=ROOT, env=train_env(DEVICES), stdout=out, stderr=subprocess.STDOUT)
  try:
    root = psutil.Process(supervisor.pid)
    wait_for(lambda: 'drill: process 1 hangs after step 22' in log.read_text(), 400, 'the second stall')
    wait_for(lambda: (workdir / 'checkpoints' / '20').is_dir(), 60, 'checkpoint 20')
    survivor, victim = process_of(root, 0), process_of(root, 1)
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor.wait(timeout=60)
    lost_s = time.monotonic() - killed
    assert supervisor.wait(timeout=300) == 0, log.read_text()[-5000:]
  finally:
    if supervisor.poll() is None:
      os.killpg(supervisor.pid, signal.SIGKILL)  # never leave training processes behind
  text = log.read_text()
  attempts = text.split('jaxlm.cluster.supervise: attempt ')
  # Attempt 1, the hang: the first process to exit is ended by its watchdog (the other's may fire too, unless
  # JAX ends it first for losing its peer).
  assert 'of 2: no training step finished for 10s (the last was step 12)' in attempts[1], attempts[1][-5000:]
  assert 'attempt 1 failed with exit code 75 (no step finished in time)' in text
  # Attempt 2: the lost peer, noticed by JAX in bounded time with a message that says so.
  assert lost_s < 60, f'the surviving process took {lost_s:.0f}s to notice its lost peer'
  assert 'detected fatal errors' in text and 'another task died' in text, text[-5000:]
  assert 'attempt 3 finished (exit code 0)' in text, attempts[-1][-3000:]
  assert "mesh: {'data': 2, 'fsdp': 2, 'tensor': 1, 'context': 1}" in text
  resumed = [r['step'] for r in read_records(workdir, 'event') if r['event'] == 'resumed']
  assert resumed == [10, 20]
  assert_matches(workdir, reference, [5, 10, 15, 20, 25, 30])
  saved = workdir / 'checkpoints' / '30'  # written by both processes together
  assert sorted(p.name for p in (saved / 'data').glob('process_*')) == ['process_0-of-2.json', 'process_1-of-2.json']


@pytest.mark.slow(reason='two real processes train and compile a pipelined step each, against the 1-process run')
def test_pipeline_stages_across_two_processes_match_one_process(tmp_path, data_cache, short_reference):
  """mesh.dcn_stage=2: each process holds one stage (one of palm_tiny's 2 layers, fsdp over its 2 devices), and
  only activations cross between them; the logged losses and the eval loss equal the 1-process reference."""
  workdir = tmp_path / 'run'
  out = subprocess.run(local_command(workdir, *overrides(data_cache, '--config.mesh.dcn_stage=2',
                                                         '--config.pipeline.microbatches=2', *SHORT)),
                       cwd=ROOT, env=train_env(DEVICES), capture_output=True, text=True, timeout=900)
  text = out.stdout + out.stderr
  assert out.returncode == 0, text[-5000:]
  assert "mesh: {'stage': 2, 'data': 1, 'fsdp': 2, 'tensor': 1, 'context': 1}" in text, text[-5000:]
  assert 'stage 0: layers 0\n' in text and 'stage 1: layers 1\n' in text
  assert 'bubble (S−1)/(R·M+S−1) = 0.333' in text
  assert_matches(workdir, short_reference, [1, 2, 3, 4])
  assert all(r['bubble'] == pytest.approx(1 / 3) for r in read_records(workdir))


@pytest.mark.slow(reason='two real processes train and compile a context-parallel step each, against the 1-process run')
def test_context_across_two_processes_matches_one_process(tmp_path, data_cache, short_reference):
  """mesh.dcn_context=2: every sequence split between the two processes, which therefore read the same rows
  (sharding.row_share) and each place their half of them; the losses and the eval loss equal the 1-process run."""
  workdir = tmp_path / 'run'
  out = subprocess.run(local_command(workdir, *overrides(data_cache, '--config.mesh.dcn_context=2', *SHORT)),
                       cwd=ROOT, env=train_env(DEVICES), capture_output=True, text=True, timeout=900)
  text = out.stdout + out.stderr
  assert out.returncode == 0, text[-5000:]
  assert "mesh: {'data': 1, 'fsdp': 2, 'tensor': 1, 'context': 2}" in text, text[-5000:]
  assert_matches(workdir, short_reference, [1, 2, 3, 4])
  saved = workdir / 'checkpoints' / str(SHORT_STEPS)
  assert sorted(p.name for p in (saved / 'data').glob('process_*')) == ['process_0-of-2.json', 'process_1-of-2.json']


@pytest.mark.slow(reason='two real processes train, checkpoint on SIGTERM and exit; the process boundary is the point')
def test_sigterm_to_one_process_stops_every_process_after_the_same_step(tmp_path, data_cache):
  # A preemption notice that reaches one process only: both must checkpoint the same step and exit 0.
  workdir = tmp_path / 'run'
  # A checkpoint every 2 steps: the signal is sent once the first is written, after 2 steps rather than 10.
  proc = subprocess.Popen(local_command(workdir, *overrides(data_cache, '--config.train.steps=500',
                                                            '--config.checkpoint.every=2')), cwd=ROOT,
                          env=train_env(DEVICES), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    wait_for(lambda: (workdir / 'checkpoints' / '2').is_dir(), 300, 'checkpoint 2')
    process_of(psutil.Process(proc.pid), 1).send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  assert proc.returncode == 0, out[-5000:]
  [event] = [r for r in read_records(workdir, 'event') if r['event'] == 'preempted']
  assert 'a stop signal to another process received' in event['message'] and 'checkpoint saved' in event['message']
  saved = workdir / 'checkpoints' / str(event['step'])
  assert sorted(p.name for p in (saved / 'data').glob('process_*')) == ['process_0-of-2.json', 'process_1-of-2.json']



@pytest.mark.slow(reason='two real processes checkpoint to the GCS emulator on SIGTERM, then one process resumes there')
def test_two_processes_on_a_bucket_workdir_with_no_shared_directory_then_resume_on_one(data_cache, reference,
                                                                                       gcs_emulator, monkeypatch):
  # The TPU-pod case: no directory the processes share, only a bucket (the data cache is each host's own copy).
  # Preempted as a scheduler does it: SIGTERM to launch/local.sh only, which passes it on to its processes; its
  # `wait -n`, interrupted by the trap, must wait again rather than trip over `set -u`.
  workdir = f'gs://{BUCKET}/{uuid.uuid4().hex[:12]}/run'
  env = {**train_env(DEVICES), **store_env('gs', gcs=gcs_emulator)}
  for name, value in store_env('gs', gcs=gcs_emulator).items():  # this process reads the bucket too
    monkeypatch.setenv(name, value)
  train_records = lambda: [r for r in rundir.read_metrics(workdir) if r.get('kind') == 'train']
  launcher = subprocess.Popen(local_command(workdir, *overrides(data_cache)), cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    wait_for(lambda: any(r['step'] >= 10 for r in train_records()), 300, 'step 10 in metrics.jsonl on the bucket')
    launcher.send_signal(signal.SIGTERM)
    out, _ = launcher.communicate(timeout=180)
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
  assert 'unbound variable' not in out, out[-3000:]
  assert launcher.returncode == 0, out[-5000:]
  [event] = [r for r in rundir.read_metrics(workdir) if r.get('event') == 'preempted']
  assert 'checkpoint saved' in event['message'], event
  stopped = event['step']
  assert 10 <= stopped < 30 and stopped in rundir.checkpoint_steps(workdir), event
  saved = storage.join(workdir, 'checkpoints', str(stopped), 'data')
  assert [n for n in storage.listdir(saved) if n.startswith('process_')] == ['process_0-of-2.json',
                                                                            'process_1-of-2.json']
  again = subprocess.run([sys.executable, '-m', 'jaxlm.train', '--config=configs/palm_tiny.py', f'--workdir={workdir}',
                          *overrides(data_cache)], cwd=ROOT, env={**train_env(), **store_env('gs', gcs=gcs_emulator)},
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0 and f'resumed from checkpoint step {stopped}' in again.stdout, again.stderr[-3000:]
  losses, eval_loss = reference
  logged = {r['step']: r['loss'] for r in train_records()}  # steps logged before and after the stop
  assert sorted(logged) == [5, 10, 15, 20, 25, 30]
  np.testing.assert_allclose([logged[s] for s in sorted(logged)], [losses[s] for s in sorted(logged)], rtol=2e-5)
  evals = [r for r in rundir.read_metrics(workdir) if r.get('kind') == 'eval']
  np.testing.assert_allclose(evals[-1]['eval_loss'], eval_loss, rtol=2e-5)
