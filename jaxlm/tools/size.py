"""How big is a config: parameters, FLOPs per token, per-device memory of the train step, and time to train.

  python -m jaxlm.tools.size --config=configs/palm_8b.py [--mesh=1,64,1] [--chips=256 --mfu=0.4
      --device_kind='TPU v5p' | --peak_tflops=459] [--tokens=2e11] [--fake_devices=64] [--config.a.b=v]

Memory comes from an ahead-of-time compile of the real train step on the given mesh (nothing is allocated);
when the mesh needs more devices than this host has, the state memory is still exact (shapes and shardings on
an abstract mesh) but the compiled numbers are left out; --fake_devices=N compiles on N fake CPU devices.
Time to train uses PaLM's FLOPs per token, the definition MFU is measured against (jaxlm.perf.mfu).

Pre-flight on a TPU this machine does not have (needs libtpu: pip install 'jax[tpu]'):

  python -m jaxlm.tools.size --config=configs/palm_8b.py --target=v5p:4x4x4 [--slices=2] [--fit]

compiles the exact train step `python -m jaxlm.train` would run on that topology (libtpu's compile-only
devices: same shardings, same attention kernel, nothing allocated) and prints per chip the parameter,
optimizer-state and temporary bytes against the chip's HBM with a fits verdict, the attention kernel compiled,
the collectives in the step, and the compile time. A step that does not fit exits 2 (DoesNotFitError);
--fit then compiles cheaper settings (more remat, then microbatches) and prints the first that fits.
No predicted step time or MFU: XLA's cost analysis of a scanned model does not give one.
"""

import math
import os
import re
import time

from absl import flags, logging
from ml_collections import config_flags
import flax.linen as nn
import jax

from jaxlm import attention as attention_lib
from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm import metrics
from jaxlm import perf
from jaxlm import preflight
from jaxlm import model as model_lib
from jaxlm import sharding
from jaxlm import step as step_lib

FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program, so importing this module next to others defines nothing.
  config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/palm_8b.py (with --config.a.b=v).')
  flags.DEFINE_string('mesh', '', 'data,fsdp,tensor ways, e.g. 1,64,1 (one may be -1: the rest of --chips); '
                      "default: the config's mesh.")
  flags.DEFINE_integer('chips', 0, "Chips to train on; default: the mesh's device count.")
  flags.DEFINE_float('mfu', 0.4, 'Model FLOPs utilisation to assume (PaLM 540B reached 0.46).')
  flags.DEFINE_float('tokens', 0, "A token budget to time, besides the config's run and Chinchilla's.")
  flags.DEFINE_string('device_kind', '', 'Device kind for the peak FLOP/s, e.g. "TPU v5p" or '
                      '"NVIDIA H100 80GB HBM3"; default: this host\'s.')
  flags.DEFINE_float('peak_tflops', 0, 'Peak dense bf16 TFLOP/s per chip (overrides --device_kind).')
  flags.DEFINE_string('target', '', 'A TPU topology to compile for without having it, as libtpu names it: '
                      'v5e:2x2, v5p:4x4x4, v4:2x2x1, v6e:4x4, v5e:1x1 ...')
  flags.DEFINE_integer('slices', 1, '--target: how many such slices (multi-slice over DCN; mesh.dcn_* spans them, '
                       'dcn_data=slices unless set).')
  flags.DEFINE_bool('fit', False, '--target: if the step does not fit, compile cheaper settings (remat, then '
                    'microbatches) and print the first that fits.')
  flags.DEFINE_integer('fake_devices', 0, "Compile on this many fake CPU devices (e.g. the mesh size) instead "
                       "of this host's devices.")


CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: compute-optimal D ≈ 20 N


def analytic(cfg) -> dict:
  """Parameter count, FLOPs per token (PaLM and causal), tokens of the configured run and Chinchilla's."""
  m = model_lib.ModelConfig.from_config(cfg.model)
  n = model_lib.param_count(m)
  t = cfg.train
  moe_layers = sum(model_lib.is_moe(m, i) for i in range(m.num_layers))
  return {'params': n,
          # A mixture of experts: what one token's forward multiplies by (the FLOPs below count these), and the
          # routed experts' stacked (X, D, F) weights.
          'active_params': model_lib.param_count(m, active=True),
          'expert_params': moe_layers * 3 * m.d_model * m.moe.mlp_dim * m.moe.experts,
          'embedding_params': m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2),
          'flops_per_token': model_lib.flops_per_token(m, cfg.data.seq_len),
          'flops_per_token_causal': model_lib.flops_per_token(m, cfg.data.seq_len, causal=True),
          'run_tokens': config_lib.BatchRamp(t, cfg.data.seq_len).tokens(t.steps),  # a batch ramp included
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
    # The axes make_mesh would build (a stage axis outermost, an expert axis after fsdp, each only when > 1).
    axes, ici, dcn = sharding.layout(sharding.MeshShape.resolve(cfg.mesh, 0))
    mesh = jax.sharding.AbstractMesh(tuple(i * d for i, d in zip(ici, dcn)), axes)
  else:
    mesh = sharding.make_mesh(cfg.mesh, devices)
  t = cfg.train
  with nn.logical_axis_rules(sharding.RULES):
    program = step_lib.build_program(cfg, mesh)  # what train.run would compile
    state, shardings = program.abstract_state, program.state_shardings
    out = {'param_bytes': sharding.bytes_per_device(state.params, shardings.params),
           'opt_state_bytes': sharding.bytes_per_device(state.opt_state, shardings.opt_state)}
    if cfg.model.moe_experts:
      out['expert_bytes'] = expert_bytes(state.params, shardings.params)
    if devices is not None:
      with jax.sharding.set_mesh(mesh):
        batch = step_lib.abstract_batch(t.batch_size, cfg.data.seq_len, program.batch_sharding)
        compiled = program.train_step.lower(state, batch).compile()
      out.update(perf.compiled_memory(compiled))
  return out


def expert_bytes(params, shardings) -> int:
  """Bytes one device holds of the routed experts' stacked weights (every MoE layer's gate, up and down)."""
  is_sharding = lambda x: isinstance(x, jax.sharding.NamedSharding)  # noqa: E731
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_s = jax.tree.leaves(shardings, is_leaf=is_sharding)
  experts = [(x, s) for (path, x), s in zip(leaves, flat_s)
             if re.search(r"\['moe'\]\['(gate|up|down)'\]$", jax.tree_util.keystr(path))]
  return sharding.bytes_per_device([x for x, _ in experts], [s for _, s in experts])


def _count(x: float) -> str:
  """172_640_256_000 -> '172.6B'."""
  for suffix, scale in (('T', 1e12), ('B', 1e9), ('M', 1e6), ('k', 1e3)):
    if x >= scale:
      return f'{x / scale:.4g}{suffix}'
  return f'{x:,.0f}'


def model_rows(a: dict, cfg) -> list[tuple[str, str]]:
  """Rows of the analytic numbers."""
  tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
  moe = [('  of which routed experts', f'{a["expert_params"]:,} ({_count(a["expert_params"])})'),
         ('active per token (shared + k/X routed + router)', f'{a["active_params"]:,} ({_count(a["active_params"])})')]
  return [
      ('parameters', f'{a["params"]:,} ({_count(a["params"])})'),
      ('  of which embeddings', f'{a["embedding_params"]:,} ({_count(a["embedding_params"])})'),
      *(moe if cfg.model.moe_experts else []),
      ('FLOPs/token, PaLM (6N + 12·L·H·Q·T)' + (', N active' if cfg.model.moe_experts else ''),
       f'{a["flops_per_token"]:,.0f}'),
      ('FLOPs/token, causal attention', f'{a["flops_per_token_causal"]:,.0f}'),
      ('Chinchilla-optimal tokens (20/param)', f'{_count(a["chinchilla_tokens"])} = '
       f'{a["chinchilla_tokens"] / tokens_per_step:,.0f} steps of {cfg.train.batch_size} × {cfg.data.seq_len}'),
      ('configured run', f'{_count(a["run_tokens"])} tokens in {cfg.train.steps:,} steps'),
  ]


def memory_rows(mem: dict) -> list[tuple[str, str]]:
  """Rows of `memory`'s per-device bytes."""
  b = perf.format_bytes
  rows = [('parameters', b(mem['param_bytes'])), ('optimizer state', b(mem['opt_state_bytes']))]
  if 'expert_bytes' in mem:
    rows.insert(1, ('  of which routed experts', b(mem['expert_bytes'])))
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


class PreflightError(config_lib.ConfigError):
  """A --target that cannot be compiled here (libtpu missing, a topology libtpu does not know): exit 2."""


# Read once, when libtpu loads: the first two silence its warnings about a missing TPU VM environment; the
# third lets several processes load it (compile-only devices hold no chip, so /tmp/libtpu_lockfile guards nothing).
_TPU_ENV = {'TPU_ACCELERATOR_TYPE': 'v5litepod-4', 'TPU_WORKER_HOSTNAMES': 'localhost',
            'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}


def tpu_devices(target: str, slices: int = 1) -> list:
  """Compile-only devices of the TPU topology `target` ('v5e:2x2', 'v5p:4x4x4', 'v4:2x2x1'), `slices` times."""
  for key, value in _TPU_ENV.items():
    os.environ.setdefault(key, value)
  match = re.fullmatch(r'(v\d+[a-z]*):(\d+(?:x\d+)*)', target)
  if not match:
    raise PreflightError(f'--target={target!r} is not a TPU topology; write <chip>:<shape>, e.g. '
                         f'--target=v5e:2x2, v5p:4x4x4, v4:2x2x1, v6e:4x4')
  dims = [int(x) for x in match.group(2).split('x')]
  kwargs = {}
  if dims[0] < 2 or (len(dims) > 1 and dims[1] < 2):
    # libtpu's default host is 2x2x1 chips; a smaller slice (one chip, 1x2) is one host of its own shape.
    kwargs['chips_per_host_bounds'] = tuple(dims + [1] * (3 - len(dims)))
  if slices > 1:
    kwargs['num_slices'] = slices
  if match.group(1) == 'v4':
    # A v4 chip's two TensorCores run as one 32 GiB "megacore" device, as JAX uses a real v4 (and as MaxText
    # compiles for one); libtpu's default describes each core as its own device with half the HBM.
    kwargs['chip_config_name'] = 'megacore'
  try:
    from jax.experimental import topologies
    desc = topologies.get_topology_desc(topology_name=target, platform='tpu', **kwargs)
  except Exception as e:  # pylint: disable=broad-except  -- libtpu missing, or a name it rejects
    text = ' '.join(str(e).split())[:300]
    if 'tpu' in text.lower() and ('not found' in text.lower() or 'unknown backend' in text.lower()
                                  or 'plugin' in text.lower()):
      raise PreflightError(f'cannot load libtpu to compile for {target} ({text}); pip install '
                           f'"jax[tpu]=={jax.__version__}"') from e
    raise PreflightError(f'libtpu cannot describe --target={target} --slices={slices} ({text}); use a '
                         f'topology such as v5e:2x2, v5p:2x2x1, v4:2x2x1, v6e:2x2') from e
  return list(desc.devices)


_SHAPE = re.compile(r'\b(pred|[suf]\d+|bf16|f8\w*)\[([\d,]*)\]')
_BITS = {'pred': 8, 'bf16': 16}
_OPS = {'all-gather': 'all-gather', 'all-gather-start': 'all-gather', 'reduce-scatter': 'reduce-scatter',
        'all-reduce': 'all-reduce', 'all-reduce-start': 'all-reduce', 'all-to-all': 'all-to-all',
        'collective-permute': 'collective-permute', 'collective-permute-start': 'collective-permute'}


def _shape_bytes(text: str, last_only: bool = False) -> int:
  shapes = _SHAPE.findall(text)
  if last_only:
    # An async start's result is (operand, output); a collective-permute's adds two u32[] context words (TPU),
    # which a plain "last" took for the permute's size (4 B): the output is the last array that is not a scalar.
    shapes = ([s for s in shapes if s[1]] or shapes)[-1:]
  total = 0
  for dtype, dims in shapes:
    bits = _BITS.get(dtype) or int(re.sub(r'\D', '', dtype.split('e')[0]) or 8)
    total += math.prod(int(d) for d in dims.split(',') if d) * bits // 8
  return total


def collectives(hlo: str) -> dict:
  """{kind: (ops, bytes)} of the collectives in a compiled module's HLO text (per device, result sizes).

  TPU reduce-scatters are fusions calling an `all-reduce-scatter` computation; the all-reduces inside those
  computations are part of them and not counted again. Ops in a scanned layer body appear once here and run
  once per layer.
  """
  out, computation = {}, ''
  for line in hlo.splitlines():
    if not line.startswith(' ') and line.rstrip().endswith('{'):
      computation = line.split(' ', 1)[0]
      continue
    m = re.match(r'\s+%\S+ = (.*?) ([a-z-]+)\(', line)
    if not m:
      continue
    result, op = m.groups()
    kind = _OPS.get(op)
    if op == 'fusion' and 'calls=%all-reduce-scatter' in line:
      kind = 'reduce-scatter'
    if kind is None or 'all-reduce-scatter' in computation:
      continue
    ops, nbytes = out.get(kind, (0, 0))
    out[kind] = (ops + 1, nbytes + _shape_bytes(result, last_only=op.endswith('-start')))
  return out


# XLA:TPU's refusal: "... the total memory required for HLO temporaries (40.77G) exceeds available HBM (15.75G)"
_HBM_REFUSAL = re.compile(r'Ran out of memory on HBM.*?\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)')
GiB_G = 2**30  # XLA's 'G' in that message is GiB


def compile_step(cfg, devices) -> dict:
  """Compiles cfg's train step on `devices` ahead of time: memory, kernel, collectives, compile seconds."""
  mesh = sharding.make_mesh(cfg.mesh, devices)
  started = time.perf_counter()
  program = step_lib.build_program(cfg, mesh)  # abstract end to end: fine on compile-only devices
  state, shardings = program.abstract_state, program.state_shardings
  batch = step_lib.abstract_batch(cfg.train.batch_size, cfg.data.seq_len, program.batch_sharding)
  lowered = program.train_step.lower(state, batch)
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    # The TPU compiler itself refuses a program that exceeds HBM; that is the answer "does not fit".
    refused = _HBM_REFUSAL.search(str(e))
    if not refused:
      raise PreflightError(f'the train step does not compile for {devices[0].device_kind}: '
                           f'{" ".join(str(e).split())[:400]}; change the config (see the message)') from e
    compiled = None
  seconds = time.perf_counter() - started
  hlo = (compiled.as_text() or '') if compiled is not None else ''
  m = cfg.model
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    kernel, why = attention_lib.select(m.attention, dtype=m.dtype, head_dim=model_lib.head_dim(m),
                                       seq_len=cfg.data.seq_len)
  # XLA:TPU lowers jax.lax.ragged_dot (the experts' grouped GEMMs) to its own Mosaic kernels, named ragged-dot-*:
  # counted apart, so that they do not pass for the attention kernel.
  ragged = len(re.findall(r'%ragged-dot-\S* = .*custom_call_target="tpu_custom_call"', hlo))
  custom = hlo.count('tpu_custom_call') - len(re.findall(r'%ragged-dot-\S* = .*tpu_custom_call', hlo))
  if kernel == 'splash' and not custom:
    kernel, why = 'xla', 'splash was selected but the step has no tpu_custom_call: it fell back while tracing'
  limit, source = preflight.device_memory(devices)
  if compiled is None:
    needed, available = (float(x) * GiB_G for x in refused.groups())
    state_bytes = sharding.bytes_per_device((state, batch), (shardings, {k: program.batch_sharding for k in batch}))
    memory = {'argument_bytes': state_bytes, 'temp_bytes': int(needed), 'total_bytes': int(needed),
              'refused': f'the TPU compiler needs {refused.group(1)}G and has {refused.group(2)}G'}
    limit, source = int(available), f'what the TPU compiler has for a {devices[0].device_kind}'
  else:
    memory = preflight.step_memory(compiled)
  return {'param_bytes': sharding.bytes_per_device(state.params, shardings.params),
          'opt_state_bytes': sharding.bytes_per_device(state.opt_state, shardings.opt_state),
          'expert_bytes': expert_bytes(state.params, shardings.params) if m.moe_experts else None,
          'ragged_dot_kernels': ragged, 'memory': memory, 'limit_bytes': limit, 'limit_source': source,
          'fits': preflight.fits(memory, limit), 'kernel': kernel, 'kernel_why': why,
          'tpu_custom_calls': custom, 'collectives': collectives(hlo), 'compile_s': seconds,
          'device_kind': devices[0].device_kind, 'devices': len(devices), 'hlo': hlo}


def mesh_axes(shape: sharding.MeshShape) -> str:
  """'stage=2 × data=1 × fsdp=4 × expert=2 × tensor=1': the axes make_mesh builds, in its order, each the whole
  mesh's size (context only when it splits)."""
  axes, ici, dcn = sharding.layout(shape)
  return ' × '.join(f'{a}={i * d}' for a, i, d in zip(axes, ici, dcn) if a != 'context' or i * d > 1)


def target_config(cfg, devices, slices: int) -> None:
  """Resolves cfg.mesh (a -1) for `devices`; multi-slice without dcn_* set spans slices with dcn_data."""
  dcn = [cfg.mesh.get(f'dcn_{a}', 1) for a in (*sharding.AXES, 'stage', 'expert')]
  if slices > 1 and math.prod(dcn) == 1:
    cfg.mesh.dcn_data = slices
  config_lib.validate(cfg, len(devices), sharding.num_processes(devices), sharding.num_slices(devices))


def fit_search(cfg, devices) -> tuple[dict | None, list]:
  """The first of preflight.candidates(cfg) whose step fits, compiled; and (setting, report) of every try."""
  def measure(trial):
    try:
      config_lib.validate(trial, len(devices), sharding.num_processes(devices), sharding.num_slices(devices))
    except ValueError:
      return None
    return compile_step(trial, devices)

  return preflight.search(cfg, preflight.candidates(cfg), measure)


def target_rows(report: dict) -> list[tuple[str, str]]:
  """Rows of a compile_step report."""
  b, mem = perf.format_bytes, report['memory']
  rows = [('parameters', b(report['param_bytes'])), ('optimizer state', b(report['opt_state_bytes']))]
  if report.get('expert_bytes') is not None:
    rows.insert(1, ('  of which routed experts', b(report['expert_bytes'])))
  if mem.get('refused'):
    rows += [('step arguments (state + batch)', b(mem['argument_bytes'])),
             ('compile', f'refused: {mem["refused"]}')]
  elif mem:
    rows += [('step arguments (state + batch)', b(mem['argument_bytes'])),
             ('step temporaries', b(mem['temp_bytes'])), ('step total', b(mem['total_bytes']))]
  limit = report['limit_bytes']
  rows.append(('memory per chip', f'{b(limit)} ({report["limit_source"]})' if limit else report['limit_source']))
  if report['fits'] is not None:
    headroom = limit - mem['total_bytes']
    rows.append(('verdict', f'fits, {b(headroom)} to spare' if report['fits'] else
                 f'does NOT fit: {b(-headroom)} too much'))
  rows.append(('attention kernel', f'{report["kernel"]} ({report["kernel_why"]}; '
                                   f'{report["tpu_custom_calls"]} tpu_custom_call in the HLO)'))
  if report.get('expert_bytes') is not None:
    rows.append(('expert GEMMs (ragged_dot)', f'{report["ragged_dot_kernels"]} ragged-dot tpu_custom_call (XLA:TPU\'s '
                                              f'grouped-matmul kernel) in the HLO'))
  for kind, (ops, nbytes) in sorted(report['collectives'].items()):
    rows.append((f'  {kind}', f'{ops} ops, {b(nbytes)} per device per pass'))
  rows.append(('compile time', f'{report["compile_s"]:.1f} s'))
  return rows


def main_target(cfg) -> int:
  """--target: compile for a TPU topology this machine does not have; exit 2 when the step does not fit."""
  devices = tpu_devices(FLAGS.target, FLAGS.slices)
  try:
    if FLAGS.mesh:
      cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = parse_mesh(FLAGS.mesh)
    target_config(cfg, devices, FLAGS.slices)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from e
  a = analytic(cfg)
  shape = sharding.MeshShape.resolve(cfg.mesh, len(devices))
  report = compile_step(cfg, devices)
  where = f'{FLAGS.target}' + (f' × {FLAGS.slices} slices' if FLAGS.slices > 1 else '')
  title = (f'per chip on {where} ({len(devices)} × {report["device_kind"]}), mesh {mesh_axes(shape)}, '
           f'remat={cfg.model.remat}, '
           f'microbatches={cfg.train.microbatches}')
  sections = [(f'{cfg.name}: model', model_rows(a, cfg)), (title, target_rows(report))]
  if report['fits'] is False and FLAGS.fit:
    setting, tried = fit_search(cfg, devices)
    rows = [(preflight.describe(s), f'{perf.format_bytes(r["memory"]["total_bytes"])}, '
             f'{"fits" if r["fits"] else "does not fit"}, compiled in {r["compile_s"]:.1f} s') for s, r in tried]
    rows.append(('cheapest that fits', preflight.describe(setting) if setting else 'none of these'))
    sections.append(('--fit: cheaper settings, cheapest first', rows))
    print(render(sections))
    if setting is None:
      raise preflight.DoesNotFitError(
          f'{cfg.name} does not fit {where} with any remat policy or microbatch count tried; shard wider '
          f'(a larger --target, more mesh.fsdp or mesh.tensor)')
    return 0
  print(render(sections))
  if report['fits'] is False:
    raise preflight.DoesNotFitError(preflight.not_fitting_message(
        cfg, report['memory'], report['limit_bytes'], report['limit_source']).replace(
        '--config=<this config>', f'--config=<this config> --target={FLAGS.target}'))
  return 0


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
  if cfg.model.remat == preflight.REMAT_AUTO:  # sized with the least recompute; --fit climbs the ladder as auto does
    cfg.model.remat = preflight.REMAT_LADDER[0]
  if FLAGS.target:
    return main_target(cfg)
  try:
    if FLAGS.mesh:
      cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = parse_mesh(FLAGS.mesh)
    available = jax.device_count()
    shape = sharding.MeshShape.resolve(cfg.mesh, FLAGS.chips or available)
    sizes = shape.sizes
    needed = math.prod(sizes) * shape.stages * shape.experts
    # One mesh of the whole size, a -1 resolved: what a device holds depends on each axis's total ways, not on
    # which network (dcn_* across hosts, or inside one) carries them.
    for axis, n in zip(sharding.AXES, sizes):
      cfg.mesh[axis] = n
    for axis in sharding.AXES:
      if f'dcn_{axis}' in cfg.mesh:
        cfg.mesh[f'dcn_{axis}'] = 1
    if 'stage' in cfg.mesh:
      cfg.mesh.stage, cfg.mesh.dcn_stage = shape.stages, 1
    if 'expert' in cfg.mesh:
      cfg.mesh.expert, cfg.mesh.dcn_expert = shape.experts, 1
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
  mesh_title = f'memory per device on mesh {mesh_axes(shape)}'

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
