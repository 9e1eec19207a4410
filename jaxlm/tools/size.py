"""How big is a config: parameters, FLOPs per token, per-device memory of the train step, and time to train.

  python -m jaxlm.tools.size --config=configs/palm_8b.py [--mesh=1,64,1] [--chips=256 --mfu=0.4
      --device_kind='TPU v5p' | --peak_tflops=459] [--tokens=2e11] [--fake_devices=64] [--config.a.b=v]

Memory comes from an ahead-of-time compile of the real train step on the given mesh (nothing is allocated);
when the mesh needs more devices than this host has, the state memory is still exact (shapes and shardings on
an abstract mesh) but the compiled numbers are left out; --fake_devices=N compiles on N fake CPU devices.
Time to train uses PaLM's FLOPs per token, the definition MFU is measured against (jaxlm.perf.mfu).
"""

import math

from absl import flags, logging
import flax.linen as nn
import jax

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm import metrics
from jaxlm import perf
from jaxlm import model as model_lib
from jaxlm import sharding
from jaxlm import step as step_lib
from jaxlm import train as train_lib

FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program, so importing this module next to others defines nothing; --config (and
  # its --config.a.b=v overrides) is the trainer's flag (jaxlm.train, imported above, defines it).
  flags.DEFINE_string('mesh', '', 'data,fsdp,tensor ways, e.g. 1,64,1 (one may be -1: the rest of --chips); '
                      "default: the config's mesh.")
  flags.DEFINE_integer('chips', 0, "Chips to train on; default: the mesh's device count.")
  flags.DEFINE_float('mfu', 0.4, 'Model FLOPs utilisation to assume (PaLM 540B reached 0.46).')
  flags.DEFINE_float('tokens', 0, "A token budget to time, besides the config's run and Chinchilla's.")
  flags.DEFINE_string('device_kind', '', 'Device kind for the peak FLOP/s, e.g. "TPU v5p" or '
                      '"NVIDIA H100 80GB HBM3"; default: this host\'s.')
  flags.DEFINE_float('peak_tflops', 0, 'Peak dense bf16 TFLOP/s per chip (overrides --device_kind).')
  flags.DEFINE_integer('fake_devices', 0, "Compile on this many fake CPU devices (e.g. the mesh size) instead "
                       "of this host's devices.")


CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: compute-optimal D ≈ 20 N


def analytic(cfg) -> dict:
  """Parameter count, FLOPs per token (PaLM and causal), tokens of the configured run and Chinchilla's."""
  m = model_lib.ModelConfig.from_config(cfg.model)
  n = model_lib.param_count(m)
  t = cfg.train
  return {'params': n,
          'embedding_params': m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2),
          'flops_per_token': model_lib.flops_per_token(m, cfg.data.seq_len),
          'flops_per_token_causal': model_lib.flops_per_token(m, cfg.data.seq_len, causal=True),
          'run_tokens': train_lib.BatchRamp(t, cfg.data.seq_len).tokens(t.steps),  # a batch ramp included
          'chinchilla_tokens': CHINCHILLA_TOKENS_PER_PARAM * n}


def train_seconds(tokens: float, flops_per_token: float, chips: int, peak_flops: float, mfu: float) -> float:
  """Wall seconds to train on `tokens`: total FLOPs over the FLOP/s the chips deliver at `mfu`."""
  return tokens * flops_per_token / (chips * peak_flops * mfu)


def parse_mesh(text: str) -> tuple[int, int, int]:
  """'1,8,1' -> (1, 8, 1); a ValueError says how to write it."""
  try:
    sizes = tuple(int(x) for x in text.split(','))
  except ValueError:
    sizes = ()
  if len(sizes) != 3:
    raise ValueError(f'--mesh={text!r}: write data,fsdp,tensor ways, e.g. --mesh=1,8,1.')
  return sizes


def memory(cfg, devices=None) -> dict:
  """Per-device bytes of the train state on cfg.mesh, plus the compiled step's when `devices` are given.

  Without devices the mesh is abstract: shapes and shardings (hence the state bytes) are exact, nothing is
  compiled. With them, the step is compiled ahead of time as train.run compiles it; nothing is allocated.
  """
  if devices is None:  # cfg.mesh must then be fully given (no -1): there are no devices to fill it from
    mesh = jax.sharding.AbstractMesh((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor), sharding.AXES)
  else:
    mesh = sharding.make_mesh(cfg.mesh, devices)
  t = cfg.train
  with nn.logical_axis_rules(sharding.RULES):
    program = step_lib.build_program(cfg, mesh)  # what train.run would compile
    state, shardings = program.abstract_state, program.state_shardings
    out = {'param_bytes': sharding.bytes_per_device(state.params, shardings.params),
           'opt_state_bytes': sharding.bytes_per_device(state.opt_state, shardings.opt_state)}
    if devices is not None:
      with jax.sharding.set_mesh(mesh):
        batch = step_lib.abstract_batch(t.batch_size, cfg.data.seq_len, program.batch_sharding)
        compiled = program.train_step.lower(state, batch).compile()
      out.update(perf.compiled_memory(compiled))
  return out


def _count(x: float) -> str:
  """172_640_256_000 -> '172.6B'."""
  for suffix, scale in (('T', 1e12), ('B', 1e9), ('M', 1e6), ('k', 1e3)):
    if x >= scale:
      return f'{x / scale:.4g}{suffix}'
  return f'{x:,.0f}'


def model_rows(a: dict, cfg) -> list[tuple[str, str]]:
  """Rows of the analytic numbers."""
  tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
  return [
      ('parameters', f'{a["params"]:,} ({_count(a["params"])})'),
      ('  of which embeddings', f'{a["embedding_params"]:,} ({_count(a["embedding_params"])})'),
      ('FLOPs/token, PaLM (6N + 12·L·H·Q·T)', f'{a["flops_per_token"]:,.0f}'),
      ('FLOPs/token, causal attention', f'{a["flops_per_token_causal"]:,.0f}'),
      ('Chinchilla-optimal tokens (20/param)', f'{_count(a["chinchilla_tokens"])} = '
       f'{a["chinchilla_tokens"] / tokens_per_step:,.0f} steps of {cfg.train.batch_size} × {cfg.data.seq_len}'),
      ('configured run', f'{_count(a["run_tokens"])} tokens in {cfg.train.steps:,} steps'),
  ]


def memory_rows(mem: dict) -> list[tuple[str, str]]:
  """Rows of `memory`'s per-device bytes."""
  b = perf.format_bytes
  rows = [('parameters', b(mem['param_bytes'])), ('optimizer state', b(mem['opt_state_bytes']))]
  # XLA's peak_memory_in_bytes is left out: on the CPU backend it comes out below the arguments alone.
  for key, label in (('argument_bytes', 'step arguments (state + batch)'), ('temp_bytes', 'step temporaries'),
                     ('total_bytes', 'step total')):
    if key in mem:
      rows.append((label, b(mem[key])))
  return rows


def render(sections: list[tuple[str, list[tuple[str, str]]]]) -> str:
  """Titled sections of aligned 'quantity  value' rows."""
  width = max(len(k) for _, rows in sections for k, _ in rows)  # one key column across the sections
  return '\n'.join(f'{title}\n' + metrics.format_table(rows, indent='  ', widths=(width, 0))
                   for title, rows in sections)


def main(argv):
  """Prints the size report of --config."""
  del argv
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # as in train: libraries' INFO lines would break up the table
  if FLAGS.fake_devices:
    # Before the first device query, the CPU backend is still unstarted: it will start with N devices.
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', FLAGS.fake_devices)
  cfg = FLAGS.config
  try:
    if FLAGS.mesh:
      cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = parse_mesh(FLAGS.mesh)
    available = jax.device_count()
    sizes = sharding.MeshShape.resolve(cfg.mesh, FLAGS.chips or available).sizes
    needed = math.prod(sizes)
    # One mesh of the whole size, a -1 resolved: what a device holds depends on each axis's total ways, not on
    # which network (dcn_* across hosts, or inside one) carries them.
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = sizes
    for axis in ('data', 'fsdp', 'tensor'):
      if f'dcn_{axis}' in cfg.mesh:
        cfg.mesh[f'dcn_{axis}'] = 1
    config_lib.validate(cfg, needed)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from e
  a = analytic(cfg)
  kind = jax.devices()[0].device_kind
  if needed <= available:
    mem_rows = memory_rows(memory(cfg, jax.devices()[:needed]))
    note = f'compiled ahead of time for {needed} × {kind}'
    if jax.default_backend() == 'cpu':
      note += '; temporaries differ on GPU/TPU (other fusions)'
  else:
    mem_rows = memory_rows(memory(cfg))
    note = (f'needs {needed} devices, this host has {available}: state only (--fake_devices={needed} compiles '
            f'on fake CPU devices)')
  mesh_title = f'memory per device on mesh data={sizes[0]} × fsdp={sizes[1]} × tensor={sizes[2]}'

  chips = FLAGS.chips or needed
  device_kind = FLAGS.device_kind or kind
  peak = FLAGS.peak_tflops * 1e12 if FLAGS.peak_tflops else perf.peak_flops(device_kind)
  budgets = [('Chinchilla', a['chinchilla_tokens']), ('configured run', a['run_tokens'])]
  if FLAGS.tokens:
    budgets.append(('--tokens', FLAGS.tokens))
  if peak:
    chip = 'chips' if FLAGS.peak_tflops else device_kind
    time_title = f'time to train on {chips} × {chip} ({peak / 1e12:.0f} TFLOP/s peak each) at {FLAGS.mfu:.0%} MFU'
    timing = [(f'{label}: {_count(tokens)} tokens, {tokens * a["flops_per_token"]:.2e} FLOPs',
               metrics.duration(train_seconds(tokens, a['flops_per_token'], chips, peak, FLAGS.mfu)))
              for label, tokens in budgets]
  else:
    time_title = 'time to train'
    timing = [('note', f'no peak FLOP/s known for {device_kind!r}: pass --device_kind (e.g. "TPU v5p", '
                       f'"NVIDIA H100 80GB HBM3") or --peak_tflops')]
  print(render([(f'{cfg.name}: model', model_rows(a, cfg)), (mesh_title, mem_rows + [('note', note)]),
                (time_title, timing)]))
  return 0


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('config',))


if __name__ == '__main__':
  console()
