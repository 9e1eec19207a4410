"""gemma3_1b: Gemma 3 1B (text): 5 local layers (a 512-token window, RoPE base 10k) to 1 global (base 1M), sandwich
norms with (1+w) scales, GeGLU, per-head QK-norm, embeddings times sqrt(D).

The shape of the released model (its Hugging Face config.json), to pre-train from scratch or, with
`python -m jaxlm.hf.import_llama`, to continue from its weights (import prints the same model keys).
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'gemma3_1b'
  c.model.update(vocab_size=262144, d_model=1152, num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
                 mlp_dim=6912, parallel_block=False, tie_embeddings=True, rope_theta=1_000_000.0,
                 rope_local_theta=10_000.0, attention_window=512, attention_global_every=6,
                 query_pre_attn_scalar=256.0, qk_norm='head', norm_placement='sandwich', norm_offset=True,
                 mlp_activation='geglu', embed_scale=True,
                 attention='xla')  # a window, soft-cap or sinks: the masks of xla attention
  c.data.seq_len = 4096  # the released model reaches 32k; raise it with the memory to spare
  c.train.update(steps=10_000, batch_size=16, eval_every=1000)
  c.optim.update(lr=3e-4, warmup_steps=500)
  c.checkpoint.every = 1000
  return c
