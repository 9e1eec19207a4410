"""Elastic resume (#19): checkpointed on N processes, continued on M, with the losses of an uninterrupted run.

Each case trains palm_tiny for 6 steps in three segments on three topologies — 2 processes × 4 devices (steps
1-2), 1 × 8 (3-4), 4 × 2 with another mesh (5-6) — and compares every step's loss with one uninterrupted 1 × 8
run. The schedule is constant after warmup so that train.steps (the segment's end) does not change the learning
rate. Two steps a segment: each resume is checked by the loss of the step right after it and of the one after
that; the cost of a case is its processes' start-ups and compiles, not its steps.
"""

import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxlm.data import pipeline as data_lib
from tests.conftest import ROOT
from tests.helpers import load_config, read_records, train_env

SEGMENTS = [(2, 4, 2, ()), (1, 8, 4, ()), (4, 2, 6, ('--config.mesh.data=2',))]  # processes, devices, steps


def overrides(data_cache, *extra) -> list[str]:
  return [f'--config.data.cache_dir={data_cache}', '--config.stability.policy=off', '--config.log.tensorboard=False',
          '--config.dist.peer_timeout_s=15', '--config.optim.schedule=constant', '--config.optim.warmup_steps=1',
          '--config.train.log_every=1', '--config.checkpoint.every=2', *extra]


def train(workdir, processes: int, devices: int, *args) -> subprocess.CompletedProcess:
  command = ['launch/local.sh', '-n', str(processes), '-d', str(devices), '--', sys.executable, '-m', 'jaxlm.train',
             '--config=configs/palm_tiny.py', f'--workdir={workdir}', *args]
  return subprocess.run(command, cwd=ROOT, env=train_env(devices), capture_output=True, text=True, timeout=600)


def losses(workdir) -> dict[int, float]:
  return {r['step']: r['loss'] for r in read_records(workdir)}


def mixture(data_cache, tmp_path) -> tuple[str, ...]:
  """Two prepared datasets (the stdlib corpus and a copy, shuffled apart by their seeds), weighted 2:1."""
  cfg = load_config('palm_tiny').data
  cfg.cache_dir = str(data_cache)
  (path,) = data_lib.dataset_dirs(cfg, 512)
  copy = shutil.copytree(path, tmp_path / 'copy')
  return '--config.data.source=prepared', f'--config.data.paths={path},{copy}', '--config.data.weights=2,1'


@pytest.mark.e2e
@pytest.mark.slow(reason='five runs of up to four processes each, resumed across topologies')
@pytest.mark.parametrize('case', ['plain', 'ramp_mixture'])
def test_resume_on_other_topologies_matches_an_uninterrupted_run(tmp_path, data_cache, case):
  # A batch ramp and a weighted mixture of two datasets ride in one case: each is a position the data pipeline
  # must carry across topologies, and every case costs five runs of up to four processes.
  extra = () if case == 'plain' else (
      '--config.train.batch_size=16', '--config.train.batch_ramp=8:1536', *mixture(data_cache, tmp_path))
  ref = tmp_path / 'reference'
  done = train(ref, 1, 8, *overrides(data_cache, '--config.train.steps=6', *extra))
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  want = losses(ref)
  assert sorted(want) == [1, 2, 3, 4, 5, 6]
  run = tmp_path / 'run'
  for processes, devices, steps, more in SEGMENTS:
    done = train(run, processes, devices, *overrides(data_cache, f'--config.train.steps={steps}', *extra, *more))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  got = losses(run)
  assert sorted(got) == sorted(want)
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-5)
  events = [r for r in read_records(run, 'event') if r['event'] == 'data_resumed']
  assert [e['step'] for e in events] == [2, 4]
  assert 'processes 2 -> 1, devices_per_process 4 -> 8' in events[0]['message']
  assert "mesh {'data': 1, 'fsdp': 8, 'tensor': 1, 'context': 1} -> {'data': 2, 'fsdp': 4, 'tensor': 1, 'context': 1}" in events[1]['message']
  rows = 3 * 8 + 1 * 16 if case == 'ramp_mixture' else 4 * 8  # 4 steps of 8 rows (ramp: 3 of 8 rows, up to 1536 tokens)
  assert f'data position carried over: global row {rows}' in events[1]['message']
  if case == 'plain':
    # A change that cannot continue exactly is refused in one line (exit 2), naming the field and the fix.
    done = train(run, 1, 8, *overrides(data_cache, '--config.train.steps=8', '--config.data.seq_len=32'))
    assert done.returncode == 2
    [last] = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith('jaxlm:')]
    assert 'data.seq_len was 64 when the checkpoint was written, now 32' in last, last
    assert '--config.checkpoint.allow_data_change=True' in last
