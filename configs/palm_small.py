"""palm_small: the CPU demo — trains on this interpreter's standard library in a few minutes on 2 cores."""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'palm_small'
  # float32 compute: most CPUs emulate bf16 matmuls and run them several times slower. No remat: a CPU has
  # memory to spare and recomputation would cost a third more time. Use dtype=bfloat16 on GPU/TPU.
  # Unrolled layers and plain-product weight gradients: each measured faster on XLA:CPU (bench/RESULTS.md);
  # four layers compile in seconds either way.
  c.model.update(vocab_size=4096, d_model=256, num_layers=4, num_heads=4, num_kv_heads=1,
                 dtype='float32', remat='none', scan_layers=False, explicit_transpose_grads=True)
  c.data.seq_len = 128
  c.train.update(steps=300, batch_size=16, log_every=10, eval_every=100, eval_batches=8)
  c.optim.update(lr=3e-3, warmup_steps=30)
  return c
