"""Tests of jaxlm.metrics and jaxlm.perf: MFU, sinks, time accounting, slow steps, profiling, memory, compilation cache."""

import glob
import json
import logging
import math
import os
import subprocess
import sys
import threading
import types

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from tensorboard.backend.event_processing import event_accumulator

from jaxlm import perf
from jaxlm import metrics
from jaxlm.config import ConfigError

# PaLM 540B (paper, appendix B): 238.3K tokens/s on 6144 TPU v4 chips is 46.2% MFU.
PALM = dict(N=540e9, L=118, H=48, Q=256, T=2048, tokens_per_s=238.3e3, chips=6144)


def log_cfg(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(dict(tensorboard=True, wandb=False, wandb_project='jaxlm', profile_steps='',
                                     slow_step_factor=3.0, slow_step_count=3, compilation_cache=''))
  c.update(overrides)
  return c


class FakeClock:
  """A clock that moves only when told."""

  def __init__(self, t: float = 0.0):
    self.t = t

  def __call__(self) -> float:
    return self.t

  def advance(self, seconds: float) -> None:
    self.t += seconds


def palm_flops_per_token(causal: bool) -> float:
  attention = 12 * PALM['L'] * PALM['H'] * PALM['Q'] * PALM['T']
  return 6 * PALM['N'] + (attention / 2 if causal else attention)


def test_mfu_palm_540b_conformance():
  value = perf.mfu(PALM['tokens_per_s'], palm_flops_per_token(False), PALM['chips'], 'TPU v4')
  assert abs(100 * value - 46.2) <= 0.1


def test_mfu_causal_is_lower_by_half_the_attention_term():
  value = perf.mfu(PALM['tokens_per_s'], palm_flops_per_token(True), PALM['chips'], 'TPU v4')
  assert abs(100 * value - 45.95) <= 0.01  # 238.3e3 * (6N + 6LHQT) / (6144 * 275e12)


@pytest.mark.parametrize('kind, peak', [
    ('NVIDIA H100 80GB HBM3', 989e12), ('NVIDIA H200', 989e12), ('NVIDIA GH200 480GB', 989e12),
    ('NVIDIA H100 PCIe', 756e12), ('NVIDIA H100 NVL', 835e12), ('NVIDIA A100-SXM4-80GB', 312e12),
    ('NVIDIA A100 80GB PCIe', 312e12), ('TPU v4', 275e12), ('TPU v5 lite', 197e12), ('TPU v5e', 197e12),
    ('TPU v5', 459e12), ('TPU v5p', 459e12), ('TPU v6 lite', 918e12), ('TPU v6e', 918e12),
    ('cpu', None), ('TPU v4 lite', None), ('NVIDIA H800', None), ('TPU7x', None), ('Tesla V100-SXM2-16GB', None),
])
def test_peak_flops_by_device_kind(kind, peak):
  assert perf.peak_flops(kind) == peak


def test_unknown_device_gives_none_and_one_message(monkeypatch, caplog):
  monkeypatch.setattr(perf, '_unknown_kinds_reported', set())
  with caplog.at_level(logging.INFO, logger='jaxlm.perf'):
    values = [perf.mfu(1e6, 1e9, 8, 'cpu') for _ in range(5)]
  assert values == [None] * 5
  assert len(caplog.records) == 1 and "'cpu'" in caplog.records[0].getMessage()


def test_progress_line():
  line = metrics.progress_line(50, 200, {'loss': 2.5, 'tokens_per_s': 12345.0, 'mfu': 0.4123}, 3725.0)
  assert line == 'step  50/200 ( 25.0%) | loss 2.5000 | 12.3k tok/s | MFU 41.2% | ETA 1h02m'
  line = metrics.progress_line(5, 200, {'loss': float('nan'), 'tokens_per_s': 99.0}, None)
  assert 'MFU' not in line and 'loss nan' in line and line.endswith('ETA ?')
  line = metrics.progress_line(7, None, {'loss': 1.0, 'tokens_per_s': 2e6, 'mfu': 0.5}, None)
  assert line == 'step 7 | loss 1.0000 | 2M tok/s | MFU 50.0%'


def write_run(workdir, **kwargs):
  """A short run through MetricsLogger: two train records, one eval, two events."""
  clock = FakeClock()
  with metrics.MetricsLogger(str(workdir), log_cfg(), total_steps=100, clock=clock, **kwargs) as logger:
    logger.write(10, {'loss': jnp.float32(3.5), 'lr': 1e-3, 'grad_norm': 0.75, 'tokens_per_s': 1000.0,
                      'mfu': None, 'tokens': 40960})
    clock.advance(20.0)  # 10 steps in 20 s: 80 steps left -> 160 s
    logger.write(20, {'loss': 3.25, 'lr': 2e-3, 'grad_norm': 0.5, 'tokens_per_s': 1100.0, 'tokens': 81920})
    logger.write(20, {'eval_loss': 3.375}, kind='eval')
    logger.event(21, 'slow_step', '3 slow steps in a row', factor=4.5)
    logger.event(22, 'slow_step', 'again')
    logger.write(20, {'goodput': 0.9, 'wall_s': 100.0}, kind='system')


def test_jsonl_schema_and_stdout(tmp_path, capsys):
  write_run(tmp_path)
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith('step  10/100') and out[0].endswith('ETA ?')
  assert out[1].endswith('ETA 2m40s')
  assert out[2] == 'eval step 20 | eval_loss 3.3750'
  assert out[3] == 'WARNING step 21 [slow_step] 3 slow steps in a row'
  records = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert [r['kind'] for r in records] == ['train', 'train', 'eval', 'event', 'event', 'system']
  for r in records:
    assert type(r['step']) is int and type(r['time']) is float
  for r in records[:2]:
    for key in ('loss', 'lr', 'grad_norm', 'tokens_per_s'):
      assert type(r[key]) is float
    assert type(r['tokens']) is int and 'mfu' not in r  # None is left out, not written as 0
  assert records[0]['loss'] == 3.5
  assert type(records[2]['eval_loss']) is float
  assert records[3]['event'] == 'slow_step' and records[3]['message'] == '3 slow steps in a row'
  assert records[3]['factor'] == 4.5


def test_records_missing_required_keys_are_refused(tmp_path):
  with metrics.MetricsLogger(str(tmp_path), log_cfg(), total_steps=10) as logger:
    with pytest.raises(KeyError, match='grad_norm'):
      logger.write(1, {'loss': 1.0, 'lr': 1.0, 'tokens_per_s': 1.0})
    with pytest.raises(KeyError, match='eval_loss'):
      logger.write(1, {'loss': 1.0}, kind='eval')
    with pytest.raises(ValueError, match='kind'):
      logger.write(1, {}, kind='bogus')
    with pytest.raises(ValueError, match='reserved'):
      logger.write(1, {'time': 0.5}, kind='system')
    with pytest.raises(ValueError, match='reserved'):
      logger.event(1, 'rollback', 'x', time=3.0)


def test_tensorboard_files_read_back(tmp_path):
  write_run(tmp_path)
  files = glob.glob(str(tmp_path / 'tb' / 'events.out.tfevents.*'))
  assert len(files) == 1
  acc = event_accumulator.EventAccumulator(str(tmp_path / 'tb'), size_guidance={'scalars': 0, 'tensors': 0})
  acc.Reload()
  loss = acc.Scalars('train/loss')
  assert [e.step for e in loss] == [10, 20] and [e.value for e in loss] == [3.5, 3.25]
  assert [(e.step, e.value) for e in acc.Scalars('eval/eval_loss')] == [(20, 3.375)]
  assert [(e.step, e.value) for e in acc.Scalars('events/slow_step')] == [(21, 1.0), (22, 2.0)]
  assert acc.Scalars('system/goodput')[0].value == pytest.approx(0.9)
  assert 'train/mfu' not in acc.Tags()['scalars']
  text = acc.Tensors('events')
  assert [e.step for e in text] == [21, 22]
  assert text[0].tensor_proto.string_val[0].decode() == '**slow_step**: 3 slow steps in a row'


def test_a_failed_tensorboard_write_is_one_storage_error_not_a_thread_traceback(tmp_path, capfd):
  """tensorboard's writer thread fails on its own; the run must still end in one StorageError, quietly."""
  from tensorboard.summary.writer import record_writer  # pylint: disable=import-outside-toplevel

  def full_disk(self, data):
    raise OSError(28, 'No space left on device')

  thread_errors = []  # what would reach Python's default hook (a traceback on stderr)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(threading, 'excepthook', thread_errors.append)
    logger = metrics.MetricsLogger(str(tmp_path), log_cfg(), total_steps=10)
    worker = logger._tb._writer._async_writer._worker  # pylint: disable=protected-access
    m.setattr(record_writer.RecordWriter, 'write', full_disk)
    with pytest.raises(metrics.StorageError, match=r'cannot write .*tb \(OSError: \[Errno 28\]'):
      logger.event(1, 'spike', 'x')  # text events flush, so the thread's failure reaches the main thread here
      logger.close()
    worker.join(timeout=30)
  assert not worker.is_alive() and thread_errors == []
  assert 'Traceback' not in capfd.readouterr().err


def test_non_primary_process_writes_nothing(tmp_path, capsys):
  workdir = tmp_path / 'run'
  write_run(workdir, is_primary=False)
  assert not workdir.exists()
  assert capsys.readouterr().out == ''


def test_wandb_missing_is_a_clear_config_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)  # makes `import wandb` raise ImportError
  with pytest.raises(ConfigError, match='pip install wandb'):
    metrics.MetricsLogger(str(tmp_path), log_cfg(wandb=True), total_steps=10)


def test_wandb_offline_run(tmp_path, monkeypatch):
  wandb = pytest.importorskip('wandb')
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  config = ml_collections.ConfigDict({'name': 'tiny', 'train': {'steps': 100}})
  for _ in range(2):  # the second logger resumes the same run id
    with metrics.MetricsLogger(str(tmp_path), log_cfg(wandb=True), total_steps=100, config=config) as logger:
      logger.write(10, {'loss': 3.5, 'lr': 1e-3, 'grad_norm': 0.75, 'tokens_per_s': 1000.0})
      logger.event(11, 'rollback', 'back to step 0')
  run_id = (tmp_path / 'wandb_id').read_text()
  assert glob.glob(str(tmp_path / 'wandb' / f'offline-run-*-{run_id}' / f'run-{run_id}.wandb'))
  assert wandb.run is None  # finished on close


def test_slow_step_detector_fires_exactly_when_expected():
  d = perf.SlowStepDetector(factor=3.0, count=3, window=50)
  fired = {}
  times = [1.0] * 20 + [10.0] + [1.0] * 5 + [4.0, 4.0, 1.0] + [5.0] * 5 + [1.0] * 3 + [3.5] * 3
  for step, seconds in enumerate(times):
    message = d.update(step, seconds)
    if message:
      fired[step] = message
  # Step 20 is a single outlier; 26-27 is a run of two (< count); the run 29..33 fires once, at its third step;
  # the run 37..39 fires at 39.
  assert sorted(fired) == [31, 39]
  assert '(29..31)' in fired[31] and '5.0x the rolling median 1s' in fired[31]


def test_slow_step_detector_waits_for_history():
  d = perf.SlowStepDetector(factor=2.0, count=1, window=10, min_history=5)
  assert [d.update(i, s) for i, s in enumerate([1.0, 9.0, 1.0, 1.0, 1.0])] == [None] * 5
  assert d.update(5, 9.0) is not None


def test_time_accounting_on_a_fake_clock():
  clock = FakeClock(100.0)
  acct = perf.TimeAccounting(clock=clock, start=95.0)  # the process started 5 s before
  clock.advance(1.0)  # untracked start-up: 6 s in all
  with acct.track('compile'):
    clock.advance(10.0)
  for _ in range(3):
    with acct.track('data'):
      clock.advance(0.5)
    with acct.track('step'):
      clock.advance(2.0)
  assert acct.last_s == 2.0
  with acct.track('eval'):
    clock.advance(3.0)
    with acct.track('data'):  # nested: counts as data only
      clock.advance(1.0)
  with acct.track('checkpoint'):
    clock.advance(4.0)
  acct.redo_steps(2)
  for _ in range(3):
    with acct.track('step'):
      clock.advance(2.0)
  clock.advance(0.5)  # untracked after the first step: other
  s = acct.summary()
  expected = {'startup_s': 6.0, 'compile_s': 10.0, 'data_s': 2.5, 'step_s': 8.0, 'eval_s': 3.0,
              'checkpoint_s': 4.0, 'redo_s': 4.0, 'other_s': 0.5}
  assert {k: s[k] for k in expected} == pytest.approx(expected)
  assert s['wall_s'] == pytest.approx(38.0) == clock.t - 95.0
  assert s['goodput'] == pytest.approx(8.0 / 38.0)
  assert s['goodput'] + sum(v for k, v in s.items() if k.startswith('badput_')) == pytest.approx(1.0)
  table = acct.table()
  assert 'goodput 21.1%' in table and 'step (productive)' in table
  assert table.splitlines()[1].split() == ['compile', '10.0s', '26.3%']  # largest bucket first


def test_the_final_save_is_accounted_apart_from_the_saves_during_the_run():
  clock = FakeClock()
  acct = perf.TimeAccounting(clock=clock, start=0.0)
  for step in range(1, 5):
    with acct.track('step'):
      clock.advance(1.0)
    with acct.track('checkpoint'):  # the loop's on_step: blocked for the copy when a save is due
      clock.advance(0.5 if step % 2 == 0 else 0.0)
  with acct.track('final_save'):  # close(): the last save reaching the disk
    clock.advance(6.0)
  s = acct.summary()
  assert s['checkpoint_s'] == pytest.approx(1.0) and s['final_save_s'] == pytest.approx(6.0)
  assert s['badput_final_save'] == pytest.approx(6.0 / 11.0) and s['goodput'] == pytest.approx(4.0 / 11.0)
  assert s['goodput'] + sum(v for k, v in s.items() if k.startswith('badput_')) == pytest.approx(1.0)
  rows = {line.split('  ')[1].strip(): line for line in acct.table().splitlines()[1:]}
  assert rows['final save'].split()[-2:] == ['6.0s', '54.5%'] and rows['checkpoint'].split()[-2:] == ['1.0s', '9.1%']


def _steady_run(eta, total=600, log_every=25, save_every=100, eval_every=150, save_s=1.5, eval_s=2.0,
                first_eval_extra_s=4.0, final_save_s=20.0):
  """A steady run on a fake clock, in the loop's order (data, step, progress line, eval, save): yields
  (clock, step, ETA from `eta`, ETA from the wall time between lines) at every progress line."""
  clock = FakeClock()
  acct = perf.TimeAccounting(clock=clock, start=0.0)
  clock.advance(30.0)  # start-up
  eta.begin(0, acct.summary())
  last = None
  for step in range(1, total + 1):
    with acct.track('data'):
      clock.advance(0.02)
    with acct.track('step'):
      clock.advance(0.43)
    clock.advance(0.001)  # loop overhead: 'other'
    if step % log_every == 0:
      naive = (clock.t - last[0]) / (step - last[1]) * (total - step) if last else None
      last = (clock.t, step)
      yield clock.t, step, eta(step, acct.summary(), final_save_s=final_save_s), naive
    if step % eval_every == 0 or step == total:
      with acct.track('eval'):  # the first eval compiles the eval step too
        clock.advance(eval_s + (first_eval_extra_s if step == eval_every else 0.0))
    with acct.track('checkpoint'):
      clock.advance(0.0005 + (save_s if step % save_every == 0 or step == total else 0.0))


def test_eta_of_a_steady_run_moves_less_than_a_fifth_between_progress_lines():
  """The predicted end (now + ETA) moves by < 20 % of the time left between consecutive lines, saves and evals
  included; the ETA from the wall time between lines (what the progress line showed before) does not."""
  eta = perf.Eta(600, save_every=100, eval_every=150, eval_batches=8)
  lines = list(_steady_run(eta))
  assert [l[1] for l in lines] == list(range(25, 601, 25))
  for (t0, s0, e0, _), (t1, s1, e1, _) in zip(lines, lines[1:]):
    assert abs((t1 + e1) - (t0 + e0)) < 0.2 * e0, (s0, e0, s1, e1)
  end = lines[-1][0] + 2.0 + 1.5 + 20.0  # the last eval, save and final save still ahead of the last line
  assert lines[0][2] == pytest.approx(end - lines[0][0], rel=0.1)  # right from the first line, within 10 %
  naive_moves = [abs((t1 + n1) - (t0 + n0)) / n0 for (t0, _, _, n0), (t1, _, _, n1) in zip(lines[1:], lines[2:])]
  assert max(naive_moves) > 0.2  # the timeline is one where the old estimate jumped


def test_eta_counts_the_saves_and_evals_ahead():
  eta = perf.Eta(1000, save_every=100, eval_every=0, eval_batches=3)
  summary = dict.fromkeys([f'{k}_s' for k in perf.BUCKETS], 0.0)
  eta.begin(200, summary)  # resumed at step 200
  now = dict(summary, step_s=75.0, checkpoint_s=2.0)  # 150 steps of 0.5 s and the save at 300, 2 s
  # 650 steps left; saves at 400..1000 (7) at 2 s each; the final eval priced at 3 batches × 0.5 s / 3; the final
  # save's write.
  assert eta(350, now, final_save_s=9.0) == pytest.approx(650 * 0.5 + 7 * 2.0 + 0.5 + 9.0)
  # At the line of step 400 its save is still ahead: 600 steps and 7 saves (400..1000).
  assert eta(400, dict(now, step_s=100.0)) == pytest.approx(600 * 0.5 + 7 * 2.0 + 0.5)


def test_time_accounting_before_the_first_step_is_startup():
  clock = FakeClock()
  acct = perf.TimeAccounting(clock=clock, start=0.0)
  clock.advance(7.0)
  s = acct.summary()
  assert s['startup_s'] == 7.0 and s['other_s'] == 0.0 and s['goodput'] == 0.0
  with pytest.raises(ValueError, match='unknown time bucket'):
    with acct.track('lunch'):
      pass


def test_time_accounting_defaults_to_process_start():
  acct = perf.TimeAccounting()
  assert acct.summary()['wall_s'] > 0.1  # this process has been up at least as long as importing jax took


def test_profiler_traces_the_requested_steps(tmp_path):
  profiler = perf.Profiler(log_cfg(profile_steps='2,3'), str(tmp_path))
  f = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jnp.ones((32, 32))
  active = []
  for step in range(6):
    profiler.step(step, block_on=x)
    active.append(profiler.active)
    x = f(x)
  profiler.stop(x)
  assert active == [False, False, True, True, False, False]
  assert glob.glob(str(tmp_path / 'profile' / 'plugins' / 'profile' / '*' / '*.xplane.pb'))
  assert glob.glob(str(tmp_path / 'profile' / 'plugins' / 'profile' / '*' / '*.trace.json.gz'))


def test_profiler_off_does_nothing(tmp_path):
  for profiler in (perf.Profiler(log_cfg(), str(tmp_path)),
                   perf.Profiler(log_cfg(profile_steps='0,1'), str(tmp_path), is_primary=False)):
    for step in range(3):
      profiler.step(step, block_on=lambda: None)
      assert not profiler.active
  assert not (tmp_path / 'profile').exists()


def test_compiled_memory():
  compiled = jax.jit(lambda x: x @ x).lower(jnp.ones((64, 64), jnp.float32)).compile()
  mem = perf.compiled_memory(compiled)
  assert mem['argument_bytes'] == 64 * 64 * 4 and mem['output_bytes'] == 64 * 64 * 4
  assert mem['total_bytes'] >= 2 * 64 * 64 * 4
  assert perf.compiled_memory(types.SimpleNamespace(memory_analysis=lambda: None)) == {}

  def unsupported():
    raise NotImplementedError
  assert perf.compiled_memory(types.SimpleNamespace(memory_analysis=unsupported)) == {}
  assert 'argument 16.00 KiB' in perf.format_memory(mem)


def test_device_memory_stats():
  assert perf.device_memory_stats() == {}  # CPU reports none: omitted, not zeros
  devices = [types.SimpleNamespace(memory_stats=lambda: {'bytes_in_use': 5, 'peak_bytes_in_use': 9,
                                                          'bytes_limit': 80}),
             types.SimpleNamespace(memory_stats=lambda: {'bytes_in_use': 7, 'peak_bytes_in_use': 8,
                                                          'bytes_limit': 80})]
  assert perf.device_memory_stats(devices) == {'hbm_bytes_in_use': 7, 'hbm_peak_bytes': 9,
                                                  'hbm_bytes_limit': 80}


def test_compilation_cache_off():
  assert perf.enable_compilation_cache(log_cfg(compilation_cache='')) is None


def test_compilation_cache_writes_entries(tmp_path):
  # A fresh process: JAX reads the cache directory once, at its first compile.
  script = '''
import jax, jax.numpy as jnp, ml_collections
from jaxlm import perf
path = perf.enable_compilation_cache(ml_collections.ConfigDict({'compilation_cache': '~/xla'}))
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)  # cache even this tiny program
jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(3)).compile()
print(path)
'''
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  # A multi-device CPU backend reads the cache only with XLA:CPU's concurrency-optimized scheduler off, which
  # makes it safe there (issues #32, #38). JAX's own variable names the directory when set.
  off = ' --xla_cpu_enable_concurrency_optimized_scheduler=false'
  cases = ((1, '', None, True), (8, '', None, False), (8, ' --xla_cpu_enable_concurrency_optimized_scheduler=true',
                                                      None, False), (8, off, None, True), (8, off, 'envdir', True))
  for i, (devices, extra, env_dir, cached) in enumerate(cases):
    home = tmp_path / f'home{i}'
    env = dict(os.environ, HOME=str(home), JAX_PLATFORMS='cpu',
               XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}{extra}')
    env.pop('JAX_COMPILATION_CACHE_DIR', None)  # only the case that sets it
    if env_dir:
      env['JAX_COMPILATION_CACHE_DIR'] = str(home / env_dir)
    result = subprocess.run([sys.executable, '-c', script], env=env, cwd=root, capture_output=True, text=True,
                            timeout=120, check=True)
    where = home / (env_dir or 'xla')
    assert result.stdout.strip() == (str(where) if cached else 'None')
    assert bool(os.path.isdir(where) and os.listdir(where)) == cached


def test_nan_loss_is_kept(tmp_path):
  with metrics.MetricsLogger(str(tmp_path), log_cfg(tensorboard=False), total_steps=10) as logger:
    logger.write(1, {'loss': float('nan'), 'lr': 1.0, 'grad_norm': float('inf'), 'tokens_per_s': 1.0})
  record = json.loads((tmp_path / 'metrics.jsonl').read_text())
  assert math.isnan(record['loss']) and record['grad_norm'] == math.inf
  assert not (tmp_path / 'tb').exists()


def test_a_storage_error_is_one_short_line_with_the_library_message_in_the_log(tmp_path, caplog):
  raw = ('RESOURCE_EXHAUSTED: Error writing "opt_state.mu/0.0" in OCDBT database at local file "' + 'x' * 400
         + '": Failed to write 1144507 bytes to file 17: No space left on device [os_error_code=\'28\'] '
         '[source locations=\'tensorstore/internal/os/file_util_posix.cc:312\n' + 'tensorstore/kvstore ' * 20)
  path = str(tmp_path / 'run' / 'checkpoints')
  line = 'jaxlm: ' + str(metrics.storage_error(path, ValueError(raw)))
  assert len(line) <= metrics.LAST_LINE and 'source locations' not in line and 'x' * 50 not in line
  assert line.startswith(f'jaxlm: cannot write {path} (ValueError: [Errno 28] No space left on device); ')
  assert ' MiB free there. Fix: free space or use a writable --workdir' in line
  assert raw in caplog.text  # the whole library message, in the log
  deep = '/mnt/' + '/'.join(['a_rather_long_directory_name'] * 12) + '/checkpoints'
  line = 'jaxlm: ' + str(metrics.storage_error(deep, OSError(13, 'Permission denied')))
  assert len(line) <= metrics.LAST_LINE and '/mnt/a_rather' in line and '...' in line
  assert 'name/checkpoints (PermissionError: [Errno 13] Permission denied); ' in line
