"""Muon (optim.name='muon'): Newton–Schulz orthogonalised momentum for the matrix weights, AdamW for the rest.

Built from optax pieces: `optax.trace` (Nesterov momentum, float32), optax.contrib's Newton–Schulz iteration
(`scale_by_muon` with its own momentum off, applied to stacks of matrices), `optax.partition` for the AdamW part.
What jaxlm adds on top:

- Routing and each matrix's (rows, columns) come from the parameters' logical axis names (`MATRICES`), never from
  ndim: the scanned `layers` axis (pipeline stages included: they split the same axis) is a batch of matrices,
  and the embedding, unembedding and norms go to AdamW. optax's default (2-D → Muon) would do the opposite.
- Scale invariance: optax divides by ‖G‖ + 1e-8, so a gradient much smaller than 1e-8 is never orthogonalised.
  Each matrix is first divided by its largest entry (exact in any dtype), so NS(c·G) = NS(G) for any c > 0.
- Sharding: Newton–Schulz needs whole matrices. A weight's stack of matrices (one per layer) is split over every
  device of the mesh (`orthogonalize_spread`): each device gathers and orthogonalises only its own whole matrices
  (different layers on different devices, as torchtitan and Megatron spread them); none holds every layer's.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers, scale_by_muon

BATCH_AXES = ('layers', 'stage')  # scanned layers and pipeline stages: independent matrices, not matrix axes
# A matrix weight's logical axes (batch axes removed) → (rows: the axes it reads from, columns: writes to).
MATRICES = {
    ('embed', 'heads', 'kv'): (('embed',), ('heads', 'kv')),  # query
    ('embed', 'kv_heads', 'kv'): (('embed',), ('kv_heads', 'kv')),  # key, value
    ('heads', 'kv', 'embed'): (('heads', 'kv'), ('embed',)),  # attention out
    ('embed', 'mlp'): (('embed',), ('mlp',)),  # gate, up
    ('mlp', 'embed'): (('mlp',), ('embed',)),  # down
}
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (optax's default)
RMS_MATCH = 0.2  # muon_scale=rms: update RMS of AdamW's (Moonlight, Liu et al. 2025), so AdamW's LR carries over


def dimension_numbers(spec: P) -> MuonDimensionNumbers | None:
  """optax's (reduction, output) axes for a parameter with logical axes `spec`; None when AdamW takes it."""
  matrix = tuple(a for a in spec if a not in BATCH_AXES)
  if matrix not in MATRICES:
    return None
  rows, cols = MATRICES[matrix]
  return MuonDimensionNumbers(tuple(spec.index(a) for a in rows), tuple(spec.index(a) for a in cols))


def labels(logical_specs):
  """'muon' or 'adam' for every parameter, from its logical axis names."""
  return jax.tree.map(lambda s: 'adam' if dimension_numbers(s) is None else 'muon', logical_specs,
                      is_leaf=lambda x: isinstance(x, P))


def _to_matrices(x, dims: MuonDimensionNumbers, batch: tuple | None = None):
  """`x` as (batch, rows, cols), and the function that puts such a stack back into `x`'s layout.

  `batch`: the order in which the other axes merge into the batch (default: as in `x`).
  """
  rows, cols = tuple(dims.reduction_axis), tuple(dims.output_axis)
  if batch is None:
    batch = tuple(a for a in range(x.ndim) if a not in rows + cols)
  order = tuple(batch) + rows + cols
  size = lambda axes: math.prod(x.shape[a] for a in axes)
  inverse = tuple(order.index(a) for a in range(x.ndim))
  moved = tuple(x.shape[a] for a in order)
  return (x.transpose(order).reshape(size(batch), size(rows), size(cols)),
          lambda m: m.reshape(moved).transpose(inverse))


def orthogonalize(stack, ns_steps: int = 5, dtype=jnp.float32):
  """Newton–Schulz on every (rows, cols) matrix of `stack` (B, rows, cols), scale-invariant, in `dtype`."""
  biggest = jnp.max(jnp.abs(stack), axis=(1, 2), keepdims=True)
  # Largest entry 1: optax's Frobenius normalisation (‖X‖ ≥ 1 now) no longer sees its 1e-8 floor.
  x = (stack / jnp.where(biggest > 0, biggest, 1)).astype(dtype)
  # scale_by_muon with beta=0 and no Nesterov is Newton–Schulz alone (its momentum is trace's, outside).
  ns = scale_by_muon(NS_COEFFS, ns_steps, beta=0.0, nesterov=False,
                     weight_dimension_numbers=MuonDimensionNumbers(1, 2))
  out, _ = ns.update(x, ns.init(x))
  return out.astype(stack.dtype)


def shape_scale(rows: int, cols: int, mode: str) -> float:
  """The factor on an orthogonalised (rows → cols) update: rms ≈ AdamW's update RMS, or spectral width scaling.

  An orthogonal (rows, cols) matrix has RMS 1/√max(rows, cols), so rms mode's update RMS is RMS_MATCH.
  """
  return RMS_MATCH * math.sqrt(max(rows, cols)) if mode == 'rms' else math.sqrt(max(1.0, cols / rows))


def _axes(entry) -> tuple:
  """A PartitionSpec entry as a tuple of mesh axes."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def orthogonalize_spread(u, dims: MuonDimensionNumbers, mesh_axes: tuple, ns_steps: int, dtype):
  """Newton–Schulz on every matrix of `u` (sharded as `mesh_axes` say), each whole on one device, in `u`'s layout.

  The (batch, rows, cols) stack is padded to a multiple of the device count, then the mesh axes that split
  rows and columns (and those that split nothing) move one at a time onto the batch: each move is one
  all-to-all, after which every device holds its own whole matrices and no other's. The way back mirrors it.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    stack, inverse = _to_matrices(u, dims)
    return inverse(orthogonalize(stack, ns_steps, dtype))
  # A reshape keeps the sharding of each merged group's leading axis (layers; embed or heads; mlp or embed), so
  # a sharded batch axis (pipeline stages) merges first.
  batch_dims = sorted((a for a in range(u.ndim) if a not in tuple(dims.reduction_axis) + tuple(dims.output_axis)),
                      key=lambda a: not _axes(mesh_axes[a]))
  stack, inverse = _to_matrices(u, dims, tuple(batch_dims))
  n, rows, cols = stack.shape
  batch = _axes(mesh_axes[batch_dims[0]]) if batch_dims else ()
  row, col = _axes(mesh_axes[dims.reduction_axis[0]]), _axes(mesh_axes[dims.output_axis[0]])
  free = tuple(a for a in mesh.axis_names if a not in batch + row + col and mesh.shape[a] > 1)
  stages = math.prod(mesh.shape[a] for a in batch)
  ways = math.prod(mesh.shape[a] for a in row + col + free)  # devices sharing each batch shard
  own = n // stages  # matrices in each batch shard (a pipeline stage's layers)
  per = -(-own // ways) * ways
  # Padded inside each batch shard, so padding moves nothing between devices, and with the real matrices spread
  # evenly among the padding, so no device (in the end, or after any one move) holds all of them.
  slots = (np.arange(own) * per) // own
  x = stack.reshape(stages, own, rows, cols)
  x = jnp.zeros((stages, per, rows, cols), x.dtype).at[:, slots].set(x).reshape(stages * per, rows, cols)
  steps = [(batch, row, col)]
  for a in row + col + free:
    b, r, c = steps[-1]
    steps.append((b + (a,), tuple(m for m in r if m != a), tuple(m for m in c if m != a)))
  spec_of = lambda b, r, c: P(b or None, r or None, c or None)
  for b, r, c in steps:
    x = jax.lax.with_sharding_constraint(x, spec_of(b, r, c))
  x = orthogonalize(x, ns_steps, dtype)
  for b, r, c in reversed(steps):
    x = jax.lax.with_sharding_constraint(x, spec_of(b, r, c))
  return inverse(x.reshape(stages, per, rows, cols)[:, slots].reshape(n, rows, cols))


def scale_by_newton_schulz(dims, specs, ns_steps: int, dtype, mode: str) -> optax.GradientTransformation:
  """Orthogonalises every update with dimension numbers in `dims` (`orthogonalize_spread`), scaled by `mode`.

  Matrices of one shape and layout are orthogonalised as one stack, so they spread over the devices together
  (every layer's up projection when layers are not scanned; key and value). A matrix whose transpose has that
  shape and layout joins it transposed, as NS(Xᵀ) = NS(X)ᵀ: down with gate and up, out with query.
  """

  def update(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    groups = {}  # (stages, rows, cols, dtype, mesh axes) → [(leaf index, (stages, n, rows, cols) stack, ...)]
    for i, (u, d, spec) in enumerate(zip(leaves, treedef.flatten_up_to(dims), treedef.flatten_up_to(specs))):
      axes = nn.logical_to_mesh_axes(tuple(spec))
      batch = [a for a in range(u.ndim) if a not in d.reduction_axis + d.output_axis]
      stage = next((_axes(axes[a]) for a in batch if _axes(axes[a])), ())  # pipeline stages split the layers
      stack, inverse = _to_matrices(u, d, tuple(sorted(batch, key=lambda a: not _axes(axes[a]))))
      n, rows, cols = stack.shape
      row, col = _axes(axes[d.reduction_axis[0]]), _axes(axes[d.output_axis[0]])
      flip = rows > cols or (rows == cols and row > col)
      if flip:
        stack, rows, cols, row, col = stack.transpose(0, 2, 1), cols, rows, col, row
      stages = math.prod(dict(jax.sharding.get_abstract_mesh().shape).get(a, 1) for a in stage) if stage else 1
      key = (stage, rows, cols, u.dtype, row, col)
      groups.setdefault(key, []).append((i, stack.reshape(stages, n // stages, rows, cols), inverse, flip,
                                         shape_scale(*((cols, rows) if flip else (rows, cols)), mode)))
    out = list(leaves)
    for (stage, rows, cols, _, row, col), members in groups.items():
      # Joined inside each pipeline stage's block (axis 1), where nothing is split: joining moves nothing.
      joined = jnp.concatenate([m[1] for m in members], axis=1)
      mesh_axes = (stage or None, None, row or None, col or None)
      done = orthogonalize_spread(joined, MuonDimensionNumbers((2,), (3,)), mesh_axes, ns_steps, dtype)
      start = 0
      for i, stack, inverse, flip, scale in members:
        part = done[:, start:start + stack.shape[1]].reshape(-1, rows, cols) * scale
        start += stack.shape[1]
        out[i] = inverse(part.transpose(0, 2, 1) if flip else part)
    return treedef.unflatten(out), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def constrain_like(logical_specs) -> optax.GradientTransformation:
  """Puts every update back on its parameter's sharding (logical names through the active rules)."""

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, s: nn.with_logical_constraint(u, s), updates, logical_specs,
                        is_leaf=lambda x: isinstance(x, P)), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def muon(optim_cfg, lr, adam_lr, logical_specs, decay_mask) -> optax.GradientTransformation:
  """optax.partition: Muon for the matrices `MATRICES` names, AdamW (its own LR and decay) for the rest."""
  o = optim_cfg
  is_spec = lambda x: isinstance(x, P)
  dims = jax.tree.map(dimension_numbers, logical_specs, is_leaf=is_spec)
  muon_dims = jax.tree.map(lambda d: d if d is not None else optax.MaskedNode(), dims,
                           is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
  muon_mask = jax.tree.map(lambda d: d is not None, dims,
                           is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
  # Newton–Schulz in bfloat16 on accelerators (as Keller Jordan's and torchtitan's), float32 on the CPU, where
  # bfloat16 matmuls are emulated and slower.
  ns_dtype = jnp.float32 if jax.default_backend() == 'cpu' else jnp.bfloat16
  mask_of = lambda tree: jax.tree.map(lambda m, keep: m if keep else optax.MaskedNode(), tree, muon_mask,
                                     is_leaf=is_spec)
  adam_decay = o.weight_decay if o.adam_weight_decay < 0 else o.adam_weight_decay
  matrices = optax.chain(
      optax.trace(o.muon_momentum, nesterov=True, accumulator_dtype=jnp.float32),
      scale_by_newton_schulz(muon_dims, mask_of(logical_specs), o.muon_ns_steps, ns_dtype, o.muon_scale),
      constrain_like(mask_of(logical_specs)),
      optax.add_decayed_weights(o.weight_decay),
      optax.scale_by_learning_rate(lr))
  rest = optax.adamw(adam_lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=adam_decay, mask=decay_mask)
  return optax.partition({'muon': matrices, 'adam': rest}, labels(logical_specs))
