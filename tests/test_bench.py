"""The benchmark scripts still run and report consistent figures (speed itself is measured by hand, not here)."""

import json
import math
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, made_once
from tests.helpers import train_env


def run_bench(script: str, *args) -> str:
  out = subprocess.run([sys.executable, f'bench/{script}', '--config=configs/palm_tiny.py', *args], cwd=ROOT,
                       env=train_env(1), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


def test_cpu_step_compares_the_same_model_and_splits_phases(tmp_path):
  # Eager torch (no C++ compile in CI); the comparison's bookkeeping is what is checked.
  out = run_bench('cpu_step.py', '--steps=2', '--warmup=1', '--nocompile', '--phases', f'--json={tmp_path}/r.json')
  r = json.loads((tmp_path / 'r.json').read_text())
  j, t = r['jaxlm'], r['torch']
  assert j['params'] == t['params'] and j['flops_per_token'] == t['flops_per_token']
  assert len(r['pair_ratios']) == 2 and len(r['times']['jaxlm']) == len(r['times']['torch']) == 2
  assert [p[0] for p in r['phases']] == ['forward', 'forward + backward']
  assert all(p[1] > 0 and p[2] > 0 for p in r['phases'])
  assert math.isfinite(j['loss']) and math.isfinite(t['loss'])
  # Same initial scale (N(0,1) tied embeddings, 1/sqrt(D) logits) and data distribution: losses agree roughly.
  assert abs(j['loss'] - t['loss']) < 1.0, (j['loss'], t['loss'])
  assert 'ratio jaxlm/torch' in out and 'whole train step' in out


@pytest.fixture(scope='session')
def mfu_run(tmp_path_factory):
  """(stdout, JSON) of one bench/mfu.py run that both of its tests read: train.deterministic and the PyTorch
  baseline in bfloat16 ride together (each is its own part of the output), one process and compile instead of two.
  Made once for the run, every xdist worker included."""
  with made_once(tmp_path_factory, 'mfu_run') as (path, done):
    if not done:
      out = run_bench('mfu.py', '--steps=2', '--warmup=1', '--config.train.deterministic=True', '--baseline=torch',
                      '--notorch_compile', '--config.model.dtype=bfloat16', f'--json={path}/r.json')
      (path / 'stdout.txt').write_text(out)
    return (path / 'stdout.txt').read_text(), json.loads((path / 'r.json').read_text())


def test_mfu_and_matmul_benchmarks_print_their_tables(mfu_run):
  out, _ = mfu_run
  assert 'tokens/s' in out and 'MFU' in out and 'n/a (unknown peak)' in out
  # train.deterministic honoured as the trainer does, and the flags it ran with printed, first and in the table.
  assert 'train.deterministic=True; XLA_FLAGS: ' in out
  assert re.search(r'^deterministic +train\.deterministic=True$', out, re.M)
  flags_row = next(line for line in out.splitlines() if line.startswith('XLA_FLAGS'))
  assert '--xla_gpu_deterministic_ops=true' in flags_row and '--xla_force_host_platform_device_count' in flags_row
  out = run_bench('cpu_matmul.py', '--repeats=2')
  assert out.count(': weight grad') == 5 and 'sum (each product once)' in out


def test_pipeline_bench_rows_compute_the_same_loss(tmp_path):
  # 2 fake devices (the bench's default is 8): enough for 2 stages, and each compile and step is cheaper.
  out = subprocess.run([sys.executable, 'bench/pipeline.py', '--stages=1,2', '--microbatches=1,2', '--layers=2',
                        '--batch=16', '--seq=16', '--steps=1', '--devices=2', f'--json={tmp_path}/r.json'], cwd=ROOT,
                       env=train_env(1), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rows = json.loads((tmp_path / 'r.json').read_text())
  assert [(r['stages'], r['microbatches']) for r in rows] == [(1, 1), (2, 2), (2, 4)]
  assert [r['bubble'] for r in rows] == [0.0, 1 / 3, 1 / 5]
  assert all(math.isclose(r['loss'], rows[0]['loss'], rel_tol=1e-5) for r in rows)  # the same model and batch
  assert 'bubble computed' in out.stdout and 'bubble measured' in out.stdout


def test_mfu_baseline_torch_prints_both_rows_and_their_ratio(mfu_run):
  # bfloat16: the baseline must run mixed precision (autocast over float32 master weights), which plain float32
  # weights meeting bfloat16 activations did not (issue #23). Eager torch: no C++ compile in CI.
  out, r = mfu_run
  t = r['baseline']
  assert t['framework'] == 'torch' and t['device'] == 'cpu' and t['params'] == r['params']
  assert t['flops_per_token'] == r['flops_per_token'] and math.isfinite(t['loss'])
  assert r['ratio'] == (r['tokens_per_s'] / r['num_devices']) / t['tokens_per_s']
  rows = out[out.index('baseline, same model'):].splitlines()
  assert rows[2].startswith('jaxlm (jax ') and f'{r["tokens_per_s"]:,.0f}' in rows[2]
  assert rows[3].startswith('torch (') and 'bfloat16 autocast, float32 master weights' in rows[3]
  assert f'{t["tokens_per_s"]:,.0f}' in rows[3]
  assert rows[4] == f'ratio jaxlm/torch (tokens/s per device): {r["ratio"]:.3f}'


def test_checkpoint_bench_reports_blocked_and_sync_time_per_save(tmp_path):
  out = run_bench('checkpoint.py', '--repeats=2', f'--dir={tmp_path}/ckpt')
  rows = [line.split() for line in out.splitlines() if line.startswith(('sync ', 'async '))]
  assert [(r[0], r[1]) for r in rows] == [('sync', '1'), ('sync', '2'), ('async', '1'), ('async', '2')]
  blocked = {(r[0], r[1]): float(r[2].replace(',', '')) for r in rows}
  written = {(r[0], r[1]): float(r[7].replace(',', '')) for r in rows}
  for key in blocked:  # a sync save blocks until it is on disk; an async one no longer than that
    assert blocked[key] <= written[key] * 1.05 + 5, (key, blocked[key], written[key])
    if key[0] == 'sync':
      assert blocked[key] >= written[key] - 2, (key, blocked[key], written[key])
  assert 'median blocked: async' in out and 'copy off the devices' in out


def test_optim_quality_reads_a_sweep_and_finds_when_the_candidate_reaches_the_baseline(tmp_path):
  """A hand-made sweep of two trials per optimizer: the tables and the crossing steps follow from the curves."""
  grid = ['optim.name=adamw,muon', 'optim.lr=1e-3,1e-2']
  settings = ['train.steps=100', 'train.eval_every=25', 'optim.schedule=wsd', 'optim.warmup_steps=10',
              'optim.ema=0.9']
  (tmp_path / 'results.json').write_text(json.dumps({'config': 'configs/palm_tiny.py', 'grid': grid, 'set': settings,
                                                     'random': 0, 'seed': 0}))
  curves = {  # trial → {step: (raw, ema)}
      'name=adamw,lr=0.001': {25: (6.0, 7.0), 50: (5.5, 5.9), 75: (5.2, 5.3), 100: (5.0, 5.1)},
      'name=adamw,lr=0.01': {25: (6.1, 7.0), 50: (5.6, 5.8), 75: (5.4, 5.5), 100: (5.1, 5.3)},
      'name=muon,lr=0.001': {25: (5.9, 6.9), 50: (5.4, 5.6), 75: (5.1, 5.0), 100: (4.9, 4.95)},
      'name=muon,lr=0.01': {25: (5.8, 6.9), 50: (5.3, 4.9), 75: (5.1, 4.8), 100: (4.8, 4.85)},
  }
  for trial, curve in curves.items():
    (tmp_path / trial).mkdir()
    (tmp_path / trial / 'metrics.jsonl').write_text(''.join(
        json.dumps({'kind': 'eval', 'step': s, 'eval_loss': raw, 'eval_loss_ema': ema}) + '\n'
        for s, (raw, ema) in curve.items()))
  out = subprocess.run([sys.executable, 'bench/optim_quality.py', f'--sweep={tmp_path}'], cwd=ROOT, env=train_env(1),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert re.search(r'adamw +0\.001 +5\.0000\n', out.stdout) and re.search(r'muon +0\.01 +4\.8000\n', out.stdout)
  # AdamW's best final loss is 5.0; muon lr 1e-2 gets there between steps 75 (5.1) and 100 (4.8) with its raw
  # weights, at 75 + 25 · 0.1/0.3 ≈ 83, and between 25 (6.9) and 50 (4.9) with its EMA's: 25 + 25 · 1.9/2 = 48.75.
  assert "reaches adamw's best final held-out loss 5.0000 (lr 0.001, step 100):" in out.stdout, out.stdout
  assert 'with its raw weights at step 83: 83% of the steps' in out.stdout, out.stdout
  assert 'with its EMA weights at step 49: 49% of the steps' in out.stdout, out.stdout
  # Stable phase: steps 11-80 (wsd decays the last 20 %): evaluations 25, 50, 75; the EMA is above raw at all
  # three for adamw lr 1e-3, and only at 25 for muon lr 1e-2 (EMA − raw from −0.4 at 50 to +1.1 at 25).
  assert re.search(r'adamw +0\.001 +11–80 +3 +25, 50, 75 +\+0\.1000 +\+1\.0000\n', out.stdout), out.stdout
  assert re.search(r'muon +0\.01 +11–80 +3 +25 +-0\.4000 +\+1\.1000\n', out.stdout), out.stdout
