"""The optimizer: an optax chain of global-norm clipping and AdamW (or Adafactor, or Muon) under a warmup schedule."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

OPTIMIZERS = ('adamw', 'adafactor', 'muon', 'sf_adamw')  # optim.name; config validation reads these
SCHEDULES = ('cosine', 'linear', 'wsd', 'constant')  # optim.schedule
MUON_SCALES = ('rms', 'spectral')  # optim.muon_scale


def schedule(optim_cfg, total_steps: int, peak: float | None = None) -> optax.Schedule:
  """Linear warmup from 0 to `lr`, then `optim.schedule` down to `lr * final_lr_fraction` at `total_steps`.

  cosine: cosine decay (the default, as PaLM-era runs); linear: straight line; wsd: warmup-stable-decay
  (constant, then a linear decay over the last `decay_fraction` of training — lets a run be extended);
  constant: no decay. `peak` replaces `lr` (Muon's AdamW part runs the same shape at `optim.adam_lr`).
  """
  o = optim_cfg
  peak = o.lr if peak is None else peak
  final, warmup = peak * o.final_lr_fraction, o.warmup_steps
  if o.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total_steps, end_value=final)
  if o.schedule == 'constant':
    return _warmup_constant(peak, warmup)
  ramp = optax.linear_schedule(0.0, peak, warmup)
  if o.schedule == 'linear':
    return optax.join_schedules([ramp, optax.linear_schedule(peak, final, total_steps - warmup)], [warmup])
  decay_start = max(warmup, int(total_steps * (1 - o.decay_fraction)))
  return optax.join_schedules([ramp, optax.constant_schedule(peak),
                               optax.linear_schedule(peak, final, total_steps - decay_start)],
                              [warmup, decay_start])


def _warmup_constant(peak: float, warmup: int) -> optax.Schedule:
  """0 -> peak over `warmup` steps, then peak. (optax's warmup_constant_schedule with 0 warmup steps is 0 forever.)"""
  return optax.warmup_constant_schedule(0.0, peak, warmup) if warmup else optax.constant_schedule(peak)


def decay_mask(logical_specs):
  """True for parameters that get weight decay: matrices, not norm scales, biases or other 1-D parameters.

  Decided from logical axis names rather than ndim, because scanned layers add a leading `layers` axis that
  turns a norm's (D,) scale into an (L, D) array; biases (gpt-oss's `*_bias`, per head or per expert: 2-D) by name.
  """
  def decays(path, spec):
    name = str(getattr(path[-1], 'key', '')) if path else ''
    return not name.endswith('bias') and len([a for a in spec if a != 'layers']) >= 2
  return jax.tree_util.tree_map_with_path(decays, logical_specs, is_leaf=lambda x: isinstance(x, P))


def make_optimizer(optim_cfg, total_steps: int, mask, logical=None) -> optax.GradientTransformation:
  """clip_by_global_norm → AdamW (b1, b2, eps, decoupled weight decay on `mask`), Adafactor or Muon, scheduled.

  Muon needs the parameters' logical axis names (`logical`): they say which weights are matrices, and which of
  their axes are rows and columns (jaxlm/muon.py).
  """
  o = optim_cfg
  chain = [optax.clip_by_global_norm(o.clip)] if o.clip > 0 else []
  lr = schedule(o, total_steps)
  if o.name == 'muon':
    from jaxlm import muon  # used by one optimizer: its own module
    chain.append(muon.muon(o, lr, schedule(o, total_steps, o.adam_lr or o.lr), logical, mask))
  elif o.name == 'sf_adamw':
    # Schedule-free AdamW (Defazio et al. 2024): a constant LR after warmup, no decay phase; the averaged point
    # (`eval_params`) is what is evaluated. Its base step is AdamW without momentum (schedule_free_adamw's),
    # here with jaxlm's decay mask.
    constant = _warmup_constant(o.lr, o.warmup_steps)
    base = optax.chain(optax.scale_by_rms(decay=o.b2, eps=o.eps, eps_in_sqrt=False, bias_correction=True),
                       optax.add_decayed_weights(o.weight_decay, mask), optax.scale_by_learning_rate(constant))
    chain.append(optax.contrib.schedule_free(base, learning_rate=constant, b1=o.b1))
  elif o.name == 'adafactor':
    # PaLM's optimizer: factored second moments (memory ~ rows + columns), update clipping, no momentum.
    # Adafactor's own parameter scaling would fight the explicit schedule, so it is off (as in PaLM).
    chain.append(optax.adafactor(lr, multiply_by_parameter_scale=False, decay_rate=0.8,
                                 weight_decay_rate=o.weight_decay or None, weight_decay_mask=mask))
  else:
    chain.append(optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=mask))
  return optax.chain(*chain)


def state_logical(tx, abstract_opt, param_logical, abstract_params):
  """The logical axis names of `tx`'s state: those of its parameter where a leaf mirrors one, else replicated.

  Adam's moments and Muon's momentum mirror the parameters, so they take the parameters' specs; counters, and
  Adafactor's factored moments (other shapes than their parameters, and small), are replicated. Muon's
  optax.partition masks each part's state: a MaskedNode where the other part's parameters are.
  """
  replicated = P()
  return optax.tree_map_params(
      tx, lambda x, spec, p: x if isinstance(x, optax.MaskedNode) else spec if x.shape == p.shape else replicated,
      abstract_opt, param_logical, abstract_params, transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, (P, optax.MaskedNode)))


def identity(optim_cfg) -> dict:
  """What a checkpoint's optimizer state depends on, recorded with it: another one cannot resume from it."""
  return {'name': optim_cfg.name, 'ema': bool(optim_cfg.get('ema', 0.0))}


def eval_params(opt_state, params):
  """The parameters to evaluate: schedule-free's averaged point x under sf_adamw, else `params` themselves."""
  state = find_state(opt_state, optax.contrib.ScheduleFreeState)
  return params if state is None else optax.contrib.schedule_free_eval_params(state, params)


def init_ema(optim_cfg, params):
  """optim.ema > 0: a float32 copy of the parameters to average into (TrainState.ema); else {}."""
  if not optim_cfg.get('ema', 0.0):
    return {}
  return jax.tree.map(lambda p: p.astype(jnp.float32), params)


def update_ema(optim_cfg, ema, params, step, applied):
  """The exponential moving average after optimizer step `step` gave `params`.

  Before `optim.ema_start` it follows the parameters (a copy); a step whose update was not applied (a float16
  overflow, a skipped non-finite step: `applied` False) leaves it unchanged.
  """
  if not ema:
    return ema
  decay = jnp.where(step >= optim_cfg.get('ema_start', 0), jnp.float32(optim_cfg.ema), 0.0)
  return jax.tree.map(lambda e, p: jnp.where(applied, decay * e + (1 - decay) * p.astype(jnp.float32), e),
                      ema, params)


class LossScaleState(NamedTuple):
  """Dynamic loss scaling's state: the scale the loss is multiplied by, and finite steps since it changed."""
  scale: jax.Array  # float32
  good_steps: jax.Array  # int32
  inner: optax.OptState


def dynamic_loss_scale(inner: optax.GradientTransformation, init_scale: float,
                       period: int) -> optax.GradientTransformation:
  """float16 training: `inner` on gradients of a loss multiplied by `scale` (so small gradients do not flush).

  The gradients it receives are of the scaled loss; it divides them by the scale. On overflow (any non-finite
  gradient) the update is zero, `inner`'s state is left unchanged and the scale halves; after `period` finite
  steps in a row it doubles. An overflow is not a NaN: it is not counted as a skipped step.
  """

  def init(params):
    return LossScaleState(jnp.full((), init_scale, jnp.float32), jnp.zeros((), jnp.int32), inner.init(params))

  def update(grads, state, params=None):
    grads = jax.tree.map(lambda g: g / state.scale.astype(g.dtype), grads)
    finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
    updates, inner_state = inner.update(grads, state.inner, params)
    updates = jax.tree.map(lambda u: jnp.where(finite, u, 0.0), updates)
    inner_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), inner_state, state.inner)
    grown = state.good_steps + 1 >= period
    scale = jnp.where(finite, jnp.where(grown, state.scale * 2, state.scale), jnp.maximum(state.scale / 2, 1.0))
    good_steps = jnp.where(finite & ~grown, state.good_steps + 1, 0)
    return updates, LossScaleState(scale, good_steps, inner_state)

  return optax.GradientTransformation(init, update)


def find_state(opt_state, kind):
  """The first state of type `kind` inside a (possibly wrapped or chained) optimizer state, or None."""
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kind)) if isinstance(s, kind)]
  return found[0] if found else None


def loss_scale(opt_state) -> jax.Array | None:
  """The current dynamic loss scale inside an optimizer state, or None when there is none."""
  state = find_state(opt_state, LossScaleState)
  return None if state is None else state.scale
