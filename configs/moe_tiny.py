"""moe_tiny: palm_tiny's sizes as a Llama-style mixture of experts (4 experts, 2 per token); tests and smoke runs."""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'moe_tiny'
  c.model.update(vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128,
                 parallel_block=False, qk_norm='head', moe_experts=4, moe_top_k=2, moe_mlp_dim=32,
                 dtype='float32', remat='none')
  c.data.seq_len = 64
  c.data.stdlib_max_mb = 2
  c.train.update(steps=30, batch_size=8, log_every=5, eval_every=0, eval_batches=2)
  c.optim.update(lr=3e-3, warmup_steps=5)
  c.checkpoint.every = 10
  c.stability.update(spike_window=20, min_history=10)
  return c
