"""Performance accounting: MFU against a peak table, time accounting and goodput, slow-step alerts, profiling,
memory statistics of the compiled step and the devices, and the persistent compilation cache.
"""

import collections
import contextlib
import logging
import os
import re
import statistics
import tempfile
import time

import jax

from jaxlm import malloc
from jaxlm.data import storage
from jaxlm.metrics import duration, format_table


log = logging.getLogger(__name__)

_unknown_kinds_reported = set()

# Dense bf16 peak FLOP/s per chip, from the vendors' datasheets (NVIDIA quotes sparse numbers: halve them).
# Matched in order against the lower-cased `device.device_kind`, so a special variant comes before its family.
PEAK_FLOPS = (
    (r'\bh100\b.*\bpcie\b', 756e12),  # 'NVIDIA H100 PCIe': lower clocks and power than the SXM part
    (r'\bh1[02]0\b.*\bnvl\b', 835e12),  # 'NVIDIA H100 NVL', 'NVIDIA H200 NVL'
    # 'NVIDIA H100 80GB HBM3' (SXM), 'NVIDIA H200' (the H100 die, more memory), 'NVIDIA GH200 480GB' (Grace+H100)
    (r'\bg?h[12]00\b', 989e12),
    (r'\ba100\b', 312e12),  # 'NVIDIA A100-SXM4-80GB', 'NVIDIA A100 80GB PCIe'
    (r'^tpu v4$', 275e12),  # not 'TPU v4 lite' (v4i, an inference chip)
    (r'^tpu v5 ?(lite|e)\b', 197e12),  # v5e: 'TPU v5 lite', 'TPU v5e'
    (r'^tpu v5p?$', 459e12),  # v5p reports itself as 'TPU v5'
    (r'^tpu v6 ?(lite|e)\b', 918e12),  # v6e (Trillium): 'TPU v6 lite', 'TPU v6e'
)

def peak_flops(device_kind: str) -> float | None:
  """Dense bf16 peak FLOP/s of one chip of this `device.device_kind`, or None when unknown (cpu included)."""
  kind = ' '.join(device_kind.lower().split())
  for pattern, flops in PEAK_FLOPS:
    if re.search(pattern, kind):
      return flops
  return None


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, device_kind: str) -> float | None:
  """Model FLOPs utilisation, a fraction of the chips' peak; None (said once per kind) on an unknown device.

  PaLM appendix B: model FLOPs are those the model needs (6N + 12·L·H·Q·T per token for the forward and
  backward pass), not those the hardware ran, so rematerialisation does not inflate the number.
  """
  peak = peak_flops(device_kind)
  if peak is None:
    if device_kind not in _unknown_kinds_reported:
      _unknown_kinds_reported.add(device_kind)
      log.warning('MFU is not reported: no peak FLOP/s is known for device kind %r (add it to '
                  'jaxlm.perf.PEAK_FLOPS).', device_kind)
    return None
  return tokens_per_s * flops_per_token / (num_devices * peak)


# Where time goes. 'step' is productive; everything else is badput. 'checkpoint' is what saves (and restores)
# block the loop for, 'final_save' the wait for the last save to reach the disk at the end of a run (a cost
# that does not grow with the run, so it is kept apart). 'startup' is untracked time before the first step
# (imports, init, restore not otherwise tracked), 'redo' is steps computed again after a resume or a rollback,
# 'other' is untracked time after the first step (logging, Python overhead). 'sample' is an RL run's sampling
# (jaxlm/rl.py): productive, as its steps are, but kept apart so the two can be compared.
TRACKED = ('step', 'compile', 'data', 'checkpoint', 'final_save', 'eval', 'sample')
PRODUCTIVE = ('step', 'sample')
BUCKETS = TRACKED + ('redo', 'startup', 'other')


def _process_age_s() -> float:
  import psutil  # pylint: disable=import-outside-toplevel
  return max(0.0, time.time() - psutil.Process().create_time())


class TimeAccounting:
  """Splits wall time since process start into productive step time and badput buckets.

  `with acct.track('data'): ...` attributes the block's time to a bucket; nested blocks count only in the
  innermost one, so the buckets always add up to the wall time. Step time is honest only when the block
  waits for the device (JAX dispatch is asynchronous): block on the step's outputs inside `track('step')`.
  Call `summary()` outside any block: an open block's time so far counts as 'other'.
  """

  def __init__(self, *, clock=time.monotonic, start: float | None = None):
    self._clock = clock
    # Wall time starts when the process did, so import, device and init time count too.
    self._start = clock() - _process_age_s() if start is None else start
    self._seconds = dict.fromkeys(BUCKETS, 0.0)
    self._stack = []  # [name, started, child seconds] of the open blocks
    self._redo_left = 0
    self._first_step_seen = False
    self.last_s = 0.0  # duration of the last completed block (the loop's step time)
    # Start-up phases, in order: (what ran, seconds); the first is the process's life before this object.
    self.phases: list[tuple[str, float]] = [('python, imports', clock() - self._start)]

  def redo_steps(self, n: int) -> None:
    """Counts the next `n` step blocks as redone work (after a resume or rollback), not as progress."""
    self._redo_left += max(0, int(n))

  @contextlib.contextmanager
  def track(self, name: str):
    """Attributes the time of the block to bucket `name` (one of TRACKED)."""
    if name not in TRACKED:
      raise ValueError(f'unknown time bucket {name!r}; use one of {TRACKED}')
    if name == 'step':
      if not self._first_step_seen:
        self._first_step_seen = True
        self._seconds['startup'] = self._untracked()
      if self._redo_left:
        self._redo_left -= 1
        name = 'redo'
    frame = [name, self._clock(), 0.0]
    self._stack.append(frame)
    try:
      yield
    finally:
      self._stack.pop()
      elapsed = self._clock() - frame[1]
      self._seconds[name] += elapsed - frame[2]
      if self._stack:
        self._stack[-1][2] += elapsed
      self.last_s = elapsed

  @contextlib.contextmanager
  def phase(self, name: str):
    """Names a piece of start-up for the start-up report (wall time; buckets are tracked as usual inside)."""
    started = self._clock()
    try:
      yield
    finally:
      self.phases.append((name, self._clock() - started))

  def startup_report(self) -> str:
    """One line: the time since the process started, what ran in it and how long each part took."""
    wall = self._clock() - self._start
    parts = [(name, s) for name, s in self.phases if s >= 0.05]
    rest = wall - sum(s for _, s in self.phases)
    if rest >= 0.05:
      parts.append(('other', rest))
    return f'start-up {wall:.1f}s: ' + ', '.join(f'{name} {s:.1f}s' for name, s in parts)

  def _untracked(self) -> float:
    wall = self._clock() - self._start
    return wall - sum(s for k, s in self._seconds.items() if k != 'other')

  def summary(self) -> dict:
    """{'wall_s', 'goodput', '<bucket>_s' for every bucket, 'badput_<bucket>' fraction for each non-step one}."""
    seconds = dict(self._seconds)
    if self._first_step_seen:
      seconds['other'] = max(0.0, self._untracked())
    else:  # still starting up
      seconds['startup'] = max(0.0, self._untracked())
    wall = sum(seconds.values())
    out = {'wall_s': wall, 'goodput': sum(seconds[k] for k in PRODUCTIVE) / wall if wall > 0 else 0.0}
    out.update({f'{k}_s': v for k, v in seconds.items()})
    out.update({f'badput_{k}': (v / wall if wall > 0 else 0.0) for k, v in seconds.items() if k not in PRODUCTIVE})
    return out

  def table(self) -> str:
    """The summary as a table, largest bucket first."""
    s = self.summary()
    rows = sorted(BUCKETS, key=lambda k: -s[f'{k}_s'])
    share = lambda k: s[f'{k}_s'] / s['wall_s'] if s['wall_s'] > 0 else 0.0  # noqa: E731
    label = {'step': 'step (productive)', 'sample': 'sample (productive)', 'final_save': 'final save'}
    body = [(label.get(k, k), f'{s[f"{k}_s"]:.1f}s', f'{100 * share(k):.1f}%') for k in rows]
    return (f'time accounting: wall {duration(s["wall_s"])}, goodput {100 * s["goodput"]:.1f}%\n'
            + format_table(body, right=(False, True, True), indent='  '))


def _due(after: int, upto: int, every: int) -> int:
  """How many multiples of `every` lie in (after, upto]."""
  return max(0, upto // every - after // every) if every > 0 else 0


class Eta:
  """Seconds left in a run, from the time accounting rather than the wall time between progress lines.

  The steps ahead cost the mean step time so far (data, redone steps and loop overhead included); each save and
  eval still ahead costs what saves and evals have cost so far. Before the first eval, one is priced at its
  forward passes (eval_batches × a step / 3: a step is a forward and a backward pass, about three forwards);
  before the first save, a save at nothing (an async save blocks only for its copy). A save or an eval between two
  progress lines then moves the estimate by what it cost beyond its price, not by its whole duration.
  """

  def __init__(self, total_steps: int, *, save_every: int, eval_every: int, eval_batches: int):
    self.total, self.save_every, self.eval_every, self.eval_batches = total_steps, save_every, eval_every, eval_batches
    self._step0, self._base = None, None

  def begin(self, step: int, summary: dict) -> None:
    """The loop's first step and `TimeAccounting.summary()` before it: time before counts for nothing here."""
    self._step0, self._base = step, summary

  def _ahead(self, after: int, every: int) -> int:
    """Events due in (after, total]: the multiples of `every`, and the one the loop runs at the last step."""
    return _due(after, self.total, every) + (0 if every > 0 and self.total % every == 0 else 1)

  def __call__(self, step: int, summary: dict, final_save_s: float | None = None) -> float | None:
    """Seconds left after the progress line of `step` (saves and evals due at `step` itself are still ahead)."""
    if self._base is None or step <= self._step0:
      return None
    delta = lambda k: summary[f'{k}_s'] - self._base.get(f'{k}_s', 0.0)  # noqa: E731
    per_step = sum(delta(k) for k in ('step', 'redo', 'data', 'other')) / (step - self._step0)
    saves = _due(self._step0, step - 1, self.save_every)
    evals = _due(self._step0, step - 1, self.eval_every)
    save_s = delta('checkpoint') / saves if saves else 0.0
    eval_s = delta('eval') / evals if evals else self.eval_batches * per_step / 3
    ahead = ((self.total - step) * per_step + self._ahead(step - 1, self.save_every) * save_s
             + self._ahead(step - 1, self.eval_every) * eval_s + (final_save_s or 0.0))
    return max(0.0, ahead)


class SlowStepDetector:
  """Flags a run of `count` consecutive steps each slower than `factor` × the rolling median step time."""

  def __init__(self, factor: float, count: int, window: int = 50, min_history: int = 10):
    self.factor, self.count, self.min_history = factor, count, min_history
    self._times = collections.deque(maxlen=window)
    self._run = []  # (step, seconds, median) of the current run of slow steps

  def update(self, step: int, seconds: float) -> str | None:
    """Adds one step time; returns a message when a run of slow steps reaches `count`, else None."""
    message = None
    if len(self._times) >= self.min_history:
      median = statistics.median(self._times)
      if seconds > self.factor * median:
        self._run.append((step, seconds, median))
        if len(self._run) == self.count:  # once per run, however long it lasts
          first, mean = self._run[0][0], statistics.fmean(s for _, s, _ in self._run)
          message = (f'{self.count} slow steps in a row ({first}..{step}): {mean:.3g}s each on average, '
                     f'{mean / median:.1f}x the rolling median {median:.3g}s')
      else:
        self._run = []
    # Slow steps enter the window too: a lasting slowdown becomes the new normal after about window/2 steps.
    self._times.append(seconds)
    return message


def _block(x) -> None:
  jax.block_until_ready(x() if callable(x) else x)


class Profiler:
  """Traces steps `log.profile_steps` = 'first,last' with jax.profiler into <workdir>/profile."""

  def __init__(self, log_cfg, workdir: str, *, is_primary: bool = True):
    self._range = tuple(int(x) for x in log_cfg.profile_steps.split(',')) if log_cfg.profile_steps else None
    if not is_primary:
      self._range = None
    # The profiler writes local files only: on a bucket it writes a local directory, uploaded when it stops.
    self.url = storage.join(workdir, 'profile') if storage.is_url(workdir) and self._range else None
    self.dir = tempfile.mkdtemp(prefix='jaxlm-profile-') if self.url else os.path.join(workdir, 'profile')
    self.active = False
    self._done = False

  def step(self, step: int, block_on=None) -> None:
    """Call at the top of every step; `block_on` (arrays or a callable returning them) is the last result."""
    if self._range is None or self._done:
      return
    first, last = self._range
    if self.active and step > last:
      self.stop(block_on)
    elif not self.active and first <= step <= last:
      _block(block_on)  # so the trace does not start inside earlier, still running steps
      # The Perfetto trace opens at ui.perfetto.dev; TensorBoard's profile plugin reads the xplane files.
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self.active = True

  def stop(self, block_on=None) -> None:
    """Ends an open trace after `block_on` is ready (also call once after the loop, for a range at the end)."""
    if self.active:
      _block(block_on)  # the traced steps must finish, or the trace misses their device work
      jax.profiler.stop_trace()
      self.active = False
      self._done = True
      if self.url:
        storage.upload(self.dir, self.url)


def compiled_memory(compiled) -> dict:
  """Per-device bytes of a jax.stages.Compiled (arguments, outputs, temporaries, ...); {} when not reported."""
  try:
    stats = compiled.memory_analysis()
  except (NotImplementedError, RuntimeError, jax.errors.JaxRuntimeError):
    return {}
  if stats is None:
    return {}
  out = {}
  for name in ('argument', 'output', 'alias', 'temp', 'generated_code'):
    value = getattr(stats, f'{name}_size_in_bytes', None)
    if value is not None:
      out[f'{name}_bytes'] = int(value)
  if {'argument_bytes', 'output_bytes', 'alias_bytes', 'temp_bytes'} <= out.keys():
    # Donated (aliased) buffers are both argument and output: count them once.
    out['total_bytes'] = (out['argument_bytes'] + out['output_bytes'] - out['alias_bytes'] + out['temp_bytes']
                          + out.get('generated_code_bytes', 0))
  peak = getattr(stats, 'peak_memory_in_bytes', None)
  if peak:
    out['peak_bytes'] = int(peak)
  return out


def device_memory_stats(devices=None) -> dict:
  """Live memory of this process's devices (the largest across them); {} where the backend has no stats."""
  out = {}
  for device in devices if devices is not None else jax.local_devices():
    stats = device.memory_stats() or {}
    for key, name in (('bytes_in_use', 'hbm_bytes_in_use'), ('peak_bytes_in_use', 'hbm_peak_bytes'),
                      ('bytes_limit', 'hbm_bytes_limit')):
      if key in stats:
        out[name] = max(out.get(name, 0), int(stats[key]))
  return out


def format_bytes(n: float) -> str:
  """Bytes in binary units, e.g. '1.50 GiB'."""
  for unit, scale in (('TiB', 2**40), ('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if abs(n) >= scale:
      return f'{n / scale:.2f} {unit}'
  return f'{int(n)} B'


def format_memory(memory: dict) -> str:
  """A one-line rendering of `compiled_memory` or `device_memory_stats`."""
  if not memory:
    return 'not reported by this backend'
  return ', '.join(f'{k.removesuffix("_bytes")} {format_bytes(v)}' for k, v in memory.items())


# Why the persistent cache is off on a CPU backend with several devices unless XLA:CPU's concurrency-optimized
# scheduler is (issue #32; README, Testing; malloc.CPU_MESH_XLA_FLAG, which the test suite sets): with that scheduler, an XLA:CPU executable read back from the cache
# (jaxlib 0.10.2) let a device wait in independent collectives at the same time, each blocking one thread of the
# intra-op pool, which has one thread per device. When one group of devices ran ahead, as in the first step
# (data 2 x fsdp 4: one fsdp group at the loss denominator's all-8 all-reduce and the final norm's all-gather at
# once, the other still in its first layer), it held every thread, the others never reached the rendezvous, and
# XLA aborted the process after 40 s.
# With the flag, one process ran clean (38 of 38); several processes did not: 2 Slurm tasks of 4 devices, one CPU
# each, aborted in a collective in all 3 jobs that read their steps back from a shared cache (2026-11-27).
CPU_MESH_CACHE_OFF = ("off on a multi-device CPU mesh: XLA:CPU executables read back from the cache can run one "
                      f"device's collectives concurrently and deadlock; {malloc.CPU_MESH_XLA_FLAG} in XLA_FLAGS "
                      'makes it safe in a single process, at some cost in step time (README, Testing)')


def compilation_cache_safe() -> bool:
  """Whether programs of this backend may be read back from the persistent cache (see CPU_MESH_CACHE_OFF)."""
  if not (jax.default_backend() == 'cpu' and jax.device_count() > 1):
    return True
  return jax.process_count() == 1 and malloc.CPU_MESH_XLA_FLAG in os.environ.get('XLA_FLAGS', '').split()


def keep_compilation_cache_safe() -> bool:
  """Turns JAX's persistent cache off where compilation_cache_safe() says no, a directory set by the environment
  (JAX_COMPILATION_CACHE_DIR) included; whether it may stay on. Every entry point that starts the backend calls it
  (the trainer here, every job of several processes in distributed.initialize)."""
  if compilation_cache_safe():
    return True
  jax.config.update('jax_enable_compilation_cache', False)
  return False


def enable_compilation_cache(log_cfg) -> str | None:
  """Turns on JAX's persistent compilation cache at `log.compilation_cache`; call before the first compile.

  JAX's own JAX_COMPILATION_CACHE_DIR, when set, names the directory instead (one setting for every JAX program
  of a machine, the test suite's processes included); `log.compilation_cache=''` keeps the cache off all the
  same. None when it is off: not configured, or a CPU mesh where it is unsafe (CPU_MESH_CACHE_OFF says why).
  """
  if not keep_compilation_cache_safe():
    return None
  path = os.path.expanduser(os.environ.get('JAX_COMPILATION_CACHE_DIR') or log_cfg.compilation_cache)
  if not log_cfg.compilation_cache or not path:
    return None
  os.makedirs(path, exist_ok=True)
  # JAX reads the directory once, at its first compile; its defaults only cache programs that took >= 1 s to
  # compile, which are the ones worth the disk.
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_compilation_cache_dir', path)
  return path
