"""The device mesh and the one table mapping logical axis names to mesh axes.

Mesh axes:
  data    plain data parallelism: parameters replicated, batch split.
  fsdp    fully-sharded data parallelism (ZeRO-3): batch split, and parameters + optimizer state split along
          `embed`, gathered layer by layer inside the step.
  tensor  Megatron tensor parallelism: attention heads, MLP hidden and vocabulary split; between layers the
          residual stream is split along the sequence over it too (`act_res_seq`, Megatron's sequence
          parallelism, Korthikanti et al. 2022), so norms, residual adds and the layer inputs remat keeps are
          not replicated: each norm's output is all-gathered for the input matmuls, and the output
          projections' partial sums end split again (model.gathered, model.to_residual).
  stage   pipeline parallelism (jaxlm/pipeline.py): consecutive layers on each stage, microbatches flowing
          through. Outermost, and present only when mesh.stage × mesh.dcn_stage > 1, so an unpipelined mesh
          (and every PartitionSpec on it) is exactly (data, fsdp, tensor).
  context context parallelism: every sequence split along its length (`act_seq`), in the load-balanced
          zig-zag order of `zigzag_order`; attention gathers keys and values along it (attention.py).
  expert  expert parallelism (jaxlm/moe.py): a mixture of experts' stacked weights split along their experts
          axis; everything else uses it as one more fully-sharded data axis (the batch split over it, the
          other parameters along `embed` over fsdp × expert, as MaxText does), so no device idles. Tokens
          travel to their experts' devices and back inside the MoE layer (moe.py's transports). Between
          fsdp and tensor, and present only when mesh.expert × mesh.dcn_expert > 1, like `stage`.
With mesh.dcn_* > 1 each axis also spans hosts (or TPU slices); see make_mesh.
Storage names (parameters) and activation names (`act_*`) are kept apart, as in Levanter: they are sharded
differently (parameters over fsdp, activations over the batch).
"""

import contextlib
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlm import errors
from jaxlm.metrics import format_table

AXES = ('data', 'fsdp', 'tensor', 'context')
STAGE = 'stage'  # the pipeline axis, placed before AXES when a mesh has one
EXPERT = 'expert'  # the expert-parallel axis, placed after fsdp when a mesh has one

RULES = (
    # Storage: parameters and optimizer state.
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('heads', 'tensor'),
    ('kv_heads', None),  # one kv head under multi-query attention: too few to split, so replicated
    ('kv', None),  # head dim
    ('mlp', 'tensor'),
    ('experts', None),  # a mixture of experts' stacked weights (X, D, F): every device holds every expert
    ('layers', None),  # the scanned layer axis: every device holds its slice of every layer
  ('lora_rank', None),  # a LoRA adapter's rank r (model.adapter): small, never split
    ('latent', None),  # multi-head latent attention's latent ranks (jaxlm/mla.py): small, never split
    # Activations.
    ('act_batch', ('data', 'fsdp')),
    ('act_seq', 'context'),
    # The residual stream between layers (and a norm's input): the sequence over context, then over tensor
    # (sequence parallelism). data.seq_len must divide by context × tensor (config validation, as Megatron
    # asserts); a length that does not (a sampled prompt) is still computed right, only not evenly split.
    ('act_res_seq', ('context', 'tensor')),
    ('act_table_embed', 'tensor'),  # the embedding table's view that tokens are looked up in (model.Decoder)
    ('act_embed', None),
    ('act_heads', 'tensor'),
    ('act_kv_heads', 'tensor'),  # the KV cache's heads (generate.py); replicated where K does not divide tensor
    ('act_kv', None),
    ('act_mlp', 'tensor'),
    ('act_vocab', 'tensor'),
)

# On a mesh with a `stage` axis these rows come first: each stage stores its own layers (gpipe: a contiguous
# block of the `layers` axis), and outside the pipelined stack (embedding, loss) the batch is split over the
# stages as well, so no stage repeats that work. Inside a stage (`in_stage`) RULES alone apply: there the stage
# axis is the vmapped stage dimension.
STAGE_RULES = (
    ('layers', STAGE),
    ('act_batch', (STAGE, 'data', 'fsdp')),
    ('act_stage', STAGE),  # the pipeline's (stages, ...) state buffer
)


# On a mesh with an `expert` axis these rows come first: the stacked experts split over it, and every other
# parameter's `embed` and the batch over it too (fully-sharded data parallelism over fsdp × expert). An expert
# weight (experts, embed, mlp) takes `expert` on its experts axis first, so its `embed` falls through to the
# plain ('embed', 'fsdp') row (flax assigns each mesh axis at most once per array).
EXPERT_RULES = (
    ('experts', EXPERT),
    ('embed', ('fsdp', EXPERT)),
    ('act_batch', ('data', 'fsdp', EXPERT)),
)


def rules(mesh) -> tuple:
  """The logical → mesh rules for `mesh`: RULES, preceded by STAGE_RULES / EXPERT_RULES when the mesh has a
  stage / an expert axis."""
  names = mesh.axis_names
  return ((STAGE_RULES if STAGE in names else ()) + (EXPERT_RULES if EXPERT in names else ()) + RULES)


@contextlib.contextmanager
def in_stage():
  """The rules inside one pipeline stage, whose layers see only the (data, fsdp, tensor) part of the mesh."""
  with nn.logical_axis_rules(RULES):
    yield


@contextlib.contextmanager
def activate(mesh: Mesh):
  """The mesh and the logical-axis rules that model code's logical names resolve through."""
  if isinstance(mesh, Mesh):
    with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(rules(mesh)):
      yield
  else:  # an AbstractMesh (jaxlm.tools.size on more devices than this host has): shapes only
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(rules(mesh)):
      yield


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """The mesh's shape, resolved once: per-host (or per-slice) sizes and the dcn_* factors across hosts.

  The dcn_* factors split an axis across hosts or TPU slices (the slow data-centre network); the plain sizes
  split it inside one host or slice (ICI / NVLink). Config validation, the trainer, eval and size all use this.
  Both tuples follow AXES; an axis a config lacks (one saved before the axis existed) has size 1. The pipeline's
  stage axis is kept apart (`stage`, `dcn_stage`): it exists on a mesh only when there is more than one stage;
  so is the expert axis (`expert`, `dcn_expert`), on a mesh only when it splits the experts more than one way.
  """
  ici: tuple[int, ...]  # per AXES, inside one host or slice, a -1 filled in (0: cannot be)
  dcn: tuple[int, ...]  # per AXES: dcn_data, dcn_fsdp, ...
  stage_ici: int = 1  # mesh.stage: pipeline stages inside one host or slice
  stage_dcn: int = 1  # mesh.dcn_stage: pipeline stages across hosts or slices
  expert_ici: int = 1  # mesh.expert: expert-parallel ways inside one host or slice
  expert_dcn: int = 1  # mesh.dcn_expert: expert-parallel ways across hosts or slices

  @classmethod
  def resolve(cls, mesh_cfg, num_devices: int) -> 'MeshShape':
    """The shape `mesh_cfg` asks for on `num_devices` devices (unchecked: see `errors`)."""
    # .get: configs saved before the dcn_* keys (or an axis, or stages) existed (old checkpoints) mean one host,
    # size 1, no pipeline.
    dcn = tuple(mesh_cfg.get(f'dcn_{axis}', 1) for axis in AXES)
    stage_ici, stage_dcn = mesh_cfg.get('stage', 1), mesh_cfg.get('dcn_stage', 1)
    expert_ici, expert_dcn = mesh_cfg.get('expert', 1), mesh_cfg.get('dcn_expert', 1)
    hosts = math.prod(dcn) * stage_dcn * expert_dcn
    per_host = num_devices // hosts if hosts > 0 and num_devices % hosts == 0 else 0
    sizes = [mesh_cfg.get(axis, 1) for axis in AXES]
    if sizes.count(-1) == 1:
      rest = math.prod(s for s in sizes if s != -1) * stage_ici * expert_ici
      sizes[sizes.index(-1)] = per_host // rest if rest > 0 and per_host % rest == 0 else 0
    return cls(tuple(sizes), dcn, stage_ici, stage_dcn, expert_ici, expert_dcn)

  @property
  def sizes(self) -> tuple[int, ...]:
    """The whole mesh's size per AXES: each axis is its dcn_* factor times its per-host size."""
    return tuple(i * d for i, d in zip(self.ici, self.dcn))

  def size(self, axis: str) -> int:
    """The whole mesh's size along `axis` (one of AXES, or 'expert')."""
    return self.experts if axis == EXPERT else self.sizes[AXES.index(axis)]

  @property
  def stages(self) -> int:
    """Pipeline stages in the whole mesh: dcn_stage × stage (1: no pipeline)."""
    return self.stage_ici * self.stage_dcn

  @property
  def experts(self) -> int:
    """Expert-parallel ways in the whole mesh: dcn_expert × expert (1: no expert axis)."""
    return self.expert_ici * self.expert_dcn

  @staticmethod
  def errors(mesh_cfg, num_devices: int, num_processes: int = 1, num_slices: int = 1) -> list[str]:
    """Problems with the mesh sizes on `num_devices` devices in `num_processes` processes / `num_slices` slices."""
    sizes = tuple(mesh_cfg.get(axis, 1) for axis in AXES)
    names = '×'.join(AXES)
    given = ', '.join(f'{a}={x}' for a, x in zip(AXES, sizes))
    text = '×'.join(map(str, sizes))
    if any(x == 0 or x < -1 for x in sizes) or sizes.count(-1) > 1:
      return [f'mesh ({given}): each must be positive, with at most one -1 meaning "the remaining devices".']
    shape = MeshShape.resolve(mesh_cfg, num_devices)
    if any(not isinstance(x, int) or x < 1 for x in (shape.stage_ici, shape.stage_dcn)):
      return [f'mesh.stage={shape.stage_ici} and mesh.dcn_stage={shape.stage_dcn} must be positive integers '
              f'(1 = no pipeline).']
    if any(not isinstance(x, int) or x < 1 for x in (shape.expert_ici, shape.expert_dcn)):
      return [f'mesh.expert={shape.expert_ici} and mesh.dcn_expert={shape.expert_dcn} must be positive integers '
              f'(1 = no expert parallelism).']
    if shape.stages > num_devices:
      return [f'mesh stage×dcn_stage = {shape.stage_ici}×{shape.stage_dcn} = {shape.stages} pipeline stages '
              f'exceed the {num_devices} devices available; each stage needs at least one device, so use at most '
              f'{num_devices} stages.']
    dcn = shape.dcn
    dcn_names = '×'.join(f'dcn_{a}' for a in AXES)
    if any(not isinstance(x, int) or x < 1 for x in dcn):
      return [f'mesh ({dcn_names.replace("×", ", ")}) = {dcn}: each must be a positive integer (1 = not split '
              f'across hosts).']
    hosts = math.prod(dcn) * shape.stage_dcn * shape.expert_dcn
    dcn_text = '×'.join(map(str, dcn))
    if shape.stage_dcn > 1:
      dcn_text = f'{shape.stage_dcn}×{dcn_text}'
    dcn_names = ('dcn_stage×' if shape.stage_dcn > 1 else '') + dcn_names
    if shape.expert_dcn > 1:
      dcn_text, dcn_names = f'{dcn_text}×{shape.expert_dcn}', f'{dcn_names}×dcn_expert'
    if hosts > 1 and hosts not in (num_processes, num_slices):
      return [f'mesh {dcn_names} = {dcn_text} = {hosts} must equal the number of processes '
              f'({num_processes}) or of TPU slices ({num_slices}): the dcn_* axes run across hosts, each host '
              f'holding a {names} block. Set them so, or all to 1 for a single host.']
    if math.prod(shape.sizes) * shape.stages * shape.experts != num_devices:
      if shape.stage_ici > 1:
        names, text = f'stage×{names}', f'{shape.stage_ici}×{text}'
      if shape.expert_ici > 1:
        names, text = f'{names}×expert', f'{text}×{shape.expert_ici}'
      if hosts == 1:
        return [f'mesh {names} = {text} does not match the {num_devices} devices '
                f'available; make the product {num_devices}, or set one axis to -1 (e.g. --config.mesh.fsdp=-1).']
      return [f'mesh ({names}) × ({dcn_names}) = ({text}) × '
              f'({dcn_text}) does not match the {num_devices} devices available: each of the {hosts} hosts/slices '
              f'has {num_devices / hosts:g} devices, so make {names} {num_devices / hosts:g}, or set one '
              f'axis to -1.']
    return []


def single_host_mesh_cfg(mesh_cfg, num_devices: int, num_processes: int):
  """`mesh_cfg` if it fits here, else all `num_devices` as FSDP on one host (eval of a multi-host run's checkpoint)."""
  shape = MeshShape.resolve(mesh_cfg, num_devices)
  multi_host = math.prod(shape.dcn) * shape.stage_dcn * shape.expert_dcn > 1
  if (multi_host and num_processes == 1) or math.prod(shape.sizes) * shape.stages * shape.experts != num_devices:
    mesh_cfg = mesh_cfg.copy_and_resolve_references()
    mesh_cfg.update({axis: 1 for axis in AXES}, **{f'dcn_{axis}': 1 for axis in AXES})
    mesh_cfg.fsdp = -1
    if 'stage' in mesh_cfg:
      mesh_cfg.update(stage=1, dcn_stage=1)
    if 'expert' in mesh_cfg:
      mesh_cfg.update(expert=1, dcn_expert=1)
  return mesh_cfg


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """A (data, fsdp, tensor, context) mesh over `devices` (default: all), one axis possibly given as -1.

  With mesh.dcn_* > 1 the mesh is hybrid: each axis is dcn_* × its per-host size, the dcn factor outermost, so
  one host's (or TPU slice's) devices form a contiguous block and only the dcn axes cross the slow network.
  HSDP, for example, is fsdp=-1 with dcn_data=<hosts>: parameters sharded inside a host, replicated across.
  With pipeline stages the mesh is (stage, data, fsdp, tensor), stage outermost: with dcn_stage = hosts, each
  host holds whole stages, and only the stage-to-stage activations cross the slow network. With an expert axis
  it is (data, fsdp, expert, tensor, context): tensor stays innermost (the fastest links), and the experts'
  token exchange runs over the axis next to it.
  """
  devices = jax.devices() if devices is None else devices
  processes, slices = num_processes(devices), num_slices(devices)
  if problems := MeshShape.errors(mesh_cfg, len(devices), processes, slices):
    raise errors.ConfigError('invalid config:\n  - ' + '\n  - '.join(problems))
  axes, ici, dcn = layout(MeshShape.resolve(mesh_cfg, len(devices)))
  # Auto axis types: shardings come from jit in/out shardings and with_sharding_constraint (JAX >= 0.7 would
  # otherwise default to explicit-sharding mode).
  axis_types = (jax.sharding.AxisType.Auto,) * len(axes)
  if math.prod(dcn) == 1:
    return jax.make_mesh(ici, axes, axis_types=axis_types, devices=devices)
  # TPU multi-slice: slices are the units of the slow network. Elsewhere (GPU hosts, CPU processes) processes
  # are, and each host's devices keep their local, topology-aware order inside its block.
  by_slice = slices == math.prod(dcn) and slices > 1
  grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=not by_slice)
  return Mesh(grid, axes, axis_types=axis_types)


def layout(shape: MeshShape) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
  """(axis names, per-host sizes, dcn factors) of the mesh `shape` describes, in make_mesh's order: the stage
  axis outermost and the expert axis after fsdp, each only when it splits more than one way. An AbstractMesh of
  the same shape (shapes only, no devices) is AbstractMesh(tuple(i·d for i, d in zip(ici, dcn)), axes)."""
  ici, dcn, axes = shape.ici, shape.dcn, AXES
  if shape.experts > 1:
    at = AXES.index('fsdp') + 1
    ici, dcn = (*ici[:at], shape.expert_ici, *ici[at:]), (*dcn[:at], shape.expert_dcn, *dcn[at:])
    axes = (*axes[:at], EXPERT, *axes[at:])
  if shape.stages > 1:
    ici, dcn, axes = (shape.stage_ici, *ici), (shape.stage_dcn, *dcn), (STAGE, *axes)
  return axes, ici, dcn


def num_processes(devices=None) -> int:
  """How many processes hold `devices` (default: all devices)."""
  return len({d.process_index for d in (jax.devices() if devices is None else devices)})


def num_slices(devices=None) -> int:
  """How many TPU slices hold `devices` (1 where devices carry no slice_index: GPUs, CPUs, one TPU slice)."""
  return len({getattr(d, 'slice_index', 0) for d in (jax.devices() if devices is None else devices)})


def constrain_stages(x, logical: tuple):
  """`x` (stages, ...) with its leading axis on the mesh's stage axis and the rest named by `logical` (RULES)."""
  rest = nn.logical_to_mesh_axes(logical, RULES)
  return jax.lax.with_sharding_constraint(x, P(STAGE, *rest))


def logical_to_mesh(logical_tree, mesh: Mesh):
  """Maps a pytree of logical PartitionSpecs to NamedShardings on `mesh` through RULES."""
  return nn.logical_to_mesh_sharding(logical_tree, mesh, rules(mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches are (B, T): split along B over data and fsdp (and the pipeline's stages, the expert axis, when there
  are any: `act_batch`), along T over context (in `zigzag_order`)."""
  rows = (STAGE, 'data', 'fsdp') if STAGE in mesh.axis_names else ('data', 'fsdp')
  if EXPERT in mesh.axis_names:
    rows = (*rows, EXPERT)
  return NamedSharding(mesh, P(rows, 'context'))


@functools.lru_cache(maxsize=None)
def row_share(batch_sharding: NamedSharding) -> tuple[int, int]:
  """(index, count): this process reads rows index·B/count … (index+1)·B/count of every global batch.

  A process reads the rows its devices hold. Processes whose devices differ only along axes that do not split
  the rows (tensor or context across hosts: mesh.dcn_tensor, mesh.dcn_context) hold the same rows, so they read
  the same share, and each device takes its part of the sequence from the whole rows. One process: (0, 1).
  """
  mesh, (rows_axes, seq_axes) = batch_sharding.mesh, batch_sharding.spec
  n = ways(mesh, rows_axes)
  indices = batch_sharding.addressable_devices_indices_map((n, ways(mesh, seq_axes))).values()
  held = {index[0].indices(n)[:2] for index in indices}  # (start, stop) of each local device's rows
  lo, hi = min(start for start, _ in held), max(stop for _, stop in held)
  if sum(stop - start for start, stop in held) < hi - lo:  # a gap: the mesh does not give each host a block
    raise errors.ConfigError(f'this process\'s devices hold rows {sorted(held)} of the {n} batch shards, not one '
                             f'contiguous block; use the mesh make_mesh builds (dcn_* axes outermost).')
  return lo // (hi - lo), n // (hi - lo)


def context_size(mesh=None) -> int:
  """Ways the sequence is split (`act_seq`'s mesh axes) on `mesh`, default the mesh being traced under."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty:
    return 1
  return ways(mesh, dict(RULES)['act_seq'])


def ways(mesh, axes) -> int:
  """How many parts a PartitionSpec entry (an axis name, a tuple of them, or None) cuts a dimension into."""
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))


def zigzag_order(seq_len: int, context: int) -> np.ndarray:
  """Token order that balances causal attention over `context` shards: (T,) original index per new slot.

  The sequence is cut into 2·C chunks and shard i holds chunks i and 2C-1-i, so every shard has one early
  (cheap) and one late (expensive) chunk of the causal triangle: no shard idles on the masked-out half while
  another does twice its share (the zig-zag of Megatron / MaxText's load-balanced context parallelism).
  C = 1 is the identity.
  """
  if context == 1:
    return np.arange(seq_len)
  chunks = np.arange(seq_len).reshape(2 * context, seq_len // (2 * context))
  order = [c for i in range(context) for c in (i, 2 * context - 1 - i)]
  return chunks[order].reshape(-1)


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
  return format_table(rows, header=('parameter', 'shape', 'partition', 'bytes/device'))


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
  ways = mesh.shape['fsdp'] * mesh.shape['tensor'] * dict(mesh.shape).get(EXPERT, 1)
  held = bytes_per_device(params, shardings)
  if held > total / ways * (1 + tolerance):
    raise AssertionError(f'parameters are not sharded as asked: a device holds {held:,} of {total:,} bytes, '
                         f'expected about {total // ways:,} on fsdp×tensor(×expert) = {ways}.')
