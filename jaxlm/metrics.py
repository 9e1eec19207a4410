"""Metrics you can trust: sinks (stdout, metrics.jsonl, TensorBoard, W&B), MFU, time accounting and goodput,
slow-step alerts, profiling, memory and the persistent compilation cache.

Nothing here imports TensorFlow: TensorBoard event files are written with the `tensorboard` package's own
record writer and protos. W&B is imported only when `log.wandb` is set. Only the primary process (process 0)
writes anything; the others hold a logger that does nothing, so the loop never branches on the process index.
"""

import collections
import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import statistics
import time

import jax
import numpy as np

from jaxlm import rundir
from jaxlm.errors import ConfigError, StorageError

log = logging.getLogger(__name__)

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

TRAIN_KEYS = ('loss', 'lr', 'grad_norm', 'tokens_per_s')  # every train record has these (and 'step')
EVAL_KEYS = ('eval_loss',)
KINDS = ('train', 'eval', 'system')  # system: memory, time accounting, compile time: no stdout line
RESERVED = ('kind', 'step', 'time', 'event', 'message')  # keys every record sets itself; `time` is Unix time

_unknown_kinds_reported = set()


read_metrics = rundir.read_metrics  # moved; kept for callers of metrics.read_metrics


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
                  'jaxlm.metrics.PEAK_FLOPS).', device_kind)
    return None
  return tokens_per_s * flops_per_token / (num_devices * peak)


def _duration(seconds: float | None) -> str:
  if seconds is None or not math.isfinite(seconds) or seconds < 0:
    return '?'
  s = round(seconds)
  if s >= 3600:
    return f'{s // 3600}h{s % 3600 // 60:02d}m'
  return f'{s // 60}m{s % 60:02d}s'


def _si(x: float) -> str:
  for unit, scale in (('G', 1e9), ('M', 1e6), ('k', 1e3)):
    if abs(x) >= scale:
      return f'{x / scale:.3g}{unit}'
  return f'{x:.3g}'


def progress_line(step: int, total_steps: int | None, values: dict, eta_s: float | None) -> str:
  """One stdout line: step, loss, tokens/s, MFU (when known) and the time left (when the total is known)."""
  if total_steps:
    width = len(str(total_steps))
    parts = [f'step {step:>{width}}/{total_steps} ({100 * step / total_steps:5.1f}%)']
  else:
    parts = [f'step {step}']
  parts += [f'loss {values["loss"]:.4f}', f'{_si(values["tokens_per_s"])} tok/s']
  if values.get('mfu') is not None:
    parts.append(f'MFU {100 * values["mfu"]:.1f}%')
  if total_steps:
    parts.append(f'ETA {_duration(eta_s)}')
  return ' | '.join(parts)


def _plain(value):
  """A JSON-ready Python scalar from a Python, NumPy or JAX scalar (a JAX array waits for its value)."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  array = np.asarray(value)
  if array.ndim:
    raise TypeError(f'metrics must be scalars, got an array of shape {array.shape}')
  return array.item()


def _check_reserved(values: dict) -> None:
  clash = sorted(set(values) & set(RESERVED))
  if clash:
    raise ValueError(f'metric names {clash} are reserved for the record itself; rename them')


def _is_storage_error(e: BaseException) -> bool:
  """OSError anywhere in the chain: TensorBoard's writer wraps its thread's error in another."""
  while e is not None:
    if isinstance(e, OSError):
      return True
    e = e.__cause__ or e.__context__
  return False


def free_space(path: str) -> str:
  """Free space of the file system holding `path` (or its nearest existing parent), for error messages."""
  while path and not os.path.exists(path):
    path = os.path.dirname(path)
  try:
    return f'{shutil.disk_usage(path or ".").free / 2**20:.1f} MiB'
  except OSError:
    return 'unknown'


def storage_error(path: str, error: BaseException) -> StorageError:
  """The one stop for a run directory that cannot be written, whoever was writing."""
  return StorageError(f'cannot write {path} ({type(error).__name__}: {error}); {free_space(path)} free there. '
                      f'Fix: free disk space or make the directory writable (or pass a --workdir on another '
                      f'disk), then run the same command again to resume from the newest checkpoint')


class _TensorBoard:
  """Scalars and text in TensorBoard event files, through tensorboard's own writer (no TensorFlow)."""

  def __init__(self, logdir: str):
    # Imported here so a run with log.tensorboard=False does not pay for the import.
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.text import metadata as text_metadata
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from tensorboard.util import tensor_util
    self._summary_pb2, self._event_pb2, self._tensor_util = summary_pb2, event_pb2, tensor_util
    self._text_metadata = text_metadata.create_summary_metadata(display_name='events', description='')
    # A background thread writes; flush_secs bounds what a crash (not a clean close) can lose.
    self._writer = EventFileWriter(logdir, flush_secs=10)

  def scalars(self, step: int, values: dict, prefix: str) -> None:
    summary = self._summary_pb2.Summary()
    for key, value in values.items():
      if isinstance(value, (bool, int, float)):
        summary.value.add(tag=f'{prefix}/{key}', simple_value=float(value))
    if summary.value:
      self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

  def text(self, step: int, tag: str, text: str) -> None:
    summary = self._summary_pb2.Summary()
    summary.value.add(tag=tag, metadata=self._text_metadata,
                      tensor=self._tensor_util.make_tensor_proto([text.encode()]))
    self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
    self._writer.flush()  # events are rare and are what one looks for after a crash

  def close(self) -> None:
    self._writer.close()


def _start_wandb(workdir: str, log_cfg, config):
  """A W&B run that resumes across restarts of the same workdir (its id is kept in <workdir>/wandb_id)."""
  try:
    import wandb  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError('log.wandb=True but the wandb package is not installed: `pip install wandb` (or '
                      'jaxlm[wandb]), or set --config.log.wandb=False. WANDB_MODE=offline logs without an '
                      'account.') from e
  id_path = os.path.join(workdir, 'wandb_id')
  if os.path.exists(id_path):
    with open(id_path) as f:
      run_id = f.read().strip()
  else:
    run_id = secrets.token_hex(4)
    with open(id_path, 'w') as f:
      f.write(run_id)
  name = config.get('name') if config is not None else None
  run = wandb.init(project=log_cfg.wandb_project, name=name or os.path.basename(os.path.abspath(workdir)),
                   id=run_id, resume='allow', dir=workdir,
                   config=config.to_dict() if hasattr(config, 'to_dict') else config)
  # Our own step axis: W&B drops any log whose internal step goes backwards, which a rollback or a resume
  # from an older checkpoint does.
  run.define_metric('step')
  run.define_metric('*', step_metric='step')
  return run


class MetricsLogger:
  """Writes metric records and events to stdout, <workdir>/metrics.jsonl, TensorBoard and W&B.

  Records are appended, so a restarted run continues the same files; steps redone after a resume appear
  again (the later record of a step wins in `jaxlm.tools.report`). Non-finite floats are written as NaN/Infinity
  (what Python's json reads) rather than dropped: a NaN loss is exactly what the log must show.
  """

  def __init__(self, workdir: str, log_cfg, *, total_steps: int | None = None, is_primary: bool = True,
               config=None, clock=time.monotonic):
    self.is_primary = is_primary
    self._total_steps = total_steps
    self._clock = clock
    self._last = None  # (clock, step) of the previous train record, for the ETA
    self._event_counts = collections.Counter()
    self._jsonl = self._tb = self._wandb = None
    if not is_primary:
      return
    self._workdir = workdir
    with self._writing('metrics.jsonl'):
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', buffering=1)  # line-buffered
    if log_cfg.tensorboard:
      with self._writing('tb'):
        self._tb = _TensorBoard(os.path.join(workdir, 'tb'))
    if log_cfg.wandb:
      self._wandb = _start_wandb(workdir, log_cfg, config)

  def write(self, step: int, values: dict, kind: str = 'train') -> None:
    """Records `values` at `step`; None values (e.g. MFU on an unknown device) are left out, not zeroed."""
    if kind not in KINDS:
      raise ValueError(f'kind={kind!r}; use one of {KINDS}')
    required = {'train': TRAIN_KEYS, 'eval': EVAL_KEYS}.get(kind, ())
    missing = [k for k in required if values.get(k) is None]
    if missing:
      raise KeyError(f'a {kind} record needs {", ".join(missing)}; got {sorted(values)}')
    _check_reserved(values)
    if not self.is_primary:
      return
    values = {k: _plain(v) for k, v in values.items() if v is not None}
    step = int(step)
    if kind == 'train':
      now, eta = self._clock(), None
      if self._last is not None and step > self._last[1] and self._total_steps:
        eta = (now - self._last[0]) / (step - self._last[1]) * (self._total_steps - step)
      self._last = (now, step)
      print(progress_line(step, self._total_steps, values, eta), flush=True)
    elif kind == 'eval':
      print(f'eval step {step} | ' + ' | '.join(f'{k} {v:.4f}' for k, v in values.items()
                                               if isinstance(v, float)), flush=True)
    self._record({'kind': kind, 'step': step, 'time': time.time(), **values})
    if self._tb:
      with self._writing('tb'):
        self._tb.scalars(step, values, kind)
    if self._wandb:
      self._wandb.log({'step': step, **{f'{kind}/{k}': v for k, v in values.items()}})

  def event(self, step: int, name: str, message: str, **fields) -> None:
    """A loud thing (skipped step, spike, rollback, failed save, slow steps): a WARNING line and a record."""
    _check_reserved(fields)
    if not self.is_primary:
      return
    step = int(step)
    self._event_counts[name] += 1
    print(f'WARNING step {step} [{name}] {message}', flush=True)
    fields = {k: _plain(v) for k, v in fields.items()}
    self._record({'kind': 'event', 'step': step, 'time': time.time(), 'event': name, 'message': message,
                  **fields})
    if self._tb:
      with self._writing('tb'):
        self._tb.text(step, 'events', f'**{name}**: {message}')
        self._tb.scalars(step, {name: self._event_counts[name]}, 'events')
    if self._wandb:
      self._wandb.log({'step': step, f'events/{name}': self._event_counts[name]})

  def _record(self, record: dict) -> None:
    with self._writing('metrics.jsonl'):
      self._jsonl.write(json.dumps(record) + '\n')

  @contextlib.contextmanager
  def _writing(self, name: str):
    """A full or unwritable run directory stops the run like a failed checkpoint: exit 3, one clear line."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except  -- TensorBoard's writer thread re-raises anything
      if isinstance(e, StorageError) or not _is_storage_error(e):
        raise
      self._jsonl = self._tb = None  # a sink that failed once is not written (or flushed) again
      raise storage_error(os.path.join(self._workdir, name), e) from e

  def close(self) -> None:
    """Flushes and closes every sink."""
    sinks, (self._jsonl, self._tb, self._wandb) = (self._jsonl, self._tb, self._wandb), (None, None, None)
    jsonl, tb, wandb = sinks
    with self._writing('metrics.jsonl'):
      if jsonl:
        jsonl.close()
    with self._writing('tb'):
      if tb:
        tb.close()
    if wandb:
      wandb.finish()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


# Where time goes. 'step' is productive; everything else is badput. 'startup' is untracked time before the
# first step (imports, init, restore not otherwise tracked), 'redo' is steps computed again after a resume or a
# rollback, 'other' is untracked time after the first step (logging, Python overhead).
TRACKED = ('step', 'compile', 'data', 'checkpoint', 'eval')
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
    out = {'wall_s': wall, 'goodput': seconds['step'] / wall if wall > 0 else 0.0}
    out.update({f'{k}_s': v for k, v in seconds.items()})
    out.update({f'badput_{k}': (v / wall if wall > 0 else 0.0) for k, v in seconds.items() if k != 'step'})
    return out

  def table(self) -> str:
    """The summary as a table, largest bucket first."""
    s = self.summary()
    rows = sorted(BUCKETS, key=lambda k: -s[f'{k}_s'])
    lines = [f'time accounting: wall {_duration(s["wall_s"])}, goodput {100 * s["goodput"]:.1f}%']
    for k in rows:
      label = 'step (productive)' if k == 'step' else k
      share = s[f'{k}_s'] / s['wall_s'] if s['wall_s'] > 0 else 0.0
      lines.append(f'  {label:<18} {s[f"{k}_s"]:>10.1f}s {100 * share:6.1f}%')
    return '\n'.join(lines)


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
    self.dir = os.path.join(workdir, 'profile')
    self._range = tuple(int(x) for x in log_cfg.profile_steps.split(',')) if log_cfg.profile_steps else None
    if not is_primary:
      self._range = None
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


def enable_compilation_cache(log_cfg) -> str | None:
  """Turns on JAX's persistent compilation cache at `log.compilation_cache`; call before the first compile."""
  path = os.path.expanduser(log_cfg.compilation_cache)
  if not path:
    return None
  os.makedirs(path, exist_ok=True)
  # JAX reads the directory once, at its first compile; its defaults only cache programs that took >= 1 s to
  # compile, which are the ones worth the disk.
  jax.config.update('jax_compilation_cache_dir', path)
  return path
