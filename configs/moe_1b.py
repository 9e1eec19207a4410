"""moe_1b: about 1B parameters of which about 0.3B active per token (36 experts, 8 per token),
sized for one 80 GB GPU."""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'moe_1b'
  c.model.update(vocab_size=32768, d_model=1024, num_layers=16, num_heads=16, num_kv_heads=4, head_dim=64,
                 parallel_block=False, tie_embeddings=False, qk_norm='head', moe_experts=36, moe_top_k=8,
                 moe_mlp_dim=512, remat='full', attention='auto')
  c.data.seq_len = 2048
  c.train.update(steps=10_000, batch_size=16, eval_every=1000)
  c.optim.update(lr=3e-4, warmup_steps=500)
  c.checkpoint.every = 1000
  return c
