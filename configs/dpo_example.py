"""dpo_example: preference tuning (DPO) of an SFT run with LoRA adapters; the base model is the reference.

  python -m jaxlm.data.prepare --format=preference --tokenizer=runs/llama_import --seq_len=2048 \\
      --inputs=pairs.jsonl --out=data/pairs
  python -m jaxlm.train --config=configs/dpo_example.py --workdir=runs/dpo \\
      --config.checkpoint.init_from=runs/sft/checkpoints <the --config.model.* flags import printed>
  python -m jaxlm.hf.export --workdir=runs/dpo --out=hf/dpo --adapter_out=hf/dpo_adapter

Hyperparameters in the range DPO recipes use (TRL's DPOConfig defaults, Zephyr / Tülu DPO): β = 0.1, a small
constant-after-warmup learning rate (LoRA takes a larger one than full fine-tuning: 5e-6 full, 5e-5 here), one to
three epochs, no weight decay, no z-loss. With model.lora.rank=0 the reference is a frozen copy of the initial
weights instead (preference.reference=copy, optionally preference.reference_dtype=bfloat16).
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'dpo_example'
  c.model.update(z_loss=0.0, dropout_rate=0.0, dtype='bfloat16', remat='full')
  c.model.lora.update(rank=8, alpha=16.0, base_dtype='bfloat16')  # peft's default rank
  c.data.update(source='prepared', paths='data/pairs', seq_len=2048)
  c.train.update(objective='preference', epochs=1, batch_size=16, log_every=10, eval_every=50, eval_batches=4)
  c.preference.update(loss_type='sigmoid', beta=0.1, reference='base')
  c.optim.update(name='adamw', lr=5e-5, warmup_steps=10, schedule='constant', weight_decay=0.0, b2=0.999,
                 clip=1.0)
  c.checkpoint.update(every=100, init_from='')  # set init_from to the SFT run's (or the import's) checkpoints
  return c
