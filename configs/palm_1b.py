"""palm_1b: ~1B parameters in PaLM's shape, sized for one 80 GB GPU (the MFU benchmark's model)."""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'palm_1b'
  # Unrolled layers without activation checkpointing: the fastest setting on one H100 in issue #23's table (it
  # fits 80 GB; bench/RESULTS.md, "GPU"). Unrolling compiles each of the 16 layers separately (a longer compile,
  # README "Speed"); on a device with less memory use --config.model.remat=auto.
  c.model.update(vocab_size=32768, d_model=2048, num_layers=16, num_heads=16, num_kv_heads=1, head_dim=128,
                 remat='none', scan_layers=False, attention='auto')
  c.data.seq_len = 2048
  c.train.update(steps=10_000, batch_size=16, eval_every=1000)
  c.optim.update(lr=3e-4, warmup_steps=500)
  c.checkpoint.every = 1000
  return c
