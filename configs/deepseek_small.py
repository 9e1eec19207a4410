"""deepseek_small: DeepSeek-V2-Lite's shape (about 16B parameters, 2.4B active) with DeepSeek-V3's blocks: multi-head
latent attention with a plain query projection (q_lora_rank=0), one dense layer then 26 mixture-of-experts layers
(64 routed experts, 6 per token, 2 shared; V3's sigmoid routing where V2-Lite's is softmax).
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'deepseek_small'
  c.model.update(vocab_size=102400, d_model=2048, num_layers=27, num_heads=16, num_kv_heads=16, head_dim=192,
                 mlp_dim=10944, parallel_block=False, tie_embeddings=False, norm_eps=1e-6, rope_theta=10_000.0,
                 kv_lora_rank=512, q_lora_rank=0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 moe_experts=64, moe_top_k=6, moe_mlp_dim=1408, moe_shared_experts=2, moe_first_dense=1,
                 moe_router='deepseek_v3', moe_bias_rate=1e-3,
                 attention='xla')  # MLA's query/key and value widths differ: the xla kernel
  c.data.seq_len = 4096
  c.train.update(steps=10_000, batch_size=16, eval_every=1000)
  c.optim.update(lr=4.2e-4, warmup_steps=2000)
  c.checkpoint.every = 1000
  return c
