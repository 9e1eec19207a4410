"""How long an asynchronous checkpoint blocks the training loop, against a synchronous save of the same state.

  python bench/checkpoint.py [--d_model=512 --num_layers=8 --repeats=3 --dir=/tmp/jaxlm_bench_ckpt]

Prints a table: blocked time per async save, time per sync save, their ratio (target: blocked <= 10 % of the
synchronous time), and the checkpoint's size on disk against parameter + optimizer bytes.
"""

import argparse
import os
import pathlib
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm import checkpoint as checkpoint_lib  # noqa: E402
from jaxlm import cli  # noqa: E402
from jaxlm import sharding, step, train  # noqa: E402


def _dir_bytes(path):
  return sum(f.stat().st_size for f in pathlib.Path(path).rglob('*') if f.is_file())


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--d_model', type=int, default=512)
  p.add_argument('--num_layers', type=int, default=8)
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--dir', default='/tmp/jaxlm_bench_ckpt')
  args = p.parse_args()

  cfg = cli.load_file(ROOT / 'configs' / 'palm_small.py')
  cfg.model.update(d_model=args.d_model, num_layers=args.num_layers, vocab_size=32768)
  mesh = sharding.make_mesh(cfg.mesh)
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    cfg.train.steps = 100
    program = step.build_program(cfg, mesh)
    # One real step first: freshly initialised Adam moments are zeros and would compress to nothing.
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=np.ones_like(tokens[:, 1:]),
                 positions=np.broadcast_to(np.arange(cfg.data.seq_len, dtype=np.int32), tokens[:, 1:].shape),
                 weights=np.ones(tokens[:, 1:].shape, np.float32))
    state, _ = program.train_step(program.init(), train.global_batch(batch, program.batch_sharding))
    state = jax.block_until_ready(state)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  events = []
  results = {}
  for mode in ('sync', 'async'):
    ckpt_cfg = cfg.checkpoint.copy_and_resolve_references()
    ckpt_cfg.async_save = mode == 'async'
    ckpt_cfg.keep = args.repeats + 1
    directory = os.path.join(args.dir, mode)
    shutil.rmtree(directory, ignore_errors=True)
    ckpt = checkpoint_lib.Checkpointer(directory, ckpt_cfg, lambda *a, **k: events.append(a))
    blocked, total = [], []
    for i in range(args.repeats):
      t0 = time.perf_counter()
      ckpt.save(i + 1, state, None, {})  # returns once the loop may go on
      t1 = time.perf_counter()
      ckpt.wait()
      blocked.append(t1 - t0)
      total.append(time.perf_counter() - t0)
    ckpt.close()
    results[mode] = (min(blocked), min(total), _dir_bytes(os.path.join(directory, str(args.repeats))))
  assert not events, events  # no save failed

  sync_s = results['sync'][0]
  rows = [('state (params + optimizer) bytes', f'{state_bytes / 2**20:,.1f} MiB'),
          ('checkpoint size on disk', f'{results["async"][2] / 2**20:,.1f} MiB '
                                      f'({results["async"][2] / state_bytes:.2f}× the state)'),
          ('synchronous save (loop blocked)', f'{sync_s * 1e3:,.0f} ms'),
          ('asynchronous save: loop blocked', f'{results["async"][0] * 1e3:,.0f} ms'),
          ('asynchronous save: until on disk', f'{results["async"][1] * 1e3:,.0f} ms'),
          ('blocked async / sync', f'{results["async"][0] / sync_s:.1%} (target <= 10%)')]
  width = max(len(r[0]) for r in rows)
  print(f'device: {jax.devices()[0].device_kind} × {jax.device_count()}, best of {args.repeats}')
  for name, value in rows:
    print(f'{name:<{width}}  {value}')


if __name__ == '__main__':
  main()
