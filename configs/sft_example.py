"""sft_example: supervised fine-tuning of an imported model on chat data (the prompt masked out of the loss).

  python -m jaxlm.hf.import_llama --hf_dir=path/to/Llama-3.2-1B-Instruct --out=runs/llama_import
  python -m jaxlm.data.prepare --format=chat --tokenizer=runs/llama_import --seq_len=2048 \\
      --inputs=chats.jsonl --out=data/chat
  python -m jaxlm.train --config=configs/sft_example.py --workdir=runs/sft \\
      --config.checkpoint.init_from=runs/llama_import/checkpoints <the --config.model.* flags import printed>

Hyperparameters in the range SFT recipes use (TRL's SFTTrainer defaults, Llama / Tülu fine-tuning): a small peak
learning rate with a short warmup and cosine decay, a few epochs, no weight decay, no z-loss (the imported model was
not trained with one), gradient clipping at 1.
"""

import pathlib

from jaxlm.cli import load_file

_BASE = pathlib.Path(__file__).with_name('base.py')


def get_config():
  c = load_file(_BASE)
  c.name = 'sft_example'
  c.model.update(z_loss=0.0, dropout_rate=0.0, dtype='bfloat16', remat='full')
  c.data.update(source='prepared', paths='data/chat', seq_len=2048)
  c.train.update(epochs=3, batch_size=16, log_every=10, eval_every=50, eval_batches=4)
  c.optim.update(name='adamw', lr=2e-5, warmup_steps=10, schedule='cosine', final_lr_fraction=0.0,
                 weight_decay=0.0, b2=0.999, clip=1.0)
  c.checkpoint.update(every=100, init_from='')  # set init_from to the import's checkpoints directory
  return c
