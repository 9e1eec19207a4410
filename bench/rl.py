"""RL step time split: sampling (jaxlm.generate, KV cache) against training (the one train step), per step.

  python bench/rl.py --config=configs/palm_small.py [--steps=6] [--prompts=8] [--generations=8] [--new=64]

Runs the real loop (jaxlm.rl.run) on random prompts of 32 tokens with a verifiable toy reward (the share of even
token ids), then prints the median over the steps after the first (which compiles) of: sampling seconds,
train-step seconds, sampled tokens/s (completion tokens written) and trained tokens/s (rows × seq_len / step).
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile

if '--device=gpu' not in sys.argv:
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
import jaxlm  # noqa: E402,F401  first, as in `python -m jaxlm.rl` (malloc set up before JAX)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm import cli  # noqa: E402
from jaxlm import rl  # noqa: E402


class Ids:
  """Token ids written as 'w<id>' words: a tokenizer with nothing to download (id 0 ends a completion)."""
  eos_id = separator_id = 0
  special_tokens = {}

  def encode(self, text):
    return [int(w[1:]) for w in text.split()]

  def decode(self, ids):
    return ' '.join(f'w{i}' for i in ids)


def even(completion_ids, **_):
  return [float(np.mean([t % 2 == 0 for t in ids])) if ids else 0.0 for ids in completion_ids]


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--config', default='configs/palm_small.py')
  p.add_argument('--steps', type=int, default=6)
  p.add_argument('--prompts', type=int, default=8, help='prompts per step')
  p.add_argument('--generations', type=int, default=8)
  p.add_argument('--new', type=int, default=64, help='rl.max_new_tokens')
  p.add_argument('--device', default='cpu')
  args = p.parse_args()
  cfg = cli.load_file(args.config)
  work = pathlib.Path(tempfile.mkdtemp(prefix='bench_rl_'))
  rng = np.random.default_rng(0)
  V = cfg.model.vocab_size
  with open(work / 'prompts.jsonl', 'w') as f:
    for _ in range(64):
      f.write(json.dumps({'prompt': ' '.join(f'w{i}' for i in rng.integers(1, V, 32))}) + '\n')
  cfg.train.update(steps=args.steps, batch_size=args.prompts * args.generations, log_every=1, eval_every=0)
  cfg.optim.update(warmup_steps=0)
  cfg.checkpoint.update(every=0)
  cfg.log.tensorboard = False
  cfg.rl.update(prompts=str(work / 'prompts.jsonl'), num_generations=args.generations, max_new_tokens=args.new,
                temperature=1.0)
  rl.run(cfg, str(work / 'run'), [('even', even)], tokenizer=Ids())
  records = [json.loads(x) for x in (work / 'run' / 'metrics.jsonl').read_text().splitlines()]
  steps = [r for r in records if r.get('kind') == 'train'][1:]
  sample_s = statistics.median(r['sample_s'] for r in steps)
  # step_time_s is the loop's whole step (the rollout, as the step's data, and the train step): the rest is training
  train_s = statistics.median(r['step_time_s'] - r['sample_s'] for r in steps)
  written = statistics.median(r['completions/mean_length'] * cfg.train.batch_size for r in steps)
  rows = cfg.train.batch_size
  print(f'{cfg.name} on {jax.device_count()} {jax.devices()[0].device_kind} device(s): {args.prompts} prompts x '
        f'{args.generations} completions, up to {args.new} new tokens, seq_len {cfg.data.seq_len}; '
        f'median of {len(steps)} steps')
  print(f'{"sample s/step":>14} {"train s/step":>13} {"sample share":>13} {"sampled tok/s":>14} {"trained tok/s":>14}')
  print(f'{sample_s:>14.3f} {train_s:>13.3f} {sample_s / (sample_s + train_s):>13.0%} {written / sample_s:>14,.0f} '
        f'{rows * cfg.data.seq_len / train_s:>14,.0f}')


if __name__ == '__main__':
  main()
