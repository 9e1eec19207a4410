"""mistral_7b: Mistral 7B (v0.1): Llama's block with every layer local over a 4096-token window, grouped-query
attention.

The shape of the released model (its Hugging Face config.json), to pre-train from scratch or, with
`python -m jaxlm.hf.import_llama`, to continue from its weights (import prints the same model keys).
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'mistral_7b'
  c.model.update(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                 mlp_dim=14336, parallel_block=False, tie_embeddings=False, rope_theta=10_000.0, norm_eps=1e-5,
                 attention_window=4096,
                 attention='xla')  # a window, soft-cap or sinks: the masks of xla attention
  c.data.seq_len = 8192
  # 2 microbatches: with 1 the step needs more than a v5p-8's 95 GiB a chip (bench/RESULTS.md, Pre-flight).
  c.train.update(steps=10_000, batch_size=16, eval_every=1000, microbatches=2)
  c.optim.update(lr=3e-4, warmup_steps=500)
  c.checkpoint.every = 1000
  return c
