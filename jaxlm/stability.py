"""Loss-spike and NaN defence, host side: detect spikes, decide skip / rollback / stop (drills: jaxlm.faults).

The device side lives in the train step: optax.apply_if_finite drops any update whose gradients are not finite
and counts it, so a NaN never reaches the parameters and no per-step host synchronisation is needed. Here, the
logged values are watched. Under `rollback` (PaLM section 5.1's remedy, automated): after `spikes` spikes within
`spike_window` steps, or non-finite values for `nonfinite_steps` steps in a row, the loop restores the newest
checkpoint from before the first bad step, skips `skip_batches` batches of data, and may lower the learning rate
for a while.
"""

import collections
import dataclasses
import math
import statistics



from jaxlm.errors import StabilityError  # noqa: F401  (raised here, re-exported for callers)
from jaxlm.data import storage

POLICIES = ('off', 'skip', 'rollback')  # stability.policy

@dataclasses.dataclass
class Rollback:
  """What the loop must do: restore a checkpoint that predates every update that could have caused it.

  The loss logged at step s is computed on the parameters after update s-1, so when the first bad value shows
  at step s, update s-1 may be the culprit (an LR spike), as may batch s (a data spike): the checkpoint restored
  must hold fewer than s-1 updates.
  """
  first_bad_step: int  # the earliest step whose logged values may be bad
  decided_at: int  # the step whose record triggered it: every batch up to its one is suspect
  reason: str

  @property
  def restore_before(self) -> int:
    """Restore the newest checkpoint with a step strictly below this."""
    return self.first_bad_step - 1


class SpikeDetector:
  """A value above the rolling mean + threshold·std of the last `window` normal values is a spike.

  Spikes and non-finite values are kept out of the history, so one spike does not hide the next.
  """

  def __init__(self, window: int, threshold: float, min_history: int):
    self.threshold = threshold
    self.min_history = min_history
    self.history: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=window))

  def state(self) -> dict:
    """The history as JSON (Python floats round-trip exactly through json)."""
    return {name: list(h) for name, h in self.history.items()}

  def load(self, state: dict) -> None:
    """Replaces the history with a saved one."""
    self.history.clear()
    for name, values in state.items():
      self.history[name].extend(values)

  def update(self, values: dict[str, float]) -> dict[str, str]:
    """Returns {name: description} for each of `values` that spiked; adds the others to the history."""
    spikes = {}
    for name, value in values.items():
      if not math.isfinite(value):
        continue
      h = self.history[name]
      if len(h) >= self.min_history:
        mean, std = statistics.fmean(h), statistics.pstdev(h)
        limit = mean + self.threshold * max(std, 1e-6 * abs(mean))
        if value > limit:
          spikes[name] = f'{name} {value:.4g} > mean {mean:.4g} + {self.threshold:g}·std {std:.3g} = {limit:.4g}'
          continue
      h.append(value)
    return spikes


class Guard:
  """Applies `cfg.stability.policy` to the logged metrics; reports every event through `event`.

  Its whole state (detector history, spikes, rollback counts, the lowered-LR window) is saved with every
  checkpoint, so a resumed run judges spikes exactly as the run it continues. The rollback count is also kept
  in `ledger` (a JSON file beside the checkpoints), so a crash-and-restart loop cannot reset it.
  """

  def __init__(self, stability_cfg, event, *, log_every: int = 1, ledger: str | None = None,
               writes_ledger: bool = True, watch: tuple[str, ...] = ('loss', 'grad_norm')):
    self.cfg = stability_cfg
    self.event = event
    self.log_every = log_every  # a logged spike may have started anywhere in the steps since the last record
    self.ledger = ledger  # every process reads it (the workdir is shared); one writes it
    self.writes_ledger = writes_ledger
    self.watch = watch  # the logged values judged for spikes (an RL run watches others: jaxlm/rl.py)
    self.detector = SpikeDetector(stability_cfg.window, stability_cfg.threshold, stability_cfg.min_history)
    self.spike_steps: list[int] = []
    self.skipped_total = 0
    self.rollbacks = 0
    self.restores: dict[int, int] = {}  # checkpoint step -> times restored
    self.lr_factor_until = -1  # last step of a post-rollback learning-rate change

  def observe(self, step: int, values: dict) -> Rollback | None:
    """Looks at one logged record; returns a Rollback when the policy calls for one, raises when it must stop."""
    if self.cfg.policy == 'off':
      return None
    skipped = int(values.get('skipped_steps', 0))
    if skipped > self.skipped_total:
      self.event(step, 'skipped_step', f'{skipped - self.skipped_total} update(s) with non-finite loss or '
                 f'gradients skipped up to step {step}; parameters and optimizer state left unchanged',
                 skipped=skipped - self.skipped_total, total=skipped)
      self.skipped_total = skipped
    run = int(values.get('nonfinite_run', 0))
    if run >= self.cfg.nonfinite_steps:
      reason = f'loss or gradients non-finite for {run} steps in a row (steps {step - run + 1}-{step})'
      if self.cfg.policy == 'skip':
        raise StabilityError(f'{reason}: the model cannot recover by skipping updates. Fix: resume from an '
                             f'earlier checkpoint with a lower optim.lr, or use stability.policy=rollback.')
      return Rollback(step - run + 1, step, reason)
    spikes = self.detector.update({k: values[k] for k in self.watch if values.get(k) is not None})
    if spikes:
      self.spike_steps.append(step)
      self.event(step, 'spike', '; '.join(spikes.values()), metrics=','.join(sorted(spikes)))
    recent = [s for s in self.spike_steps if s > step - self.cfg.spike_window]
    if self.cfg.policy == 'rollback' and len(recent) >= self.cfg.spikes:
      return Rollback(recent[0] - self.log_every + 1, step,
                      f'{len(recent)} spikes within {self.cfg.spike_window} steps (at {recent})')
    return None

  def state(self) -> dict:
    """Everything the guard has learned, as JSON: saved in each checkpoint."""
    return {'history': self.detector.state(), 'spike_steps': list(self.spike_steps),
            'skipped_total': self.skipped_total, 'rollbacks': self.rollbacks,
            'restores': {str(k): v for k, v in self.restores.items()}, 'lr_factor_until': self.lr_factor_until}

  def load(self, state: dict | None) -> None:
    """Continues from a checkpoint's guard state (None: a checkpoint written before guards were saved)."""
    if state:
      self.detector.load(state['history'])
      self.spike_steps = list(state['spike_steps'])
      self.skipped_total = state['skipped_total']
      self.rollbacks = state['rollbacks']
      self.restores = {int(k): v for k, v in state['restores'].items()}
      self.lr_factor_until = state['lr_factor_until']
    # A rollback after the checkpoint was written, then a crash: the ledger still counts it.
    ledger = _read_json(self.ledger) if self.ledger else None
    if ledger and ledger['rollbacks'] > self.rollbacks:
      self.rollbacks = ledger['rollbacks']
      for k, v in ledger['restores'].items():
        self.restores[int(k)] = max(self.restores.get(int(k), 0), v)

  def reset_ledger(self) -> None:
    """A fresh run (no checkpoint to resume) starts with no rollbacks."""
    if self.ledger and self.writes_ledger:
      storage.remove(self.ledger)

  def rolled_back(self, to_step: int) -> int:
    """Counts a rollback to `to_step` (raising past the cap); returns how many batches to skip.

    The n-th restore of the same checkpoint skips n × skip_batches: replaying the data of a failed attempt
    would retrace it exactly.
    """
    self.rollbacks += 1
    self.restores[to_step] = self.restores.get(to_step, 0) + 1
    if self.ledger and self.writes_ledger:
      storage.write_json(self.ledger, {'rollbacks': self.rollbacks,
                                      'restores': {str(k): v for k, v in self.restores.items()}})
    if self.rollbacks > self.cfg.max_rollbacks:
      raise StabilityError(f'{self.rollbacks - 1} rollbacks already (stability.max_rollbacks); instability keeps '
                           f'coming back. Fix: lower optim.lr, raise optim.warmup_steps, or inspect the data '
                           f'around the logged spikes.')
    self.spike_steps = []
    if self.cfg.lr_factor_steps and self.cfg.lr_factor != 1.0:
      self.lr_factor_until = to_step + self.cfg.lr_factor_steps
    return self.restores[to_step] * self.cfg.skip_batches

  def lr_scale(self, step: int) -> float:
    """The learning-rate multiplier for the step after `step` (post-rollback factor, else 1)."""
    return self.cfg.lr_factor if step < self.lr_factor_until else 1.0


def _read_json(path: str) -> dict | None:
  try:
    return storage.read_json(path)
  except (OSError, ValueError):
    return None


