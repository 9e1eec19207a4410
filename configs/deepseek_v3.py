"""deepseek_v3: DeepSeek-V3's shape (671B parameters, 37B active per token): multi-head latent attention, three
dense layers then 58 mixture-of-experts layers (256 routed experts, 8 per token in 4 of 8 groups, one shared
expert, sigmoid scores with the auxiliary-loss-free bias), one multi-token prediction depth.

The shape of the released model (its Hugging Face config.json); `python -m jaxlm.hf.import_llama` prints the same
model keys for a checkpoint (whose MTP layer it does not import yet). jaxlm's MTP block is dense, not a mixture
of experts as DeepSeek-V3's.
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'deepseek_v3'
  c.model.update(vocab_size=129280, d_model=7168, num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192,
                 mlp_dim=18432, parallel_block=False, tie_embeddings=False, norm_eps=1e-6, rope_theta=10_000.0,
                 kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 moe_experts=256, moe_top_k=8, moe_mlp_dim=2048, moe_shared_experts=1, moe_first_dense=3,
                 moe_router='deepseek_v3', moe_groups=8, moe_top_groups=4, moe_routed_scale=2.5,
                 moe_bias_rate=1e-3, mtp_depth=1, mtp_weight=0.3,
                 attention='xla')  # MLA's query/key and value widths differ: the xla kernel
  c.data.seq_len = 4096
  c.train.update(steps=10_000, batch_size=16, eval_every=1000)
  c.optim.update(lr=2.2e-4, warmup_steps=2000)
  c.checkpoint.every = 1000
  return c
