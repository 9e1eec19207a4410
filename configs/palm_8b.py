"""palm_8b: the PaLM paper's 8B shapes, for reference — loads, validates and sizes here; train it on a pod slice."""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'palm_8b'
  # PaLM 8B (paper, table 1): 32 layers, d 4096, 16 heads of 256, multi-query, 256k vocab
  c.model.update(vocab_size=256_000, d_model=4096, num_layers=32, num_heads=16, num_kv_heads=1, head_dim=256,
                 remat='full')
  c.data.seq_len = 2048
  # 4 microbatches: the pre-flight's cheapest setting that fits a v4-64 slice's 32 GiB chips (bench/RESULTS.md).
  c.train.update(steps=250_000, batch_size=512, microbatches=4, eval_every=5000)
  # PaLM: 1e-2 for 10k steps, then 1/sqrt(step) decay; here the same peak with jaxlm's warmup-cosine schedule.
  c.optim.update(lr=0.01, warmup_steps=10_000, weight_decay=0.1)
  c.checkpoint.update(every=1000, keep_every=10_000)
  return c
