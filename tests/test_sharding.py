"""Sharded == unsharded, and parameters / optimizer state land where the rules table says."""

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxlm import sharding, step, train
from tests.helpers import grid, odd_config, plain_program, random_batch

MESHES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)]
_mesh_id = lambda shape: 'x'.join(map(str, shape))  # noqa: E731


def _two_steps(cfg, mesh_shape, batch, init=None):
  """init: a host initial state to start from (None: the program's own init)."""
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh_shape
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(mesh_shape))])
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    program = plain_program(cfg, mesh, steps=10)
    state = program.init() if init is None else jax.device_put(init, program.state_shardings)
    b = train.global_batch(batch, program.batch_sharding)
    state, m1 = program.train_step(state, b)
    state, m2 = program.train_step(state, b)
    return [float(m1['loss']), float(m2['loss']), float(m1['grad_norm'])], state


@functools.cache
def _odd_init(parallel_block: bool):
  """odd_config's initial state from one device, on the host: every mesh's two steps start from it (one init
  compile per block type, not one per mesh). That a mesh's own init draws these very values is checked once, in
  test_params_and_adam_moments_placement_and_bytes."""
  cfg = odd_config(parallel_block)
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 1, 1
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    return jax.tree.map(lambda x: np.array(x, copy=True), plain_program(cfg, mesh, steps=10).init())


@functools.cache
def _odd_two_steps(parallel_block: bool, mesh_shape, explicit_transpose_grads: bool = False):
  """Two steps of odd_config on `mesh_shape`, computed once per session (references are shared by tests)."""
  cfg = odd_config(parallel_block)
  cfg.model.explicit_transpose_grads = explicit_transpose_grads
  return _two_steps(cfg, mesh_shape, random_batch(8, 24, cfg.model.vocab_size, docs=2), _odd_init(parallel_block))


@pytest.mark.parametrize('parallel_block, shape', grid(
    [(block, shape) for block in (True, False) for shape in MESHES[1:]], fast=[],
    ids=lambda case: f'{"palm" if case[0] else "llama"}-{_mesh_id(case[1])}', unpack=True))
def test_sharded_steps_match_single_device(parallel_block, shape):
  reference, _ = _odd_two_steps(parallel_block, (1, 1, 1))
  assert reference[1] < reference[0]  # the step did something
  got, _ = _odd_two_steps(parallel_block, shape)
  np.testing.assert_allclose(got, reference, rtol=1e-5, err_msg=f'mesh {shape}')


@pytest.mark.parametrize('shape', grid([(1, 1, 1), (1, 8, 1), (2, 2, 2)], fast=[], ids=_mesh_id))
def test_explicit_transpose_grads_sharded_match_single_device(shape):
  # Transposed copies of FSDP-sharded activations: the weight gradients must still reduce over every shard.
  reference, _ = _odd_two_steps(True, (1, 1, 1))
  got, _ = _odd_two_steps(True, shape, explicit_transpose_grads=True)
  np.testing.assert_allclose(got, reference, rtol=1e-5, err_msg=f'mesh {shape}')


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_params_and_adam_moments_placement_and_bytes():
  _, state = _odd_two_steps(True, (1, 8, 1))  # the state of the sharded-steps test on this mesh
  p = state.params
  expected = {  # the rules table, read off per parameter (the leading None is the scanned `layers` axis)
      ('embedding',): P('tensor', 'fsdp'),
      ('layers', 'attention', 'query'): P(None, 'fsdp', 'tensor', None),
      ('layers', 'attention', 'key'): P(None, 'fsdp', None, None),
      ('layers', 'attention', 'out'): P(None, 'tensor', None, 'fsdp'),
      ('layers', 'mlp', 'gate'): P(None, 'fsdp', 'tensor'),
      ('layers', 'mlp', 'down'): P(None, 'tensor', 'fsdp'),
      ('layers', 'norm', 'scale'): P(None, 'fsdp'),
  }
  mu, nu = (optax.tree_utils.tree_get(state.opt_state, k) for k in ('mu', 'nu'))  # Adam's moments
  for path, spec in expected.items():
    for tree in (p, mu, nu):
      leaf = tree
      for k in path:
        leaf = leaf[k]
      assert leaf.sharding.spec == spec, (path, leaf.sharding.spec)
  # With fsdp=8 each device holds about 1/8 of the parameter and optimizer bytes.
  for tree in (p, mu, nu):
    total = sum(x.nbytes for x in jax.tree.leaves(tree))
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
    assert held <= total / 8 * 1.05, (held, total)
  # The sharded-steps tests start every mesh from one device's init (_odd_init): a program's own init on a mesh with
  # every axis split draws the same values, both blocks.
  for parallel_block in (True, False):
    cfg = odd_config(parallel_block)
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 2, 2, 2
    mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
      own = plain_program(cfg, mesh, steps=10).init()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(own), _odd_init(parallel_block))


def test_check_sharded_rejects_replicated_params():
  cfg = odd_config()
  mesh = sharding.make_mesh(cfg.mesh)
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    program = plain_program(cfg, mesh, steps=10)
  replicated = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, P()), program.state_shardings.params)
  sharding.check_sharded(program.abstract_state.params, program.state_shardings.params, mesh)
  with pytest.raises(AssertionError, match='not sharded as asked'):
    sharding.check_sharded(program.abstract_state.params, replicated, mesh)


@functools.cache
def _remat_step_hlo() -> str:
  """The compiled train step of a 3-layer remat=full odd_config on (data 1, fsdp 4, tensor 2), T = 24, B = 4."""
  cfg = odd_config()
  cfg.model.update(num_layers=3, remat='full')
  cfg.data.seq_len, cfg.train.batch_size = 24, 4
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 4, 2
  mesh = sharding.make_mesh(cfg.mesh)
  with sharding.activate(mesh):
    program = plain_program(cfg, mesh)
    batch = step.abstract_batch(4, 24, program.batch_sharding)
    return program.train_step.lower(program.abstract_state, batch).compile().as_text()


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_residual_stream_is_sequence_split_over_tensor():
  # Megatron's sequence parallelism: between layers each device holds T/tensor of its rows' tokens. Under
  # remat=full the step keeps every layer's input for the backward, a (L, B/fsdp, T/tensor, D) stack; without
  # the split it would be (L, B/fsdp, T, D), the same on every tensor device.
  hlo = _remat_step_hlo()
  assert 'f32[3,1,12,56]' in hlo, 'no (L, B/fsdp, T/tensor, D) stack of layer inputs'
  assert 'f32[3,1,24,56]' not in hlo, 'layer inputs kept whole along the sequence on each tensor device'


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_embedding_lookup_holds_one_tensor_share_of_the_table():
  # Tokens are looked up in a (V, D/tensor) view, and the lookup's gradient is scattered into one: no device
  # holds the whole (V, D) table or its whole float32 gradient (at PaLM 540B's 256k × 18432, 17.6 GiB).
  hlo = _remat_step_hlo()
  assert 'f32[398,28]' in hlo
  assert 'f32[398,56]' not in hlo, 'a whole (V, D) table on one device'


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_a_length_tensor_does_not_divide_still_gives_the_same_logits():
  # Sampling feeds prompts of any length: the residual's sequence split cannot be even there, and XLA must
  # still compute the unsplit model's logits.
  cfg = odd_config()
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 4, 2
  mesh = sharding.make_mesh(cfg.mesh)
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (4, 13)).astype(np.int32)
  segments, positions = np.ones_like(tokens), np.broadcast_to(np.arange(13, dtype=np.int32), tokens.shape)
  with sharding.activate(mesh):
    program = plain_program(cfg, mesh)
    params = program.init().params
    forward = jax.jit(lambda p, x, s, q: program.model.apply({'params': p}, x, s, q))
    split = forward(params, tokens, segments, positions)
  whole = jax.jit(program.model.apply)({'params': jax.device_get(params)}, tokens, segments, positions)  # no mesh
  np.testing.assert_allclose(np.asarray(split), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_expert_axis_exists_only_when_split():
  import ml_collections
  cfg = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1, context=1, expert=4, dcn_expert=1))
  shape = sharding.MeshShape.resolve(cfg, 8)
  assert shape.size('fsdp') == 2 and shape.size('expert') == 4  # -1 takes what the expert axis leaves
  mesh = sharding.make_mesh(cfg)
  assert dict(mesh.shape) == {'data': 1, 'fsdp': 2, 'expert': 4, 'tensor': 1, 'context': 1}
  assert sharding.batch_sharding(mesh).spec == P(('data', 'fsdp', 'expert'), 'context')
  axes, ici, dcn = sharding.layout(shape)  # what an AbstractMesh of this config needs (jaxlm.tools.size)
  assert axes == mesh.axis_names and tuple(i * d for i, d in zip(ici, dcn)) == tuple(mesh.shape.values())
  cfg.expert = 1  # no expert axis: the mesh, the rules and the batch spec exactly as before it existed
  mesh = sharding.make_mesh(cfg)
  assert mesh.axis_names == sharding.AXES and sharding.rules(mesh) == sharding.RULES
  assert sharding.batch_sharding(mesh).spec == P(('data', 'fsdp'), 'context')
  cfg.update(fsdp=1, dcn_expert=2)  # across hosts, but this is one process
  (problem,) = sharding.MeshShape.errors(cfg, 8)
  assert 'dcn_expert = 1×1×1×1×2 = 2 must equal the number of processes (1)' in problem
