"""The benchmark scripts still run and report consistent figures (speed itself is measured by hand, not here)."""

import json
import math
import re
import subprocess
import sys

from tests.conftest import ROOT
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


def test_mfu_and_matmul_benchmarks_print_their_tables():
  out = run_bench('mfu.py', '--steps=2', '--warmup=1', '--config.train.deterministic=True')
  assert 'tokens/s' in out and 'MFU' in out and 'n/a (unknown peak)' in out
  # train.deterministic honoured as the trainer does, and the flags it ran with printed, first and in the table.
  assert 'train.deterministic=True; XLA_FLAGS: ' in out
  assert re.search(r'^deterministic +train\.deterministic=True$', out, re.M)
  flags_row = next(line for line in out.splitlines() if line.startswith('XLA_FLAGS'))
  assert '--xla_gpu_deterministic_ops=true' in flags_row and '--xla_force_host_platform_device_count' in flags_row
  out = run_bench('cpu_matmul.py', '--repeats=2')
  assert out.count(': weight grad') == 5 and 'sum (each product once)' in out


def test_pipeline_bench_rows_compute_the_same_loss(tmp_path):
  out = subprocess.run([sys.executable, 'bench/pipeline.py', '--stages=1,2', '--microbatches=1,2', '--layers=2',
                        '--batch=16', '--seq=16', '--steps=1', f'--json={tmp_path}/r.json'], cwd=ROOT,
                       env=train_env(1), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rows = json.loads((tmp_path / 'r.json').read_text())
  assert [(r['stages'], r['microbatches']) for r in rows] == [(1, 1), (2, 2), (2, 4)]
  assert [r['bubble'] for r in rows] == [0.0, 1 / 3, 1 / 5]
  assert all(math.isclose(r['loss'], rows[0]['loss'], rel_tol=1e-5) for r in rows)  # the same model and batch
  assert 'bubble computed' in out.stdout and 'bubble measured' in out.stdout


def test_mfu_baseline_torch_prints_both_rows_and_their_ratio(tmp_path):
  # bfloat16: the baseline must run mixed precision (autocast over float32 master weights), which plain float32
  # weights meeting bfloat16 activations did not (issue #23). Eager torch: no C++ compile in CI.
  out = run_bench('mfu.py', '--steps=2', '--warmup=1', '--baseline=torch', '--notorch_compile',
                  '--config.model.dtype=bfloat16', f'--json={tmp_path}/r.json')
  r = json.loads((tmp_path / 'r.json').read_text())
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
