"""Checkpoints: exact resume after SIGKILL, preemption, resharding, loud save failures, warm start.

Training runs are real subprocesses of `python -m jaxlm.train`, killed and restarted as a user's job would be.
"""

import json
import os
import pathlib
import signal
import subprocess
import time

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import psutil
import pytest

from jaxlm import checkpoint as checkpoint_lib
from jaxlm import integrity
from jaxlm import sharding, train
from tests.conftest import ROOT, made_once
from tests.helpers import (assert_fails_with, odd_config, plain_program, random_batch, read_records, train_command,
                           train_env)

STEPS = 16  # four checkpoints (every 4): room for a kill after each of two, and 5 steps after the last kill
COMMON = (f'--config.train.steps={STEPS}', '--config.train.log_every=1', '--config.checkpoint.every=4',
          '--config.checkpoint.keep=3', '--config.stability.spike_window=10')


def _args(data_cache, *extra):
  return (*COMMON, f'--config.data.cache_dir={data_cache}', *extra)


def _run(workdir, data_cache, *extra, check=True, config='palm_tiny'):
  out = subprocess.run(train_command(workdir, *_args(data_cache, *extra), config=config), cwd=ROOT, env=train_env(),
                       capture_output=True, text=True, timeout=600)
  if check:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out


def _start(workdir, data_cache, *extra, config='palm_tiny'):
  return subprocess.Popen(train_command(workdir, *_args(data_cache, *extra), config=config), cwd=ROOT, env=train_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_step(proc, workdir, step, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if any(r['step'] >= step for r in read_records(workdir)):
      return
    if proc.poll() is not None:
      raise AssertionError(f'run ended before step {step}: {proc.stdout.read()[-3000:]}')
    time.sleep(0.05)
  raise AssertionError(f'step {step} not reached in {timeout}s')


def _final_params(workdir):
  step_dir = pathlib.Path(workdir, 'checkpoints', str(STEPS), 'state')
  state = ocp.StandardCheckpointer().restore(step_dir)
  return state['params']


def _losses(workdir):
  """step -> every loss logged for it (a resumed run logs redone steps again)."""
  losses = {}
  for r in read_records(workdir):
    losses.setdefault(r['step'], []).append(r['loss'])
  return losses


@pytest.fixture(scope='module')
def reference(tmp_path_factory, data_cache):
  """The uninterrupted run, trained once for the whole run (xdist may give this module's tests to several workers)."""
  with made_once(tmp_path_factory, 'checkpoint_reference') as (workdir, done):
    if not done:
      _run(workdir, data_cache)
  return workdir


@pytest.mark.slow(reason='a trainer killed with SIGKILL at several steps, each resumed: one process per kill')
def test_sigkill_at_several_steps_resumes_bit_for_bit(reference, tmp_path, data_cache):
  for kill_after in (6, 11):  # two kills, at unrelated points of the checkpoint interval
    proc = _start(tmp_path, data_cache)
    _wait_for_step(proc, tmp_path, kill_after)
    trainer = _trainer_of(proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    trainer.wait(timeout=10)  # the trainer a watcher ran dies with it: nothing trains on behind a kill -9
  out = _run(tmp_path, data_cache)
  assert 'resumed from checkpoint step' in out.stdout
  expected = {step: losses[0] for step, losses in _losses(reference).items()}
  got = _losses(tmp_path)
  assert sorted(got) == list(range(1, STEPS + 1))
  for step, losses in got.items():  # every logged loss, redone steps included, is the uninterrupted one
    assert losses == [expected[step]] * len(losses), step
  a, b = _final_params(reference), _final_params(tmp_path)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


# A mixture of experts with every piece of routing state on: the balancing biases move each step.
MOE = ('--config.model.moe_bias_rate=0.01', '--config.model.moe_aux_loss=0.01', '--config.model.moe_router_z_loss=0.001')


@pytest.mark.slow(reason='the MoE trainer, killed with SIGKILL and resumed, against an uninterrupted run: three processes')
def test_sigkill_of_a_moe_run_resumes_bit_for_bit_router_biases_included(tmp_path, data_cache):
  reference = tmp_path / 'reference'
  _run(reference, data_cache, *MOE, config='moe_tiny')
  killed = tmp_path / 'killed'
  proc = _start(killed, data_cache, *MOE, config='moe_tiny')
  _wait_for_step(proc, killed, 10)  # past the checkpoint at step 8: steps 9 and 10 are redone
  trainer = _trainer_of(proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  trainer.wait(timeout=10)
  out = _run(killed, data_cache, *MOE, config='moe_tiny')
  assert 'resumed from checkpoint step' in out.stdout
  want = {r['step']: (r['loss'], r['moe/max_load']) for r in read_records(reference)}
  got = [(r['step'], (r['loss'], r['moe/max_load'])) for r in read_records(killed)]
  assert sorted({step for step, _ in got}) == list(range(1, STEPS + 1))
  for step, values in got:  # every logged loss and max load, redone steps included, is the uninterrupted one
    assert values == want[step], step
  a, b = _final_params(reference), _final_params(killed)
  biases = [x for path, x in jax.tree_util.tree_flatten_with_path(b)[0] if jax.tree_util.keystr(path).endswith("['bias']")]
  assert biases and np.abs(biases[0]).max() > 0  # the balancing moved the router biases
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _trainer_of(proc) -> psutil.Process:
  """The training process that `python -m jaxlm.train` (its watcher, cli.run_watched) runs as its child."""
  children = psutil.Process(proc.pid).children()
  assert len(children) == 1 and children[0].environ().get('JAXLM_WATCHED') == '1', children
  return children[0]


def test_an_abort_inside_jax_ends_with_one_jaxlm_line_and_the_restart_code(tmp_path, data_cache):
  # JAX/XLA end a process with abort() from a C++ thread (a rendezvous whose peers never arrive, a lost peer):
  # SIGABRT, which no Python code in that process outlives. Its watcher prints the last line.
  proc = _start(tmp_path, data_cache)
  _wait_for_step(proc, tmp_path, 5)
  deadline = time.time() + 120
  while not (tmp_path / 'checkpoints' / '4').is_dir() and time.time() < deadline:  # finalized, not '4.orbax-...-tmp'
    time.sleep(0.05)
  _trainer_of(proc).send_signal(signal.SIGABRT)
  output = proc.communicate(timeout=120)[0]
  assert proc.returncode == 75, output[-3000:]  # errors.HUNG_EXIT: a restart from the checkpoint may work
  last = output.strip().splitlines()[-1]
  assert last.startswith('jaxlm: JAX/XLA aborted the run (SIGABRT') and '; restart from the newest' in last, last
  assert 'Traceback (most recent call last)' not in output
  assert 'resumed from checkpoint step' in _run(tmp_path, data_cache).stdout  # and the same command resumes


def test_sigterm_checkpoints_and_exits_zero(reference, tmp_path, data_cache):
  proc = _start(tmp_path, data_cache)
  _wait_for_step(proc, tmp_path, 5)
  proc.send_signal(signal.SIGTERM)
  output = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, output[-3000:]
  event = [r for r in read_records(tmp_path, 'event') if r['event'] == 'preempted'][-1]
  stopped = event['step']
  assert 'checkpoint saved' in event['message']
  assert (tmp_path / 'checkpoints' / str(stopped)).is_dir()
  _run(tmp_path, data_cache)
  records = read_records(tmp_path)
  first_after = [r['step'] for r in records][[r['step'] for r in records].index(stopped) + 1]
  assert first_after == stopped + 1  # no step lost, none redone
  assert {s: l[-1] for s, l in _losses(tmp_path).items()} == {s: l[0] for s, l in _losses(reference).items()}


def test_corrupt_newest_checkpoint_falls_back_with_warning(reference, tmp_path, data_cache):
  import shutil
  shutil.copytree(reference / 'checkpoints', tmp_path / 'checkpoints')
  newest = tmp_path / 'checkpoints' / str(STEPS)
  for f in (newest / 'state').rglob('*'):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(b'\0' * 7)  # garbage where the arrays were
  out = _run(tmp_path, data_cache, f'--config.train.steps={STEPS + 4}', '--config.optim.warmup_steps=5')
  events = read_records(tmp_path, 'event')
  unreadable = [e for e in events if e['event'] == 'checkpoint_unreadable']
  assert unreadable and unreadable[0]['step'] == STEPS, out.stdout[-2000:]
  resumed = [e for e in events if e['event'] == 'resumed']
  assert resumed[0]['step'] == STEPS - 4
  assert newest.exists()  # never deleted


def test_unwritable_directory_stops_loudly(tmp_path, data_cache):
  (tmp_path / 'checkpoints').write_text('a file where the checkpoint directory should be')
  out = _run(tmp_path, data_cache, '--config.checkpoint.max_failures=2', check=False)
  assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
  assert 'Traceback' not in out.stderr
  assert '2 checkpoint saves failed in a row' in out.stderr and 'Fix:' in out.stderr
  failed = [e for e in read_records(tmp_path, 'event') if e['event'] == 'checkpoint_failed']
  assert len(failed) == 2 and failed[1]['step'] == failed[0]['step'] + 1  # retried on the next step
  assert all('free space' in e['message'] and str(tmp_path) in e['message'] for e in failed)


def _small_disk(tmp_path, size: str):
  """A real tmpfs of `size` mounted under tmp_path (skips where mounting is refused); unmounted afterwards."""
  mount = tmp_path / 'disk'
  mount.mkdir()
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(mount)],
                    capture_output=True).returncode != 0:
    pytest.skip('cannot mount a tmpfs here (needs root and mount rights); the unwritable-directory test '
                'still covers failed saves')
  yield mount
  subprocess.run(['umount', '-l', str(mount)], check=False)


@pytest.fixture
def tiny_disk(tmp_path):
  yield from _small_disk(tmp_path, '2m')


def test_full_disk_is_detected_never_newest_and_resumable(tmp_path, tiny_disk, data_cache):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  os.symlink(tiny_disk, workdir / 'checkpoints')  # only checkpoints live on the 2 MiB disk
  out = _run(workdir, data_cache, '--config.checkpoint.max_failures=3', '--config.checkpoint.keep=5',
             check=False)
  assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
  events = read_records(workdir, 'event')
  failed = [e for e in events if e['event'] == 'checkpoint_failed']
  assert len(failed) == 3 and all('MiB' in e['message'] for e in failed)
  assert any(e['event'] == 'checkpoint_low_space' for e in events)  # warned before the first failure
  good = ocp.CheckpointManager(str(tiny_disk)).all_steps()
  assert good and max(good) < failed[0]['step']  # the failed save never became the newest
  assert 'newest good checkpoint is step' in out.stderr
  assert not [p for p in tiny_disk.iterdir() if 'tmp' in p.name]  # partial saves cleaned up
  # One short last line: where, why, how much room, what to do; TensorStore's own message is in the events only.
  last = out.stderr.strip().splitlines()[-1]
  assert len(last) <= 300 and last.startswith('jaxlm: 3 checkpoint saves failed in a row (saving step '), last
  assert f'{workdir}/checkpoints: No space left on device; ' in last and ' MiB free)' in last and 'Fix:' in last
  # Each event keeps the writer's own error: TensorStore's (with its os_error_code), or the OSError's errno when a
  # Python-side write of the save hit the full disk first (which one does depends on timing).
  assert 'os_error_code' not in last and '[Errno' not in last
  assert all('os_error_code' in e['message'] or '[Errno 28]' in e['message'] for e in failed), failed


def _remount(mount, size: str) -> None:
  """The user frees space: the same tmpfs, its checkpoints kept, grown to `size`."""
  subprocess.run(['mount', '-o', f'remount,size={size}', str(mount)], check=True)


def _assert_final_params_equal(workdir, reference) -> None:
  jax.tree.map(np.testing.assert_array_equal, _final_params(workdir), _final_params(reference))


@pytest.mark.slow(reason='a run whose final save hits a full disk, then the same command after space is freed')
def test_a_failed_final_save_exits_3_and_the_rerun_ends_as_the_uninterrupted_run(reference, tmp_path, tiny_disk,
                                                                                data_cache):
  """One failed save, fewer than checkpoint.max_failures, but the last one: the run's newest weights exist nowhere,
  so it ends with exit 3 and one line (which step, why, what a rerun resumes from), never 0 (issue #57)."""
  workdir = tmp_path / 'run'
  workdir.mkdir()
  os.symlink(tiny_disk, workdir / 'checkpoints')  # 2 MiB: one palm_tiny checkpoint fits, a second does not
  out = _run(workdir, data_cache, f'--config.checkpoint.every={STEPS // 2}', check=False)
  assert_fails_with(out, 3, f'checkpoint of step {STEPS} was not written', 'No space left on device',
                    f'a rerun resumes from step {STEPS // 2}, the newest good checkpoint', 'fix: ')
  failed = [e['step'] for e in read_records(workdir, 'event') if e['event'] == 'checkpoint_failed']
  assert failed == [STEPS], failed  # one failure: under the old rule (3 in a row) the run ended with exit 0
  assert ocp.CheckpointManager(str(tiny_disk)).all_steps() == [STEPS // 2]
  _remount(tiny_disk, '64m')
  again = _run(workdir, data_cache, f'--config.checkpoint.every={STEPS // 2}')
  assert f'resumed from checkpoint step {STEPS // 2}' in again.stdout, again.stdout[-2000:]
  _assert_final_params_equal(workdir, reference)


@pytest.mark.slow(reason='a preempted run whose save hits a full disk, then the same command after space is freed')
def test_a_failed_preemption_save_exits_3_and_the_rerun_ends_as_the_uninterrupted_run(reference, tmp_path, tiny_disk,
                                                                                     data_cache):
  """SIGTERM's save fails: exit 3 (restartable), not 0 (done, or preempted and saved), naming the step not written
  and the checkpoint a rerun resumes from; the rerun ends with the uninterrupted run's parameters."""
  workdir = tmp_path / 'run'
  workdir.mkdir()
  os.symlink(tiny_disk, workdir / 'checkpoints')
  # Step 4's save fits; every later one fails (and is retried each step) until the stop signal's save fails too.
  proc = _start(workdir, data_cache, '--config.checkpoint.max_failures=1000')
  _wait_for_step(proc, workdir, 5)
  proc.send_signal(signal.SIGTERM)
  output = proc.communicate(timeout=300)[0]
  assert proc.returncode == 3, output[-3000:]
  [event] = [e for e in read_records(workdir, 'event') if e['event'] == 'preempted']
  assert 'checkpoint NOT saved' in event['message'], event
  last = output.strip().splitlines()[-1]
  assert last.startswith(f'jaxlm: checkpoint of step {event["step"]} was not written') and 'Traceback' not in output
  assert 'a rerun resumes from step 4, the newest good checkpoint' in last, last
  _remount(tiny_disk, '64m')
  again = _run(workdir, data_cache)
  assert 'resumed from checkpoint step 4' in again.stdout, again.stdout[-2000:]
  _assert_final_params_equal(workdir, reference)


@pytest.mark.e2e  # four compiled programs, a save and three restores
def test_reshard_checkpoint_onto_other_meshes(tmp_path):
  cfg = odd_config()
  batch = random_batch(8, 24, cfg.model.vocab_size, docs=2)
  programs = {}  # one program (and compiled step) per mesh: the restore onto the saving mesh reuses the save's

  def steps(mesh_shape, devices, state=None, n=2, save=None):
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh_shape
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:devices])
    with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
      if (mesh_shape, devices) not in programs:
        programs[mesh_shape, devices] = plain_program(cfg, mesh, steps=10)
      program = programs[mesh_shape, devices]
      ckpt = checkpoint_lib.Checkpointer(str(tmp_path / 'ckpt'), load_config_checkpoint(), lambda *a, **k: None)
      if state == 'restore':
        state, _ = ckpt.restore(program.abstract_state, program.state_shardings, None)
        assert state.params['embedding'].sharding.mesh.shape == mesh.shape
      else:
        state = program.init()
      losses = []
      for _ in range(n):
        state, m = program.train_step(state, train.global_batch(batch, program.batch_sharding))
        losses.append(float(m['loss']))
      if save:
        ckpt.save(int(state.step), state, None, {})
      ckpt.close()
      return losses

  steps((1, 8, 1), 8, save=True)
  continued = steps((1, 8, 1), 8, state='restore')
  np.testing.assert_allclose(steps((2, 2, 2), 8, state='restore'), continued, rtol=1e-5)
  np.testing.assert_allclose(steps((1, 2, 2), 4, state='restore'), continued, rtol=1e-5)  # 8 devices -> 4


def load_config_checkpoint():
  from tests.helpers import load_config
  c = load_config('palm_tiny').checkpoint
  c.async_save = False
  return c


@pytest.mark.slow(reason='a warm-started trainer run and a refused one, each its own process')
def test_warm_start_loads_params_only_and_names_mismatches(reference, tmp_path, data_cache):
  out = _run(tmp_path / 'ft', data_cache, f'--config.checkpoint.init_from={reference}/checkpoints',
             '--config.train.steps=2', '--config.optim.warmup_steps=1')
  assert 'warm start' in out.stderr + out.stdout
  first = read_records(tmp_path / 'ft')[0]
  assert first['step'] == 1  # step 0, fresh optimizer
  assert first['loss'] < read_records(reference)[0]['loss'] - 1.0  # starts trained, not from scratch
  # The loaded parameters are exactly the source run's newest ones, placed on this run's shardings.
  cfg = odd_config()  # palm_tiny's shape below
  cfg.model.update(vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=0, mlp_dim=128)
  mesh = sharding.make_mesh(cfg.mesh)
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    program = plain_program(cfg, mesh, steps=10)
    loaded = checkpoint_lib.load_params(str(reference / 'checkpoints'), program.abstract_state.params,
                                        program.state_shardings.params)
  for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(_final_params(reference))):
    np.testing.assert_array_equal(x, y)
  assert loaded['embedding'].sharding == program.state_shardings.params['embedding']
  bad = _run(tmp_path / 'bad', data_cache, f'--config.checkpoint.init_from={reference}/checkpoints',
             '--config.model.mlp_dim=96', check=False)
  # The store is fine, the config does not fit it: exit 2 (bad config), like every refusal of a config.
  assert bad.returncode == 2 and 'Traceback' not in bad.stderr
  assert "parameter ['layers']['mlp']['down'] has shape" in bad.stderr


def test_environment_record_saved(reference):
  env = json.loads((reference / 'checkpoints' / str(STEPS) / 'env' / 'metadata').read_text()) if (
      reference / 'checkpoints' / str(STEPS) / 'env' / 'metadata').exists() else None
  if env is None:  # Orbax's JsonSave file name
    files = list((reference / 'checkpoints' / str(STEPS) / 'env').iterdir())
    env = json.loads(files[0].read_text())
  assert env['config']['model']['d_model'] == 64 and env['device_count'] == 8
  assert env['versions']['jax'] == jax.__version__ and env['mesh'] == {'data': 1, 'fsdp': 8, 'tensor': 1, 'context': 1}


def _flip_bytes(step_dir: pathlib.Path, count: int = 64) -> pathlib.Path:
  """Bit rot: `count` bytes in the middle of the largest array file, flipped in place (same size)."""
  target = max((f for f in (step_dir / 'state').rglob('*') if f.is_file()), key=lambda f: f.stat().st_size)
  data = bytearray(target.read_bytes())
  middle = len(data) // 2
  for i in range(middle, middle + count):
    data[i] ^= 0xFF
  target.write_bytes(bytes(data))
  return target


def test_flipped_bytes_fail_the_checksums_and_the_run_falls_back(reference, tmp_path, data_cache):
  import shutil
  shutil.copytree(reference / 'checkpoints', tmp_path / 'checkpoints')
  newest = tmp_path / 'checkpoints' / str(STEPS)
  assert json.loads((newest / integrity.CHECKSUMS).read_text())['sha256']  # written with every save
  assert integrity.verify_checksums(str(newest)) is None
  _flip_bytes(newest)
  assert 'differ from the checksums' in integrity.verify_checksums(str(newest))
  out = _run(tmp_path, data_cache, f'--config.train.steps={STEPS + 4}', '--config.optim.warmup_steps=5')
  events = read_records(tmp_path, 'event')
  unreadable = [e for e in events if e['event'] == 'checkpoint_unreadable']
  assert [e['step'] for e in unreadable] == [STEPS], out.stdout[-2000:]
  assert 'differ from the checksums' in unreadable[0]['message']
  assert [e['step'] for e in events if e['event'] == 'resumed'] == [STEPS - 4]
  assert not [e for e in events if e['event'] == 'rollback']
  aside = list((tmp_path / 'checkpoints.unreadable').iterdir())  # kept for inspection, out of the listing
  assert [p.name.split('-')[0] for p in aside] == [str(STEPS)]
  assert (tmp_path / 'checkpoints' / str(STEPS + 4)).is_dir()  # the step numbers go on being saved


def test_a_poisoned_checkpoint_without_checksums_is_rolled_back_past(reference, tmp_path, data_cache):
  """A checkpoint whose parameters are bad yet readable (written so, or older than checksums): the rollback
  must not land on it again."""
  import shutil
  shutil.copytree(reference / 'checkpoints', tmp_path / 'checkpoints')
  newest = tmp_path / 'checkpoints' / str(STEPS)
  state = ocp.StandardCheckpointer().restore(newest / 'state')
  state['params'] = jax.tree.map(lambda x: np.full_like(x, np.nan), state['params'])
  shutil.rmtree(newest / 'state')
  with ocp.StandardCheckpointer() as c:
    c.save(newest / 'state', state)
  (newest / integrity.CHECKSUMS).unlink()
  out = _run(tmp_path, data_cache, f'--config.train.steps={STEPS + 8}', '--config.optim.warmup_steps=5',
             '--config.stability.nonfinite_steps=2', '--config.checkpoint.keep=6', check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rollbacks = [e for e in read_records(tmp_path, 'event') if e['event'] == 'rollback']
  assert len(rollbacks) == 1 and rollbacks[0]['to_step'] == STEPS - 4, [e['message'] for e in rollbacks]


@pytest.fixture
def tiny_workdir(tmp_path):
  yield from _small_disk(tmp_path, '96k')


def test_a_full_disk_stops_every_writer_the_same_way(tiny_workdir, data_cache):
  """The whole workdir (metrics, TensorBoard, checkpoints) on a 96 KiB disk: exit 3, no traceback, one line."""
  out = _run(tiny_workdir / 'run', data_cache, '--config.checkpoint.every=2', '--config.checkpoint.keep=6',
             check=False)
  text = out.stdout + out.stderr
  assert out.returncode == 3, text[-3000:]
  assert 'Traceback' not in text and 'Event loop is closed' not in text
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith('jaxlm: ') and str(tiny_workdir) in last and 'free' in last and 'Fix:' in last
  assert len(last) <= 300 and 'No space left on device' in last, last  # the cause in the OS's words, short
  earlier = out.stdout + '\n'.join(out.stderr.strip().splitlines()[:-1])
  assert 'No space left on device' in earlier  # the library's own message went to the log before it


@pytest.fixture
def slow_write(monkeypatch):
  """Orbax's background writer holds each save for `delay[0]` seconds after the array data is written."""
  delay = [1.0]
  handler = ocp.BasePyTreeCheckpointHandler
  original = handler._write_metadata_after_commits  # pylint: disable=protected-access

  async def slowed(self, *args, **kwargs):
    import asyncio
    await asyncio.sleep(delay[0])
    return await original(self, *args, **kwargs)

  monkeypatch.setattr(handler, '_write_metadata_after_commits', slowed)
  return delay


def _small_state():
  mesh = sharding.make_mesh(load_config_checkpoint_cfg().mesh)
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('fsdp'))
  return {'w': jax.device_put(np.arange(8 * 37, dtype=np.float32).reshape(8, 37), spec),
          'step': jax.device_put(np.int32(3), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))}


def load_config_checkpoint_cfg():
  from tests.helpers import load_config
  return load_config('palm_tiny')


def test_an_async_save_blocks_only_for_the_copy(tmp_path, slow_write):
  """save() returns while the write is still in flight; the loop then donates and overwrites the state, and the
  checkpoint still holds the values it was asked to save: the copy was taken before save() returned."""
  events = []
  ckpt_cfg = load_config_checkpoint_cfg().checkpoint
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / 'ckpt'), ckpt_cfg, lambda *a, **k: events.append(a))
  state = _small_state()
  saved = jax.tree.map(np.asarray, state)
  ckpt.save(1, state, None, {})
  assert ckpt.manager.is_saving_in_progress() and not (tmp_path / 'ckpt' / '1').exists()  # still being written
  state = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)(state)  # the next "step"
  jax.block_until_ready(state)
  assert ckpt.manager.is_saving_in_progress()  # the loop went on while the write was in flight
  ckpt.wait()
  assert ckpt.last_good == 1 and not events
  timing = ckpt.timings[0]
  assert timing['step'] == 1 and timing['waited_s'] == 0.0 and 'copy_s' in timing
  assert timing['blocked_s'] < slow_write[0] <= timing['write_s']  # the slowed write was not waited for
  ckpt.close()
  restored = ocp.StandardCheckpointer().restore(tmp_path / 'ckpt' / '1' / 'state')
  for key in saved:
    np.testing.assert_array_equal(restored[key], saved[key])
  assert (tmp_path / 'ckpt' / '1' / integrity.CHECKSUMS).exists()


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_a_save_due_while_the_previous_is_written_waits_and_says_so_once(tmp_path, slow_write):
  events = []
  ckpt_cfg = load_config_checkpoint_cfg().checkpoint
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / 'ckpt'), ckpt_cfg,
                                     lambda step, name, message, **k: events.append((step, name, message, k)))
  state = _small_state()
  for step in (10, 20, 30):
    ckpt.save(step, state, None, {})  # each due at once, while the previous one is still being written
  ckpt.close()
  assert [e[1] for e in events] == ['checkpoint_stall']  # once, not at every overlapping save
  step, _, message, fields = events[0]
  assert step == 20 and 'checkpoint 10 was still being written' in message
  assert f'waited {fields["waited_s"]:.1f}s' in message and f'takes {fields["write_s"]:.1f}s to write' in message
  assert fields['waited_s'] > 0.5 * slow_write[0] and 'set checkpoint.every >= ' in message
  every = int(message.split('checkpoint.every >= ')[1].split()[0])
  assert every > 10  # longer than the cadence that overlapped
  assert [t['step'] for t in ckpt.timings] == [10, 20, 30] and ckpt.timings[1]['waited_s'] == fields['waited_s']
  assert all('write_s' in t for t in ckpt.timings)  # every save confirmed, none overwritten unchecked
  assert ckpt.manager.all_steps() == [10, 20, 30] and ckpt.last_good == 30
  stats = ckpt.stats()  # what the run's last system record carries
  assert stats['checkpoint_saves'] == 3 and stats['checkpoint_waited_max_s'] == max(t['waited_s'] for t in ckpt.timings)
  assert stats['checkpoint_blocked_median_s'] == sorted(t['blocked_s'] for t in ckpt.timings)[1]
  assert all((tmp_path / 'ckpt' / str(s) / integrity.CHECKSUMS).exists() for s in (10, 20, 30))


def test_stall_message_cadence():
  text = checkpoint_lib.stall_message(200, 100, waited_s=6.0, interval_s=10.0)  # a 16 s write every 10 s
  assert 'waited 6.0s' in text and 'takes 16.0s' in text and 'every 10.0s (100 steps)' in text
  assert 'checkpoint.every >= 200' in text  # 16 s × 1.25 = 20 s of steps at 0.1 s each


@pytest.mark.slow(reason='a trainer on streamed parquet/jsonl, killed with SIGKILL and resumed, against an uninterrupted run')
def test_sigkill_of_a_streaming_run_resumes_bit_for_bit(tmp_path, data_cache):
  # data.source=stream: the data position is every lane's cursor; the resumed run must read the same rows.
  from jaxlm.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  from tests.data import scale_corpus  # pylint: disable=import-outside-toplevel
  docs = scale_corpus.write(tmp_path / 'corpus')['docs']
  tokenizer_lib.train(iter(docs), str(tmp_path / 'tok.model'), vocab_size=320)
  stream = ('--config.data.source=stream', f'--config.data.paths={tmp_path / "corpus"}',
            f'--config.data.tokenizer={tmp_path / "tok.model"}',
            f'--config.data.eval_paths={tmp_path / "corpus" / "j0.jsonl"}', '--config.data.seq_len=32',
            '--config.model.vocab_size=320')
  _run(tmp_path / 'reference', data_cache, *stream)
  proc = _start(tmp_path / 'killed', data_cache, *stream)
  _wait_for_step(proc, tmp_path / 'killed', 10)  # past the checkpoint at step 8: steps 9 and 10 are redone
  trainer = _trainer_of(proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  trainer.wait(timeout=10)
  out = _run(tmp_path / 'killed', data_cache, *stream)
  assert 'resumed from checkpoint step' in out.stdout
  want = {step: losses[0] for step, losses in _losses(tmp_path / 'reference').items()}
  got = _losses(tmp_path / 'killed')
  assert sorted(got) == list(range(1, STEPS + 1))
  for step, losses in got.items():  # every logged loss, redone steps included, is the uninterrupted one
    assert losses == [want[step]] * len(losses), step
  jax.tree.map(np.testing.assert_array_equal, _final_params(tmp_path / 'reference'),
               _final_params(tmp_path / 'killed'))
