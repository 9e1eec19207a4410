"""How long a checkpoint save blocks the training loop, and what it is made of, against a synchronous save.

  python bench/checkpoint.py [--config=configs/palm_1b.py] [--d_model=1024 --num_layers=8] [--repeats=2]
                             [--interval=0] [--dir=/tmp/jaxlm_bench_ckpt]

Builds the config's real train state (parameters and AdamW moments, sharded as the trainer shards them; the
moments filled with random values, since zeros would compress to nothing) without compiling a train step, then
saves it with jaxlm's Checkpointer, `--repeats` times synchronously and `--repeats` times asynchronously. One
row per save: the time the caller was blocked and what it was made of (waiting for the previous save, Orbax's
device-to-host copy, its write plan), the time until the step was on disk, and until its checksums were written.

`--interval=S`: the asynchronous saves come S seconds apart (the loop "trains" meanwhile) instead of each after
the previous one is on disk; below the write time, each save then waits for the previous one, and the
Checkpointer says so once. The summary line gives blocked async / sync (target: the copy alone).
"""

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxlm import checkpoint as checkpoint_lib  # noqa: E402
from jaxlm import cli  # noqa: E402
from jaxlm import metrics  # noqa: E402
from jaxlm import sharding, step  # noqa: E402


def _dir_bytes(path):
  return sum(f.stat().st_size for f in pathlib.Path(path).rglob('*') if f.is_file())


def random_state(cfg, mesh):
  """The config's initial train state with every floating array filled with small random values, on its shardings."""
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    program = step.build_program(cfg, mesh)
    state = program.init()

    def noise(x, seed):  # a cheap hash of the position (threefry over a 1B-parameter state takes minutes on a CPU)
      i = jax.lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1) + x.shape[-1] * jax.lax.broadcasted_iota(
          jnp.float32, x.shape, 0) + seed
      return (x + 0.01 * (jnp.sin(i * 12.9898) * 43758.5453 % 1.0)).astype(x.dtype)

    def fill(s):
      leaves, tree = jax.tree.flatten(s)
      return tree.unflatten([noise(x, n) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim else x
                             for n, x in enumerate(leaves)])

    state = jax.jit(fill, donate_argnums=0, out_shardings=program.state_shardings)(state)
    return jax.block_until_ready(state)


def run(state, ckpt_cfg, directory: str, repeats: int, interval: float, events: list) -> tuple[list[dict], int]:
  """Saves `state` `repeats` times; returns the Checkpointer's timing of each save (plus on-disk and checksum
  times) and the bytes of the last save on disk."""
  shutil.rmtree(directory, ignore_errors=True)
  ckpt = checkpoint_lib.Checkpointer(directory, ckpt_cfg, lambda *a, **k: events.append((a, k)))
  rows = []
  for i in range(repeats):
    ckpt.save(i + 1, state, None, {'bench': True})  # returns once the loop may go on
    timing = ckpt.timings[-1]
    if interval:
      end = time.monotonic() + interval
      while time.monotonic() < end:  # the loop trains on; it polls once per step
        ckpt.poll()
        time.sleep(0.01)
    else:
      ckpt.wait()
      start = time.monotonic()
      ckpt._join_hashing()  # pylint: disable=protected-access  -- the checksums are part of a save's cost
      timing['checksums_s'] = timing['write_s'] + time.monotonic() - start
    rows.append(timing)
  ckpt.close()
  size = _dir_bytes(os.path.join(directory, str(repeats)))
  shutil.rmtree(directory, ignore_errors=True)  # a 1B model's state is gigabytes: one mode's copies on disk at a time
  return rows, size


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--config', default=str(ROOT / 'configs' / 'palm_small.py'))
  p.add_argument('--d_model', type=int, default=0, help='override model.d_model (0: the config\'s)')
  p.add_argument('--num_layers', type=int, default=0, help='override model.num_layers (0: the config\'s)')
  p.add_argument('--vocab_size', type=int, default=0, help='override model.vocab_size (0: the config\'s)')
  p.add_argument('--repeats', type=int, default=2)
  p.add_argument('--interval', type=float, default=0.0, help='seconds between async saves (0: each after the last)')
  p.add_argument('--dir', default='/tmp/jaxlm_bench_ckpt')
  args = p.parse_args()

  cfg = cli.load_file(args.config)
  for key in ('d_model', 'num_layers', 'vocab_size'):
    if getattr(args, key):
      cfg.model[key] = getattr(args, key)
  mesh = sharding.make_mesh(cfg.mesh)
  start = time.monotonic()
  state = random_state(cfg, mesh)
  build_s = time.monotonic() - start
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  events, results = [], {}
  for mode in ('sync', 'async'):
    ckpt_cfg = cfg.checkpoint.copy_and_resolve_references()
    ckpt_cfg.async_save = mode == 'async'
    ckpt_cfg.keep = 2  # the step being written and the one before: what a training run holds at least
    results[mode], size = run(state, ckpt_cfg, os.path.join(args.dir, mode), args.repeats,
                              args.interval if mode == 'async' else 0.0, events)
  failed = [e for e in events if e[0][1] != 'checkpoint_stall']
  assert not failed, failed  # no save failed

  def ms(x):
    return '-' if x is None else f'{x * 1e3:,.0f}'

  header = ('mode', 'save', 'blocked ms', 'waited prev ms', 'copy ms', 'plan ms', 'rest ms', 'on disk ms',
            '+ checksums ms')
  rows = []
  for mode, timings in results.items():
    for t in timings:
      parts = [t.get(k, 0.0) for k in ('waited_s', 'copy_s', 'plan_s')]
      rows.append((mode, t['step'], ms(t['blocked_s']), ms(t['waited_s']), ms(t.get('copy_s')),
                   ms(t.get('plan_s')), ms(t['blocked_s'] - sum(parts)), ms(t.get('write_s')),
                   ms(t.get('checksums_s'))))
  print(f'device: {jax.devices()[0].device_kind} × {jax.device_count()}, jax {jax.__version__}; config '
        f'{os.path.basename(args.config)} d_model={cfg.model.d_model} num_layers={cfg.model.num_layers} '
        f'vocab={cfg.model.vocab_size}: state (params + optimizer) {state_bytes / 2**20:,.1f} MiB, on disk '
        f'{size / 2**20:,.1f} MiB; state built in {build_s:.1f}s; async interval '
        f'{args.interval or "after the previous save is on disk"}')
  print(metrics.format_table(rows, header=header, right=(False,) + (True,) * 8, rule=True))
  sync = statistics.median(t['blocked_s'] for t in results['sync'])
  blocked = statistics.median(t['blocked_s'] for t in results['async'])
  copy = statistics.median(t.get('copy_s', 0.0) for t in results['async'])
  print(f'median blocked: async {blocked * 1e3:,.0f} ms / sync {sync * 1e3:,.0f} ms = {blocked / sync:.1%}; '
        f'of the async block, the copy off the devices is {copy * 1e3:,.0f} ms ({copy / blocked:.0%})')
  for (_, name, message), _ in (e for e in events if e[0][1] == 'checkpoint_stall'):
    print(f'[{name}] {message}')
  shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == '__main__':
  main()
