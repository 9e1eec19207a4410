"""Tests of jaxlm.tools.report: the summary of a synthetic metrics.jsonl, and the PNG."""

import json
import subprocess
import sys

import ml_collections
import pytest

from jaxlm import metrics
from jaxlm.tools import report
from jaxlm import rundir

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def train(step, loss, **extra):
  return {'kind': 'train', 'step': step, 'time': 1e9 + step, 'loss': loss, 'lr': 1e-3 * step / 50,
          'grad_norm': 1.0 / step, 'tokens_per_s': 1000.0 + step, 'tokens': 4096 * step, **extra}


def synthetic_run() -> list[dict]:
  """Two processes: the first reaches step 30 and dies; the second resumes from step 20 and finishes at 50."""
  return [
      train(10, 4.0, mfu=0.30, mfu_causal=0.25), train(20, 3.5, mfu=0.40, mfu_causal=0.35),
      {'kind': 'eval', 'step': 20, 'time': 1e9, 'eval_loss': 3.6},
      {'kind': 'system', 'step': 20, 'time': 1e9, 'wall_s': 50.0, 'step_s': 30.0, 'goodput': 0.6},
      train(30, 3.4, mfu=0.40, mfu_causal=0.35),
      {'kind': 'event', 'step': 30, 'time': 1e9, 'event': 'slow_step', 'message': '3 slow steps'},
      {'kind': 'system', 'step': 30, 'time': 1e9, 'wall_s': 100.0, 'step_s': 70.0, 'goodput': 0.7},
      # second process: step 30 is redone, its later record wins
      train(30, 3.3, mfu=0.40, mfu_causal=0.35),
      {'kind': 'event', 'step': 31, 'time': 1e9, 'event': 'slow_step', 'message': 'again'},
      {'kind': 'event', 'step': 32, 'time': 1e9, 'event': 'rollback', 'message': 'loss spike'},
      {'kind': 'eval', 'step': 40, 'time': 1e9, 'eval_loss': 3.1},
      train(40, 3.0, mfu=0.50, mfu_causal=0.45), train(50, 2.9, mfu=0.50, mfu_causal=0.45),
      {'kind': 'eval', 'step': 50, 'time': 1e9, 'eval_loss': 3.2},
      {'kind': 'system', 'step': 50, 'time': 1e9, 'wall_s': 60.0, 'step_s': 50.0, 'goodput': 50 / 60},
  ]


def write_jsonl(path, records, torn_tail=True):
  with open(path, 'w') as f:
    for r in records:
      f.write(json.dumps(r) + '\n')
    if torn_tail:
      f.write('{"kind": "train", "step": 6')  # the process died mid-line


def test_read_metrics_skips_a_torn_last_line(tmp_path):
  write_jsonl(tmp_path / 'metrics.jsonl', synthetic_run())
  assert report.read_metrics(str(tmp_path / 'metrics.jsonl')) == synthetic_run()


def test_summarize():
  s = report.summarize(synthetic_run())
  assert s['steps'] == 50 and s['final_loss'] == 2.9 and s['tokens'] == 4096 * 50
  assert (s['best_eval_loss'], s['best_eval_step']) == (3.1, 40)
  # one record per step (30 redone: counted once): 1010, 1020, 1030, 1040, 1050
  assert s['mean_tokens_per_s'] == pytest.approx(1030.0)
  assert s['mean_mfu'] == pytest.approx(0.42) and s['mean_mfu_causal'] == pytest.approx(0.37)
  assert s['goodput'] == pytest.approx((70 + 50) / (100 + 60)) and s['processes'] == 2
  assert s['events'] == {'slow_step': 2, 'rollback': 1}


def test_summary_table():
  lines = report.summary_table(report.summarize(synthetic_run())).splitlines()
  # 'name', padded to the longest name ('mean MFU (causal)', 17 characters), two spaces, 'value'
  rows = {line[:17].strip(): line[19:] for line in lines}
  assert rows == {
      'steps': '50',
      'final loss': '2.9000',
      'best eval loss': '3.1000 (step 40)',
      'tokens': '204,800',
      'mean tokens/s': '1,030',
      'mean MFU': '42.0%',
      'mean MFU (causal)': '37.0%',
      'goodput': '75.0% over 2 processes',
      'events': 'rollback 1, slow_step 2',
  }


def test_summary_without_mfu_or_eval():
  records = [train(10, 4.0), train(20, 3.5)]
  table = report.summary_table(report.summarize(records))
  assert 'mean MFU           -' in table and 'best eval loss     -' in table and 'events             none' in table


def test_main_writes_a_png(tmp_path, capsys):
  write_jsonl(tmp_path / 'metrics.jsonl', synthetic_run())
  assert report.report(str(tmp_path)) == str(tmp_path / 'report.png')
  png = (tmp_path / 'report.png').read_bytes()
  assert png.startswith(PNG_MAGIC) and len(png) > 10_000  # four panels of curves, not an empty canvas
  out = capsys.readouterr().out
  assert 'final loss' in out and f'plot: {tmp_path / "report.png"}' in out


def test_main_without_metrics_fails_cleanly(tmp_path):
  with pytest.raises(rundir.RunDirError, match='no metrics.jsonl') as failure:
    report.report(str(tmp_path))
  assert failure.value.exit_code == 2


def test_report_reads_what_the_logger_writes(tmp_path):
  """Round trip through the real writer and the `python -m jaxlm.tools.report` entry point."""
  cfg = ml_collections.ConfigDict(dict(tensorboard=False, wandb=False))
  with metrics.MetricsLogger(str(tmp_path), cfg, total_steps=20) as logger:
    for step in (10, 20):
      logger.write(step, {'loss': 5.0 - step / 10, 'lr': 0.1, 'grad_norm': 1.0, 'tokens_per_s': 500.0})
    logger.write(20, {'eval_loss': 3.25}, kind='eval')
    logger.event(20, 'checkpoint_failed', 'disk full')
  out = tmp_path / 'curves.png'
  result = subprocess.run([sys.executable, '-m', 'jaxlm.tools.report', f'--workdir={tmp_path}', f'--out={out}'],
                          cwd=report.__file__.rsplit('/jaxlm/', 1)[0], capture_output=True, text=True,
                          timeout=120, check=True)
  assert 'final loss         3.0000' in result.stdout
  assert 'best eval loss     3.2500 (step 20)' in result.stdout
  assert 'events             checkpoint_failed 1' in result.stdout
  assert out.read_bytes().startswith(PNG_MAGIC)
