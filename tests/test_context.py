"""Context parallelism: the sequence split over `mesh.context` computes what one device does.

The batch goes through `step.global_batch`, which puts every row in the zig-zag order on the host; the loss is a
sum over tokens, so losses and gradients must equal the unsplit run's (float32, rtol 1e-5) for every attention
layout (MQA, GQA, MHA), both blocks, packed documents, remat, and with fsdp and tensor beside context.
"""

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxlm import attention, sharding, step
from jaxlm import model as model_lib
from tests.helpers import assert_fails_with, odd_config, plain_program, random_batch, run_cli


def _config(**model):
  c = odd_config()
  c.model.update(vocab_size=256, d_model=48, num_heads=4, num_kv_heads=1, head_dim=12, mlp_dim=96, num_layers=2,
                 remat='none', z_loss=1e-3)
  c.model.update(**model)
  c.data.seq_len = 64
  return c


def _mesh(cfg, data=1, fsdp=1, tensor=1, context=1):
  cfg.mesh.update(data=data, fsdp=fsdp, tensor=tensor, context=context)
  return sharding.make_mesh(cfg.mesh, jax.devices()[:data * fsdp * tensor * context])


def _random_params(program, seed=0):
  """Random parameters drawn in numpy from the abstract shapes (a compiled init costs seconds per mesh here)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(x.dtype),
                      program.abstract_state.params)


def _loss_and_grads(cfg, batch, **axes):
  """(total loss, aux, gradients, batch, compiled step) of one batch on the mesh `axes`, through the trainer's
  batch path."""
  mesh = _mesh(cfg, **axes)
  with sharding.activate(mesh):
    program = plain_program(cfg, mesh)
    params = jax.device_put(_random_params(program), program.state_shardings.params)
    b = step.global_batch(batch, program.batch_sharding)

    def loss(params, b):
      logits = program.model.apply({'params': params}, b['inputs'], b['segment_ids'], b['positions'])
      return model_lib.loss_fn(logits, b['targets'], b['weights'], cfg.model.z_loss)

    compiled = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params, b).compile()
    (total, aux), grads = compiled(params, b)
    return float(total), {k: float(v) for k, v in aux.items()}, jax.device_get(grads), b, compiled


def _collectives(compiled, op) -> list[tuple[int, ...]]:
  """The result shapes of the compiled program's `op` ('all-gather', 'collective-permute') instructions (each
  array of an async start's tuple)."""
  shapes = []
  for line in compiled.as_text().splitlines():
    if (m := re.search(rf'=\s*(.*?)\s{op}(-start)?\(', line)):
      shapes += [tuple(int(d) for d in dims.split(',') if d) for dims in re.findall(r'\w+\[([\d,]*)\]', m.group(1))]
  return shapes


def _assert_same(got, want, what):
  total, aux, grads = got[:3]
  np.testing.assert_allclose(total, want[0], rtol=1e-5, err_msg=what)
  for k in ('loss', 'z_loss'):
    np.testing.assert_allclose(aux[k], want[1][k], rtol=1e-5, err_msg=f'{what}: {k}')
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want[2])):
    # rtol 1e-5 per element; entries near zero (float32 sums in another order) are held to 1e-5 of the tensor's
    # largest gradient instead.
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max(),
                               err_msg=f'{what}: {jax.tree_util.keystr(path)}')


LAYOUTS = {'mqa': 1, 'gqa': 2, 'mha': 4}


@pytest.mark.parametrize('context', [2, 4, 8])
def test_zigzag_order_balances_causal_work(context):
  T = 16 * context
  order = sharding.zigzag_order(T, context)
  assert sorted(order.tolist()) == list(range(T))
  shards = order.reshape(context, -1)
  # Shard i holds chunks i and 2C-1-i: the keys each shard's queries see causally add up to the same count.
  work = [int(sum(p + 1 for p in shard)) for shard in shards]
  assert len(set(work)) == 1, work
  chunk = T // (2 * context)
  assert shards[0][:chunk].tolist() == list(range(chunk))
  assert shards[0][chunk:].tolist() == list(range(T - chunk, T))
  np.testing.assert_array_equal(sharding.zigzag_order(T, 1), np.arange(T))


_REFERENCE = {}  # (layout, block, remat) -> the unsplit run, shared by the grid


def _reference(cfg, batch, key):
  if key not in _REFERENCE:
    _REFERENCE[key] = _loss_and_grads(cfg, batch)
  return _REFERENCE[key]


def _packed_batch():
  # Three packed documents per row, the third cut short by padding (segment 0, weight 0).
  batch = random_batch(4, 64, 256, seed=1, docs=3)
  batch['segment_ids'][:, -5:] = 0
  batch['positions'][:, -5:] = 0
  batch['weights'][:, -5:] = 0.0
  return batch


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_context_matches_single_device_fast():
  # The fast loop's representative: multi-query (PaLM), context=4 beside fsdp=2, packed documents.
  cfg = _config(num_kv_heads=1)
  batch = _packed_batch()
  want = _reference(cfg, batch, ('mqa', 'palm', 'none'))
  got = _loss_and_grads(cfg, batch, fsdp=2, context=4)
  _assert_same(got, want, 'mqa fsdp=2 context=4')
  # Only attention talks along the sequence: the loss and its gradients all-gather the keys and values (one head,
  # (2, 64, 1, 12) per device) and the segment ids (2, 64), never a projection's input or output, the MLP's or
  # the logits ((2, 64, 48), (2, 64, 96), (2, 64, 256): what merging a split batch with a split sequence for a
  # matmul costs when a device holds 2 rows; blocks.tokens).
  along = {s for s in _collectives(got[4], 'all-gather') if s[:2] == (2, 64)}
  assert along <= {(2, 64), (2, 64, 1, 12)}, along
  # The batch arrived split as the rules say: rows over fsdp, the sequence over context, in zig-zag order.
  b = got[3]
  assert b['inputs'].sharding.spec == P(('data', 'fsdp'), 'context')
  assert b['inputs'].addressable_shards[0].data.shape == (2, 16)
  order = sharding.zigzag_order(64, 4)
  for key in ('inputs', 'targets', 'positions', 'segment_ids', 'weights'):
    np.testing.assert_array_equal(np.asarray(b[key]), batch[key][:, order], err_msg=key)


# Each context size beside the other axes: 2 with fsdp and tensor, 4 with fsdp, 8 alone.
MESHES = {2: dict(fsdp=2, tensor=2, context=2), 4: dict(fsdp=2, context=4), 8: dict(context=8)}


@pytest.mark.e2e
@pytest.mark.parametrize('context', [2, 4, 8])
@pytest.mark.parametrize('block', ['palm', 'llama'])
@pytest.mark.parametrize('layout', ['mqa', 'gqa', 'mha'])
def test_context_matches_single_device(layout, block, context):
  cfg = _config(num_kv_heads=LAYOUTS[layout], parallel_block=block == 'palm')
  batch = _packed_batch()
  want = _reference(cfg, batch, (layout, block, 'none'))
  _assert_same(_loss_and_grads(cfg, batch, **MESHES[context]), want, f'{layout} {block} {MESHES[context]}')


@pytest.mark.e2e
@pytest.mark.parametrize('remat', ['full', 'dots'])
def test_context_matches_single_device_under_remat(remat):
  cfg = _config(num_kv_heads=2, remat=remat)
  batch = _packed_batch()
  want = _reference(cfg, batch, ('gqa', 'palm', remat))
  _assert_same(_loss_and_grads(cfg, batch, tensor=2, context=4), want, f'remat={remat} tensor=2 context=4')


@pytest.mark.e2e
@pytest.mark.slow(reason='full remat under context parallelism with microbatches: the train and eval steps compiled twice')
def test_train_and_eval_steps_match_single_device():
  # The whole step (z-loss, gradient norm, AdamW update) and eval's token sums, with microbatches.
  cfg = _config(num_kv_heads=1, remat='full')
  batch = _packed_batch()
  results = []
  for axes in ({}, dict(fsdp=2, context=4)):
    mesh = _mesh(cfg, **axes)
    with sharding.activate(mesh):
      program = plain_program(cfg, mesh, microbatches=2)
      state = program.init()
      b = step.global_batch(batch, program.batch_sharding)
      state, m1 = program.train_step(state, b)
      state, m2 = program.train_step(state, b)
      e = program.eval_step(state.params, b)
      results.append([float(m1['loss']), float(m1['z_loss']), float(m1['grad_norm']), float(m2['loss']),
                      float(e['loss_sum']), float(e['tokens'])])
  np.testing.assert_allclose(results[1], results[0], rtol=1e-5)
  assert results[0][3] < results[0][0]  # the step did something


@pytest.mark.e2e
def test_sliding_window_context_matches_single_device():
  # Local (W = 8, so a 64-token row is 8 windows) and global layers in one scanned stack, with soft-cap, sinks
  # and packed documents: each context shard's queries take only the keys their window reaches, and the loss and
  # gradients equal one device's. With W <= the chunk (T / 2C = 8 at context 4, 16 at context 2) a local layer
  # gets its keys by halos from its neighbours (attention._halo_attention), tensor beside it at context 2.
  cfg = _config(num_kv_heads=2, parallel_block=False, attention_window=8, attention_global_every=2,
                attention_softcap=3.0, attention_sinks=True)
  batch = _packed_batch()
  want = _loss_and_grads(cfg, batch)
  got = _loss_and_grads(cfg, batch, fsdp=2, context=4)
  _assert_same(got, want, 'window=8 fsdp=2 context=4')
  # The local layers' halos: W keys (and values, segment ids) of each of the 2 rows a shard holds, passed on.
  assert (2, 8, 2, 12) in _collectives(got[4], 'collective-permute')
  _assert_same(_loss_and_grads(cfg, batch, fsdp=2, tensor=2, context=2), want, 'window=8 fsdp=2 tensor=2 context=2')


def _forward(cfg, **axes):
  """The compiled forward (logits) of `cfg`'s model on the mesh `axes`, for the packed batch."""
  mesh = _mesh(cfg, **axes)
  with sharding.activate(mesh):
    program = plain_program(cfg, mesh)
    params = jax.device_put(_random_params(program), program.state_shardings.params)
    b = step.global_batch(_packed_batch(), program.batch_sharding)
    apply = lambda p, b: program.model.apply({'params': p}, b['inputs'], b['segment_ids'], b['positions'])  # noqa: E731
    return jax.jit(apply).lower(params, b).compile()


def _gathered_keys(compiled) -> list[tuple[int, ...]]:
  """The all-gathers of keys or values ((2, S, 2, 12) per device, S >= T = 64: K = 2 heads, unlike the queries'
  4) or segment ids ((2, S)) along the whole sequence in `compiled`, for fsdp 2 × context 4 on `_config`'s model."""
  return [s for s in _collectives(compiled, 'all-gather')
          if len(s) in (2, 4) and s[0] == 2 and s[1] >= 64 and s[2:] in ((), (2, 12))]


@pytest.mark.e2e
def test_local_layers_under_context_pass_halos_not_the_sequence():
  # An all-local stack (Mistral's) on fsdp 2 × context 4: its loss and gradients never all-gather anything along
  # the sequence (keys, values, segment ids, or a projection's activations: blocks.tokens), only the weights over
  # fsdp; it passes halos of W = 8 positions, (2, 8, 2, 12) and (2, 8) per device. The same model with global
  # layers (window 0), or with a window longer than a chunk (16 > T / 2C = 8: a query reaches past the chunk
  # before its own; the blocks in the zig-zag order of attention._window_blocks), gathers them.
  cfg = _config(num_kv_heads=2, attention_window=8, attention_softcap=3.0, attention_sinks=True)
  local = _loss_and_grads(cfg, _packed_batch(), fsdp=2, context=4)[4]
  assert not [s for s in _collectives(local, 'all-gather') if s[:2] == (2, 64)], _collectives(local, 'all-gather')
  halos = _collectives(local, 'collective-permute')
  assert (2, 8, 2, 12) in halos and (2, 8) in halos, halos
  for window in (0, 16):
    cfg.model.attention_window = window
    gathered = _gathered_keys(_forward(cfg, fsdp=2, context=4))
    assert (2, 64, 2, 12) in gathered and any(len(s) == 2 for s in gathered), (window, gathered)


def _temp_bytes(cfg, **axes) -> int:
  """Temporary (activation) bytes per device of the compiled train step."""
  mesh = _mesh(cfg, **axes)
  program = plain_program(cfg, mesh)
  batch = step.abstract_batch(cfg.train.batch_size, cfg.data.seq_len, program.batch_sharding)
  compiled = program.train_step.lower(program.abstract_state, batch).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.e2e
def test_activation_memory_falls_as_one_over_context():
  # Long enough that attention's (T, S) scores dominate; one row, so only the sequence can be split.
  cfg = _config(num_kv_heads=1, remat='none')
  cfg.data.seq_len = 1024
  cfg.train.batch_size = 1
  one = _temp_bytes(cfg)
  for context in (2, 4, 8):
    ratio = _temp_bytes(cfg, context=context) / one
    assert ratio < 1.5 / context, (context, ratio)


@pytest.mark.e2e
def test_query_blocks_under_context_match_single_device():
  # model.attention_block_q: each context shard's queries in blocks of 4, against the unblocked single device.
  batch = _packed_batch()
  want = _reference(_config(num_kv_heads=2, remat='full'), batch, ('gqa', 'palm', 'full'))
  cfg = _config(num_kv_heads=2, remat='full', attention_block_q=4)
  _assert_same(_loss_and_grads(cfg, batch, fsdp=2, context=4), want, 'attention_block_q=4 fsdp=2 context=4')


@pytest.mark.e2e
def test_query_blocks_cut_the_activation_memory():
  # The (T/C, T) scores are the bulk at long sequences; in blocks of 32 rows only one block's are live.
  cfg = _config(num_kv_heads=1, remat='full')
  cfg.data.seq_len = 1024
  cfg.train.batch_size = 1
  whole = _temp_bytes(cfg, context=4)
  cfg.model.attention_block_q = 32
  blocked = _temp_bytes(cfg, context=4)
  assert blocked < whole / 3, (whole, blocked)


def test_fused_kernels_fall_back_under_context_with_the_reason():
  for impl, platform in [('cudnn', 'gpu'), ('splash', 'tpu'), ('auto', 'tpu')]:
    kernel, why = attention.select(impl, dtype='bfloat16', head_dim=128, seq_len=4096, platform=platform,
                                   context=4)
    assert kernel == 'xla' and 'context parallelism (mesh context=4)' in why, why
  assert attention.select('splash', dtype='bfloat16', head_dim=128, seq_len=4096, platform='tpu',
                          context=1)[0] == 'splash'


@pytest.mark.e2e
def test_activations_stay_split_along_the_sequence():
  # Logits come out split as the rules say: rows over fsdp, sequence over context, vocabulary over tensor; and
  # the compiled forward gathers (keys and values) rather than leaving everything replicated.
  cfg = _config(num_kv_heads=1)
  mesh = _mesh(cfg, fsdp=2, tensor=2, context=2)
  with sharding.activate(mesh):
    program = plain_program(cfg, mesh)
    params = jax.device_put(_random_params(program), program.state_shardings.params)
    b = step.global_batch(_packed_batch(), program.batch_sharding)
    forward = jax.jit(lambda p, b: program.model.apply({'params': p}, b['inputs'], b['segment_ids'], b['positions']))
    logits = forward(params, b)
    hlo = forward.lower(params, b).compile().as_text()
  assert logits.sharding.spec == P('fsdp', 'context', 'tensor')  # (data of size 1 is dropped)
  assert logits.addressable_shards[0].data.shape == (2, 32, 128)
  assert 'all-gather' in hlo


def test_entry_point_refuses_a_seq_len_context_cannot_split(tmp_path):
  out = run_cli('jaxlm.train', '--config=configs/palm_tiny.py', f'--workdir={tmp_path}', '--config.mesh.context=4',
                '--config.data.seq_len=60', timeout=300)
  assert_fails_with(out, 2, 'data.seq_len=60')
