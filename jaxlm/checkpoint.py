"""Checkpoints on Orbax's CheckpointManager: async saves, exact resume, and no silent save failure.

One checkpoint step holds four items: `state` (params, optimizer state, step, RNG), `data` (the training
stream's global row position, readable on any number of processes), `guard` (the stability guard's history,
so a resume judges spikes as the run it continues)
and `env` (a JSON record of how the run was made). On a local disk Orbax writes each step to a temporary directory
and renames it only when complete; on a bucket (`gs://`), which has no atomic rename, it writes the step in place
and a commit marker last. Either way a partial save is never listed as a step, and its leftovers are cleared
before that step is saved again. Every path operation goes through `jaxlm.data.storage`, local or bucket alike.

Integrity (integrity.py): once a save is confirmed, process 0 writes `checksums.json` into the step directory; a
restore verifies it first. A checkpoint that fails the check, or cannot be read, is moved aside to
`<directory>.unreadable/` (kept for inspection, never resumed from, and out of the way of the step number being
saved again; copy then delete on a bucket) and the one before it is used.

Async saves block the loop only for the device-to-host copy: Orbax writes, finalizes and renames in the
background, and the checksums are hashed on a thread of their own. A save that comes due while the previous one is
still being written waits for it; that wait is said once, with the durations and the cadence that avoids it, and
every save's blocked / copy / write seconds are kept in `Checkpointer.timings` (bench/checkpoint.py prints them).

Failures are loud: an error from a save — raised at once, or later by the background writer — is logged as an
event with the directory and its free space, the save is retried on the next step, and after
`max_failures` failures in a row training stops (a public run once trained for weeks while every save failed).
"""

import concurrent.futures
import importlib.metadata
import logging as py_logging
import math
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from absl import logging

EventFn = Callable[..., None]  # event(step, name, message, **fields), e.g. MetricsLogger.event


from jaxlm.errors import CheckpointError, CheckpointMismatchError, ConfigError  # noqa: F401
from jaxlm import integrity
from jaxlm import metrics as metrics_lib
from jaxlm.data import storage

def environment(cfg, mesh) -> dict:
  """A JSON record of the training environment, saved with every checkpoint."""
  versions = {}
  for package in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'grain', 'sentencepiece', 'numpy'):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  try:
    commit = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True, timeout=10,
                            cwd=os.path.dirname(__file__)).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    commit = None
  from jaxlm import optimizer  # pylint: disable=import-outside-toplevel
  return {'config': cfg.to_dict(), 'optimizer': optimizer.identity(cfg.optim), 'versions': versions,
          'git_commit': commit, 'mesh': dict(mesh.shape),
          'device_kind': jax.devices()[0].device_kind, 'device_count': jax.device_count(),
          'process_count': jax.process_count()}


class _WriterErrors(py_logging.Filter):
  """Takes Orbax's background-thread error logs (one traceback per array fragment) and its repeated
  waiting-for-the-previous-save warnings off the console.

  A failed save is reported once, as a `checkpoint_failed` event that counts these; printing them would bury
  the one line that says what to do.
  """

  def __init__(self):
    super().__init__()
    self.messages: list[str] = []

  def filter(self, record) -> bool:
    if record.levelno >= py_logging.ERROR and ('orbax' in record.pathname or record.name == 'asyncio'):
      self.messages.append(record.getMessage().splitlines()[0][:300])
      return False
    # Orbax repeats this at every overlapping save; the `checkpoint_stall` event says it once, with the cadence.
    return not (record.levelno == py_logging.WARNING and 'orbax' in record.pathname
                and record.getMessage().startswith('Waiting for previous save to complete'))

  def take(self) -> list[str]:
    taken, self.messages = self.messages, []
    return taken


_writer_errors = _WriterErrors()


def _capture_writer_errors() -> None:
  for name in ('absl', 'asyncio'):
    logger = py_logging.getLogger(name)
    if _writer_errors not in logger.filters:
      logger.addFilter(_writer_errors)
  if getattr(sys.unraisablehook, 'jaxlm', False):
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    # After a failed save Orbax closes its event loop while TensorStore still completes writes; their
    # callbacks fail in C++ with "Event loop is closed", which Python reports as unraisable.
    if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == 'Event loop is closed':
      _writer_errors.messages.append('RuntimeError: Event loop is closed')
      return
    previous(unraisable)

  hook.jaxlm = True
  sys.unraisablehook = hook


def _without_absent_empty_fields(target, state_dir: str):
  """(restore target, rebuild): a checkpoint written before a state field existed restores when that field holds
  nothing (TrainState.fp8 is {} unless model.matmul_dtype=fp8): the rest is restored and the field filled in.

  Any other difference between the checkpoint and the target still fails the restore, as it should.
  """
  fields = getattr(target, '__dataclass_fields__', None)
  if not fields:
    return target, lambda state: state
  tree = ocp.StandardCheckpointHandler().metadata(epath.Path(state_dir))  # the saved tree's top-level keys
  absent = [f for f in fields if f not in tree and not jax.tree.leaves(getattr(target, f))]
  if not absent:
    return target, lambda state: state
  present = {f: getattr(target, f) for f in fields if f not in absent}
  return present, lambda state: target.replace(**state, **{f: getattr(target, f) for f in absent})


def with_shardings(abstract_tree, shardings):
  """ShapeDtypeStructs that carry shardings: Orbax restores each array straight onto its devices."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_tree, shardings)


# Orbax reports the parts of a save's blocking phase through jax.monitoring; these are the ones a slow save is
# made of (the rest is validation and bookkeeping, milliseconds). Its wait for the previous save is not among
# them: `Checkpointer.save` waits for that itself, first, and times it.
_ORBAX_BLOCKING = {'/jax/orbax/write/blocking_d2h_duration_secs': 'copy_s',  # device -> host, the part that must block
                   '/jax/orbax/write/blocking_tree_map_duration_secs': 'plan_s',  # which array goes to which file
                   '/jax/orbax/write/blocking_sync_item_duration_secs': 'sync_items_s',  # data/env/guard JSON
                   '/jax/orbax/write/blocking_directory_creation_secs': 'mkdir_s'}
_orbax_blocking: dict[str, float] = {}  # filled by the listener during one `manager.save` on the main thread
_listening = False


def _listen_to_orbax() -> None:
  """Registers (once per process) the jax.monitoring listener that fills `_orbax_blocking`."""
  global _listening
  if _listening:
    return
  _listening = True

  def listener(event: str, duration_s: float, **_):
    if event in _ORBAX_BLOCKING and threading.current_thread() is threading.main_thread():
      name = _ORBAX_BLOCKING[event]
      _orbax_blocking[name] = _orbax_blocking.get(name, 0.0) + duration_s

  jax.monitoring.register_event_duration_secs_listener(listener)


STALL_SAY_S = 0.5  # a wait for the previous save shorter than this is not worth a warning


def stall_message(step: int, previous: int, waited_s: float, interval_s: float) -> str:
  """What to say when a save came due while the previous one was still being written, and the cadence that avoids it."""
  steps = step - previous
  write_s = interval_s + waited_s  # the previous save started `interval_s` ago and has just finished
  # Room for a quarter more than the write took: the disk is shared and write times vary.
  every = max(steps + 1, math.ceil(1.25 * write_s / max(interval_s, 1e-9) * steps))
  return (f'checkpoint {step} came due while checkpoint {previous} was still being written: the loop waited '
          f'{waited_s:.1f}s for it. A save takes {write_s:.1f}s to write here but came every {interval_s:.1f}s '
          f'({steps} steps); set checkpoint.every >= {every} so saves do not overlap (said once; later waits '
          f'count as checkpoint time)')


class Checkpointer:
  """Saves and restores training state in `<workdir>/checkpoints`, and refuses to fail quietly."""

  def __init__(self, directory: str, ckpt_cfg, event: EventFn):
    self.directory = storage.normalize(directory)
    if problem := storage.checkpoints_unsupported(self.directory):
      raise ConfigError(problem)
    self.cfg = ckpt_cfg
    self.event = event
    self.failures = 0  # consecutive failed saves
    self.retry = False  # a save failed: try again at the next step
    self.pending: int | None = None  # step of a save whose success is not confirmed yet
    self.last_good: int | None = None
    self.unsaved: tuple[int, str, str] | None = None  # (step, short cause, free space) of a failed save not yet redone
    self.is_primary = jax.process_index() == 0
    # Writes checksums.json of each confirmed step, one at a time, beside training: a save never waits for it.
    self._hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix='jaxlm_checksums')
    self._hashing: list[concurrent.futures.Future] = []
    self._closed = False
    self.timings: list[dict] = []  # per save: step, blocked_s, waited_s, copy_s, ... and write_s once confirmed
    self._stall_said = False
    self._clock = time.monotonic
    _capture_writer_errors()
    _listen_to_orbax()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=ckpt_cfg.keep, keep_period=ckpt_cfg.keep_every or None,
        enable_async_checkpointing=ckpt_cfg.async_save, create=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=('state', 'data', 'guard', 'env'))
    if self.is_primary:
      self._clean_partial()  # a save that died half-way (kill -9) is cleared before its step is saved again

  def due(self, step: int, last_step: int) -> bool:
    """Whether to save after `step`: on the interval, at the end, or to retry a failed save."""
    every = self.cfg.every
    return self.retry or step == last_step or (every > 0 and step % every == 0)

  def on_step(self, step: int, last_step: int, state, data_iter, env: dict, guard: dict,
              stopping: bool = False) -> None:
    """Once per step: confirms a finished background save, saves when due (or stopping), waits when stopping."""
    self.poll()
    if stopping or self.due(step, last_step):
      self.save(step, state, data_iter, env, guard)
    if stopping:
      self.wait()

  def save(self, step: int, state, data_iter, env: dict, guard: dict | None = None) -> None:
    """Starts an (async) save of `step`; returns once the state is copied off the devices.

    Failures are counted and retried, never silent. A previous save still being written is waited for first
    (and said once: `stall_message`), so its outcome is confirmed before the next one starts.
    """
    start = self._clock()
    waited = self._wait_for_previous(step, start)
    self.poll()
    if step in self.manager.all_steps():
      return  # already saved (e.g. the final step of a resumed run that had finished)
    self._warn_if_low_space(step)
    _orbax_blocking.clear()
    try:
      storage.makedirs(self.directory)
      # force: a step's leftovers (a save killed half-way on a bucket) are removed by process 0 and the others
      # synchronised with it before anything is written.
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), env=ocp.args.JsonSave(env),
          guard=ocp.args.JsonSave(guard or {}), **self._data_args(data_iter)),
          force=True)
      self.pending = step
      self.retry = False
    except Exception as e:  # pylint: disable=broad-except  -- every save error must be counted
      self._failed(step, e)
      return
    timing = {'step': step, 'start': start, 'blocked_s': self._clock() - start, 'waited_s': waited,
              **_orbax_blocking}
    self.timings.append(timing)
    if not self.cfg.async_save:
      self.poll(wait=True)
      timing['blocked_s'] = self._clock() - start

  def stats(self) -> dict:
    """The saves of this process in numbers for the run's last system record: count, and the median and largest
    seconds each blocked the loop, waited for the previous save, copied off the devices and took to be written."""
    out = {'checkpoint_saves': len(self.timings)}
    for key in ('blocked_s', 'waited_s', 'copy_s', 'write_s'):
      values = sorted(t[key] for t in self.timings if key in t)
      if values:
        name = key.removesuffix('_s')
        out.update({f'checkpoint_{name}_median_s': values[len(values) // 2], f'checkpoint_{name}_max_s': values[-1]})
    return out

  def _wait_for_previous(self, step: int, now: float) -> float:
    """Waits for a save still being written (confirming it); says so once. Returns the seconds waited."""
    if self.pending is None or not self.manager.is_saving_in_progress():
      return 0.0
    previous = self.timings[-1] if self.timings and self.timings[-1]['step'] == self.pending else None
    self.poll(wait=True)
    waited = self._clock() - now
    if previous is not None and self.last_good == previous['step'] and waited >= STALL_SAY_S and not self._stall_said:
      self._stall_said = True
      self.event(step, 'checkpoint_stall', stall_message(step, previous['step'], waited, now - previous['start']),
                 waited_s=waited, write_s=now - previous['start'] + waited)
    return waited

  def poll(self, wait: bool = False) -> None:
    """Confirms or fails the pending save once the background writer is done (`wait` blocks for it)."""
    if self.pending is None:
      return
    if not wait and self.manager.is_saving_in_progress():
      return
    step, self.pending = self.pending, None
    try:
      self.manager.wait_until_finished()
      self.manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      self._failed(step, e)
      return
    if step not in self.manager.all_steps():
      self._failed(step, RuntimeError('the writer reported success but the step is not on disk'))
      return
    self.failures, self.last_good, self.unsaved = 0, step, None
    _writer_errors.take()
    timing = self.timings[-1] if self.timings and self.timings[-1]['step'] == step else {}
    if timing:
      timing['write_s'] = self._clock() - timing['start']  # at most one step late when not waited for
    logging.info('checkpoint %d saved in %s (the loop was blocked %.2fs, the copy off the devices %.2fs; '
                 'written within %.1fs)', step, self.directory, timing.get('blocked_s', math.nan),
                 timing.get('copy_s', math.nan), timing.get('write_s', math.nan))
    if self.is_primary:
      self._hashing = [f for f in self._hashing if not f.done()]
      self._hashing.append(self._hasher.submit(self._write_checksums, step))

  def _write_checksums(self, step: int) -> None:
    """Runs beside training: hashes the confirmed step's files and writes checksums.json atomically."""
    step_dir = storage.join(self.directory, str(step))
    try:
      algorithm, sums = integrity.file_checksums(step_dir)
      storage.write_json(storage.join(step_dir, integrity.CHECKSUMS), {algorithm: sums, 'written': time.time()})
    except OSError as e:  # deleted meanwhile (keep policy, rollback) or disk full: the step stays unverified
      logging.warning('checksums of checkpoint %d not written: %s', step, e)

  def _join_hashing(self) -> None:
    """Waits until every confirmed step has its checksums.json (before a restore reads them, and at close)."""
    for f in self._hashing:
      f.result()
    self._hashing = []

  def wait(self) -> None:
    """Blocks until the pending save is complete and checked."""
    self.poll(wait=True)

  def _free_bytes(self) -> int | None:
    return storage.free_bytes(self.directory)  # None on a bucket: it reports no free space

  def _warn_if_low_space(self, step: int) -> None:
    steps = self.manager.all_steps()
    free = self._free_bytes()
    if not steps or free is None:
      return
    previous = storage.tree_bytes(storage.join(self.directory, str(max(steps))))
    if free is not None and free < 2 * previous:
      self.event(step, 'checkpoint_low_space',
                 f'{free / 2**20:.1f} MiB free in {self.directory}, the last checkpoint took '
                 f'{previous / 2**20:.1f} MiB: the next saves may fail. Free space or move --workdir.',
                 free_bytes=free, checkpoint_bytes=previous)

  def _failed(self, step: int, error: Exception) -> None:
    if self.failures >= self.cfg.max_failures:
      return  # already stopped the run: close() must not report the same failed saves again
    self.failures += 1
    self.retry = True
    free = self._free_bytes()
    free_text = 'unknown' if free is None else f'{free / 2**20:.1f} MiB'
    writer_errors = _writer_errors.take()
    message = (f'checkpoint save of step {step} failed ({self.failures}/{self.cfg.max_failures} in a row): '
               f'{type(error).__name__}: {error}. Directory {self.directory}, free space {free_text}.'
               + (f' The background writer logged {len(writer_errors)} error(s) for it.' if writer_errors else ''))
    self.event(step, 'checkpoint_failed', message, directory=self.directory, free_bytes=free,
               failures=self.failures, writer_errors=len(writer_errors))
    self.unsaved = (step, metrics_lib.short_cause(error), free_text)
    self._clean_partial()
    if self.failures >= self.cfg.max_failures:
      newest = self._newest_step()
      last = f'step {newest}' if newest is not None else 'none'
      # One short line: the library's whole message is in the checkpoint_failed event above (and metrics.jsonl).
      raise CheckpointError(metrics_lib.fit_line(
          f'{self.failures} checkpoint saves failed in a row (saving step {step} to {{path}}: '
          f'{metrics_lib.short_cause(error)}; {free_text} free); the newest good checkpoint is {last}. Fix: free '
          f'space or use a writable --workdir, then rerun to resume', self.directory))

  def unsaved_error(self) -> CheckpointError | None:
    """After the last save was waited for: the error a run must end with when its newest save never reached
    storage (a failed final or preemption save, fewer than max_failures in a row), else None. Exit 3, never 0:
    the run's newest weights exist nowhere but in the memory of a process about to end."""
    if self.unsaved is None:
      return None
    step, cause, free_text = self.unsaved
    newest = self._newest_step()
    resume = (f'a rerun resumes from step {newest}, the newest good checkpoint' if newest is not None
              else 'no checkpoint was written, so a rerun starts from step 0')
    bucket = storage.is_url(self.directory)  # no free space to report: a refused write is quota or permissions
    why = cause if bucket else f'{cause}; {free_text} free'
    fix = ("the bucket's quota or write permission, or use another --workdir" if bucket
           else 'free space or use a writable --workdir')
    return CheckpointError(metrics_lib.fit_line(
        f'checkpoint of step {step} was not written to {{path}} ({why}) and {resume}; fix: {fix}, then rerun the '
        f'same command', self.directory))

  def _newest_step(self) -> int | None:
    """The newest finalized step on storage (a failed save is never listed)."""
    self.manager.reload()
    return max(self.manager.all_steps(), default=None)

  def _clean_partial(self) -> None:
    """Removes what failed or killed saves left (temporary directories; on a bucket, steps without their commit
    marker) so they cannot fill the disk further nor be mistaken for a step."""
    self.manager.reload()
    committed = set(self.manager.all_steps())
    for name in storage.listdir(self.directory):
      uncommitted = storage.is_url(self.directory) and name.isdigit() and int(name) not in committed
      if '.orbax-checkpoint-tmp' in name or uncommitted:
        storage.rmtree(storage.join(self.directory, name))

  def restore(self, abstract_state, shardings, data_iter, before: int | None = None,
              identity: dict | None = None) -> tuple[Any, dict]:
    """Restores the newest intact checkpoint (older than step `before`, if given) into `shardings`.

    Returns (state, guard state), or (None, {}) if there is none. A checkpoint that fails its checksums or
    cannot be read gives a warning event, is moved aside, and the one before it is tried. One that is intact but
    does not fit this run (`misfit`: another optimizer than `identity`, another model shape or dtype) is
    refused with a ConfigError before anything is restored, and left where it is.
    """
    self._join_hashing()
    self.manager.reload()
    target = with_shardings(abstract_state, shardings)
    unreadable = 0
    for step in sorted(self.manager.all_steps(), reverse=True):
      if before is not None and step >= before:
        continue
      step_dir = storage.join(self.directory, str(step))
      try:
        if problem := integrity.verify_checksums(step_dir):
          raise CheckpointError(problem)
        if problem := integrity.misfit(step_dir, target, identity):
          raise integrity.Misfit(problem)
        state_target, rebuild = _without_absent_empty_fields(target, storage.join(step_dir, 'state'))
        items = dict(state=ocp.args.StandardRestore(state_target))
        if storage.isdir(storage.join(step_dir, 'guard')):  # absent in checkpoints older than the guard item
          items['guard'] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        data_state = self._read_data(step_dir) if data_iter is not None else None
      except integrity.Misfit as e:
        raise self._misfit_error(step, str(e), 'it is intact and left in place') from None
      except Exception as e:  # pylint: disable=broad-except  -- corrupt: fall back to an older step
        unreadable += 1
        aside = self._move_aside(step)
        self.event(step, 'checkpoint_unreadable',
                   f'checkpoint {step} in {self.directory} cannot be used ({type(e).__name__}: {e}); '
                   f'trying an older one. It is kept for inspection in {aside}.')
        continue
      if data_state is not None:
        data_iter.set_state(data_state)  # outside the try: a refused data change is the user's to fix, not corrupt
      self.last_good = step
      return rebuild(restored['state']), (dict(restored['guard']) if 'guard' in items else {})
    if unreadable and before is None:
      raise CheckpointError(f'no checkpoint in {self.directory} could be read (see the warnings above). '
                            f'Fix: move the directory aside to start afresh, or repair it.')
    return None, {}

  def refuse_misfit(self, abstract_state, shardings, identity: dict | None = None) -> None:
    """Refuses, as `restore` would, a newest checkpoint that does not fit this run, from its metadata alone: called
    before the train step is compiled, so a config that cannot resume fails in seconds, not after the compile.

    Anything else (no checkpoint, one whose metadata cannot be read) is left to `restore`, which moves a corrupt
    step aside and tries the one before it. At start-up the manager's listing is current: no reload, no hashing.
    """
    steps = self.manager.all_steps()
    if not steps:
      return
    step = max(steps)
    try:
      problem = integrity.misfit(storage.join(self.directory, str(step)), with_shardings(abstract_state, shardings),
                                 identity)
    except Exception:  # pylint: disable=broad-except  -- unreadable: restore decides what it is
      return
    if problem:
      raise self._misfit_error(step, problem, 'it is left in place')

  def _misfit_error(self, step: int, problem: str, kept: str) -> ConfigError:
    return ConfigError(
        f'checkpoint {step} in {self.directory} does not fit this run ({problem}); {kept}: resume with the config '
        f'it was written with, or start a new --workdir with checkpoint.init_from={self.directory} (parameters '
        f'only, any optimizer)')

  def _move_aside(self, step: int) -> str:
    """Moves an unusable step out of the listing (process 0; the others wait for it)."""
    aside = f'{self.directory}.unreadable'
    target = storage.join(aside, f'{step}-{int(time.time())}')
    if self.is_primary:
      try:
        storage.move(storage.join(self.directory, str(step)), target)  # copy then delete on a bucket
      except OSError as e:
        logging.warning('could not move checkpoint %d aside: %s', step, e)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      multihost_utils.sync_global_devices(f'jaxlm_move_aside_{step}')
    self.manager.reload()
    return target

  @staticmethod
  def _data_args(data_iter) -> dict:
    """The data item, when there is an iterator to save (library users may checkpoint state alone).

    Grain's handler writes `data/process_<i>-of-<n>.json` from every process; jaxlm's training iterator saves the
    global row position, the same in every file, so `_read_data` reads it back on any number of processes.
    """
    if data_iter is None:
      return {}
    return {'data': grain.checkpoint.CheckpointSave(data_iter)}

  @staticmethod
  def _read_data(step_dir: str) -> dict:
    """The saved data position: this process's file if the process count is unchanged, else process 0's."""
    directory = storage.join(step_dir, 'data')
    names = [n for n in storage.listdir(directory) if n.startswith('process_') and n.endswith('.json')]
    if not names:
      raise CheckpointError(f'{directory} holds no data position')
    mine = f'process_{jax.process_index()}-of-{jax.process_count()}.json'
    name = mine if mine in names else next((n for n in names if n.startswith('process_0-of-')), names[0])
    state = storage.read_json(storage.join(directory, name))
    if 'lanes' in state:  # streaming: each process saved the cursors of its own lanes; together they are all
      lanes = {}
      for other in names:
        if other.endswith(name[name.index('-of-'):]):  # the files of the same save (same process count)
          lanes.update(storage.read_json(storage.join(directory, other)).get('lanes', {}))
      state['lanes'] = lanes
    # Global positions are the same in every file; per-process ones (older checkpoints) only fit their process.
    return state

  def delete_after(self, step: int) -> list[int]:
    """Deletes checkpoints newer than `step` (after a rollback they hold the abandoned trajectory)."""
    newer = [s for s in self.manager.all_steps() if s > step]
    for s in newer:
      self.manager.delete(s)
    return newer

  def close(self) -> None:
    """Waits for the last save and releases Orbax's threads (a second call does nothing)."""
    if self._closed:
      return
    self._closed = True
    try:
      self.wait()
      self._join_hashing()
    finally:
      self._hasher.shutdown(wait=True)
      self._close_manager()

  def _close_manager(self) -> None:
    try:
      self.manager.close()
    except Exception as e:  # pylint: disable=broad-except
      # Orbax re-raises, when it closes, a background write that failed (a step's _CHECKPOINT_METADATA on a bucket
      # refusing writes). A save already counted as failed says so in the run's last line (`unsaved_error`); one
      # not confirmed otherwise becomes that line too: a failed save is never a traceback, never a quiet exit 0.
      logging.warning('closing the checkpoint manager: %s: %s', type(e).__name__, e)
      step = self.timings[-1]['step'] if self.timings else None
      if self.unsaved is None and step is not None and step != self.last_good:
        self.unsaved = (step, metrics_lib.short_cause(e), 'unknown')


def load_params(path: str, abstract_params, shardings, weights: str = 'raw', fill=None):
  """Warm start: parameters only from another run's checkpoint directory (its newest step) or a step directory.

  Arrays are cast to this run's dtypes; a missing parameter or a shape mismatch is a CheckpointMismatchError
  (exit 2: the config must change) naming it.
  weights='ema' reads the exponential moving average of the parameters (optim.ema) instead (a LoRA run's averages
  its adapters alone: its frozen base comes from the parameters). `fill`: this run's initial parameters; LoRA
  adapters (lora.is_adapter) the checkpoint lacks keep their values from it (a LoRA run from an SFT run or an
  import), while an adapter it holds with another shape is refused like any parameter.
  """
  from jaxlm import lora as lora_lib  # pylint: disable=import-outside-toplevel
  if weights == 'ema' and _averages_adapters_only(path):
    (base, adapters), (base_s, adapters_s) = (lora_lib.split_adapters(t) for t in (abstract_params, shardings))
    return lora_lib.join_adapters(load_params(path, base, base_s), _load_params(path, adapters, adapters_s, 'ema'))
  if fill is not None:
    from flax import traverse_util  # pylint: disable=import-outside-toplevel
    # Which parameters the checkpoint holds, by name: load those and keep `fill`'s absent adapters.
    saved = _saved_param_names(path, weights)
    flat = traverse_util.flatten_dict(abstract_params)
    keep = {k for k in flat if lora_lib.is_adapter(k) and jax.tree_util.keystr(tuple(
        jax.tree_util.DictKey(x) for x in k)) not in saved}
    if keep:
      pick = lambda tree: traverse_util.unflatten_dict(
          {k: v for k, v in traverse_util.flatten_dict(tree).items() if k not in keep})
      loaded = load_params(path, pick(abstract_params), pick(shardings), weights)
      return lora_lib.join_adapters(fill, loaded)
  return _load_params(path, abstract_params, shardings, weights)


def step_dir_of(path: str) -> str:
  """The step directory `path` names: itself, or the newest step of a checkpoints directory."""
  path = storage.normalize(path)
  if storage.isdir(storage.join(path, 'state')):  # a step directory
    return path
  steps = [int(n) for n in storage.listdir(path) if n.isdigit()] if storage.isdir(path) else []
  if not steps:
    raise CheckpointError(f'checkpoint.init_from={path} holds no checkpoint; give a run\'s checkpoints '
                          f'directory or one of its step directories.')
  return storage.join(path, str(max(steps)))


def _averages_adapters_only(path: str) -> bool:
  """Whether the checkpoint's moving average (optim.ema) holds LoRA adapters only, as a LoRA run's does."""
  from jaxlm import lora as lora_lib  # pylint: disable=import-outside-toplevel
  saved = ocp.StandardCheckpointer().metadata(storage.join(step_dir_of(path), 'state'))
  saved = getattr(saved, 'item_metadata', saved)
  saved_tree = saved if isinstance(saved, dict) else saved.tree
  keys = [k for k, _ in jax.tree_util.tree_flatten_with_path(saved_tree.get('ema', {}))[0]]
  return bool(keys) and all(lora_lib.is_adapter(k) for k in keys)


def _saved_param_names(path: str, weights: str) -> set:
  item = 'ema' if weights == 'ema' else 'params'
  saved = ocp.StandardCheckpointer().metadata(storage.join(step_dir_of(path), 'state'))
  saved = getattr(saved, 'item_metadata', saved)
  saved_tree = saved if isinstance(saved, dict) else saved.tree
  return {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(saved_tree.get(item, {}))[0]}


def _load_params(path: str, abstract_params, shardings, weights: str = 'raw'):
  item = 'ema' if weights == 'ema' else 'params'
  step_dir = step_dir_of(path)
  checkpointer = ocp.StandardCheckpointer()
  saved = checkpointer.metadata(storage.join(step_dir, 'state'))
  saved = getattr(saved, 'item_metadata', saved)
  saved_tree = saved if isinstance(saved, dict) else saved.tree
  if item not in saved_tree or not jax.tree.leaves(saved_tree[item]):
    raise CheckpointError(f'{step_dir} holds no averaged weights: the run trained without optim.ema; use '
                          f'--weights=raw.')
  saved_params = saved_tree[item]
  flat_saved = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(saved_params)[0]}
  for key, want in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
    name = jax.tree_util.keystr(key)
    if name not in flat_saved:
      raise CheckpointMismatchError(f'checkpoint.init_from: parameter {name} is not in {step_dir}; change the '
                                    f'model config to match the checkpoint.')
    if tuple(flat_saved[name].shape) != tuple(want.shape):
      raise CheckpointMismatchError(f'checkpoint.init_from: parameter {name} has shape '
                                    f'{tuple(flat_saved[name].shape)} in {step_dir} but {tuple(want.shape)} in this '
                                    f'model; change the model config to match.')
  # Restore with the saved dtypes onto this run's shardings, then cast (e.g. a bf16 export into fp32 masters).
  target = jax.tree_util.tree_map_with_path(
      lambda k, w, s: jax.ShapeDtypeStruct(w.shape, np.dtype(flat_saved[jax.tree_util.keystr(k)].dtype),
                                           sharding=s),
      abstract_params, shardings)
  # StandardCheckpointer.restore takes no `args`; the PyTree checkpointer does the partial (params-only) restore.
  state = ocp.PyTreeCheckpointer().restore(storage.join(step_dir, 'state'), args=ocp.args.PyTreeRestore(
      item={item: target}, restore_args=ocp.checkpoint_utils.construct_restore_args({item: target}),
      partial_restore=True))
  return jax.tree.map(lambda x, w: x.astype(w.dtype), state[item], abstract_params)

