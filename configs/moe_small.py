"""moe_small: the CPU demo as a mixture of experts — palm_small's width and depth, 8 experts with 2 per token.

Each token's MLP work equals palm_small's (2 experts of width 512 = one SwiGLU of width 1024), so the two compare
at equal active FLOPs: `python -m jaxlm.train --config=configs/moe_small.py`.
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'moe_small'
  # As palm_small: float32, no remat and unrolled layers on a CPU. The Llama-style block, as every HF MoE family.
  # moe_impl=dense (every expert on every token, a one-hot combine): XLA:CPU expands ragged_dot into a slower
  # masked product over all experts (bench/RESULTS.md "Mixture of experts"); the same function, so the held-out
  # comparison with palm_small is unchanged. Use moe_impl=ragged (dropless grouped GEMMs) on GPU/TPU.
  c.model.update(vocab_size=4096, d_model=256, num_layers=4, num_heads=4, num_kv_heads=1, parallel_block=False,
                 qk_norm='head', moe_experts=8, moe_top_k=2, moe_mlp_dim=512, moe_impl='dense',
                 dtype='float32', remat='none', scan_layers=False, explicit_transpose_grads=True)
  c.data.seq_len = 128
  c.train.update(steps=300, batch_size=16, log_every=10, eval_every=100, eval_batches=8)
  c.optim.update(lr=3e-3, warmup_steps=30)
  return c
