"""The optimizer: an optax chain of global-norm clipping and AdamW under a warmup-cosine schedule."""

import jax
import optax
from jax.sharding import PartitionSpec as P


def schedule(optim_cfg, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `lr`, then cosine decay to `lr * final_lr_fraction` at `total_steps`."""
  o = optim_cfg
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps, decay_steps=total_steps,
      end_value=o.lr * o.final_lr_fraction)


def decay_mask(logical_specs):
  """True for parameters that get weight decay: matrices, not norm scales or other 1-D parameters.

  Decided from logical axis names rather than ndim, because scanned layers add a leading `layers` axis that
  turns a norm's (D,) scale into an (L, D) array.
  """
  return jax.tree.map(lambda spec: len([a for a in spec if a != 'layers']) >= 2, logical_specs,
                      is_leaf=lambda x: isinstance(x, P))


def make_optimizer(optim_cfg, total_steps: int, mask) -> optax.GradientTransformation:
  """clip_by_global_norm → AdamW(b1, b2, eps, decoupled weight decay on `mask`) with the schedule above."""
  o = optim_cfg
  chain = [optax.clip_by_global_norm(o.clip)] if o.clip > 0 else []
  chain.append(optax.adamw(schedule(o, total_steps), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                           mask=mask))
  return optax.chain(*chain)
