"""gpt_oss_20b: gpt-oss-20b's shape (20.9B parameters; 3.6B active per token besides the input embeddings): 24
layers alternating a 128-token sliding window and full attention, each head with a learned sink, biases on q, k, v
and out, YaRN RoPE (32 × a 4k context), and a mixture of experts in every layer: 32 experts, 4 per token, routed by
a softmax over the top-4 logits (plus a router bias), each expert gpt-oss's clamped SwiGLU with biases.

The shape of the released model (its Hugging Face config.json), to pre-train from scratch or, with
`python -m jaxlm.hf.import_llama` on the released checkpoint (its MXFP4 experts are dequantized on import), to
continue from its weights (import prints the same model keys).
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'gpt_oss_20b'
  c.model.update(vocab_size=201088, d_model=2880, num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64,
                 mlp_dim=2880, parallel_block=False, tie_embeddings=False, norm_eps=1e-5, rope_theta=150_000.0,
                 rope_scaling='yarn', rope_factor=32.0, rope_original_max_positions=4096, rope_beta_fast=32.0,
                 rope_beta_slow=1.0, rope_truncate=False, attention_window=128, attention_global_every=2,
                 attention_sinks=True, attention_bias=True, mlp_activation='clamped', mlp_swiglu_limit=7.0,
                 mlp_swiglu_alpha=1.702, moe_experts=32, moe_top_k=4, moe_mlp_dim=2880, moe_router='gpt_oss',
                 moe_expert_bias=True, moe_router_bias=True, moe_bias_rate=0.0, moe_aux_loss=1e-3,
                 attention='xla')  # a window or sinks: the masks of xla attention
  c.data.seq_len = 4096  # the released model reaches 128k through YaRN; raise it with the memory to spare
  c.train.update(steps=10_000, batch_size=16, eval_every=1000)
  c.optim.update(lr=3e-4, warmup_steps=500)
  c.checkpoint.every = 1000
  return c
