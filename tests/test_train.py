"""The real entry point, end to end, on palm_tiny: it trains, evaluates, reports and checkpoints."""

import subprocess

from tests.conftest import ROOT
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
  for text in ("mesh: {'data': 1, 'fsdp': 8, 'tensor': 1}", 'layers/attention/query', "P(None, 'fsdp', 'tensor', None)",
               'compiled the train step', 'goodput', 'ETA'):
    assert text in out.stdout, text
  assert (tmp_path / 'checkpoints' / '40').is_dir() and list((tmp_path / 'tb').iterdir())
