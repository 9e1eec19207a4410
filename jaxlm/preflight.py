"""Does the compiled train step fit the devices' memory: the one check `train` runs before step 0 and
`jaxlm.tools.size --target` runs for a TPU it does not have.

A device's memory is, in order: what it reports (`memory_stats()['bytes_limit']`: GPUs, TPUs), else
$JAXLM_DEVICE_MEMORY_BYTES (CPUs report none; tests set it), else the HBM table below by device kind (compile-only
TPU devices report none). Unknown memory is never a failure: the check says so and passes.
"""

import os

import jax

from jaxlm import errors
from jaxlm import model as model_lib
from jaxlm import perf
from jaxlm import step as step_lib

MEMORY_ENV = 'JAXLM_DEVICE_MEMORY_BYTES'

GiB = 2**30
# HBM per chip, keyed by jax Device.device_kind (as libtpu reports it: v5e is 'TPU v5 lite', v5p 'TPU v5').
HBM_BYTES = {
    'TPU v4': 32 * GiB,
    'TPU v5 lite': 16 * GiB,
    'TPU v5e': 16 * GiB,
    'TPU v5': 95 * GiB,
    'TPU v5p': 95 * GiB,
    'TPU v6 lite': 32 * GiB,
    'TPU v6e': 32 * GiB,
}

# Activation checkpointing from least to most recompute (model.REMAT_CHOICES, in cost order).
REMAT_LADDER = ('none', 'dots', 'dots_no_batch', 'attn_out', 'full')
assert set(REMAT_LADDER) == set(model_lib.REMAT_CHOICES)
REMAT_AUTO = 'auto'  # model.remat=auto: the trainer picks from REMAT_LADDER before step 0 (`choose_remat`)


class DoesNotFitError(errors.ConfigError):
  """The compiled train step needs more memory than a device has (exit 2: a restart will not help)."""
  exit_code = 2


def device_memory(devices) -> tuple[int | None, str]:
  """(bytes one device can hold, where that number came from); (None, why) when nobody knows."""
  limits = []
  for d in devices:
    try:
      stats = d.memory_stats() or {}
    except (RuntimeError, NotImplementedError, jax.errors.JaxRuntimeError):  # compile-only devices
      stats = {}
    if 'bytes_limit' in stats:
      limits.append(int(stats['bytes_limit']))
  if limits:
    return min(limits), 'reported by the device'
  if os.environ.get(MEMORY_ENV):
    return int(float(os.environ[MEMORY_ENV])), f'${MEMORY_ENV}'
  kind = devices[0].device_kind
  if kind in HBM_BYTES:
    return HBM_BYTES[kind], f'HBM of a {kind} chip'
  return None, f'{kind} reports no memory limit (set ${MEMORY_ENV} to check one)'


def step_memory(compiled) -> dict:
  """Per-device bytes of a compiled step: arguments, outputs, aliased (donated), temporaries, code, total."""
  try:
    stats = compiled.memory_analysis()
  except (NotImplementedError, RuntimeError, jax.errors.JaxRuntimeError):
    stats = None
  if stats is None:
    return {}
  out = {f'{n}_bytes': int(getattr(stats, f'{n}_size_in_bytes', 0) or 0)
         for n in ('argument', 'output', 'alias', 'temp', 'generated_code')}
  # Donated state is updated in place: its outputs alias its arguments and are not held twice.
  out['total_bytes'] = (out['argument_bytes'] + out['output_bytes'] - out['alias_bytes'] + out['temp_bytes']
                        + out['generated_code_bytes'])
  return out


def candidates(cfg) -> list[dict]:
  """Settings that need less memory than cfg's, cheapest first: more recompute, then more microbatches.

  Each is {'remat': policy, 'microbatches': n}. Microbatches must keep dividing the batch over data×fsdp.
  """
  current = cfg.model.remat
  start = REMAT_LADDER.index(current) if current in REMAT_LADDER else 0
  micro = max(cfg.train.microbatches, 1)
  out = [{'remat': r, 'microbatches': micro} for r in REMAT_LADDER[start + 1:]]
  ways = cfg.mesh.data * cfg.mesh.fsdp if cfg.mesh.data > 0 and cfg.mesh.fsdp > 0 else 1
  n = micro * 2
  while cfg.train.batch_size % (n * ways) == 0:
    out.append({'remat': 'full', 'microbatches': n})
    n *= 2
  return out


def with_setting(cfg, setting: dict):
  """A copy of cfg with a candidate's remat policy and microbatch count."""
  trial = cfg.copy_and_resolve_references()
  trial.model.remat, trial.train.microbatches = setting['remat'], setting['microbatches']
  return trial


def search(cfg, settings: list[dict], measure) -> tuple[dict | None, list]:
  """The first of `settings` (cheapest first) whose step fits, and (setting, report) of every one compiled.

  measure(trial_cfg) compiles one candidate and returns a report with 'fits' (or None to pass over a setting the
  config refuses). The one search behind `jaxlm.tools.size --fit` and model.remat=auto.
  """
  tried = []
  for setting in settings:
    report = measure(with_setting(cfg, setting))
    if report is None:
      continue
    tried.append((setting, report))
    if report['fits']:
      return setting, tried
  return None, tried


def choose_remat(cfg, mesh) -> tuple[str, str]:
  """model.remat=auto: (the policy with the least recompute whose compiled step fits a device, why).

  Compiles the real train step ahead of time for each policy in REMAT_LADDER order and stops at the first that
  fits the devices' memory (`device_memory`); nothing is allocated. Memory nobody knows picks `none`.
  Raises DoesNotFitError when even `full` does not fit.
  """
  devices = mesh.local_devices
  limit, source = device_memory(devices)
  if limit is None:
    return REMAT_LADDER[0], f'{source}: no memory to fit, so no recompute'
  gib = perf.format_bytes

  def measure(trial):
    program = step_lib.build_program(trial, mesh)
    batch = step_lib.abstract_batch(trial.train.batch_size, trial.data.seq_len, program.batch_sharding)
    memory = step_memory(program.train_step.lower(program.abstract_state, batch).compile())
    return {'memory': memory, 'fits': fits(memory, limit)}

  micro = max(cfg.train.microbatches, 1)
  setting, tried = search(cfg, [{'remat': r, 'microbatches': micro} for r in REMAT_LADDER], measure)
  sizes = ', '.join(f'{s["remat"]} {gib(r["memory"]["total_bytes"])}' for s, r in tried if r['memory'])
  if setting is None:
    raise DoesNotFitError(
        f'model.remat=auto: no activation checkpointing fits: the train step needs {sizes} per device and a device '
        f'holds {gib(limit)} ({source}); shard wider (more mesh.fsdp or mesh.tensor), raise train.microbatches, or '
        f'run python -m jaxlm.tools.size --config=<this config> --fit to find a setting that fits')
  return setting['remat'], (f'the least recompute whose compiled step fits {gib(limit)} per device ({source}); '
                             f'compiled per device: {sizes}')


def describe(setting: dict) -> str:
  """A setting as command-line overrides."""
  return f'--config.model.remat={setting["remat"]} --config.train.microbatches={setting["microbatches"]}'


def fits(memory: dict, limit: int | None) -> bool | None:
  """True/False when both numbers are known, else None."""
  if not memory or limit is None:
    return None
  return memory['total_bytes'] <= limit


def check(cfg, compiled, devices) -> dict:
  """The step's memory against the devices'; raises DoesNotFitError (numbers and the cheapest fix) if too big."""
  memory = step_memory(compiled)
  limit, source = device_memory(devices)
  verdict = fits(memory, limit)
  if verdict is False:
    raise DoesNotFitError(not_fitting_message(cfg, memory, limit, source))
  return {**memory, 'limit_bytes': limit, 'limit_source': source, 'fits': verdict}


def not_fitting_message(cfg, memory: dict, limit: int, source: str) -> str:
  """`<what>; <fix>`: the numbers, then the cheapest untried setting and the search that proves one."""
  gib = lambda n: f'{n / GiB:.2f} GiB'
  what = (f'the train step needs {gib(memory["total_bytes"])} per device (arguments {gib(memory["argument_bytes"])}, '
          f'temporaries {gib(memory["temp_bytes"])}) and a device holds {gib(limit)} ({source}), '
          f'{gib(memory["total_bytes"] - limit)} too much')
  options = candidates(cfg)
  first = f'try {describe(options[0])}, or ' if options else 'shard wider (more mesh.fsdp or mesh.tensor), or '
  return (f'{what}; {first}run python -m jaxlm.tools.size --config=<this config> --fit to find the cheapest '
          f'setting that fits')
