"""palm_540b: the PaLM paper's 540B shapes, for reference — loads, validates and sizes here; train it on a pod slice."""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'palm_540b'
  # PaLM 540B (paper, table 1): 118 layers, d 18432, 48 heads of 256, multi-query, 256k vocab
  c.model.update(vocab_size=256_000, d_model=18432, num_layers=118, num_heads=48, num_kv_heads=1, head_dim=256,
                 remat='full')
  c.data.seq_len = 2048
  c.train.update(steps=250_000, batch_size=2048, eval_every=5000)
  # PaLM: 1e-2 for 10k steps, then 1/sqrt(step) decay; here the same peak with jaxlm's warmup-cosine schedule.
  c.optim.update(lr=0.01, warmup_steps=10_000, weight_decay=0.1)
  c.checkpoint.update(every=1000, keep_every=10_000)
  return c
