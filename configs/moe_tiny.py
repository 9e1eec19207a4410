"""moe_tiny: palm_tiny's sizes as a Llama-style mixture of experts (4 experts, 2 per token); tests and smoke runs."""

import pathlib

from jaxlm.cli import load_file

_TINY = pathlib.Path(__file__).with_name('palm_tiny.py')


def get_config():
  c = load_file(_TINY)  # everything else as palm_tiny: the two differ only in the MLP and the block
  c.name = 'moe_tiny'
  c.model.update(parallel_block=False, qk_norm='head', moe_experts=4, moe_top_k=2, moe_mlp_dim=32)
  return c
