"""Sliding-window layers on the CPU: train-step time per token against sequence length, local against global, and
the sampler's KV-cache bytes per layer (issue #59, §3).

  python bench/window.py [--seq_lens=1024,2048,4096,8192] [--window=256] [--tokens=8192] [--steps=3]
                         [--models=local,global] [--json=out.json]

palm_tiny (float32, one device) with every layer local (model.attention_window=W) or every layer global, the same
--tokens per step at each length (batch = tokens / length, rows of 4 documents), so a flat time per token means a
cost linear in the sequence. A local layer's xla attention goes by blocks of W queries over the 2W keys their window
reaches, folded into the batch (jaxlm/attention.py), a global one over the whole causal row. Step time is the median
of --steps timed steps after one untimed one, and the best of them (on a shared machine the least disturbed: the
other programs' load only adds). Every program (model and length) is compiled first and their steps interleave, one
of each in turn, so a shared machine's drift hits them all alike. Each row's "vs first" is its time per token over
the first length's, median and best. The cache rows are the decoding cache (jaxlm/generate.py: cache_shapes) of one
sequence of the last length: a local layer keeps a ring of W slots.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
import jaxlm  # noqa: E402,F401  first: malloc tuning before JAX starts
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm import cli, generate, model, sharding, step  # noqa: E402


def config(seq_len: int, window: int, tokens: int):
  """palm_tiny at `seq_len`, tokens / seq_len rows per step, every layer local (`window` > 0) or global."""
  cfg = cli.load_file(pathlib.Path(__file__).absolute().parents[1] / 'configs' / 'palm_tiny.py')
  cfg.model.update(dtype='float32', attention_window=window, attention_global_every=0, remat='none')
  cfg.data.seq_len = seq_len
  cfg.train.update(batch_size=max(1, tokens // seq_len), microbatches=1)
  cfg.stability.policy = 'off'
  cfg.mesh.update(data=1, fsdp=1, tensor=1, context=1)
  return cfg


def batch(rows: int, seq_len: int, vocab: int, seed: int) -> dict:
  """Random tokens, each row packed as 4 documents."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (rows, seq_len + 1)).astype(np.int32)
  doc = seq_len // 4
  segment_ids = np.broadcast_to((np.arange(seq_len) // doc + 1).astype(np.int32), (rows, seq_len))
  positions = np.broadcast_to((np.arange(seq_len) % doc).astype(np.int32), (rows, seq_len))
  return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segment_ids, positions=positions,
              weights=np.ones((rows, seq_len), np.float32))


def compiled_step(cfg):
  """(program, the train step compiled for cfg's batch, the mesh) on one device."""
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  with sharding.activate(mesh):
    program = step.build_program(cfg, mesh)
    abstract = step.abstract_batch(cfg.train.batch_size, cfg.data.seq_len, program.batch_sharding)
    return program, program.train_step.lower(program.abstract_state, abstract).compile(), mesh


def step_seconds(runs: dict, steps: int) -> dict:
  """(median, best) step time of each compiled program in `runs` (name -> (cfg, program, compiled, mesh)), the
  programs' steps interleaved."""
  states = {}
  for name, (cfg, program, _, mesh) in runs.items():
    with sharding.activate(mesh):
      states[name] = program.init()
  times = {name: [] for name in runs}
  for i in range(steps + 1):
    for name, (cfg, program, compiled, mesh) in runs.items():
      with sharding.activate(mesh):
        b = step.global_batch(batch(cfg.train.batch_size, cfg.data.seq_len, cfg.model.vocab_size, i),
                              program.batch_sharding)
        started = time.perf_counter()
        states[name], out = compiled(states[name], b)
        jax.block_until_ready((states[name], out))
        times[name].append(time.perf_counter() - started)
  return {name: (statistics.median(t[1:]), min(t[1:])) for name, t in times.items()}


def cache_bytes(seq_len: int, window: int) -> dict:
  """Bytes of one layer's decoding cache (keys and values) for one sequence of seq_len tokens."""
  cfg = config(seq_len, window, seq_len)
  m = model.ModelConfig.from_config(cfg.model)
  tokens = np.zeros((1, 8), np.int32)
  params = nn.unbox(jax.eval_shape(model.Decoder(m).init, jax.random.PRNGKey(0), tokens, tokens + 1, tokens)['params'])
  shapes = generate.cache_shapes(generate.inference_model(m), params, 1, seq_len)
  leaves = jax.tree_util.tree_leaves_with_path(shapes['layers']['attention'])
  total = sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for path, x in leaves
              if str(path[-1].key) in ('key', 'value'))
  return dict(bytes_per_layer=int(total // m.num_layers), slots=int(shapes['layers']['attention']['key'].shape[2]))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--seq_lens', default='1024,2048,4096,8192')
  p.add_argument('--window', type=int, default=256)
  p.add_argument('--tokens', type=int, default=8192, help='tokens per step at every length')
  p.add_argument('--steps', type=int, default=3)
  p.add_argument('--models', default='local,global', help='which of local, global to time')
  p.add_argument('--json', default='')
  args = p.parse_args()
  runs = {}  # every (model, length) compiled first: their steps then interleave, one round over all of them a step
  for seq_len in [int(s) for s in args.seq_lens.split(',')]:
    for name, window in (('local', args.window), ('global', 0)):
      if name in args.models.split(','):
        cfg = config(seq_len, window, args.tokens)
        runs[name, seq_len] = (cfg, *compiled_step(cfg))
  seconds = step_seconds(runs, args.steps)
  rows = []
  for (name, seq_len), (cfg, *_rest) in runs.items():
    tokens = cfg.train.batch_size * seq_len
    median, best = seconds[name, seq_len]
    rows.append(dict(model=name, seq_len=seq_len, tokens=tokens, step_s=median, best_s=best,
                     us_per_token=median / tokens * 1e6, best_us_per_token=best / tokens * 1e6))
  first = {r['model']: r for r in rows if r['seq_len'] == rows[0]['seq_len']}
  print(f'palm_tiny, float32, one CPU device, {args.tokens} tokens a step; local: W = {args.window}')
  print(f'{"model":7s} {"seq_len":>7s} {"rows":>4s} {"step s":>8s} {"us/token":>9s} {"vs first":>8s} '
        f'{"best s":>8s} {"us/token":>9s} {"vs first":>8s}')
  for r in rows:
    r['vs_first'] = r['us_per_token'] / first[r['model']]['us_per_token']
    r['best_vs_first'] = r['best_us_per_token'] / first[r['model']]['best_us_per_token']
    print(f'{r["model"]:7s} {r["seq_len"]:7d} {r["tokens"] // r["seq_len"]:4d} {r["step_s"]:8.3f} '
          f'{r["us_per_token"]:9.2f} {r["vs_first"]:7.2f}x {r["best_s"]:8.3f} {r["best_us_per_token"]:9.2f} '
          f'{r["best_vs_first"]:7.2f}x')
  last = rows[-1]['seq_len']
  caches = {name: cache_bytes(last, window) for name, window in (('local', args.window), ('global', 0))}
  print(f'\ndecoding cache of one {last}-token sequence, per layer (keys and values, float32):')
  for name, c in caches.items():
    print(f'  {name:7s} {c["slots"]:6d} slots  {c["bytes_per_layer"] / 2**20:8.2f} MiB')
  print(f'  global / local: {caches["global"]["bytes_per_layer"] / caches["local"]["bytes_per_layer"]:.1f}x')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(dict(rows=rows, caches=caches, window=args.window, tokens=args.tokens), f, indent=1)


if __name__ == '__main__':
  main()
