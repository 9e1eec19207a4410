"""Every weight matmul of a train step, alone: XLA (as jaxlm's step emits it) against PyTorch, on this device.

  python bench/cpu_matmul.py --config=configs/palm_small.py [--repeats=40]

For each product of the step — forward (x·W), input gradient (dy·Wᵀ) and weight gradient (xᵀ·dy) of the
attention, MLP and tied output projections — it times the same float32 product, with the same operand layouts,
in jax.jit and in torch (2 threads), alternating, and prints milliseconds, GFLOP/s and the ratio. If XLA's
products are as fast as PyTorch's but the step is not, the step's time goes elsewhere (see `cpu_step.py --phases`).
"""

import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from ml_collections import config_flags  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
from jaxlm import model as model_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/palm_small.py.')
_REPEATS = flags.DEFINE_integer('repeats', 40, 'Timed calls of each product in each framework.')

# Operand layouts as (lhs contracting dim, rhs contracting dim) on 2-D row-major arrays: NN = x·W, NT = dy·Wᵀ
# (W stored (in, out)), TN = xᵀ·dy (both contract their leading, token axis).
LAYOUTS = {'NN': (1, 0), 'NT': (1, 1), 'TN': (0, 0)}


def products(m: model_lib.ModelConfig, tokens: int) -> list[tuple[str, str, tuple, tuple]]:
  """(name, layout, lhs shape, rhs shape) of each distinct weight product of one layer and the output layer."""
  N, D, F, V = tokens, m.d_model, m.mlp_dim, m.vocab_size
  HE, KE = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  rows = []
  for name, fan_in, fan_out in (('q / out', D, HE), ('k, v', D, KE), ('gate, up', D, F), ('down', F, D)):
    rows += [(f'{name}: forward', 'NN', (N, fan_in), (fan_in, fan_out)),
             (f'{name}: input grad', 'NT', (N, fan_out), (fan_in, fan_out)),
             (f'{name}: weight grad', 'TN', (N, fan_in), (N, fan_out))]
  return rows + [('logits: forward', 'NT', (N, D), (V, D)), ('logits: input grad', 'NN', (N, V), (V, D)),
                 ('logits: weight grad', 'TN', (N, V), (N, D))]


def _median_s(fn, repeats: int) -> float:
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv):
  del argv
  cfg = _CONFIG.value
  m = model_lib.ModelConfig.from_config(cfg.model)
  torch.set_num_threads(os.cpu_count() or 1)
  print(f'{cfg.name}: float32, {cfg.train.batch_size} × {cfg.data.seq_len} tokens; jax {jax.__version__} '
        f'({jax.devices()[0].device_kind}), torch {torch.__version__} ({torch.get_num_threads()} threads)')
  header = ('product', 'layout', 'shapes', 'jax ms', 'torch ms', 'jax GFLOP/s', 'torch GFLOP/s', 'jax/torch')
  rows, total = [header], [0.0, 0.0]
  for name, layout, a, b in products(m, cfg.train.batch_size * cfg.data.seq_len):
    lc, rc = LAYOUTS[layout]
    flops = 2 * a[1 - lc] * a[lc] * b[1 - rc]
    ja, jb = jnp.ones(a, jnp.float32), jnp.ones(b, jnp.float32)
    dot = jax.jit(lambda x, y, lc=lc, rc=rc: jax.lax.dot_general(x, y, (((lc,), (rc,)), ((), ()))))
    ta, tb = torch.ones(a), torch.ones(b)
    tdot = (lambda: (ta.T if lc == 0 else ta) @ (tb.T if rc == 1 else tb))
    # Interleaved halves, so a change in the machine's load falls on both.
    j1 = _median_s(lambda: dot(ja, jb).block_until_ready(), _REPEATS.value // 2)
    t1 = _median_s(tdot, _REPEATS.value // 2)
    t2 = _median_s(tdot, _REPEATS.value // 2)
    j2 = _median_s(lambda: dot(ja, jb).block_until_ready(), _REPEATS.value // 2)
    j, t = (j1 + j2) / 2, (t1 + t2) / 2
    total[0] += j
    total[1] += t
    rows.append((name, layout, f'{a}·{b}', f'{j * 1e3:.2f}', f'{t * 1e3:.2f}', f'{flops / j / 1e9:.0f}',
                 f'{flops / t / 1e9:.0f}', f'{t / j:.2f}'))
  rows.append(('sum (each product once)', '', '', f'{total[0] * 1e3:.1f}', f'{total[1] * 1e3:.1f}', '', '',
               f'{total[1] / total[0]:.2f}'))
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
  for row in rows:
    print('  '.join(f'{c:<{w}}' for c, w in zip(row, widths)))
  print('jax/torch > 1: XLA is faster (throughput ratio, = torch time / jax time).')


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
