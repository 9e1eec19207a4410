"""olmo2_1b: OLMo 2 1B: norms after each sublayer (before the residual add) and QK-norm over all heads.

The shape of the released model (its Hugging Face config.json), to pre-train from scratch or, with
`python -m jaxlm.hf.import_llama`, to continue from its weights (import prints the same model keys).
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'olmo2_1b'
  c.model.update(vocab_size=100352, d_model=2048, num_layers=16, num_heads=16, num_kv_heads=16, head_dim=128,
                 mlp_dim=8192, parallel_block=False, tie_embeddings=False, rope_theta=500_000.0,
                 norm_placement='post', qk_norm='full',
                 attention='xla')  # a window, soft-cap or sinks: the masks of xla attention
  c.data.seq_len = 4096
  c.train.update(steps=10_000, batch_size=16, eval_every=1000)
  c.optim.update(lr=3e-4, warmup_steps=500)
  c.checkpoint.every = 1000
  return c
