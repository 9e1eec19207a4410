"""Mixture of experts: the dropless grouped-GEMM path against the dense reference, padding, capacity, balancing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import model as model_lib
from jaxlm import moe
from tests.helpers import grid, odd_config, random_batch

# Small, distinct sizes (X experts of width F on D): a wrong transpose or expert index fails loudly.
D, X, F, K = 24, 7, 10, 3


def _cfg(**overrides) -> model_lib.ModelConfig:
  base = dict(vocab_size=101, d_model=D, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=12, mlp_dim=20,
              dtype='float32', moe_experts=X, moe_top_k=K, moe_mlp_dim=F)
  return model_lib.ModelConfig(**{**base, **overrides})


def _inputs(n_rows=3, seq=11, pad=4, seed=0):
  """x (B, T, D) and segment ids with the last `pad` tokens of each row padding (segment id 0)."""
  x = jax.random.normal(jax.random.PRNGKey(seed), (n_rows, seq, D))
  seg = np.ones((n_rows, seq), np.int32)
  seg[:, seq - pad:] = 0
  return x, jnp.asarray(seg)


@functools.cache
def _params(**overrides):
  x, seg = _inputs()
  m = _cfg(**overrides)
  return jax.jit(moe.MoE(m).init)(jax.random.PRNGKey(1), x, seg)['params']


def _out_and_grads(impl, x, seg, **overrides):
  m = _cfg(moe_impl=impl, **overrides)
  params = jax.tree.map(lambda p: getattr(p, 'value', p), _params(**overrides),
                        is_leaf=lambda p: hasattr(p, 'names'))
  layer = moe.MoE(m)
  cot = jax.random.normal(jax.random.PRNGKey(7), x.shape)

  def f(p, x):
    y, vjp = jax.vjp(lambda p, x: layer.apply({'params': p}, x, seg), p, x)
    return y, vjp(cot)
  return jax.jit(f)(params, x)  # one compile: outputs and the gradients of (y · cot) together


@pytest.mark.parametrize('overrides', [
    {},  # mixtral
    {'moe_router': 'qwen3_moe', 'moe_norm_topk_prob': False},
    {'moe_router': 'deepseek_v3', 'moe_routed_scale': 2.5, 'moe_shared_experts': 1},
    {'moe_capacity_factor': 1.0},  # some assignments dropped
], ids=['mixtral', 'qwen3-unnormalised', 'deepseek-shared', 'capacity1'])
def test_ragged_dot_path_equals_dense_reference(overrides):
  x, seg = _inputs()
  y_ref, g_ref = _out_and_grads('dense', x, seg, **overrides)
  y, g = _out_and_grads('ragged', x, seg, **overrides)
  assert float(jnp.abs(y_ref).max()) > 0.1  # the layer computed something
  np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=0)
  flat, flat_ref = jax.tree.leaves(g), jax.tree.leaves(g_ref)
  assert len(flat) == len(flat_ref) >= 5
  for a, b in zip(flat, flat_ref):
    assert float(jnp.abs(b).max()) > 0  # every parameter (router included) and the input get a gradient
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_padding_tokens_are_routed_nowhere():
  x, seg = _inputs()
  m = _cfg()
  params = _params()
  y, stats = jax.jit(lambda p, x: moe.MoE(m).apply({'params': p}, x, seg, mutable=[moe.STATS]))(params, x)
  pad = np.asarray(seg) == 0
  np.testing.assert_array_equal(np.asarray(y)[pad], 0.0)  # no expert ran on them
  valid = int((~pad).sum())
  assert float(stats[moe.STATS]['tokens']) == valid
  assert float(stats[moe.STATS]['load'].sum()) == valid * K == float(stats[moe.STATS]['kept'])
  # Whatever the padding holds changes neither the real tokens' outputs nor any statistic.
  x2 = jnp.where(jnp.asarray(pad)[..., None], 100.0 * x[::-1], x)
  y2, stats2 = jax.jit(lambda p, x: moe.MoE(m).apply({'params': p}, x, seg, mutable=[moe.STATS]))(params, x2)
  np.testing.assert_array_equal(np.asarray(y2)[~pad], np.asarray(y)[~pad])
  for k, v in stats[moe.STATS].items():
    np.testing.assert_allclose(stats2[moe.STATS][k], v, rtol=1e-6, err_msg=k)


def test_route_presets_normalise_as_their_families():
  logits = jax.random.normal(jax.random.PRNGKey(3), (5, X)) * 2
  w, e, s = moe.route(logits, 'mixtral', K, False, 1.0)  # mixtral renormalises whatever the flag says
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  top = jax.lax.top_k(logits, K)[0]
  np.testing.assert_allclose(w, jax.nn.softmax(top, -1), rtol=1e-5)  # a softmax over the top-k logits
  w, e2, _ = moe.route(logits, 'olmoe', K, False, 1.0)
  np.testing.assert_array_equal(e, e2)
  np.testing.assert_allclose(w, jnp.take_along_axis(jax.nn.softmax(logits, -1), e, -1), rtol=1e-6)
  assert float(w.sum(-1).max()) < 1.0
  bias = jnp.zeros(X).at[0].set(10.0)  # bias changes the choice, not the weights
  w, e, s = moe.route(logits, 'deepseek_v3', K, True, 2.0, bias=bias)
  assert (np.asarray(e) == 0).any(axis=1).all()
  np.testing.assert_allclose(w.sum(-1), 2.0, rtol=1e-6)
  sel = jnp.take_along_axis(jax.nn.sigmoid(logits), e, -1)
  np.testing.assert_allclose(w, 2.0 * sel / sel.sum(-1, keepdims=True), rtol=1e-6)


def _model(**overrides):
  cfg = odd_config(parallel_block=False)
  cfg.model.update(moe_experts=5, moe_top_k=2, moe_mlp_dim=18, **overrides)
  return model_lib.ModelConfig.from_config(cfg.model)


@pytest.mark.parametrize('overrides', [{}, {'moe_every': 2, 'num_layers': 4, 'moe_shared_experts': 2},
                                       {'scan_layers': False, 'moe_every': 2, 'qk_norm': 'full'},
                                       {'parallel_block': True, 'qk_norm': 'head'}])
def test_param_counts_match_pytree(overrides):
  m = _model(**overrides)
  b = random_batch(1, 8, m.vocab_size)
  variables = jax.eval_shape(model_lib.Decoder(m).init, jax.random.PRNGKey(0), b['inputs'], b['segment_ids'],
                             b['positions'])
  params = variables['params']
  assert model_lib.param_count(m) == sum(x.size for x in jax.tree.leaves(params))
  routed = 3 * m.d_model * m.moe_mlp_dim * (m.moe_experts - m.moe_top_k)
  moe_layers = m.num_layers // m.moe_every
  assert model_lib.param_count(m) - model_lib.param_count(m, active=True) == moe_layers * routed
  flops = model_lib.flops_per_token(m, 16)
  assert flops == 6 * model_lib.param_count(m, active=True) + 12 * m.num_layers * m.num_heads * m.head_dim * 16


@functools.cache
def _loss_and_grad_norm(**overrides):
  m = _model(**overrides)
  b = random_batch(2, 12, m.vocab_size, docs=2)
  b['segment_ids'][:, -3:] = 0  # a padded tail
  decoder = model_lib.Decoder(m)
  params = jax.jit(decoder.init)(jax.random.PRNGKey(1), b['inputs'], b['segment_ids'], b['positions'])['params']

  def loss(p):
    logits = decoder.apply({'params': p}, b['inputs'], b['segment_ids'], b['positions'])
    return model_lib.loss_fn(logits, b['targets'], b['weights'], m.z_loss)[0]
  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return float(value), float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))


@pytest.mark.parametrize('remat', grid(['full', 'dots'], fast=['dots']))
def test_remat_changes_nothing_in_a_moe_model(remat):
  reference = _loss_and_grad_norm(remat='none', moe_every=2, num_layers=4)
  np.testing.assert_allclose(_loss_and_grad_norm(remat=remat, moe_every=2, num_layers=4), reference, rtol=1e-5)


def test_moe_model_ragged_equals_dense_reference():
  np.testing.assert_allclose(_loss_and_grad_norm(moe_impl='ragged'), _loss_and_grad_norm(moe_impl='dense'),
                             rtol=1e-5)
