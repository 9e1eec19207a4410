"""palm_540b: the PaLM paper's 540B shapes, for two v4-6144 pods as in the paper — loads, validates and sizes here."""

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
  # For 2 × v4-6144 (PaLM's 6144 chips, 1536 hosts): mesh 1×192×16 per slice, dcn_data=2
  # (`--target=v4:16x16x12 --slices=2 --mesh=1,192,16`; the mesh is not set here, so the config still validates
  # on small hosts). The batch is a multiple of the 1536 hosts; 2 microbatches leave headroom on the 32 GiB
  # chips, where 1 fits with next to none (the pre-flight, bench/RESULTS.md).
  c.train.update(steps=250_000, batch_size=3072, microbatches=2, eval_every=5000)
  # PaLM: 1e-2 for 10k steps, then 1/sqrt(step) decay; here the same peak with jaxlm's warmup-cosine schedule.
  c.optim.update(lr=0.01, warmup_steps=10_000, weight_decay=0.1)
  c.checkpoint.update(every=1000, keep_every=10_000)
  return c
