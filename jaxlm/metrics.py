"""Metric sinks behind one interface: stdout progress lines, metrics.jsonl, TensorBoard and W&B.

MFU, goodput, slow steps, profiling and memory statistics are computed in jaxlm.perf and logged here.

Nothing here imports TensorFlow: TensorBoard event files are written with the `tensorboard` package's own
record writer and protos. W&B is imported only when `log.wandb` is set. Only the primary process (process 0)
writes anything; the others hold a logger that does nothing, so the loop never branches on the process index.
"""

import collections
import contextlib
import json
import math
import logging
import os
import re
import secrets
import threading
import time

import numpy as np

from jaxlm.data import storage
from jaxlm.errors import ConfigError, StorageError

log = logging.getLogger(__name__)

TRAIN_KEYS = ('loss', 'lr', 'grad_norm', 'tokens_per_s')  # every train record has these (and 'step')
EVAL_KEYS = ('eval_loss',)
KINDS = ('train', 'eval', 'system', 'gen')  # system: memory, time accounting, compile time: no stdout line; gen: train.gen_eval
RESERVED = ('kind', 'step', 'time', 'event', 'message')  # keys every record sets itself; `time` is Unix time


def duration(seconds: float | None) -> str:
  """Seconds for a person: '12m05s', '3h07m', or past two days '12.5 days' ('?' when unknown)."""
  if seconds is None or not math.isfinite(seconds) or seconds < 0:
    return '?'
  for unit, scale in (('years', 365 * 86400), ('days', 86400)):
    if seconds >= 2 * scale:
      return f'{seconds / scale:.1f} {unit}'
  s = round(seconds)
  if s >= 3600:
    return f'{s // 3600}h{s % 3600 // 60:02d}m'
  return f'{s // 60}m{s % 60:02d}s'


def format_table(rows, header=None, right=(), indent: str = '', widths=None, rule: bool = False) -> str:
  """Aligned text columns, the one renderer of every table jaxlm prints.

  right: which columns are right-aligned; widths: minimum widths (to align several tables); rule: dashes
  under the header.
  """
  lines = [tuple(map(str, r)) for r in ([header] if header else []) + list(rows)]
  cols = max(len(r) for r in lines)
  minimum = tuple(widths or ()) + (0,) * cols
  widths = [max([len(r[i]) for r in lines if i < len(r)] + [minimum[i]]) for i in range(cols)]
  right = tuple(right) + (False,) * cols

  def fmt(r):
    return (indent + '  '.join(c.rjust(w) if right[i] else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))

  out = [fmt(r).rstrip() for r in lines]
  if header and rule:
    out.insert(1, indent + '  '.join('-' * w for w in widths))
  return '\n'.join(out)


def _si(x: float) -> str:
  for unit, scale in (('G', 1e9), ('M', 1e6), ('k', 1e3)):
    if abs(x) >= scale:
      return f'{x / scale:.3g}{unit}'
  return f'{x:.3g}'


def progress_line(step: int, total_steps: int | None, values: dict, eta_s: float | None) -> str:
  """One stdout line: step, loss, tokens/s, MFU (when known), a MoE's max load, and the time left (when known)."""
  if total_steps:
    width = len(str(total_steps))
    parts = [f'step {step:>{width}}/{total_steps} ({100 * step / total_steps:5.1f}%)']
  else:
    parts = [f'step {step}']
  if values.get('epoch') is not None:  # train.epochs
    parts.append(f'epoch {values["epoch"]:.2f}')
  parts += [f'loss {values["loss"]:.4f}', f'{_si(values["tokens_per_s"])} tok/s']
  if values.get('reward') is not None:  # an RL run (jaxlm/rl.py): the mean reward of the step's completions
    parts.append(f'reward {values["reward"]:.3f}')
  if values.get('mfu') is not None:
    parts.append(f'MFU {100 * values["mfu"]:.1f}%')
  if values.get('moe/max_load') is not None:  # a mixture of experts: the busiest expert over the mean, all layers
    parts.append(f'max load {values["moe/max_load"]:.2f}')
  if total_steps:
    parts.append(f'ETA {duration(eta_s)}')
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
  free = storage.free_bytes(path)  # None on a bucket: it has no such number
  return 'unknown' if free is None else f'{free / 2**20:.1f} MiB'


LAST_LINE = 300  # characters of a storage error's `jaxlm:` line: the library's own message goes to the log


def os_errno(error: BaseException) -> int | None:
  """The errno of an OSError anywhere in the chain, or the one TensorStore quotes in its message; else None."""
  e = error
  while e is not None:
    if isinstance(e, OSError) and e.errno:
      return e.errno
    if code := re.search(r"os_error_code='?(\d+)", str(e)):
      return int(code.group(1))
    e = e.__cause__ or e.__context__
  return None


def short_cause(error: BaseException) -> str:
  """The operating system's words for why a write failed ('No space left on device'); else the error's first
  words. Never a library's whole message (TensorStore's runs to source locations and hundreds of characters)."""
  if (number := os_errno(error)) is not None:
    return os.strerror(number)
  text = ' '.join(str(error).split())
  return f'{type(error).__name__}: {text[:60]}{"..." if len(text) > 60 else ""}'


def shorten_path(path: str, room: int) -> str:
  """`path` in at most `room` characters: its start and its end, which say which disk and which directory."""
  if len(path) <= room or room < 12:
    return path
  keep = room - 3
  return f'{path[:keep // 3]}...{path[-(keep - keep // 3):]}'


def fit_line(template: str, path: str) -> str:
  """`template` with `{path}` filled in, the path shortened in its middle if the line would pass LAST_LINE."""
  room = LAST_LINE - len('jaxlm: ') - (len(template) - len('{path}'))
  return template.replace('{path}', shorten_path(path, room))


def storage_error(path: str, error: BaseException) -> StorageError:
  """The one stop for a run directory that cannot be written, whoever was writing.

  The line names the path, the cause, the free space and the fix; the library's full message is logged first.
  """
  log.error('writing %s failed: %s: %s', path, type(error).__name__, error)
  number = os_errno(error)
  cause = f'{type(error).__name__}: [Errno {number}] {short_cause(error)}' if number else short_cause(error)
  if storage.is_url(path):  # a bucket has no free space to report: a refused write is quota, throttling or rights
    return StorageError(fit_line(f'cannot write {{path}} ({cause}); the store refused the write. Fix: the '
                                 f'bucket\'s quota or write permission, or another --workdir, then rerun to resume',
                                 path))
  return StorageError(fit_line(f'cannot write {{path}} ({cause}); {free_space(path)} free there. Fix: '
                               f'free space or use a writable --workdir, then rerun to resume', path))


def _quiet_writer_thread() -> None:
  """Leaves a failed TensorBoard write to the main thread instead of a thread traceback on stderr.

  tensorboard's writer thread keeps the exception and re-raises it in the main thread at the next
  add_event/flush/close, where `_writing` turns it into one StorageError line; the thread itself re-raises too,
  and Python's default hook would print its traceback first.
  """
  if getattr(threading.excepthook, 'jaxlm', False):
    return
  from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread  # pylint: disable=import-outside-toplevel
  previous = threading.excepthook

  def hook(args):
    if isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError):
      return
    previous(args)

  hook.jaxlm = True
  threading.excepthook = hook


class _TensorBoard:
  """Scalars and text in TensorBoard event files, through tensorboard's own writer (no TensorFlow)."""

  def __init__(self, logdir: str):
    # On a bucket the writer writes a local directory that `storage.Mirror` uploads at each flush: the event
    # writer only knows local files, and a bucket cannot append. Files are rotated so each upload stays small.
    self._mirror = storage.Mirror(logdir, prefix='jaxlm-tb-') if storage.is_url(logdir) else None
    self._logdir = self._mirror.local if self._mirror else logdir
    # Imported here so a run with log.tensorboard=False does not pay for the import.
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.compat.proto import event_pb2
    from tensorboard.plugins.text import metadata as text_metadata
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from tensorboard.util import tensor_util
    self._summary_pb2, self._event_pb2, self._tensor_util = summary_pb2, event_pb2, tensor_util
    self._text_metadata = text_metadata.create_summary_metadata(display_name='events', description='')
    # A background thread writes; flush_secs bounds what a crash (not a clean close) can lose.
    self._writer_class = EventFileWriter
    self._writer = EventFileWriter(self._logdir, flush_secs=10)
    _quiet_writer_thread()

  def _uploaded(self) -> None:
    """On a bucket: flushes and uploads what changed, so a kill -9 loses no event written before it."""
    if self._mirror is None:
      return
    self._writer.flush()
    self._mirror.sync()
    if os.path.getsize(self._newest()) > storage.SEGMENT_BYTES:  # a new file (its name has a per-process count)
      self._writer.close()
      self._writer = self._writer_class(self._logdir, flush_secs=10)

  def _newest(self) -> str:
    return max((os.path.join(self._logdir, n) for n in os.listdir(self._logdir)), key=os.path.getmtime)

  def scalars(self, step: int, values: dict, prefix: str) -> None:
    summary = self._summary_pb2.Summary()
    for key, value in values.items():
      if isinstance(value, (bool, int, float)):
        summary.value.add(tag=f'{prefix}/{key}', simple_value=float(value))
    if summary.value:
      self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
      self._uploaded()

  def text(self, step: int, tag: str, text: str) -> None:
    summary = self._summary_pb2.Summary()
    summary.value.add(tag=tag, metadata=self._text_metadata,
                      tensor=self._tensor_util.make_tensor_proto([text.encode()]))
    self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
    self._writer.flush()  # events are rare and are what one looks for after a crash
    self._uploaded()

  def close(self) -> None:
    self._writer.close()
    if self._mirror is not None:
      self._mirror.close()


def _start_wandb(workdir: str, log_cfg, config):
  """A W&B run that resumes across restarts of the same workdir (its id is kept in <workdir>/wandb_id)."""
  try:
    import wandb  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError('log.wandb=True but the wandb package is not installed: `pip install wandb` (or '
                      'jaxlm[wandb]), or set --config.log.wandb=False. WANDB_MODE=offline logs without an '
                      'account.') from e
  id_path = storage.join(workdir, 'wandb_id')
  if storage.exists(id_path):
    run_id = storage.read_text(id_path).strip()
  else:
    run_id = secrets.token_hex(4)
    storage.write_bytes(id_path, run_id)
  name = config.get('name') if config is not None else None
  run = wandb.init(project=log_cfg.wandb_project, name=name or storage.basename(storage.normalize(workdir)),
                   id=run_id, resume='allow', dir=None if storage.is_url(workdir) else workdir,  # W&B's own files
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
      storage.makedirs(workdir)
      # Line-buffered locally; on a bucket each record is uploaded before write returns (storage.Segments).
      self._jsonl = storage.open_log(storage.join(workdir, 'metrics.jsonl'))
    if log_cfg.tensorboard:
      with self._writing('tb'):
        self._tb = _TensorBoard(storage.join(workdir, 'tb'))
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
      # The trainer passes `eta_s` (jaxlm.perf.Eta: saves and evals priced apart from steps); without it, the
      # time since the previous record, which a save or an eval in between inflates.
      now, eta = self._clock(), values.get('eta_s')
      if eta is None and self._last is not None and step > self._last[1] and self._total_steps:
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
    if self._jsonl is None:  # failed once (see _writing): the error that said so is already on its way
      return
    with self._writing('metrics.jsonl'):
      self._jsonl.write(json.dumps(record) + '\n')

  @contextlib.contextmanager
  def _writing(self, name: str):
    """A full or unwritable run directory stops the run like a failed checkpoint: exit 3, one clear line."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except  -- TensorBoard's writer thread re-raises anything
      # On a bucket any error of a write is the store's (quota, throttling, permissions): the same loud stop.
      if isinstance(e, StorageError) or not (_is_storage_error(e) or storage.is_url(self._workdir)):
        raise
      self._jsonl = self._tb = None  # a sink that failed once is not written (or flushed) again
      raise storage_error(storage.join(self._workdir, name), e) from e

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


