"""The real entry point, end to end, on palm_tiny: it trains, evaluates, reports and checkpoints."""

import json
import os
import subprocess
import sys
import types

import pytest

from tests.conftest import FAST_COMPILE_XLA_FLAGS, ROOT
from tests.helpers import read_records, train_command, train_env


def test_entry_point_trains_palm_tiny_and_loss_falls(tmp_path, data_cache):
  out = subprocess.run(train_command(tmp_path, f'--config.data.cache_dir={data_cache}', '--config.train.steps=40',
                                     '--config.train.eval_every=20', '--config.train.log_every=5'),
                       cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  train = read_records(tmp_path)
  evals = read_records(tmp_path, 'eval')
  assert [r['step'] for r in train] == list(range(5, 41, 5))
  assert train[-1]['loss'] < train[0]['loss'] - 1.0
  assert [r['step'] for r in evals] == [20, 40] and evals[1]['eval_loss'] < evals[0]['eval_loss']
  assert all(r['tokens_per_s'] > 0 and r['lr'] > 0 and r['grad_norm'] > 0 for r in train)
  # The start-up report: resolved config, mesh, the parameter table, the compiled step's memory.
  for text in ("mesh: {'data': 1, 'fsdp': 8, 'tensor': 1, 'context': 1}", 'layers/attention/query', "P(None, 'fsdp', 'tensor', None)",
               'compiled the train step', 'goodput', 'ETA', 'bit-reproducible: yes (cpu', 'attention: xla attention'):
    assert text in out.stdout, text
  assert (tmp_path / 'checkpoints' / '40').is_dir() and list((tmp_path / 'tb').iterdir())
  # What start-up spent its time on, and the final save's wait apart from the saves during the run.
  startup = next(line for line in out.stdout.splitlines() if line.startswith('start-up '))
  assert 'python, imports' in startup and 'compile train step' in startup, startup
  assert any(line.split()[:2] == ['final', 'save'] for line in out.stdout.splitlines())
  assert all(r['eta_s'] >= 0 for r in train)  # the progress line's ETA, recorded
  final = read_records(tmp_path, 'system')[-1]  # with the saves in numbers: steps 10, 20, 30 and 40
  assert final['checkpoint_saves'] == 4 and final['checkpoint_blocked_max_s'] <= final['checkpoint_s'] + 1e-6



_FAULTS = '''
import json, os, resource, sys
os.environ['JAX_PLATFORMS'] = 'cpu'
# One device (the setting's own case: all the step's temporaries in one block), compiled as the suite compiles.
os.environ['XLA_FLAGS'] = sys.argv[1]
import jaxlm  # first, as `python -m jaxlm.train` does: before JAX starts a thread
sys.path.insert(0, 'bench')
import mfu
from jaxlm import perf
from jaxlm import metrics
from jaxlm.cli import load_file
cfg = load_file('configs/palm_small.py')
cfg.train.batch_size = 2  # temporaries of ~41 MiB: past the threshold below
bench = mfu.Bench(cfg)
for _ in range(4):  # the heap grows to its working size in the first steps
  bench.step()
per_step = []
for _ in range(5):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  bench.step()
  per_step.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults = sorted(per_step)[2]  # the median step: one late growth of the heap is not the steady state
pages = perf.compiled_memory(bench.compiled)['temp_bytes'] / 4096
print(json.dumps(dict(kept=jaxlm.HOST_MEMORY_KEPT, faults=faults, pages=pages)))
'''


@pytest.mark.slow(reason='trainer subprocesses run long enough for the page-fault counts to settle')
def test_host_memory_is_kept_so_steps_do_not_refault_their_temporaries():
  """XLA:CPU's per-step temporary block is reused, not mapped, faulted and zeroed again every step."""
  runs = {}
  for keep in ('', '0'):  # unset: the default on one CPU device
    env = dict(os.environ, JAXLM_KEEP_HOST_MEMORY=keep)
    out = subprocess.run([sys.executable, '-c', _FAULTS, FAST_COMPILE_XLA_FLAGS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs[keep] = json.loads(out.stdout.strip().splitlines()[-1])
  assert runs['0']['kept'] is False
  if not runs['']['kept']:
    pytest.skip('no glibc mallopt on this machine')
  pages = runs['']['pages']
  assert pages > 8192  # > 32 MiB: past glibc's largest mmap threshold, so by default a thread arena maps it
  assert runs['']['faults'] < 0.05 * pages, runs
  # Without it, every step faults the block in again (unless the kernel backs it with huge pages anyway).
  assert runs['0']['faults'] > 0.5 * pages or runs['0']['faults'] > 20 * runs['']['faults'], runs


def test_host_memory_left_alone_with_fake_devices_or_when_asked(monkeypatch):
  from jaxlm import malloc as host
  monkeypatch.delenv('JAXLM_KEEP_HOST_MEMORY', raising=False)
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')  # one arena would serialise them
  assert host.keep_freed_memory() is False
  monkeypatch.delenv('XLA_FLAGS')
  monkeypatch.setenv('JAXLM_KEEP_HOST_MEMORY', '0')
  assert host.keep_freed_memory() is False
  # The pre-flight sizing tool only compiles: one arena would only serialise the compiler's threads.
  monkeypatch.delenv('JAXLM_KEEP_HOST_MEMORY')
  for argv in (['python', '-m', 'jaxlm.tools.size', '--target=v5e:2x2'], ['python3', '/usr/local/bin/jaxlm-size']):
    monkeypatch.setattr(host.sys, 'orig_argv', argv)
    assert host.keep_freed_memory() is False, argv
  assert not host.compile_only_command(['python', '-m', 'jaxlm.train', '--config=configs/palm_small.py'])
  # libtpu installed (the test extra has it, for pre-flight compiles) is not a TPU host without TPU devices.
  monkeypatch.setattr(host.pkgutil, 'iter_modules', lambda: [types.SimpleNamespace(name='libtpu')])
  monkeypatch.setattr(host.glob, 'glob', lambda pattern: [])
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  assert host.accelerator_host() is False
  monkeypatch.setattr(host.glob, 'glob', lambda pattern: ['/dev/accel0'] if 'accel' in pattern else [])
  assert host.accelerator_host() is True
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  assert host.accelerator_host() is False


def test_deterministic_sets_xla_flags_and_the_report_says_when_runs_are_bit_for_bit(monkeypatch):
  from jaxlm import train
  from tests.helpers import load_config
  t = load_config('palm_tiny').train
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  train.set_deterministic(t)  # off by default: nothing changes
  assert os.environ['XLA_FLAGS'] == '--xla_force_host_platform_device_count=8'
  assert train.reproducibility(t, 'gpu').startswith('no: ') and 'train.deterministic=True' in train.reproducibility(
      t, 'gpu')
  assert train.reproducibility(t, 'cpu').startswith('yes') and train.reproducibility(t, 'tpu').startswith('yes')
  t.deterministic = True
  train.set_deterministic(t)
  train.set_deterministic(t)  # once only
  assert os.environ['XLA_FLAGS'].split() == ['--xla_force_host_platform_device_count=8',
                                             '--xla_gpu_deterministic_ops=true']
  assert train.reproducibility(t, 'gpu').startswith('yes')


# The first steps of a data 2 x fsdp 4 run, each from a fresh init (the trainer's start), in a process that
# turns on the compilation cache the way the trainer does. Run twice on one cache directory: the second process
# reads the train step back from it, which aborted in a rendezvous within a few steps under XLA:CPU's
# concurrency-optimized scheduler (issue #32; 3 of 3 processes), and runs clean without it.
_FIRST_STEPS = '''
import sys
import jax, ml_collections, numpy as np
hits = []
jax.monitoring.register_event_listener(lambda event, **_: hits.append(event) if event.endswith('cache_hits') else 0)
from jaxlm import perf, sharding, step
from tests.helpers import load_config, random_batch
perf.enable_compilation_cache(ml_collections.ConfigDict({'compilation_cache': sys.argv[1]}))
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)  # what the trainer caches at >= 1 s
cfg = load_config('palm_tiny')
cfg.model.update(dtype='float32', parallel_block=False)
cfg.train.update(steps=100, batch_size=8)
cfg.mesh.update(data=2, fsdp=4, tensor=1)
mesh = sharding.make_mesh(cfg.mesh)
program = step.build_program(cfg, mesh)
batch = step.global_batch(random_batch(8, cfg.data.seq_len, cfg.model.vocab_size), program.batch_sharding)
compiled = program.train_step.lower(program.abstract_state, step.abstract_batch(8, cfg.data.seq_len,
                                                                               program.batch_sharding)).compile()
losses = set()
for _ in range(int(sys.argv[2])):
  state, metrics = compiled(program.init(), batch)  # no wait between init and step, as in the trainer
  losses.add(float(metrics['loss']))
print('losses', sorted(losses))
print('cache hits', len(hits))
'''


def test_first_steps_on_data2_fsdp4_never_deadlock(tmp_path):
  cache = tmp_path / 'xla'
  env = dict(train_env(8), XLA_FLAGS='--xla_force_host_platform_device_count=8 '
             '--xla_cpu_collective_call_terminate_timeout_seconds=10 '  # a deadlock fails in 10 s, not 40
             '--xla_cpu_enable_concurrency_optimized_scheduler=false')
  env['JAX_COMPILATION_CACHE_DIR'] = str(cache)  # the directory the script's own setting names
  outs = [subprocess.run([sys.executable, '-c', _FIRST_STEPS, str(cache), '30'], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400) for _ in range(2)]
  for out in outs:
    assert out.returncode == 0, out.stderr[-3000:]
  losses = [out.stdout.splitlines()[0] for out in outs]
  assert losses[0] == losses[1] and losses[0].count(',') == 0  # one loss, the same in both
  assert os.listdir(cache)  # the multi-device CPU mesh caches its programs
  assert outs[0].stdout.splitlines()[1] == 'cache hits 0' and outs[1].stdout.splitlines()[1] != 'cache hits 0'
