"""LoRA against full fine-tuning: per-device memory (state and the compiled step) and, on a GPU, step time.

  python bench/lora.py --config=configs/palm_1b.py [--devices=8] [--rank=16] [--time_steps=0] [--device=gpu]

Builds the real train step (step.build_program, as `python -m jaxlm.train` does) for the config as it is (full
fine-tuning) and with model.lora.rank=--rank on every projection, base stored in bfloat16, and compiles both ahead
of time on a mesh of --devices devices (fsdp over all of them): parameter, optimizer-state and compiled temporary
bytes per device, from the compiled executables (nothing is allocated). --time_steps > 0 also runs that many steps of
each on random batches and reports the median step time (meaningful on an accelerator; CPU steps of palm_1b are
minutes).
"""

import os
import pathlib
import statistics
import sys
import time

_DEVICES = next((int(a.split('=', 1)[1]) for a in sys.argv if a.startswith('--devices=')), 8)
if '--device=gpu' not in sys.argv:
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={_DEVICES}').strip()

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
import jaxlm  # noqa: E402,F401  first, as in `python -m jaxlm.train` (malloc settings)
from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jaxlm import perf, sharding, step  # noqa: E402
from jaxlm.metrics import format_table  # noqa: E402
from jaxlm.tools import size  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/palm_1b.py', 'Model and batch to measure.')
flags.DEFINE_integer('devices', 8, 'Devices in the mesh (fsdp over all of them); on the CPU, fake host devices.')
flags.DEFINE_integer('rank', 16, 'LoRA rank of the LoRA variant (alpha = 2 × rank).')
flags.DEFINE_integer('time_steps', 0, 'Steps to time per variant (0: memory only).')
flags.DEFINE_string('device', 'cpu', 'cpu (fake host devices) or gpu.')
FLAGS = flags.FLAGS


def variant(cfg, rank: int):
  c = cfg.copy_and_resolve_references()
  c.mesh.update(data=1, fsdp=-1, tensor=1)
  c.model.lora.update(rank=rank, alpha=2.0 * rank, base_dtype='bfloat16' if rank else 'float32')
  c.stability.policy = 'off'
  return c


def time_steps(cfg, devices, steps: int) -> float:
  mesh = sharding.make_mesh(cfg.mesh, devices)
  program = step.build_program(cfg, mesh)
  state = program.init()
  rng = np.random.default_rng(0)
  B, T = cfg.train.batch_size, cfg.data.seq_len
  tokens = rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
  batch = step.global_batch(dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=np.ones((B, T), np.int32),
                                 positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
                                 weights=np.ones((B, T), np.float32)), program.batch_sharding)
  state, metrics = program.train_step(state, batch)  # compile
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = program.train_step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv):
  del argv
  cfg = _CONFIG.value
  devices = jax.devices()[:FLAGS.devices]
  rows = []
  for name, rank in (('full fine-tuning', 0), (f'LoRA r={FLAGS.rank}, bf16 base', FLAGS.rank)):
    c = variant(cfg, rank)
    mem = size.memory(c, devices)
    row = [name, perf.format_bytes(mem['param_bytes']), perf.format_bytes(mem['opt_state_bytes']),
           perf.format_bytes(mem.get('temp_bytes', 0)),
           perf.format_bytes(mem.get('total_bytes', 0))]
    if FLAGS.time_steps:
      row.append(f'{time_steps(c, devices, FLAGS.time_steps) * 1e3:.1f} ms')
    rows.append(row)
    print(name, mem, flush=True)
  header = ['variant', 'params/device', 'optimizer/device', 'compiled temp/device', 'compiled total/device']
  print(f'{cfg.name} on {len(devices)} {devices[0].device_kind} devices (fsdp), batch {cfg.train.batch_size} x '
        f'{cfg.data.seq_len}')
  print(format_table(rows, header=header + (['step time (median)'] if FLAGS.time_steps else [])))


if __name__ == '__main__':
  app.run(main)
