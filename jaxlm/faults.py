"""Fault drills for tests and rehearsals, each keyed so that it fires once per trajectory.

poison_batches and lr_spike_steps are keyed on the batch counter (TrainState.batches), which a rollback
advances past the skipped data: a drill does not fire again when its step number comes round a second time.
The hang drill (dist.stall) lives in jaxlm.distributed, beside the watchdog that must catch it.
"""

import numpy as np


def steps_set(text: str) -> frozenset[int]:
  """'3,5' -> {3, 5}."""
  return frozenset(int(x) for x in text.split(',') if x.strip())


class Faults:
  """The drills `cfg.faults` asks for; each is one call in the training loop."""

  def __init__(self, faults_cfg, vocab_size: int, event):
    self.cfg, self.vocab_size, self.event = faults_cfg, vocab_size, event
    self.poison_batches = steps_set(faults_cfg.poison_batches)
    self.lr_spike_batches = steps_set(faults_cfg.lr_spike_steps)

  def batch(self, local: dict, number: int, step: int) -> dict:
    """Batch `number` (1-based) as drawn, or poisoned if the drill says so."""
    if number not in self.poison_batches:
      return local
    self.event(step, 'fault_injected', f'batch {number} poisoned with {self.cfg.poison}')
    return poison(local, self.cfg.poison, self.vocab_size, number)

  def lr_scale(self, number: int) -> float | None:
    """The update multiplier for the step that trains on batch `number`, or None when no drill applies."""
    return self.cfg.lr_spike_factor if number in self.lr_spike_batches else None


def poison(batch: dict, kind: str, vocab_size: int, number: int) -> dict:
  """Random tokens (a loss spike) or NaN loss weights (non-finite loss and gradients)."""
  batch = dict(batch)
  if kind == 'random_tokens':
    rng = np.random.default_rng(number)
    batch['inputs'] = rng.integers(0, vocab_size, batch['inputs'].shape).astype(np.int32)
    batch['targets'] = rng.integers(0, vocab_size, batch['targets'].shape).astype(np.int32)
  else:
    batch['weights'] = np.full(batch['weights'].shape, np.nan, np.float32)
  return batch
