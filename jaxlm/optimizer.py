"""The optimizer: an optax chain of global-norm clipping and AdamW (or Adafactor) under a warmup schedule."""

import jax
import optax
from jax.sharding import PartitionSpec as P

OPTIMIZERS = ('adamw', 'adafactor')
SCHEDULES = ('cosine', 'linear', 'wsd', 'constant')


def schedule(optim_cfg, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `lr`, then `optim.schedule` down to `lr * final_lr_fraction` at `total_steps`.

  cosine: cosine decay (the default, as PaLM-era runs); linear: straight line; wsd: warmup-stable-decay
  (constant, then a linear decay over the last `decay_fraction` of training — lets a run be extended);
  constant: no decay.
  """
  o = optim_cfg
  peak, final, warmup = o.lr, o.lr * o.final_lr_fraction, o.warmup_steps
  if o.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total_steps, end_value=final)
  if o.schedule == 'constant':
    return optax.warmup_constant_schedule(0.0, peak, warmup)
  ramp = optax.linear_schedule(0.0, peak, warmup)
  if o.schedule == 'linear':
    return optax.join_schedules([ramp, optax.linear_schedule(peak, final, total_steps - warmup)], [warmup])
  decay_start = max(warmup, int(total_steps * (1 - o.decay_fraction)))
  return optax.join_schedules([ramp, optax.constant_schedule(peak),
                               optax.linear_schedule(peak, final, total_steps - decay_start)],
                              [warmup, decay_start])


def decay_mask(logical_specs):
  """True for parameters that get weight decay: matrices, not norm scales or other 1-D parameters.

  Decided from logical axis names rather than ndim, because scanned layers add a leading `layers` axis that
  turns a norm's (D,) scale into an (L, D) array.
  """
  return jax.tree.map(lambda spec: len([a for a in spec if a != 'layers']) >= 2, logical_specs,
                      is_leaf=lambda x: isinstance(x, P))


def make_optimizer(optim_cfg, total_steps: int, mask) -> optax.GradientTransformation:
  """clip_by_global_norm → AdamW (b1, b2, eps, decoupled weight decay on `mask`) or Adafactor, scheduled."""
  o = optim_cfg
  chain = [optax.clip_by_global_norm(o.clip)] if o.clip > 0 else []
  lr = schedule(o, total_steps)
  if o.name == 'adafactor':
    # PaLM's optimizer: factored second moments (memory ~ rows + columns), update clipping, no momentum.
    # Adafactor's own parameter scaling would fight the explicit schedule, so it is off (as in PaLM).
    chain.append(optax.adafactor(lr, multiply_by_parameter_scale=False, decay_rate=0.8,
                                 weight_decay_rate=o.weight_decay or None, weight_decay_mask=mask))
  else:
    chain.append(optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask))
  return optax.chain(*chain)
