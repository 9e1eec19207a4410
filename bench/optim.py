"""Muon against AdamW: step time on the same model, mesh and batches, in the same run, beside the FLOP prediction.

  python bench/optim.py --config=configs/palm_small.py [--devices=8] [--steps=10] [--config.model.x=y ...]
  python bench/optim.py --config=configs/palm_1b.py --predict_only

Builds the real train step (step.build_program, as `python -m jaxlm.train` does) twice, optim.name=adamw and
optim.name=muon, on a mesh of `--devices` devices (fsdp over all of them), and times them in alternation
(adamw, muon, muon, adamw, ...) so other work on a shared machine slows both alike; the median of the per-pair
ratios is the figure to quote. The prediction: Newton–Schulz costs 5 iterations × 2 × 2·m·n·min(m, n) FLOPs per
(m, n) matrix per step, whatever the batch, against the step's model FLOPs (jaxlm.model.flops_per_token × tokens);
AdamW's own elementwise work is left out of both.
"""

import os
import pathlib
import statistics
import sys
import time

_DEVICES = next((int(a.split('=', 1)[1]) for a in sys.argv if a.startswith('--devices=')), 1)
if '--device=gpu' not in sys.argv:
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={_DEVICES}').strip()

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
import jaxlm  # noqa: E402,F401  first, as in `python -m jaxlm.train` (malloc settings)
from absl import app, flags  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jaxlm import model as model_lib  # noqa: E402
from jaxlm import muon, sharding, step  # noqa: E402
from jaxlm.metrics import format_table  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/palm_small.py', 'Model and batch to time.')
flags.DEFINE_integer('devices', 1, 'Devices in the mesh (fsdp over all of them); on the CPU, fake host devices.')
flags.DEFINE_string('device', 'cpu', 'cpu, or gpu (the devices JAX finds).')
_STEPS = flags.DEFINE_integer('steps', 10, 'Timed steps of each optimizer, alternating.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed steps of each first (after compilation).')
_PREDICT_ONLY = flags.DEFINE_bool('predict_only', False, 'Print the FLOP prediction alone (no step is built): '
                                  'models too big for the device at hand.')


def newton_schulz_flops(model_cfg) -> tuple[float, int]:
  """(FLOPs of one Muon step's Newton–Schulz iterations, matrices orthogonalised), from the Muon routing."""
  m = model_lib.ModelConfig.from_config(model_cfg)
  tokens = jnp.zeros((1, 8), jnp.int32)
  boxed = jax.eval_shape(lambda: model_lib.Decoder(m).init({'params': jax.random.PRNGKey(0)}, tokens, tokens + 1,
                                                           tokens)['params'])
  logical, shapes = nn.get_partition_spec(boxed), nn.unbox(boxed)
  flops, count = 0.0, 0
  for spec, x in zip(jax.tree.leaves(logical, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)),
                     jax.tree.leaves(shapes)):
    if (d := muon.dimension_numbers(spec)) is None:
      continue
    rows = int(np.prod([x.shape[a] for a in d.reduction_axis]))
    cols = int(np.prod([x.shape[a] for a in d.output_axis]))
    matrices = x.size // (rows * cols)
    flops += matrices * 5 * 2 * 2 * rows * cols * min(rows, cols)
    count += matrices
  return flops, count


def build(cfg, name: str, mesh):
  cfg = cfg.copy_and_resolve_references()
  cfg.optim.name = name
  cfg.stability.policy = 'off'
  program = step.build_program(cfg, mesh)
  rng = np.random.default_rng(0)
  b, t, v = cfg.train.batch_size, cfg.data.seq_len, cfg.model.vocab_size
  batch = dict(inputs=rng.integers(0, v, (b, t), dtype=np.int32), targets=rng.integers(0, v, (b, t), dtype=np.int32),
               segment_ids=np.ones((b, t), np.int32), positions=np.tile(np.arange(t, dtype=np.int32), (b, 1)),
               weights=np.ones((b, t), np.float32))
  with sharding.activate(mesh):
    batch = step.global_batch(batch, program.batch_sharding)
    state = program.init()
    start = time.perf_counter()
    compiled = program.train_step.lower(state, batch).compile()
    print(f'{name}: compiled in {time.perf_counter() - start:.1f}s', flush=True)
  box = {'state': state}

  def one() -> float:
    start = time.perf_counter()
    box['state'], metrics = compiled(box['state'], batch)
    jax.block_until_ready(metrics['loss'])
    return time.perf_counter() - start
  return one


def main(argv):
  del argv
  cfg = _CONFIG.value
  cfg.mesh.update(data=1, fsdp=_DEVICES, tensor=1)
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:_DEVICES])
  m = model_lib.ModelConfig.from_config(cfg.model)
  tokens = cfg.train.batch_size * cfg.data.seq_len
  model_flops = model_lib.flops_per_token(m, cfg.data.seq_len) * tokens
  ns_flops, matrices = newton_schulz_flops(cfg.model)
  predicted = (model_flops + ns_flops) / model_flops
  if _PREDICT_ONLY.value:
    print(format_table([(cfg.name, tokens, f'{model_flops / 1e9:.1f}', f'{ns_flops / 1e9:.1f}', matrices,
                         f'{predicted:.2f}x')],
                       header=('config', 'tokens/step', 'model GFLOP', 'NS GFLOP', 'matrices', 'predicted'), rule=True))
    return
  runs = {name: build(cfg, name, mesh) for name in ('adamw', 'muon')}
  for _ in range(_WARMUP.value):
    for run in runs.values():
      run()
  times = {name: [] for name in runs}
  for i in range(_STEPS.value):
    order = ('adamw', 'muon') if i % 2 == 0 else ('muon', 'adamw')
    for name in order:
      times[name].append(runs[name]())
  ratios = [b / a for a, b in zip(times['adamw'], times['muon'])]
  measured = statistics.median(ratios)
  print(format_table(
      [(cfg.name, _DEVICES, tokens, f'{model_flops / 1e9:.1f}', f'{ns_flops / 1e9:.1f}', matrices,
        f'{statistics.median(times["adamw"]) * 1e3:.0f}', f'{statistics.median(times["muon"]) * 1e3:.0f}',
        f'{predicted:.2f}x', f'{measured:.2f}x', f'{measured / predicted:.2f}')],
      header=('config', 'devices', 'tokens/step', 'model GFLOP', 'NS GFLOP', 'matrices', 'adamw ms', 'muon ms',
              'predicted', 'measured', 'measured / predicted'), rule=True))
  print(f'device: {jax.devices()[0].device_kind} x{_DEVICES} ({jax.default_backend()}); jax {jax.__version__}')


if __name__ == '__main__':
  app.run(main)
