"""Context parallelism: the sequence split over `mesh.context` computes what one device does.

The batch goes through `step.global_batch`, which puts every row in the zig-zag order on the host; the loss is a
sum over tokens, so losses and gradients must equal the unsplit run's (float32, rtol 1e-5) for every attention
layout (MQA, GQA, MHA), both blocks, packed documents, remat, and with fsdp and tensor beside context.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxlm import attention, sharding, step
from jaxlm import model as model_lib
from tests.helpers import odd_config, plain_program, random_batch


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


def _loss_and_grads(cfg, batch, **axes):
  """(total loss, aux, gradients) of one batch on the mesh `axes`, through the trainer's batch path."""
  mesh = _mesh(cfg, **axes)
  with sharding.activate(mesh):
    program = plain_program(cfg, mesh)
    params = program.init().params
    b = step.global_batch(batch, program.batch_sharding)

    def loss(params, b):
      logits = program.model.apply({'params': params}, b['inputs'], b['segment_ids'], b['positions'])
      return model_lib.loss_fn(logits, b['targets'], b['weights'], cfg.model.z_loss)

    (total, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, b)
    return float(total), {k: float(v) for k, v in aux.items()}, jax.device_get(grads), b


def _assert_same(got, want, what):
  total, aux, grads, _ = got
  np.testing.assert_allclose(total, want[0], rtol=1e-5, err_msg=what)
  for k in ('loss', 'z_loss'):
    np.testing.assert_allclose(aux[k], want[1][k], rtol=1e-5, err_msg=f'{what}: {k}')
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want[2])):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.abs(w).max(),
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


@pytest.mark.parametrize('layout', ['mqa', 'gqa', 'mha'])
def test_context_matches_single_device_fast(layout):
  # The fast loop's representative: context=4 beside fsdp=2, packed documents, each attention layout.
  cfg = _config(num_kv_heads=LAYOUTS[layout])
  batch = random_batch(4, 64, 256, seed=1, docs=3)
  want = _loss_and_grads(cfg, batch)
  got = _loss_and_grads(cfg, batch, fsdp=2, context=4)
  _assert_same(got, want, f'{layout} fsdp=2 context=4')
  # The batch arrived split as the rules say: rows over fsdp, the sequence over context, in zig-zag order.
  b = got[3]
  assert b['inputs'].sharding.spec == P(('data', 'fsdp'), 'context')
  assert b['inputs'].addressable_shards[0].data.shape == (2, 16)
  np.testing.assert_array_equal(np.asarray(b['positions'])[0], batch['positions'][0][sharding.zigzag_order(64, 4)])
