"""Tests of jaxlm.tools.sweep: grid expansion, names, random draws, validation, launch commands, and real sweeps
through the entry point (interrupted and rerun: a finished trial is not rerun, a stopped one resumes; a crashed
trial is recorded and the sweep goes on)."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxlm.tools import sweep
from tests.conftest import ROOT
from tests.helpers import load_config, read_records, train_env

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'
GRID = ['optim.lr=1e-3,3e-4', 'model.d_model=128,256']


def sweep_command(*args, devices: int = 8) -> list[str]:
  """`python -m jaxlm.tools.sweep` on palm_tiny, validated for `devices` fake CPU devices."""
  return [sys.executable, '-m', 'jaxlm.tools.sweep', '--config=configs/palm_tiny.py', f'--num_devices={devices}', *args]


def run_sweep(*args, devices: int = 8) -> subprocess.CompletedProcess:
  return subprocess.run(sweep_command(*args, devices=devices), cwd=ROOT, env=train_env(), capture_output=True,
                        text=True, timeout=600)


def test_grid_is_the_cartesian_product_in_flag_order():
  cfg = load_config()
  trials = sweep.expand(cfg, GRID, ['train.steps=7'])
  assert [t.overrides for t in trials] == [
      {'optim.lr': 1e-3, 'model.d_model': 128}, {'optim.lr': 1e-3, 'model.d_model': 256},
      {'optim.lr': 3e-4, 'model.d_model': 128}, {'optim.lr': 3e-4, 'model.d_model': 256}]
  assert [t.name for t in trials] == ['lr=0.001,d_model=128', 'lr=0.001,d_model=256', 'lr=0.0003,d_model=128',
                                      'lr=0.0003,d_model=256']
  last = trials[-1].config
  assert (last.optim.lr, last.model.d_model, last.train.steps) == (3e-4, 256, 7)
  assert isinstance(last.model.d_model, int) and isinstance(last.optim.lr, float)
  assert (cfg.train.steps, cfg.model.d_model) == (30, 64)  # the caller's config is untouched


def test_values_take_the_field_type():
  trials = sweep.expand(load_config(), ['model.parallel_block=true,False', 'model.z_loss=0,1e-4'], [])
  assert [t.overrides for t in trials][:2] == [{'model.parallel_block': True, 'model.z_loss': 0.0},
                                               {'model.parallel_block': True, 'model.z_loss': 1e-4}]
  assert trials[2].name == 'parallel_block=False,z_loss=0.0'
  # What train's `--config.model.z_loss=...` reads back is the exact value.
  assert sweep.format_value(1e-4) == '0.0001' and sweep.format_value(1 / 3) == repr(1 / 3)


def test_names_use_the_shortest_unique_suffix():
  names = sweep.trial_names(['a.x', 'b.x', 'c.y'], [{'a.x': 1, 'b.x': 2, 'c.y': 'd/e'}])
  assert names == ['a.x=1,b.x=2,y=d_e']  # 'x' alone would be ambiguous; '/' would make a subdirectory


def test_random_draws_are_distinct_and_fixed_by_the_seed():
  cfg = load_config()
  grid = ['optim.lr=1e-3,2e-3,3e-3,4e-3', 'model.num_kv_heads=1,2,4']  # 12 points
  draw = lambda seed, n=5: [t.name for t in sweep.expand(cfg, grid, [], n_random=n, seed=seed)]
  assert draw(1) == draw(1)
  assert len(set(draw(1))) == 5 and set(draw(1)) <= set(draw(0, 0))
  assert draw(1) != draw(2)
  indices = [t.index for t in sweep.expand(cfg, grid, [], n_random=5, seed=1)]
  assert indices == sorted(indices)  # run in grid order
  assert draw(3, 50) == draw(0, 0)  # more than the grid: all of it


@pytest.mark.parametrize('flag, text, message', [
    ('grid', 'model.d_model=128,abc', "model.d_model=abc: model.d_model is an integer field and 'abc' is not one"),
    ('grid', 'model.dmodel=128', 'model.dmodel: there is no such config field'),
    ('grid', 'model=1', 'model: a ConfigDict field cannot be swept'),
    ('grid', 'optim.lr', 'write it as field=value'),
    ('grid', 'optim.lr=1e-3,1e-3', 'a value is repeated'),
    ('set', 'optim.lr=x', "optim.lr=x: optim.lr is a float field and 'x' is not one"),
])
def test_bad_overrides_name_the_field(flag, text, message):
  grid, fixed = ([text], []) if flag == 'grid' else ([], [text])
  with pytest.raises(sweep.SweepError, match=message.replace('(', r'\(').replace(')', r'\)')):
    sweep.expand(load_config(), grid, fixed)


def test_a_field_given_twice_is_an_error():
  with pytest.raises(sweep.SweepError, match='optim.lr is given more than once'):
    sweep.expand(load_config(), ['optim.lr=1e-3,2e-3'], ['optim.lr=1e-3'])


def test_invalid_trial_fails_before_anything_runs(tmp_path):
  # d_model=60 cannot be split over fsdp=8; 64 can. The sweep stops before running either.
  result = run_sweep('--grid', 'model.d_model=64,60', f'--workdir={tmp_path / "s"}')
  assert result.returncode == 2, result.stderr
  assert 'trial d_model=60 (model.d_model=60) on 8 devices: invalid config' in result.stderr
  assert 'model.d_model=60 is not divisible by mesh.fsdp=8' in result.stderr
  assert 'd_model=64 ' not in result.stderr
  assert not (tmp_path / 's').exists()


def test_print_commands(tmp_path):
  result = run_sweep('--grid', 'model.parallel_block=True,False', '--grid', 'optim.lr=1e-3',
                     '--set', 'train.steps=10', f'--workdir={tmp_path}', '--print_commands')
  assert result.returncode == 0, result.stderr
  prefix = 'python -m jaxlm.train --config=configs/palm_tiny.py'
  assert result.stdout.splitlines() == [
      f'{prefix} --workdir={tmp_path}/parallel_block=True,lr=0.001 --config.train.steps=10 '
      f'--config.model.parallel_block=True --config.optim.lr=0.001',
      f'{prefix} --workdir={tmp_path}/parallel_block=False,lr=0.001 --config.train.steps=10 '
      f'--config.model.parallel_block=False --config.optim.lr=0.001']
  assert os.listdir(tmp_path) == []  # nothing ran


def table_rows(stdout: str) -> dict:
  """Table lines of the sweep's stdout keyed by trial number (the first column)."""
  lines = stdout[stdout.index('trial  overrides'):].splitlines()[2:]
  return {line.split()[0]: line for line in lines if line.split() and line.split()[0].isdigit()}


@pytest.mark.slow(reason='a sweep of several trainer subprocesses, interrupted and resumed')
def test_sweep_resumes_and_reports(tmp_path, data_cache):
  sweep_dir = tmp_path / 'sweep'
  steps = 60  # the SIGINT comes at the first record (step 5): room for it to land well before the end
  args = ['--grid', 'model.parallel_block=True,False', '--set', f'train.steps={steps}', '--set',
          f'data.cache_dir={data_cache}', '--set', 'log.tensorboard=False', f'--workdir={sweep_dir}']
  # An earlier sweep finished the first trial: its metrics end with the eval at the last step.
  done = sweep_dir / 'parallel_block=True'
  done.mkdir(parents=True)
  records = [{'kind': 'train', 'step': steps, 'time': 0, 'loss': 3.25, 'lr': 1e-3, 'grad_norm': 1.0,
              'tokens_per_s': 1234.0, 'tokens': 2048},
             {'kind': 'eval', 'step': steps, 'time': 0, 'eval_loss': 3.5}]
  (done / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
  before = (done / 'metrics.jsonl').read_bytes()

  # Interrupted: SIGINT to the sweep alone once the second trial trains; the sweep passes it on, the trial
  # checkpoints and stops, the sweep reports and exits 130.
  ran = sweep_dir / 'parallel_block=False'
  proc = subprocess.Popen(sweep_command(*args), cwd=ROOT, env=train_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  deadline = time.monotonic() + 300
  while not read_records(ran) and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.1)
  proc.send_signal(signal.SIGINT)
  stdout = proc.communicate(timeout=300)[0]
  assert proc.returncode == 130, stdout
  assert '[1/2] parallel_block=True: finished in an earlier run, not rerun' in stdout
  assert '[2/2] parallel_block=False: stopped (rerun resumes)' in stdout
  assert (done / 'metrics.jsonl').read_bytes() == before and not (done / 'train.log').exists()
  (preempted,) = [r for r in read_records(ran, 'event') if r['event'] == 'preempted']
  stopped_at = preempted['step']  # train finished that step and checkpointed it
  assert stopped_at < steps and not read_records(ran, 'eval')

  # The same command again: the finished trial is not rerun, the stopped one resumes from its checkpoint.
  result = run_sweep(*args)
  assert result.returncode == 0, result.stdout + result.stderr
  assert '[1/2] parallel_block=True: finished in an earlier run, not rerun' in result.stdout
  assert '[2/2] parallel_block=False: resuming' in result.stdout
  assert (done / 'metrics.jsonl').read_bytes() == before
  resumed = [r for r in read_records(ran, 'event') if r['event'] == 'resumed']
  assert [r['step'] for r in resumed] == [stopped_at]
  assert [r['step'] for r in read_records(ran, 'eval')] == [steps]
  eval_loss = read_records(ran, 'eval')[0]['eval_loss']

  rows = table_rows(result.stdout)
  assert [x for x in rows['0'].split() if x != '*'] == ['0', 'model.parallel_block=True', '106,688', '3.2500',
                                                         '3.5000', '1,234', 'done', '(earlier', 'run)']
  assert rows['1'].split()[2] == '106,816'  # the Llama block has two norms per layer, PaLM's one
  assert f'{eval_loss:.4f}' in rows['1'] and rows['1'].rstrip().endswith('done (resumed)')
  assert '*' in (rows['0'] if 3.5 < eval_loss else rows['1'])  # the lower held-out loss is marked

  results = json.loads((sweep_dir / 'results.json').read_text())
  assert [t['status'] for t in results['trials']] == ['done (earlier run)', 'done (resumed)']
  assert results['trials'][1]['eval_loss'] == eval_loss and results['trials'][1]['returncode'] == 0
  with open(sweep_dir / 'results.csv') as f:
    csv_rows = list(csv.DictReader(f))
  assert [r['model.parallel_block'] for r in csv_rows] == ['True', 'False']
  assert float(csv_rows[0]['eval_loss']) == 3.5
  assert (sweep_dir / 'sweep.png').read_bytes()[:8] == PNG_MAGIC

  # Once more: both trials are finished, nothing runs, the table is the same.
  mtime = os.stat(ran / 'metrics.jsonl').st_mtime_ns
  again = run_sweep(*args)
  assert again.returncode == 0, again.stdout + again.stderr
  assert '[2/2] parallel_block=False: finished in an earlier run, not rerun' in again.stdout
  assert os.stat(ran / 'metrics.jsonl').st_mtime_ns == mtime
  assert table_rows(again.stdout)['1'].split()[:5] == rows['1'].split()[:5]


def test_a_crashed_trial_is_recorded_and_the_sweep_goes_on(tmp_path):
  # Validated for 4 devices but launched on 8: each trial's own start-up check fails (exit 2), fast.
  result = run_sweep('--grid', 'model.parallel_block=True,False', '--set', 'mesh.fsdp=4', f'--workdir={tmp_path}',
                     devices=4)
  assert result.returncode == 1
  assert result.stdout.count('failed: bad config/input (exit 2)') == 4  # two progress lines, two table rows
  assert 'does not match the 8 devices' in result.stdout  # the tail of the trial's log is shown
  results = json.loads((tmp_path / 'results.json').read_text())
  assert [t['returncode'] for t in results['trials']] == [2, 2]
  assert (tmp_path / 'parallel_block=False' / 'train.log').exists()
  assert (tmp_path / 'sweep.png').read_bytes()[:8] == PNG_MAGIC
