"""Model properties: causality, document masking, parameter and FLOP formulas, remat/scan invariance."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import model as model_lib
from tests.helpers import grid, odd_config, random_batch


_SAME_PARAMS = ('remat', 'explicit_transpose_grads')  # settings that change how the model runs, not its parameters


def _model(shapes_only: bool = False, **overrides):
  """(config, model, params, batch) for odd_config + `overrides`; shapes_only: parameter shapes, no values."""
  cfg = odd_config()
  cfg.model.update(**overrides)
  m = model_lib.ModelConfig.from_config(cfg.model)
  b = random_batch(2, 20, m.vocab_size, docs=2)
  if shapes_only:
    params = _unboxed(jax.eval_shape(_init_fn(m), jax.random.PRNGKey(1), b['inputs'], b['segment_ids'],
                                     b['positions']))
  else:
    params = _params(**{k: v for k, v in overrides.items() if k not in _SAME_PARAMS})
  return m, model_lib.Decoder(m), params, b


@functools.cache
def _params(**overrides):
  """The initial parameters, computed once per parameter-shaping setting (init compiles for seconds)."""
  m, _, _, b = _model(shapes_only=True, **overrides)
  return _unboxed(jax.jit(_init_fn(m))(jax.random.PRNGKey(1), b['inputs'], b['segment_ids'], b['positions']))


def _init_fn(m):
  return model_lib.Decoder(m).init


def _unboxed(variables):
  return jax.tree.map(lambda x: getattr(x, 'value', x), variables['params'], is_leaf=lambda x: hasattr(x, 'names'))


@functools.partial(jax.jit, static_argnums=0)
def _apply(model, params, inputs, segment_ids, positions):
  return model.apply({'params': params}, inputs, segment_ids, positions)


def _logits(model, params, inputs, segment_ids, positions):
  return np.asarray(_apply(model, params, inputs, segment_ids, positions))


@pytest.mark.parametrize('parallel_block', [True, False])
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_changing_token_t_never_changes_earlier_logits(parallel_block):
  m, model, params, b = _model(parallel_block=parallel_block)
  one = np.ones_like(b['inputs'])
  pos = np.tile(np.arange(20), (2, 1))
  base = _logits(model, params, b['inputs'], one, pos)
  for t in (0, 7, 19):
    changed = b['inputs'].copy()
    changed[:, t] = (changed[:, t] + 1) % m.vocab_size
    out = _logits(model, params, changed, one, pos)
    np.testing.assert_array_equal(out[:, :t], base[:, :t])
    assert not np.allclose(out[:, t], base[:, t])


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_documents_do_not_see_each_other():
  m, model, params, b = _model()
  base = _logits(model, params, b['inputs'], b['segment_ids'], b['positions'])
  changed = b['inputs'].copy()
  changed[:, :10] = (changed[:, :10] + 3) % m.vocab_size  # rewrite all of document 1
  out = _logits(model, params, changed, b['segment_ids'], b['positions'])
  np.testing.assert_allclose(out[:, 10:], base[:, 10:], atol=1e-6)  # document 2 is untouched
  # And the document restart is real: document 2 alone, at positions 0.., gives the same logits.
  alone = _logits(model, params, b['inputs'][:, 10:], np.ones((2, 10), np.int32), b['positions'][:, 10:])
  np.testing.assert_allclose(alone, base[:, 10:], atol=1e-5)


@pytest.mark.parametrize('overrides', [{}, {'parallel_block': False}, {'tie_embeddings': False},
                                       {'num_kv_heads': 4, 'scan_layers': False}])
def test_param_count_matches_pytree(overrides):
  m, _, params, _ = _model(shapes_only=True, **overrides)
  assert model_lib.param_count(m) == sum(x.size for x in jax.tree.leaves(params))


def test_flops_per_token_palm_formula():
  m, _, params, _ = _model(shapes_only=True)
  n = sum(x.size for x in jax.tree.leaves(params))
  T = 64
  expected = 6 * n + 12 * m.num_layers * m.num_heads * m.head_dim * T
  assert model_lib.flops_per_token(m, T) == expected
  assert model_lib.flops_per_token(m, T, causal=True) == 6 * n + 6 * m.num_layers * m.num_heads * m.head_dim * T
  untied, _, params, _ = _model(shapes_only=True, tie_embeddings=False)
  n_untied = sum(x.size for x in jax.tree.leaves(params)) - untied.vocab_size * untied.d_model  # lookup: no FLOPs
  assert model_lib.flops_per_token(untied, T) == 6 * n_untied + 12 * m.num_layers * m.num_heads * m.head_dim * T


@functools.cache
def _loss_and_grad_norm(**overrides):
  m, model, params, b = _model(**overrides)

  def loss(p):
    logits = model.apply({'params': p}, b['inputs'], b['segment_ids'], b['positions'])
    return model_lib.loss_fn(logits, b['targets'], b['weights'], m.z_loss)[0]
  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return float(value), float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))


# Plain-product weight gradients (explicit_transpose_grads, the CPU layout) are the same math, with and without
# remat.
_REMAT_CASES = [(policy, False) for policy in ('full', 'dots', 'dots_no_batch', 'attn_out')] + \
               [(policy, True) for policy in ('none', 'full', 'dots')]


@pytest.mark.parametrize('policy, explicit_transpose_grads', grid(
    _REMAT_CASES, fast=[], ids=lambda c: f'{c[0]}{"-explicit_transpose" if c[1] else ""}',
    unpack=True))
def test_remat_changes_nothing(policy, explicit_transpose_grads):
  reference = _loss_and_grad_norm(remat='none')
  np.testing.assert_allclose(_loss_and_grad_norm(remat=policy, explicit_transpose_grads=explicit_transpose_grads),
                             reference, rtol=1e-5)


def test_unrolled_layers_count_the_same_parameters():
  # Unrolled layers get other parameter names (layers_0, ...) and so other random values: compare counts only.
  m, _, params, _ = _model(shapes_only=True, scan_layers=False)
  assert 'layers_1' in params and model_lib.param_count(m) == sum(x.size for x in jax.tree.leaves(params))


def test_loss_fn_masks_padding_and_adds_z_loss():
  logits = jnp.array([[[2.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])
  targets = jnp.array([[0, 1]])
  total, aux = model_lib.loss_fn(logits, targets, jnp.array([[1.0, 0.0]]), z_loss=0.1)
  log_z = np.log(np.exp(2.0) + 2.0)
  np.testing.assert_allclose(aux['loss'], log_z - 2.0, rtol=1e-6)
  np.testing.assert_allclose(total, log_z - 2.0 + 0.1 * log_z ** 2, rtol=1e-6)


def test_swiglu_gradient_matches_autodiff_of_the_formula():
  g, u, dh = (jax.random.normal(k, (6, 10)) * 3 for k in jax.random.split(jax.random.PRNGKey(0), 3))
  plain = lambda g, u: jax.nn.silu(g) * u
  np.testing.assert_allclose(model_lib.swiglu(g, u), plain(g, u), rtol=1e-6)
  got = jax.vjp(model_lib.swiglu, g, u)[1](dh)
  want = jax.vjp(plain, g, u)[1](dh)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('fan_in,fan_out', [(6, 10), (10, 6)], ids=['copy-x', 'copy-dy'])
def test_dense_nn_weight_grad_is_a_plain_product(fan_in, fan_out):
  x, w, dy = (jax.random.normal(k, s) for k, s in zip(jax.random.split(jax.random.PRNGKey(1), 3),
                                                      [(12, fan_in), (fan_in, fan_out), (12, fan_out)]))

  def grads(nn_weight_grad):
    return jax.vjp(lambda x, w: model_lib.dense(x, w, nn_weight_grad), x, w)[1](dy)

  for a, b in zip(grads(True), grads(False)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  # The point of the option: no product in the compiled backward contracts its left operand's leading axis.
  def hlo(nn_weight_grad):
    return jax.jit(lambda x, w, dy: jax.vjp(lambda x, w: model_lib.dense(x, w, nn_weight_grad), x, w)[1](dy)
                   ).lower(x, w, dy).compile().as_text()
  assert 'lhs_contracting_dims={0}' in hlo(False)  # XLA's own choice: xᵀ·dy as a transposed-operand dot
  assert 'lhs_contracting_dims={0}' not in hlo(True)
