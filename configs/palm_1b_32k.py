"""palm_1b_32k: palm_1b at 32k tokens per sequence, each sequence split 4 ways over the context axis.

Sized for a v5p-8 slice (4 chips, 95 GiB HBM each): mesh context=4, so each chip holds 8192 of every
sequence's 32768 tokens and gathers the one key/value head (multi-query) of the rest, layer by layer. Pre-flight: `python -m jaxlm.tools.size --config=configs/palm_1b_32k.py --target=v5p:2x2x1`
(bench/RESULTS.md, "Pre-flight"). Attention is xla: splash and cuDNN cannot take the zig-zag order's mask.
RoPE: trained from scratch at 32k the base wavelength is raised (as Llama 3 / Code Llama do for long context);
to extend a palm_1b checkpoint instead, keep rope_theta and set model.rope_scaling (linear, llama3 or yarn).
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('palm_1b.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'palm_1b_32k'
  c.model.update(attention='xla', remat='full', rope_theta=500_000.0)
  c.data.seq_len = 32768
  # 4 × 32768 = 131k tokens per step, in 4 sequential microbatches: one sequence's activations at a time.
  c.train.update(batch_size=4, microbatches=4)
  # context=4 on a v5p-8's 4 chips; any devices beyond go to tensor (each sequence's microbatch is one row, so
  # data and fsdp, which split rows, have none to split).
  c.mesh.update(data=1, fsdp=1, tensor=-1, context=4)
  return c
