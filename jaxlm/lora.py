"""LoRA (Hu et al. 2021): the adapter parameters beside a projection, and the helpers that cut a parameter tree
into its frozen base and its adapters, put them back, merge them into the base, or turn them off.

model.py makes the adapters (`adapter`) where it makes a projection and adds their branch in `model.project`;
step.py trains the adapters alone (`split_adapters` / `join_adapters`); checkpoint, rundir, export and the
preference reference read them through the helpers here. An adapter of weight `<w>` is the pair `<w>_lora_a`
(I, r) and `<w>_lora_b` (r, O).
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

LORA_TARGETS = ('query', 'key', 'value', 'out', 'gate', 'up', 'down')  # model.lora.targets: what LoRA adapts by default
MLP_TARGETS = ('gate', 'up', 'down')  # a dense MLP's; a mixture of experts' MLPs are never adapted
# Multi-head latent attention's own projections (jaxlm/mla.py), which model.lora.targets may name on such a model.
MLA_TARGETS = ('query_a', 'kv_a', 'kv_b')
LORA_BASE_DTYPES = ('float32', 'bfloat16')  # model.lora.base_dtype
ADAPTER_SUFFIXES = ('_lora_a', '_lora_b')  # a LoRA adapter's parameter names: `<weight>_lora_a`, `<weight>_lora_b`


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """model.lora: low-rank adapters W + (alpha/rank)·A·B beside the projections named in `targets` (Hu et al. 2021)."""
  rank: int = 0  # r; 0 = off
  alpha: float = 16.0  # the branch is scaled by alpha / rank, as peft's lora_alpha
  targets: tuple = LORA_TARGETS
  base_dtype: str = 'float32'  # how the frozen base is stored (bfloat16 halves its memory)

  @classmethod
  def from_config(cls, lora_cfg) -> 'LoraConfig':
    """From `cfg.model.lora` (None or absent in a config saved before LoRA existed: off)."""
    if lora_cfg is None:
      return cls()
    targets = lora_cfg.get('targets', LORA_TARGETS)
    targets = tuple(t.strip() for t in targets.split(',')) if isinstance(targets, str) else tuple(targets)
    return cls(rank=int(lora_cfg.get('rank', 0)), alpha=float(lora_cfg.get('alpha', 16.0)), targets=targets,
               base_dtype=lora_cfg.get('base_dtype', 'float32'))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank if self.rank else 0.0


def adapter(module, name: str, inputs: tuple, outputs: tuple, lo: LoraConfig, dtype, target: str | None = None):
  """LoRA's (A (I, r), B (r, O)) for the projection `name` with input axes `inputs` and output axes `outputs`
  ((size, logical name) pairs), flattened for model.project; None when model.lora does not adapt it. The adapters
  are stored in `dtype` (model.param_dtype), never in the frozen base's dtype.

  A follows the weight's input axes and B its output axes, so the rules table shards them as the weight; the
  rank axis (`lora_rank`) is never split. A starts as a fan-in normal and B at zero: at step 0 the branch adds an
  exact zero and the model computes its base bit for bit. Call after the module's own parameters, so their
  initial values do not depend on whether LoRA is on.
  """
  if not lo.rank or (target or name) not in lo.targets:  # `target`: the projection's name in model.lora.targets
    return None
  r, dtype = lo.rank, jnp.dtype(dtype)
  in_shape, in_names = zip(*inputs)
  out_shape, out_names = zip(*outputs)
  fan_in = math.prod(in_shape)
  a = module.param(f'{name}_lora_a', nn.with_logical_partitioning(nn.initializers.normal(fan_in ** -0.5),
                                                                  (*in_names, 'lora_rank')), (*in_shape, r), dtype)
  b = module.param(f'{name}_lora_b', nn.with_logical_partitioning(nn.initializers.zeros, ('lora_rank', *out_names)),
                   (r, *out_shape), dtype)
  return a.reshape(fan_in, r), b.reshape(r, math.prod(out_shape))


def is_adapter(path) -> bool:
  """Whether a parameter path (a tuple of names, or a jax key path) is a LoRA adapter's."""
  last = path[-1]
  return str(getattr(last, 'key', last)).endswith(ADAPTER_SUFFIXES)


def split_adapters(params) -> tuple[dict, dict]:
  """(base, adapters): the parameter tree cut in two trees of nested dicts, by `is_adapter`."""
  flat = traverse_util.flatten_dict(params)
  base = {k: v for k, v in flat.items() if not is_adapter(k)}
  adapters = {k: v for k, v in flat.items() if is_adapter(k)}
  return traverse_util.unflatten_dict(base), traverse_util.unflatten_dict(adapters)


def join_adapters(params, adapters) -> dict:
  """`params` with the leaves of `adapters` (a subtree of the same paths) put in."""
  flat = traverse_util.flatten_dict(params)
  flat.update(traverse_util.flatten_dict(adapters))
  return traverse_util.unflatten_dict(flat)


def merge_adapters(params, lo: LoraConfig) -> dict:
  """The parameters of the plain model that computes what the LoRA model does: each adapted W + (alpha/r)·A·B,
  in float32 (numpy), the adapters removed. Parameters without adapters are returned as they are."""

  def merge(tree):
    if not isinstance(tree, dict):
      return tree
    out = {}
    for name, value in tree.items():
      if name.endswith(ADAPTER_SUFFIXES):
        continue
      if isinstance(value, dict) or f'{name}_lora_a' not in tree:
        out[name] = merge(value)
        continue
      w = np.asarray(value, np.float32)
      a, b = np.asarray(tree[f'{name}_lora_a'], np.float32), np.asarray(tree[f'{name}_lora_b'], np.float32)
      lead = a.ndim + b.ndim - 2 - w.ndim  # a scanned stack's leading layers axis (0 or 1)
      r = a.shape[-1]
      a2 = a.reshape(*a.shape[:lead], -1, r)  # (..., I, r)
      b2 = b.reshape(*b.shape[:lead], r, -1)  # (..., r, O)
      out[name] = (w + (a2 @ b2 * np.float32(lo.scale)).reshape(w.shape)).astype(np.float32)
    return out

  return merge(params)


def adapters_off(params) -> dict:
  """`params` with every LoRA B at zero: the base model (x·A·0 adds an exact zero), at no memory beyond B's."""
  return jax.tree_util.tree_map_with_path(
      lambda k, x: jnp.zeros_like(x) if str(getattr(k[-1], 'key', k[-1])).endswith('_lora_b') else x, params)
