"""Pipeline parallelism on the CPU mesh: step time and compiled memory per device against stages and microbatches.

  python bench/pipeline.py [--stages=1,2,4,8] [--microbatches=1,2] [--schedule=gpipe] [--steps=5] [--json=out.json]

One process, 8 fake CPU devices (--devices). For each stage count S (fsdp = devices / S inside each stage) and each
microbatch factor k (M = k·S), it compiles the real train step (step.build_program), times --steps steps after one
warm-up, and prints the median step time, the compiled memory per device (arguments, temporaries, total), the
layer parameters held per device, the computed bubble (S−1)/(R·M+S−1) and a measured one.

Measured bubble: 1 − t(S=1) / t(S). The pipeline is one SPMD program in which every stage computes in every
iteration, the idle (bubble) ones on data that is thrown away; on this CPU the 8 fake devices share the same cores,
so that wasted work costs wall time in proportion, and t(S)/t(S=1) ≈ (R·M+S−1)/(R·M) plus the stage-to-stage
copies. On real accelerators the stages run in parallel and the bubble shows as idle time instead.
"""

import os
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
from absl import app, flags  # noqa: E402

_DEVICES = flags.DEFINE_integer('devices', 8, 'Fake CPU devices.')
_STAGES = flags.DEFINE_list('stages', ['1', '2', '4', '8'], 'Stage counts to measure.')
_MICRO = flags.DEFINE_list('microbatches', ['1', '2'], 'Microbatches per step as multiples of the stage count.')
_SCHEDULE = flags.DEFINE_string('schedule', 'gpipe', 'gpipe or circular (repeats=2).')
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps per row (after one untimed).')
_LAYERS = flags.DEFINE_integer('layers', 16, 'Model layers (divisible by every stage count × repeats).')
_BATCH = flags.DEFINE_integer('batch', 32, 'Global batch (sequences).')
_SEQ = flags.DEFINE_integer('seq', 128, 'Sequence length.')
_JSON = flags.DEFINE_string('json', '', 'Also write the rows to this JSON file.')


def config(stages: int, microbatches: int):
  """palm_tiny at the bench's size, on `stages` stages with fsdp over the rest of the devices."""
  from jaxlm import cli
  c = cli.load_file(pathlib.Path(__file__).absolute().parents[1] / 'configs' / 'palm_tiny.py')
  c.model.update(num_layers=_LAYERS.value, d_model=128, num_heads=4, num_kv_heads=1, mlp_dim=512, vocab_size=1024,
                 dtype='float32', remat='full')
  c.data.seq_len = _SEQ.value
  c.train.update(batch_size=_BATCH.value, steps=100)
  c.stability.policy = 'off'
  c.mesh.update(stage=stages, data=1, fsdp=-1, tensor=1)
  c.pipeline.update(schedule=_SCHEDULE.value, repeats=2, microbatches=microbatches)
  return c


def measure(stages: int, microbatches: int) -> dict:
  """Median step time, compiled memory and layer parameter bytes per device of one configuration."""
  import jax
  from jaxlm import config as config_lib
  from jaxlm import perf
  from jaxlm import sharding
  from jaxlm import step as step_lib
  c = config(stages, microbatches)
  config_lib.validate(c, jax.device_count())
  mesh = sharding.make_mesh(c.mesh)
  program = step_lib.build_program(c, mesh)
  import numpy as np
  rng = np.random.default_rng(0)
  B, T = c.train.batch_size, c.data.seq_len
  tokens = rng.integers(0, c.model.vocab_size, (B, T + 1)).astype(np.int32)
  batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=np.ones((B, T), np.int32),
               positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)), weights=np.ones((B, T), np.float32))
  batch = jax.device_put(batch, program.batch_sharding)
  state = program.init()
  start = time.perf_counter()
  compiled = program.train_step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  memory = perf.compiled_memory(compiled)
  with sharding.activate(mesh):
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    times = []
    for _ in range(_STEPS.value):
      start = time.perf_counter()
      state, m = compiled(state, batch)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - start)
  lay = program.model.pipeline
  layers_bytes = sharding.bytes_per_device(program.abstract_state.params['layers'],
                                           program.state_shardings.params['layers'])
  return dict(stages=stages, microbatches=lay.microbatches if lay else 1, repeats=lay.repeats if lay else 1,
              step_s=statistics.median(times), compile_s=compile_s, loss=float(m['loss']),
              bubble=lay.bubble if lay else 0.0, layer_param_bytes=layers_bytes, **memory)


def main(argv):
  del argv
  flags_now = re.sub(r'--xla_force_host_platform_device_count=\S+', '', os.environ.get('XLA_FLAGS', ''))
  os.environ['XLA_FLAGS'] = f'{flags_now} --xla_force_host_platform_device_count={_DEVICES.value}'.strip()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import jaxlm  # noqa: F401  malloc set-up before JAX, as in `python -m jaxlm.train`
  import jax
  from jaxlm import perf
  from jaxlm.metrics import format_table
  print(f'{jax.device_count()} × {jax.devices()[0].device_kind}, {os.cpu_count()} host cores; layers '
        f'{_LAYERS.value}, batch {_BATCH.value} × {_SEQ.value}, schedule {_SCHEDULE.value}', flush=True)
  rows = []
  for s in map(int, _STAGES.value):
    for k in (map(int, _MICRO.value) if s > 1 else [1]):
      rows.append(measure(s, k * s))
      print(f'  measured S={s} M={rows[-1]["microbatches"]}: {rows[-1]["step_s"] * 1e3:.0f} ms', flush=True)
  base = next((r['step_s'] for r in rows if r['stages'] == 1), None)
  table = []
  for r in rows:
    measured = 1 - base / r['step_s'] if base and r['stages'] > 1 else 0.0
    r['measured_bubble'] = measured
    table.append((str(r['stages']), str(r['microbatches']), f'{r["step_s"] * 1e3:.0f}',
                  perf.format_bytes(r['layer_param_bytes']), perf.format_bytes(r.get('argument_bytes', 0)),
                  perf.format_bytes(r.get('temp_bytes', 0)), perf.format_bytes(r.get('total_bytes', 0)),
                  f'{r["bubble"]:.3f}', f'{measured:.3f}', f'{r["loss"]:.4f}'))
  print(format_table(table, header=('S', 'M', 'step ms', 'layer params/dev', 'arguments/dev', 'temp/dev',
                                    'total/dev', 'bubble computed', 'bubble measured', 'loss')))
  if _JSON.value:
    import json
    pathlib.Path(_JSON.value).write_text(json.dumps(rows, indent=1))


if __name__ == '__main__':
  app.run(main)
