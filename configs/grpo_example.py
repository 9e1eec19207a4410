"""grpo_example: RL with verifiable rewards (DAPO's loss) on arithmetic, from an SFT checkpoint or an import.

  python -m jaxlm.hf.import_llama --hf_dir=path/to/Llama-3.2-1B-Instruct --out=runs/llama_import
  python -m jaxlm.rl --config=configs/grpo_example.py --rewards=configs/grpo/rewards.py:correct,formatted \\
      --workdir=runs/grpo --config.checkpoint.init_from=runs/llama_import/checkpoints \\
      --config.rl.tokenizer=runs/llama_import <the --config.model.* flags import printed>

Settings as TRL's GRPOTrainer and the DAPO paper use them: 8 completions per prompt, token-level loss (dapo),
clip-higher (epsilon_high 0.28), truncated completions masked, no KL (beta 0: no reference model), a small
constant learning rate. The stability guard judges update_ratio (rl.stability_watch): see README.
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'grpo_example'
  c.model.update(z_loss=0.0, dropout_rate=0.0, dtype='bfloat16', remat='full')
  c.data.seq_len = 512  # prompt (up to seq_len - max_new_tokens) + completion
  c.train.update(steps=500, batch_size=64, log_every=1, eval_every=0, seed=0)
  c.optim.update(name='adamw', lr=1e-6, warmup_steps=10, schedule='constant', weight_decay=0.0, b2=0.999, clip=1.0)
  c.checkpoint.update(every=50, keep=3, init_from='')  # set init_from to the SFT run's or the import's checkpoints
  c.rl.update(prompts=str(pathlib.Path(__file__).with_name('grpo') / 'arithmetic.jsonl'), num_generations=8,
              max_new_tokens=256, temperature=1.0, loss_type='dapo', scale_rewards='group', epsilon=0.2,
              epsilon_high=0.28, beta=0.0, mask_truncated=True, reward_weights='1,0.2')
  return c
