"""The device mesh and the one table mapping logical axis names to mesh axes.

Mesh axes:
  data    plain data parallelism: parameters replicated, batch split.
  fsdp    fully-sharded data parallelism (ZeRO-3): batch split, and parameters + optimizer state split along
          `embed`, gathered layer by layer inside the step.
  tensor  Megatron tensor parallelism: attention heads, MLP hidden and vocabulary split.
With mesh.dcn_* > 1 each axis also spans hosts (or TPU slices); see make_mesh.
Storage names (parameters) and activation names (`act_*`) are kept apart, as in Levanter: they are sharded
differently (parameters over fsdp, activations over the batch).
"""

import contextlib
import math

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlm import config as config_lib

AXES = ('data', 'fsdp', 'tensor')

RULES = (
    # Storage: parameters and optimizer state.
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('heads', 'tensor'),
    ('kv_heads', None),  # one kv head under multi-query attention: too few to split, so replicated
    ('kv', None),  # head dim
    ('mlp', 'tensor'),
    ('layers', None),  # the scanned layer axis: every device holds its slice of every layer
    # Activations.
    ('act_batch', ('data', 'fsdp')),
    ('act_seq', None),
    ('act_embed', None),
    ('act_heads', 'tensor'),
    ('act_kv', None),
    ('act_mlp', 'tensor'),
    ('act_vocab', 'tensor'),
)


@contextlib.contextmanager
def activate(mesh: Mesh):
  """The mesh and the logical-axis rules that model code's logical names resolve through."""
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(RULES):
    yield


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all), one axis possibly given as -1.

  With mesh.dcn_* > 1 the mesh is hybrid: each axis is dcn_* × its per-host size, the dcn factor outermost, so
  one host's (or TPU slice's) devices form a contiguous block and only the dcn axes cross the slow network.
  HSDP, for example, is fsdp=-1 with dcn_data=<hosts>: parameters sharded inside a host, replicated across.
  """
  devices = jax.devices() if devices is None else devices
  processes, slices = num_processes(devices), num_slices(devices)
  if errors := config_lib.mesh_layout_errors(mesh_cfg, len(devices), processes, slices):
    raise config_lib.ConfigError('invalid config:\n  - ' + '\n  - '.join(errors))
  ici, dcn = config_lib.mesh_shapes(mesh_cfg, len(devices))
  # Auto axis types: shardings come from jit in/out shardings and with_sharding_constraint (JAX >= 0.7 would
  # otherwise default to explicit-sharding mode).
  axis_types = (jax.sharding.AxisType.Auto,) * len(AXES)
  if math.prod(dcn) == 1:
    return jax.make_mesh(ici, AXES, axis_types=axis_types, devices=devices)
  # TPU multi-slice: slices are the units of the slow network. Elsewhere (GPU hosts, CPU processes) processes
  # are, and each host's devices keep their local, topology-aware order inside its block.
  by_slice = slices == math.prod(dcn) and slices > 1
  grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=not by_slice)
  return Mesh(grid, AXES, axis_types=axis_types)


def num_processes(devices=None) -> int:
  """How many processes hold `devices` (default: all devices)."""
  return len({d.process_index for d in (jax.devices() if devices is None else devices)})


def num_slices(devices=None) -> int:
  """How many TPU slices hold `devices` (1 where devices carry no slice_index: GPUs, CPUs, one TPU slice)."""
  return len({getattr(d, 'slice_index', 0) for d in (jax.devices() if devices is None else devices)})


def logical_to_mesh(logical_tree, mesh: Mesh):
  """Maps a pytree of logical PartitionSpecs to NamedShardings on `mesh` through RULES."""
  return nn.logical_to_mesh_sharding(logical_tree, mesh, RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches are (B, T) and split along B over data and fsdp."""
  return NamedSharding(mesh, P(('data', 'fsdp'), None))


def param_table(params, shardings) -> str:
  """One row per parameter: path, shape, PartitionSpec, bytes held by each device."""
  rows = []
  flat_p = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_s = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  for (path, leaf), sharding in zip(flat_p, flat_s):
    name = '/'.join(str(getattr(k, 'key', k)) for k in path)
    shard_shape = sharding.shard_shape(leaf.shape)
    per_device = math.prod(shard_shape) * np.dtype(leaf.dtype).itemsize
    rows.append((name, str(tuple(leaf.shape)), str(sharding.spec), f'{per_device:,}'))
  header = ('parameter', 'shape', 'partition', 'bytes/device')
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
  fmt = '  '.join(f'{{:<{w}}}' for w in widths)
  return '\n'.join([fmt.format(*header)] + [fmt.format(*r) for r in rows])


def bytes_per_device(tree, shardings) -> int:
  """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) under `shardings`."""
  flat_s = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  return sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
             for x, s in zip(jax.tree.leaves(tree), flat_s))


def check_sharded(params, shardings, mesh: Mesh, tolerance: float = 0.5) -> None:
  """Fails if parameters are not spread over fsdp × tensor as asked (MaxText's `sufficiently sharded`).

  A device should hold about 1/(fsdp·tensor) of the parameter bytes; replicated norms and kv heads make it a
  little more, so anything within `tolerance` of ideal passes.
  """
  total = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
  ways = mesh.shape['fsdp'] * mesh.shape['tensor']
  held = bytes_per_device(params, shardings)
  if held > total / ways * (1 + tolerance):
    raise AssertionError(f'parameters are not sharded as asked: a device holds {held:,} of {total:,} bytes, '
                         f'expected about {total // ways:,} on fsdp×tensor = {ways}.')
