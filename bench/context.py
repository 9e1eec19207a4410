"""Context parallelism on the CPU mesh: step time and compiled memory per device vs context size and sequence length.

  python bench/context.py [--seq_lens=1024,4096,16384] [--contexts=1,2,4,8] [--block_q=0] [--steps=2] [--json=out.json]

palm_tiny (float32, remat=full), one sequence per step, so only the context axis can split it: context=C runs
on C of 8 fake CPU devices (mesh context=C, every other axis 1). For each sequence length the context=1 step is
compiled in the same run, and each row's memory is given as a ratio of it. "temp" is XLA's temporary
(activation) bytes per device from the compiled step's memory analysis; "args" the state and batch each device
holds. Step time is the median of --steps timed steps after one untimed one; the fake devices share this
machine's cores, so it shows the cost of the extra collectives, not a speed-up (a real mesh has a core per
device). Rows where the compiled step needs more than --time_max_gib per device are compiled, not run.
--block_q sets model.attention_block_q (xla attention's query rows per block on each context shard; 0 = all).
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
import jaxlm  # noqa: E402,F401  first: malloc tuning before JAX starts
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm import cli, perf, sharding, step  # noqa: E402

GiB = 1024 ** 3


def config(seq_len: int, context: int, block_q: int = 0):
  """palm_tiny at `seq_len`, one sequence per step, split `context` ways."""
  cfg = cli.load_file(pathlib.Path(__file__).absolute().parents[1] / 'configs' / 'palm_tiny.py')
  cfg.model.update(remat='full', dtype='float32', attention_block_q=block_q)
  cfg.data.seq_len = seq_len
  cfg.train.update(batch_size=1, microbatches=1)
  cfg.stability.policy = 'off'
  cfg.mesh.update(data=1, fsdp=1, tensor=1, context=context)
  return cfg


def batch(seq_len: int, vocab: int, seed: int) -> dict:
  """One row of random tokens packed as 4 documents."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (1, seq_len + 1)).astype(np.int32)
  doc = seq_len // 4
  segment_ids = (np.arange(seq_len) // doc + 1).astype(np.int32)[None]
  positions = (np.arange(seq_len) % doc).astype(np.int32)[None]
  return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segment_ids, positions=positions,
              weights=np.ones((1, seq_len), np.float32))


def measure(seq_len: int, context: int, steps: int, time_max_gib: float, block_q: int = 0) -> dict:
  cfg = config(seq_len, context, block_q)
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:context])
  with sharding.activate(mesh):
    program = step.build_program(cfg, mesh)
    started = time.perf_counter()
    abstract = step.abstract_batch(1, seq_len, program.batch_sharding)
    compiled = program.train_step.lower(program.abstract_state, abstract).compile()
    compile_s = time.perf_counter() - started
    memory = perf.compiled_memory(compiled)
    stats = compiled.memory_analysis()
    r = dict(seq_len=seq_len, context=context, block_q=block_q, temp=stats.temp_size_in_bytes, args=stats.argument_size_in_bytes,
             compile_s=compile_s, step_s=None, loss=None, memory=memory)
    if (stats.temp_size_in_bytes + stats.argument_size_in_bytes) / GiB > time_max_gib:
      return r
    state = program.init()
    times = []
    for i in range(steps + 1):
      b = step.global_batch(batch(seq_len, cfg.model.vocab_size, i), program.batch_sharding)
      started = time.perf_counter()
      state, out = compiled(state, b)
      jax.block_until_ready((state, out))
      times.append(time.perf_counter() - started)
    r.update(step_s=statistics.median(times[1:]), loss=float(out['loss']))
  return r


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--seq_lens', default='1024,4096,16384')
  parser.add_argument('--contexts', default='1,2,4,8')
  parser.add_argument('--block_q', type=int, default=0)
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--time_max_gib', type=float, default=8.0)
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  rows, results = [], []
  for seq_len in map(int, args.seq_lens.split(',')):
    base = None
    for context in map(int, args.contexts.split(',')):
      r = measure(seq_len, context, args.steps, args.time_max_gib, args.block_q)
      results.append(r)
      base = r['temp'] if context == 1 else base
      ratio = f'{r["temp"] / base:.3f} (1/{base / r["temp"]:.2f})' if base else 'n/a'
      rows.append((str(seq_len), str(context), f'{r["temp"] / 2**20:,.1f} MiB', ratio,
                   f'{r["args"] / 2**20:,.1f} MiB', f'{r["compile_s"]:.1f} s',
                   'not run' if r['step_s'] is None else f'{r["step_s"]:.2f} s',
                   '' if r['loss'] is None else f'{r["loss"]:.3f}'))
      print('|', ' | '.join(rows[-1]), '|', flush=True)
  from jaxlm.metrics import format_table
  print(format_table(rows, header=('seq_len', 'context', 'temp/device', 'temp vs context=1', 'args/device',
                                   'compile', 'step (median)', 'loss')))
  if args.json:
    import json
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == '__main__':
  main()
