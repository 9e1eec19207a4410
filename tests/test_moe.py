"""Mixture of experts: the dropless grouped-GEMM path against the dense reference, padding, capacity, balancing."""

import dataclasses
import functools

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxlm import blocks
from jaxlm import model as model_lib
from jaxlm import moe
from jaxlm.hf import convert
from tests.helpers import grid, odd_config, random_batch

# Small, distinct sizes (X experts of width F on D): a wrong transpose or expert index fails loudly.
D, X, F, K = 24, 7, 10, 3


def _cfg(**overrides) -> model_lib.ModelConfig:
  base = dict(vocab_size=101, d_model=D, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=12, mlp_dim=20,
              dtype='float32', moe_experts=X, moe_top_k=K, moe_mlp_dim=F)
  # cfg.model's flat keys, nested by the one mapping the trainer uses (model.ModelConfig.from_config).
  return model_lib.ModelConfig.from_config(ml_collections.ConfigDict({**base, **overrides}))


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
  params = jax.jit(model_lib.moe_mlp(m).init)(jax.random.PRNGKey(1), x, seg)['params']
  params = jax.tree.map(lambda p: getattr(p, 'value', p), params, is_leaf=lambda p: hasattr(p, 'names'))
  # gpt-oss's biases start at zero: drawn here, so that each row must find its own expert's
  return jax.tree_util.tree_map_with_path(
      lambda path, p: jax.random.normal(jax.random.PRNGKey(len(p.shape) + p.size), p.shape)
      if jax.tree_util.keystr(path).endswith("_bias']") else p, params)


def _out_and_grads(impl, x, seg, **overrides):
  m = _cfg(moe_impl=impl, **overrides)
  params = _params(**overrides)
  layer = model_lib.moe_mlp(m)
  cot = jax.random.normal(jax.random.PRNGKey(7), x.shape)

  def f(p, x):
    y, vjp = jax.vjp(lambda p, x: layer.apply({'params': p}, x, seg), p, x)
    return y, vjp(cot)
  return jax.jit(f)(params, x)  # one compile: outputs and the gradients of (y · cot) together


_LAYER_CASES = {
    'mixtral': {},
    'qwen3-unnormalised': {'moe_router': 'qwen3_moe', 'moe_norm_topk_prob': False},
    'deepseek-shared': {'moe_router': 'deepseek_v3', 'moe_routed_scale': 2.5, 'moe_shared_experts': 1},
    'capacity1': {'moe_capacity_factor': 1.0},  # some assignments dropped
    'gpt-oss': {'moe_router': 'gpt_oss', 'moe_expert_bias': True, 'moe_router_bias': True, 'mlp_activation': 'clamped',
                'mlp_swiglu_limit': 0.5},  # biases per expert and on the logits; clamps that act
}


@pytest.mark.parametrize('overrides', grid(list(_LAYER_CASES.values()), fast=[{}, {'moe_capacity_factor': 1.0}],
                                           ids=lambda o: next(k for k, v in _LAYER_CASES.items() if v == o)))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_ragged_dot_path_equals_dense_reference(overrides):
  x, seg = _inputs()
  y_ref, g_ref = _out_and_grads('dense', x, seg, **overrides)
  y, g = _out_and_grads('ragged', x, seg, **overrides)
  assert float(jnp.abs(y_ref).max()) > 0.1  # the layer computed something
  np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=0)
  flat, flat_ref = jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g_ref)
  assert len(flat) == len(flat_ref) >= 6
  for (path, a), b in zip(flat, flat_ref):
    if jax.tree_util.keystr(path).endswith("['bias']"):  # only top-k's choice reads the balancing bias: no gradient
      np.testing.assert_array_equal(a, 0.0)
    else:  # every other parameter (router included) and the input get a gradient
      assert float(jnp.abs(b).max()) > 0, path
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_padding_tokens_are_routed_nowhere():
  x, seg = _inputs()
  m = _cfg()
  params = _params()
  y, stats = jax.jit(lambda p, x: model_lib.moe_mlp(m).apply({'params': p}, x, seg, mutable=[moe.STATS]))(params, x)
  pad = np.asarray(seg) == 0
  np.testing.assert_array_equal(np.asarray(y)[pad], 0.0)  # no expert ran on them
  valid = int((~pad).sum())
  assert float(stats[moe.STATS]['tokens']) == valid
  assert float(stats[moe.STATS]['load'].sum()) == valid * K == float(stats[moe.STATS]['kept'])
  # Whatever the padding holds changes neither the real tokens' outputs nor any statistic.
  x2 = jnp.where(jnp.asarray(pad)[..., None], 100.0 * x[::-1], x)
  y2, stats2 = jax.jit(lambda p, x: model_lib.moe_mlp(m).apply({'params': p}, x, seg, mutable=[moe.STATS]))(params, x2)
  np.testing.assert_array_equal(np.asarray(y2)[~pad], np.asarray(y)[~pad])
  for k, v in stats[moe.STATS].items():
    np.testing.assert_allclose(stats2[moe.STATS][k], v, rtol=1e-6, err_msg=k)


def test_gpt_oss_router_and_clamped_gate_equal_transformers():
  """moe_router=gpt_oss (top-k logits, softmax over k) and the clamped SwiGLU against transformers' gpt-oss
  modules, on logits and gates wide enough that the clamps act."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss
  config = transformers.GptOssConfig(hidden_size=D, num_local_experts=X, num_experts_per_tok=K, intermediate_size=F)
  router = hf_oss.GptOssTopKRouter(config)
  x = np.random.default_rng(0).normal(size=(13, D)).astype(np.float32)
  with torch.no_grad():
    router.weight.normal_()
    router.bias.normal_()
    _, want_w, want_e = router(torch.from_numpy(x))
  logits = x @ router.weight.detach().numpy().T + router.bias.detach().numpy()
  w, e, _ = moe.route(jnp.asarray(logits), 'gpt_oss', K, False, 1.0)
  np.testing.assert_array_equal(e, want_e.numpy())
  np.testing.assert_allclose(w, want_w.numpy(), rtol=1e-5, atol=1e-7)  # logits: numpy vs torch rounding
  gate_up = np.random.default_rng(1).normal(size=(13, 2 * F)).astype(np.float32) * 10  # beyond the limit of 7
  want = hf_oss.GptOssExperts(config)._apply_gate(torch.from_numpy(gate_up)).numpy()  # pylint: disable=protected-access
  got = blocks.clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2], config.swiglu_limit, config.swiglu_alpha)
  np.testing.assert_allclose(got, want, rtol=1e-6)


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


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_deepseek_v2_routing_equals_transformers():
  """moe_router=deepseek_v2: softmax scores, top-k greedy or in the groups with the best single score
  (group_limited_greedy), no renormalisation, times routed_scale: transformers' DeepseekV2TopkRouter's experts and
  weights; group-limited routing changes the choice of some tokens."""
  import torch
  import transformers
  from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds
  n, hidden, experts, k = 64, 16, 8, 3
  rng = np.random.default_rng(5)
  x = rng.normal(size=(n, hidden)).astype(np.float32)
  weight = rng.normal(size=(experts, hidden)).astype(np.float32) * 0.5
  chosen = {}
  for method, groups, top_groups in (('greedy', 1, 1), ('group_limited_greedy', 4, 2)):
    config = transformers.DeepseekV2Config(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=k,
                                           n_group=groups, topk_group=top_groups, topk_method=method,
                                           routed_scaling_factor=2.5, num_attention_heads=4)
    router = ds.DeepseekV2TopkRouter(config)
    with torch.no_grad():
      router.weight.copy_(torch.tensor(weight))
      logits, want_w, want_e = (t.numpy() for t in router(torch.tensor(x)))
    w, e, _ = moe.route(jnp.asarray(logits), 'deepseek_v2', k, False, 2.5, groups=groups, top_groups=top_groups)
    got, want = np.argsort(np.asarray(e), -1), np.argsort(want_e, -1)  # HF's top-k is unsorted: compare sets
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(e), got, -1), np.take_along_axis(want_e, want, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), got, -1), np.take_along_axis(want_w, want, -1),
                               rtol=1e-6)
    chosen[method] = np.sort(np.asarray(e), -1)
  assert (chosen['greedy'] != chosen['group_limited_greedy']).any(axis=1).sum() >= 5


def test_deepseek_v3_group_limited_routing_equals_transformers():
  import torch
  import transformers
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
  n, hidden, experts, k = 64, 16, 8, 3
  rng = np.random.default_rng(4)
  x = rng.normal(size=(n, hidden)).astype(np.float32)
  weight = rng.normal(size=(experts, hidden)).astype(np.float32) * 0.5
  bias = rng.normal(size=(experts,)).astype(np.float32) * 0.3  # e_score_correction_bias

  def hf_route(groups, top_groups):
    config = transformers.DeepseekV3Config(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=k,
                                           n_group=groups, topk_group=top_groups, routed_scaling_factor=2.5,
                                           norm_topk_prob=True)
    router = ds.DeepseekV3TopkRouter(config)
    with torch.no_grad():
      router.weight.copy_(torch.tensor(weight))
      router.e_score_correction_bias.copy_(torch.tensor(bias))
      logits, w, e = router(torch.tensor(x))
    order = np.argsort(e.numpy(), -1)  # HF's top-k is unsorted: compare (expert, weight) sets
    return logits.numpy(), np.take_along_axis(e.numpy(), order, -1), np.take_along_axis(w.numpy(), order, -1)

  chosen = {}
  for groups, top_groups in ((1, 1), (4, 2), (4, 4), (2, 1)):
    logits, want_e, want_w = hf_route(groups, top_groups)
    np.testing.assert_allclose(x @ weight.T, logits, atol=1e-5)
    w, e, _ = moe.route(jnp.asarray(logits), 'deepseek_v3', k, True, 2.5, bias=jnp.asarray(bias), groups=groups,
                        top_groups=top_groups)
    order = np.argsort(np.asarray(e), -1)
    got_e, got_w = np.take_along_axis(np.asarray(e), order, -1), np.take_along_axis(np.asarray(w), order, -1)
    np.testing.assert_array_equal(got_e, want_e)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-6)
    chosen[groups, top_groups] = got_e
  np.testing.assert_array_equal(chosen[4, 4], chosen[1, 1])  # every group allowed: no limit
  for limited in ((4, 2), (2, 1)):  # the limit changes the choice of some tokens
    assert (chosen[limited] != chosen[1, 1]).any(axis=1).sum() >= 5, limited
  assert (chosen[2, 1] // 4 == chosen[2, 1][:, :1] // 4).all()  # one group of 4 experts per token
  # The MoE layer routes with the config's groups: its output is the dense reference under route(groups=...).
  m = _cfg(moe_experts=8, moe_top_k=2, moe_router='deepseek_v3', moe_groups=4, moe_top_groups=1, moe_impl='dense')
  xs, seg = _inputs(pad=0)
  params = jax.jit(model_lib.moe_mlp(m).init)(jax.random.PRNGKey(1), xs, seg)['params']
  params = jax.tree.map(lambda p: getattr(p, 'value', p), params, is_leaf=lambda p: hasattr(p, 'names'))
  y = jax.jit(model_lib.moe_mlp(m).apply)({'params': params}, xs, seg).reshape(-1, D)
  xt = xs.reshape(-1, D)
  w, e, _ = moe.route(xt @ params['router'], 'deepseek_v3', 2, True, 1.0, groups=4, top_groups=1)
  assert (e // 2 == e[:, :1] // 2).all()
  keep = jnp.ones(e.shape, bool)
  want = moe.dense_experts(xt, w, e, keep, params['gate'], params['up'], params['down'], model_lib.swiglu)
  np.testing.assert_allclose(y, want, atol=1e-5)


def _model(**overrides):
  cfg = odd_config(parallel_block=False)
  cfg.model.update(moe_experts=5, moe_top_k=2, moe_mlp_dim=18, **overrides)
  return model_lib.ModelConfig.from_config(cfg.model)


@pytest.mark.parametrize('overrides', [{}, {'moe_every': 2, 'num_layers': 4, 'moe_shared_experts': 2},
                                       {'scan_layers': False, 'moe_every': 2, 'qk_norm': 'full'},
                                       {'parallel_block': True, 'qk_norm': 'head'},
                                       {'moe_first_dense': 1, 'moe_every': 2, 'num_layers': 5},
                                       {'scan_layers': False, 'moe_first_dense': 2, 'num_layers': 3}])
def test_param_counts_match_pytree(overrides):
  m = _model(**overrides)
  b = random_batch(1, 8, m.vocab_size)
  variables = jax.eval_shape(model_lib.Decoder(m).init, jax.random.PRNGKey(0), b['inputs'], b['segment_ids'],
                             b['positions'])
  params = variables['params']
  assert model_lib.param_count(m) == sum(x.size for x in jax.tree.leaves(params))
  routed = 3 * m.d_model * m.moe.mlp_dim * (m.moe.experts - m.moe.top_k)
  moe_layers = (m.num_layers - m.moe.first_dense) // m.moe.every
  routers = [x.shape for path, x in jax.tree_util.tree_flatten_with_path(params)[0] if 'router' in str(path)]
  assert moe_layers == sum(r[0] if len(r) == 3 else 1 for r in routers)  # the first k layers are dense
  assert model_lib.param_count(m) - model_lib.param_count(m, active=True) == moe_layers * routed
  flops = model_lib.flops_per_token(m, 16)
  assert flops == 6 * model_lib.param_count(m, active=True) + 12 * m.num_layers * m.num_heads * m.head_dim * 16


# variant -> (moe_every, num_layers, which layers are MoE) with moe_first_dense=1.
_FIRST_DENSE = {'unrolled': (1, 3, [False, True, True]), 'remat': (2, 5, [False, False, True, False, True])}


@pytest.mark.parametrize('variant', grid(list(_FIRST_DENSE), fast=['unrolled']))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_first_dense_layers_scanned_unrolled_and_remat_agree(variant):
  import dataclasses
  every, num_layers, pattern = _FIRST_DENSE[variant]
  m = _model(moe_first_dense=1, moe_every=every, num_layers=num_layers, remat='none')
  b = random_batch(2, 12, m.vocab_size, docs=2)
  b['segment_ids'][:, -3:] = 0
  args = (b['inputs'], b['segment_ids'], b['positions'])
  params = jax.jit(model_lib.Decoder(m).init)(jax.random.PRNGKey(1), *args)['params']
  params = jax.tree.map(lambda p: getattr(p, 'value', p), params, is_leaf=lambda p: hasattr(p, 'names'))
  layers = convert.layer_params(params, m)
  assert ['moe' in p for p in layers] == pattern  # k = 1 dense, then moe_every's pattern
  moe_stack = params['layers']['block_1']['moe'] if every > 1 else params['layers']['moe']
  assert params['dense_layers']['mlp']['gate'].shape[0] == 1 and moe_stack['router'].shape[0] == 2  # two units
  unrolled = {**{k: v for k, v in params.items() if 'layers' not in k}, **{f'layers_{i}': p for i, p in enumerate(layers)}}

  def run(m, p):  # the loss, per-layer gradients (the remat case) and the routing metrics
    def loss(p):
      logits, stats = model_lib.Decoder(m).apply({'params': p}, *args, mutable=[moe.STATS])
      return model_lib.loss_fn(logits, b['targets'], b['weights'], m.z_loss)[0], stats[moe.STATS]
    if variant == 'unrolled':  # forward only: the fast loop's share
      value, stats = jax.jit(loss)(p)
      return float(value), None, moe.metrics(stats, m.moe, p)
    (value, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(p)
    return float(value), convert.layer_params(jax.device_get(grads), m), moe.metrics(stats, m.moe, p)

  ref_loss, ref_grads, ref_metrics = run(m, params)
  numbers = [i for i, is_moe in enumerate(pattern) if is_moe]  # metrics named by the layer's own number
  assert sorted(k for k in ref_metrics if k.endswith('max_load')) == [f'moe/{i}/max_load' for i in numbers] + [
      'moe/max_load']
  assert f'moe/{numbers[-1]}/bias_norm' in ref_metrics
  other, p = (dataclasses.replace(m, scan_layers=False), unrolled) if variant == 'unrolled' else (
      dataclasses.replace(m, remat='full'), params)
  loss, grads, metrics = run(other, p)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert metrics.keys() == ref_metrics.keys()
  for key in metrics:
    np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, err_msg=key)
  if grads is not None:
    assert _max_diff(grads, ref_grads) <= 1e-5


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


@pytest.mark.parametrize('remat', grid(['full', 'dots'], fast=[]))  # compiles a 2-layer model twice
def test_remat_changes_nothing_in_a_moe_model(remat):
  reference = _loss_and_grad_norm(remat='none', moe_every=2)  # one scanned group: a dense layer, then MoE
  np.testing.assert_allclose(_loss_and_grad_norm(remat=remat, moe_every=2), reference, rtol=1e-5)


@pytest.mark.e2e  # the full suite only: the layer-level comparison above is the fast one
def test_moe_model_ragged_equals_dense_reference():
  np.testing.assert_allclose(_loss_and_grad_norm(moe_impl='ragged'), _loss_and_grad_norm(moe_impl='dense'),
                             rtol=1e-5)


def _with_bias(params, bias):
  return {**params, 'bias': jnp.asarray(bias, jnp.float32)}


def _apply_stats(m, params, x, seg):
  return jax.jit(lambda p, x: model_lib.moe_mlp(m).apply({'params': p}, x, seg, mutable=[moe.STATS]))(params, x)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_infinite_capacity_is_dropless_bit_for_bit():
  x, seg = _inputs()
  params = _params()
  y0, s0 = _apply_stats(_cfg(), params, x, seg)
  # A capacity every expert stays under, yet below the token count: the capacity path runs and drops nothing.
  most = int(s0[moe.STATS]['load'].max())
  n = x.shape[0] * x.shape[1]
  factor = most * X / (n * K)
  assert moe.capacity(n, K, X, factor) < n
  for f in (factor, 1e6):
    y, s = _apply_stats(_cfg(moe_capacity_factor=f), params, x, seg)
    np.testing.assert_array_equal(y, y0)
    assert float(s[moe.STATS]['kept']) == float(s0[moe.STATS]['kept'])


@pytest.mark.parametrize('top_k', [1, 2])
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_capacity_drops_the_analytic_count_under_forced_skew(top_k):
  x, _ = _inputs(pad=0)
  seg = jnp.ones(x.shape[:2], jnp.int32)
  m = _cfg(moe_top_k=top_k, moe_capacity_factor=1.0)
  params = _with_bias(_params(moe_top_k=top_k), np.array([10.0, 5.0] + [0.0] * (X - 2)))  # every token → 0 (, 1)
  y, s = _apply_stats(m, params, x, seg)
  s = s[moe.STATS]
  n = x.shape[0] * x.shape[1]
  cap = int(np.ceil(1.0 * n * top_k / X))
  np.testing.assert_array_equal(s['load'], [n] * top_k + [0] * (X - top_k))
  assert float(s['kept']) == top_k * cap  # each chosen expert takes `cap`, drops n - cap
  dropped = 1.0 - float(moe.metrics({'layers_0': {'moe': s}}, m.moe)['moe/0/dropped'])
  np.testing.assert_allclose(dropped, top_k * cap / (n * top_k), rtol=1e-6)
  # Earlier tokens win: the first `cap` tokens got their expert(s), the rest an all-zero output.
  out = np.asarray(y).reshape(n, D)
  assert np.abs(out[:cap]).min(axis=1).min() > 0 and np.all(out[cap:] == 0)


def test_aux_loss_is_one_at_uniform_routing():
  x, seg = _inputs()
  params = _params()
  params = {**params, 'router': jnp.zeros_like(params['router'])}  # every router probability 1/X
  _, s = _apply_stats(_cfg(), params, x, seg)
  s = s[moe.STATS]
  np.testing.assert_allclose(moe.aux_loss(s, s['tokens'], K), 1.0, rtol=1e-6)
  # And X·Σ f·P with f and P both uniform, from the definition: 1.0; all tokens on one expert with P one-hot: X.
  n = 12.0
  uniform = {'load': jnp.full(X, n * K / X), 'prob': jnp.full(X, n / X)}
  np.testing.assert_allclose(moe.aux_loss(uniform, n, K), 1.0, rtol=1e-6)
  skewed = {'load': jnp.zeros(X).at[0].set(n), 'prob': jnp.zeros(X).at[0].set(n)}
  np.testing.assert_allclose(moe.aux_loss(skewed, n, 1), X, rtol=1e-6)


def test_pooled_aux_loss_is_k_at_uniform_routing_and_adds_up_over_microbatches():
  """model.moe_aux_loss_form=pooled (transformers' load_balancing_loss_func; its parity: tests/hf/test_gpt_oss.py):
  k at uniform routing; two layers' statistics pooled before the product, not a mean of their products; and, given
  the whole batch's loads, two halves' losses add up to the whole batch's (the microbatch split)."""
  n = 12.0
  pooled = moe.MoeConfig(experts=X, top_k=K, aux_loss=1.0, aux_loss_form='pooled')
  def layer(load, prob):
    return {'load': jnp.asarray(load, jnp.float32), 'prob': jnp.asarray(prob, jnp.float32), 'z': jnp.zeros(())}

  stats = lambda *layers: {f'layers_{i}': {'moe': l} for i, l in enumerate(layers)}  # noqa: E731
  uniform = layer(np.full(X, n * K / X), np.full(X, n / X))
  np.testing.assert_allclose(moe.loss(stats(uniform, uniform), pooled, n), K, rtol=1e-6)
  rng = np.random.default_rng(0)
  loads = [rng.multinomial(int(n * K), np.ones(X) / X).astype(np.float32) for _ in range(2)]
  probs = [rng.dirichlet(np.ones(X), int(n)).sum(0) for _ in range(2)]
  whole = float(moe.loss(stats(*map(layer, loads, probs)), pooled, n))
  f, p = sum(loads) / (2 * n), sum(probs) / (2 * n)
  np.testing.assert_allclose(whole, X * (f * p).sum(), rtol=1e-6)
  switch = float(moe.loss(stats(*map(layer, loads, probs)), dataclasses.replace(pooled, aux_loss_form='switch'), n))
  assert abs(switch * K - whole) > 1e-4  # not the Switch form rescaled: the layers are pooled first
  halves = [float(moe.loss(stats(*[layer(l, q * w) for l, q in zip(loads, probs)]), pooled, n,
                           [jnp.asarray(l) for l in loads])) for w in (0.25, 0.75)]
  np.testing.assert_allclose(sum(halves), whole, rtol=1e-6)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_bias_balancing_evens_out_a_synthetic_skew():
  logits = jax.random.normal(jax.random.PRNGKey(5), (512, X)) + jnp.linspace(2.0, 0.0, X)  # expert 0 favoured

  def stats(params):
    chosen = moe.route(logits, 'mixtral', K, True, 1.0, params['layers_0']['moe']['bias'])[1]
    return {'layers_0': {'moe': {'load': jnp.bincount(chosen.reshape(-1), length=X).astype(jnp.float32)}}}

  def ratio(params):
    load = stats(params)['layers_0']['moe']['load']
    return float(load.max() / load.mean())

  params = {'layers_0': {'moe': {'bias': jnp.zeros(X), 'router': jnp.zeros((D, X))}}}
  assert ratio(params) > 1.5  # the skew is real
  step = jax.jit(lambda p: moe.update_bias(p, stats(p), 1e-2))
  for _ in range(150):
    params = step(params)
  assert ratio(params) <= 1.2
  np.testing.assert_allclose(params['layers_0']['moe']['bias'].sum(), 0.0, atol=1e-5)  # centred
  np.testing.assert_array_equal(params['layers_0']['moe']['router'], 0.0)  # nothing else moved


def _moe_config(**overrides):
  """odd_config as a Llama-style MoE (5 experts, 2 per token), every routing loss and the bias balancing on."""
  cfg = odd_config(parallel_block=False)
  cfg.model.update(**{**dict(moe_experts=5, moe_top_k=2, moe_mlp_dim=18, moe_aux_loss=1e-2, moe_router_z_loss=1e-3,
                              moe_bias_rate=1e-2, qk_norm='head'), **overrides})
  return cfg


def _skew(state, program):
  """Every token's choice forced onto experts 0 and 1 (selection biases far above the router's scores)."""
  def f(path, x):
    if jax.tree_util.keystr(path).endswith("['bias']"):
      return jax.device_put(jnp.zeros_like(x).at[..., 0].set(10.0).at[..., 1].set(5.0), x.sharding)
    return x
  return state.replace(params=jax.tree_util.tree_map_with_path(f, state.params))


@functools.cache
def _moe_program(mesh_shape, microbatches: int, experts: int, remat: str):
  """_moe_config's plain program on `mesh_shape` (data, fsdp, tensor[, expert[, context]]), built (and so
  compiled) once per process for both routings, skewed or not: they differ in the state only."""
  from jaxlm import sharding
  from tests.helpers import plain_program
  cfg = _moe_config(moe_experts=experts, remat=remat)
  # A first Adam step is g / (|g| + eps): with eps = 1 it is ~linear in g, so parameters compare gradients.
  cfg.optim.eps = 1.0
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.expert, cfg.mesh.context = (*mesh_shape, 1, 1)[:5]
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(mesh_shape))])
  return cfg, plain_program(cfg, mesh, steps=10, microbatches=microbatches)


@functools.cache
def _moe_init(experts: int):
  """The one-device program's initial state, on the host: every mesh, routing, remat and microbatch count starts
  from it (one init compile per expert count, not one per program). That a mesh's own init gives these very
  values is checked once, in test_expert_weights_and_batch_are_split_over_the_expert_axis."""
  return jax.tree.map(lambda x: np.array(x, copy=True), _moe_program((1, 1, 1), 1, experts, 'none')[1].init())


@functools.cache
def _moe_steps(mesh_shape, skewed: bool = False, microbatches: int = 1, steps: int = 3, experts: int = 5,
               remat: str = 'none'):
  """`steps` training steps of _moe_config on `mesh_shape` (data, fsdp, tensor[, expert[, context]]): losses,
  metrics, final params."""
  cfg, program = _moe_program(mesh_shape, microbatches, experts, remat)
  batch = random_batch(8, 16, cfg.model.vocab_size, docs=2)
  batch['segment_ids'][:, -3:] = 0  # padded tails: routed nowhere, counted nowhere
  batch['weights'][:, -3:] = 0
  state = jax.device_put(_moe_init(experts), program.state_shardings)
  if skewed:
    state = _skew(state, program)
  from jaxlm import train
  b = train.global_batch(batch, program.batch_sharding)
  losses, metrics = [], []
  for _ in range(steps):
    state, m = program.train_step(state, b)
    losses.append(float(m['loss']))
    metrics.append({k: np.asarray(v) for k, v in m.items()})
  return losses, metrics, jax.tree.map(np.asarray, state.params)


def _max_diff(a, b) -> float:
  return max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.e2e  # two compiled programs (the split one with its routing pass)
def test_microbatches_give_the_same_update_bias_included():
  one, m1, p1 = _moe_steps((1, 2, 1), steps=1)
  four, m4, p4 = _moe_steps((1, 2, 1), microbatches=4, steps=1)
  assert _max_diff(p1, p4) <= 1e-6
  biases = lambda p: [x for path, x in jax.tree_util.tree_flatten_with_path(p)[0] if 'bias' in str(path)]
  assert np.abs(biases(p1)[0]).max() > 0  # the bias did move
  for a, b in zip(biases(p1), biases(p4)):
    np.testing.assert_array_equal(a, b)  # the same loads, so the same sign step
  for key in ('loss', 'moe/1/aux_loss', 'moe/1/z_loss', 'moe/1/max_load', 'moe/0/entropy'):
    np.testing.assert_allclose(m4[0][key], m1[0][key], rtol=1e-6, err_msg=key)


@pytest.mark.e2e  # two compiled training programs
def test_first_dense_model_trains_on_a_mesh_microbatches_giving_the_same_update():
  from jaxlm import sharding, train
  from tests.helpers import plain_program

  init = []  # the first program's initial state on the host: train.microbatches changes the step, not the init

  def step(microbatches):
    cfg = _moe_config(moe_first_dense=1, moe_every=2, num_layers=3)
    cfg.optim.eps = 1.0
    cfg.mesh.update(data=1, fsdp=2, tensor=1)
    program = plain_program(cfg, sharding.make_mesh(cfg.mesh, jax.devices()[:2]), microbatches=microbatches)
    if not init:
      init.append(jax.tree.map(lambda x: np.array(x, copy=True), program.init()))
    state, metrics = program.train_step(jax.device_put(init[0], program.state_shardings), train.global_batch(
        random_batch(8, 16, cfg.model.vocab_size, docs=2), program.batch_sharding))
    return {k: float(v) for k, v in metrics.items()}, jax.tree.map(np.asarray, state.params)

  (m1, p1), (m2, p2) = step(1), step(2)
  assert {k for k in m1 if k.endswith('/max_load')} == {'moe/2/max_load', 'moe/max_load'}  # layer 2: the one MoE
  for key in ('loss', 'moe/2/aux_loss', 'moe/2/max_load', 'moe/2/bias_norm'):
    np.testing.assert_allclose(m2[key], m1[key], rtol=1e-6, err_msg=key)
  assert m1['moe/2/bias_norm'] > 0 and _max_diff(p1, p2) <= 1e-6
  np.testing.assert_array_equal(p1['layers']['block_1']['moe']['bias'], p2['layers']['block_1']['moe']['bias'])


# (data, fsdp, tensor[, expert[, context]]); with an expert axis the model has 8 experts (divisible by it).
_EP_SHAPES = [(1, 1, 1, 8), (1, 2, 1, 4), (1, 1, 2, 4), (1, 1, 1, 4, 2)]


# Both routings of a shape in one test: they share the shape's compiled program (_moe_program), half the compiles.
@pytest.mark.parametrize('shape', grid([(1, 8, 1), (2, 2, 2), (1, 4, 2), *_EP_SHAPES], fast=[],
                                       ids=lambda s: 'x'.join(map(str, s))))
def test_sharded_moe_steps_match_single_device(shape):
  experts = 8 if len(shape) > 3 else 5  # expert-sharded shapes: x1x1... (data, fsdp, tensor, expert, context)
  for skewed in (False, True):
    ref_losses, ref_metrics, ref_params = _moe_steps((1, 1, 1), skewed, experts=experts)
    assert ref_losses[-1] < ref_losses[0], skewed
    losses, metrics, params = _moe_steps(shape, skewed, experts=experts)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f'skewed={skewed}')
    if skewed:  # every real token on experts 0 and 1: max/mean load = X/k
      np.testing.assert_allclose(ref_metrics[0]['moe/max_load'], experts / 2, rtol=1e-6)
    for key in ('moe/0/max_load', 'moe/1/dropped', 'moe/1/bias_norm'):
      np.testing.assert_allclose(metrics[-1][key], ref_metrics[-1][key], rtol=1e-5, err_msg=f'{key} skewed={skewed}')
    assert _max_diff(params, ref_params) <= 1e-4, skewed


@pytest.mark.e2e  # one more whole-step compile
def test_expert_parallel_steps_under_full_remat():
  """The exchange recomputed in the backward (moe_1b's remat='full') gives the unsharded steps."""
  ref_losses, _, ref_params = _moe_steps((1, 1, 1), True, experts=8)
  losses, _, params = _moe_steps((1, 2, 1, 4), True, experts=8, remat='full')
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert _max_diff(params, ref_params) <= 1e-4


def _loss_and_grads(cfg, batch, mesh_shape):
  """(loss, gradients) of `batch` on a (data, fsdp, tensor, expert) mesh from random parameters drawn in numpy
  (every gpt-oss bias away from its zero init), and the parameters' shardings."""
  from jaxlm import sharding, train
  from tests.helpers import plain_program
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.expert = mesh_shape
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(mesh_shape))])
  with sharding.activate(mesh):
    program = plain_program(cfg, mesh)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(x.dtype), program.abstract_state.params)
    params = jax.device_put(params, program.state_shardings.params)
    b = train.global_batch(batch, program.batch_sharding)

    def loss(params, b):
      logits = program.model.apply({'params': params}, b['inputs'], b['segment_ids'], b['positions'])
      return model_lib.loss_fn(logits, b['targets'], b['weights'], 0.0)[0]

    total, grads = jax.jit(jax.value_and_grad(loss))(params, b)
    return float(total), jax.device_get(grads), jax.tree.map(lambda x: x.sharding, params)


@pytest.mark.e2e  # two compiles of a whole model's forward and backward
def test_gpt_oss_expert_biases_on_an_expert_mesh_match_single_device():
  """gpt-oss's expert biases split over the expert axis with their experts (tensor × expert = 2 × 4: the down
  projection's bias must be added once, not once per tensor shard): loss and gradients equal one device's."""
  cfg = _moe_config(moe_experts=8, moe_aux_loss=0.0, moe_router_z_loss=0.0, moe_bias_rate=0.0, qk_norm='none',
                    **_LAYER_CASES['gpt-oss'])
  batch = random_batch(8, 16, cfg.model.vocab_size, docs=2)
  want, want_grads, _ = _loss_and_grads(cfg, batch, (1, 1, 1, 1))
  got, grads, shardings = _loss_and_grads(cfg, batch, (1, 1, 2, 4))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max(), err_msg=jax.tree_util.keystr(path))
  moe_sh = shardings['layers']['moe']
  # The scanned layer axis, then each bias's experts over `expert` (and the hidden width over tensor).
  assert moe_sh['gate_bias'].spec == moe_sh['up_bias'].spec == P(None, 'expert', 'tensor'), moe_sh['gate_bias']
  assert moe_sh['down_bias'].spec[:2] == (None, 'expert'), moe_sh['down_bias']
  assert np.abs(grads['layers']['moe']['down_bias']).max() > 0


# Tiny random Hugging Face MoE models, made here (nothing downloaded): family -> (config class, model class, kwargs).
_HF_FAMILIES = {
    'mixtral': ('MixtralConfig', 'MixtralForCausalLM', dict(num_local_experts=5, num_experts_per_tok=2,
                                                            intermediate_size=20, head_dim=8)),
    'qwen3_moe': ('Qwen3MoeConfig', 'Qwen3MoeForCausalLM', dict(num_experts=5, num_experts_per_tok=2,
                                                                moe_intermediate_size=12, intermediate_size=28,
                                                                decoder_sparse_step=2, norm_topk_prob=True,
                                                                head_dim=8)),
    'olmoe': ('OlmoeConfig', 'OlmoeForCausalLM', dict(num_experts=5, num_experts_per_tok=2, intermediate_size=20,
                                                      norm_topk_prob=False)),
}


@functools.cache
def _hf_model(family: str, layers: int = 2, **more):
  """(config.json dict, fused in-memory state dict, per-expert saved state dict, inputs, transformers' logits).

  more: config values over the family's (tuples for lists, so the call stays cacheable)."""
  import tempfile
  import safetensors.numpy
  import torch
  import transformers
  config_cls, model_cls, extra = _HF_FAMILIES[family]
  torch.manual_seed(0)
  config = getattr(transformers, config_cls)(
      vocab_size=97, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
      rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
      pad_token_id=0, **{**extra, **{k: list(v) if isinstance(v, tuple) else v for k, v in more.items()}})
  config._attn_implementation = 'eager'
  model = getattr(transformers, model_cls)(config).eval()
  inputs = np.random.default_rng(0).integers(0, 97, (2, 13))
  with torch.no_grad():
    logits = model(torch.tensor(inputs)).logits.numpy()
  fused = {k: v.numpy() for k, v in model.state_dict().items()}
  with tempfile.TemporaryDirectory() as d:
    model.save_pretrained(d)
    saved = safetensors.numpy.load_file(f'{d}/model.safetensors')
  return config.to_dict(), fused, saved, inputs, logits


def _jaxlm_logits(hf_config: dict, tensors: dict, inputs, scan_layers: bool = True, **flip):
  from jaxlm import cli
  from jaxlm.hf import convert
  from tests.conftest import ROOT
  cfg = cli.load_file(ROOT / 'configs' / 'base.py')
  cfg.model.update(convert.model_overrides(hf_config), dtype='float32', remat='none', scan_layers=scan_layers,
                   **flip)
  m = model_lib.ModelConfig.from_config(cfg.model)
  params = convert.from_hf(tensors, m, scan_layers=scan_layers)
  seg = np.ones_like(inputs)
  pos = np.tile(np.arange(inputs.shape[1]), (inputs.shape[0], 1))
  return np.asarray(jax.jit(model_lib.Decoder(m).apply)({'params': params}, inputs, seg, pos))


@pytest.mark.parametrize('family', grid(list(_HF_FAMILIES), fast=['qwen3_moe']))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_hf_moe_import_matches_transformers(family):
  hf_config, fused, saved, inputs, want = _hf_model(family)
  assert not set(fused) & {k for k in saved if 'experts.' in k}  # the two layouts really differ
  for tensors in (fused, saved):
    got = _jaxlm_logits(hf_config, tensors, inputs)
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
  if family != 'mixtral':  # Mixtral always renormalises: the flag is the other families'
    flipped = _jaxlm_logits(hf_config, saved, inputs, moe_norm_topk_prob=not hf_config['norm_topk_prob'])
    assert np.abs(flipped - want).max() > 1e-3


@pytest.mark.parametrize('family', grid(list(_HF_FAMILIES), fast=['qwen3_moe']))
def test_hf_moe_export_loads_in_transformers_with_the_same_logits(family, tmp_path):
  import json
  import safetensors.numpy
  import torch
  import transformers
  from jaxlm import cli
  from jaxlm.hf import convert
  from tests.conftest import ROOT
  hf_config, _, saved, inputs, want = _hf_model(family)
  cfg = cli.load_file(ROOT / 'configs' / 'base.py')
  cfg.model.update(convert.model_overrides(hf_config), dtype='float32')
  m = model_lib.ModelConfig.from_config(cfg.model)
  params = convert.from_hf(saved, m, scan_layers=True)
  safetensors.numpy.save_file(convert.to_hf(params, m), str(tmp_path / 'model.safetensors'))
  config = convert.hf_config(m, max_positions=64, dtype='float32', bos_id=1, eos_id=2)
  assert config['model_type'] == family
  (tmp_path / 'config.json').write_text(json.dumps(config))
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation='eager').eval()
  with torch.no_grad():
    got = model(torch.tensor(inputs)).logits.numpy()
  assert np.abs(got - want).max() <= 1e-4
  # What no Hugging Face class computes is refused, with one line naming it.
  import dataclasses
  with pytest.raises(convert.ExportError, match='parallel-block'):
    convert.architecture(dataclasses.replace(m, parallel_block=True))
  biased = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.5 if jax.tree_util.keystr(path).endswith("['bias']") else x, params)
  with pytest.raises(convert.ExportError, match='moe_bias_rate=0'):
    convert.to_hf(biased, m)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_hf_qwen3_moe_mlp_only_layers_import_and_export_as_first_dense(tmp_path):
  import dataclasses
  import json
  import safetensors.numpy
  import torch
  import transformers
  from jaxlm import cli
  from tests.conftest import ROOT
  # Layers 0, 1 dense by mlp_only_layers, 2 dense by decoder_sparse_step=2, 3 MoE: moe_first_dense=2, moe_every=2.
  hf_config, _, saved, inputs, want = _hf_model('qwen3_moe', layers=4, mlp_only_layers=(0, 1))
  overrides = convert.model_overrides(hf_config)
  assert (overrides['moe_first_dense'], overrides['moe_every']) == (2, 2)
  for scan_layers in (True, False):
    got = _jaxlm_logits(hf_config, saved, inputs, scan_layers=scan_layers)
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
  cfg = cli.load_file(ROOT / 'configs' / 'base.py')
  cfg.model.update(overrides, dtype='float32')
  m = model_lib.ModelConfig.from_config(cfg.model)
  params = convert.from_hf(saved, m, scan_layers=True)
  assert set(params) >= {'dense_layers', 'layers'}
  safetensors.numpy.save_file(convert.to_hf(params, m), str(tmp_path / 'model.safetensors'))
  config = convert.hf_config(m, max_positions=64, dtype='float32', bos_id=1, eos_id=2)
  assert (config['mlp_only_layers'], config['decoder_sparse_step']) == ([0, 1], 2)
  (tmp_path / 'config.json').write_text(json.dumps(config))
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation='eager').eval()
  with torch.no_grad():
    assert np.abs(model(torch.tensor(inputs)).logits.numpy() - want).max() <= 1e-4
  # What first-k-dense cannot say is refused with one line, both ways.
  for dense, step in (([1], 1), ([0], 2), ([0, 2], 1)):
    with pytest.raises(convert.HFImportError, match='mlp_only_layers'):
      convert.model_overrides({**hf_config, 'mlp_only_layers': dense, 'decoder_sparse_step': step})
  for changed in (dict(moe=dataclasses.replace(m.moe, first_dense=1), num_layers=3),
                  dict(moe=dataclasses.replace(m.moe, router='mixtral'),
                       attention=dataclasses.replace(m.attention, qk_norm='none'))):
    with pytest.raises(convert.ExportError, match='moe_first_dense'):
      convert.architecture(dataclasses.replace(m, **changed))


@pytest.mark.e2e  # whole training runs in process, with a checkpoint written and read back
def test_checkpoint_and_resume_is_bit_for_bit_balancing_biases_included(tmp_path):
  import os
  from jaxlm import checkpoint as checkpoint_lib
  from jaxlm import sharding, step as step_lib
  from tests.helpers import load_config, plain_program
  cfg = load_config('moe_tiny')
  cfg.model.update(moe_bias_rate=1e-2, moe_aux_loss=1e-2)
  cfg.mesh.update(data=1, fsdp=4, tensor=2)
  cfg.checkpoint.async_save = False

  def train(program, state, first, last):
    losses = []
    for i in range(first, last):
      b = random_batch(8, 64, 512, seed=i, docs=2)
      state, metrics = program.train_step(state, step_lib.global_batch(b, program.batch_sharding))
      losses.append(float(metrics['loss']))
    return state, losses

  program = plain_program(cfg, sharding.make_mesh(cfg.mesh), steps=6)
  straight, straight_losses = train(program, program.init(), 0, 6)
  state, first = train(program, program.init(), 0, 3)
  events = []
  ckpt = checkpoint_lib.Checkpointer(os.path.join(tmp_path, 'checkpoints'), cfg.checkpoint,
                                     lambda *a, **k: events.append(a))
  ckpt.save(3, state, None, {'config': cfg.to_dict()})
  ckpt.wait()
  fresh = plain_program(cfg, sharding.make_mesh(cfg.mesh), steps=6)
  restored, _ = ckpt.restore(fresh.abstract_state, fresh.state_shardings, None)
  ckpt.close()
  assert not events, events
  bias = lambda s: np.asarray(s.params['layers']['moe']['bias'])
  np.testing.assert_array_equal(bias(restored), bias(state))
  assert np.abs(bias(state)).max() > 0  # three steps of balancing moved it
  resumed, second = train(fresh, restored, 3, 6)
  np.testing.assert_array_equal(first + second, straight_losses)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), jax.device_get(straight.params))


def test_progress_line_shows_the_max_load():
  from jaxlm import metrics
  line = metrics.progress_line(5, 20, {'loss': 2.5, 'tokens_per_s': 100.0, 'moe/max_load': 1.3906}, None)
  assert '| max load 1.39 |' in line
  assert 'max load' not in metrics.progress_line(5, 20, {'loss': 2.5, 'tokens_per_s': 100.0}, None)


# Expert parallelism at the layer: the MoE layer on a mesh with an `expert` axis (8 experts, k=2) against the same
# layer on one device. Whole training steps on these meshes are in test_sharded_moe_steps_match_single_device.
_EP = dict(moe_experts=8, moe_top_k=2)


def _ep_mesh(shape):
  """A (data, fsdp, tensor, expert, context) mesh, as make_mesh builds it from a config."""
  import ml_collections
  from jaxlm import sharding
  sizes = dict(zip(('data', 'fsdp', 'tensor', 'expert', 'context'), (*shape, 1, 1)[:5]))
  return sharding.make_mesh(ml_collections.ConfigDict(sizes), jax.devices()[:int(np.prod(shape))])


def _ep_inputs():
  """8 rows of 4 tokens (the batch splits 8 ways), the last token of each row padding."""
  return _inputs(n_rows=8, seq=4, pad=1)


def _ep_out_grads_stats(mesh_shape, skewed: bool, impl: str = 'ragged', **overrides):
  """(y, gradients of y·cot, routing statistics) of the 8-expert layer, on `mesh_shape` (None: no mesh)."""
  from jaxlm import sharding
  x, seg = _ep_inputs()
  m = _cfg(moe_impl=impl, **_EP, **overrides)
  params = _params(**_EP, **overrides)
  if skewed:  # every token to experts 0 and 1, both on the first device of the expert axis
    params = _with_bias(params, np.array([10.0, 5.0] + [0.0] * 6))
  cot = jax.random.normal(jax.random.PRNGKey(7), x.shape)

  def f(p, x):
    apply = lambda p, x: model_lib.moe_mlp(m).apply({'params': p}, x, seg, mutable=[moe.STATS])  # noqa: E731
    (y, stats), vjp = jax.vjp(apply, p, x)
    return y, vjp((cot, jax.tree.map(jnp.zeros_like, stats)))[0], stats[moe.STATS]
  if mesh_shape is None:
    return jax.jit(f)(params, x)
  with sharding.activate(mesh := _ep_mesh(mesh_shape)):
    out = jax.jit(f)(params, x)
    hlo = jax.jit(f).lower(params, x).compile().as_text()
  return (*out, mesh, hlo)


@functools.cache
def _ep_gather(mesh_shape, skewed: bool):
  """_ep_out_grads_stats with the gather transport (what 'auto' picks on CPU), once per session."""
  return _ep_out_grads_stats(mesh_shape, skewed)


@functools.cache
def _ep_reference(skewed: bool):
  return _ep_out_grads_stats(None, skewed)


def _assert_same_layer(got, want):
  y, g, s = got[:3]
  y_ref, g_ref, s_ref = want
  assert float(jnp.abs(y_ref).max()) > 0.1
  np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=0)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=jax.tree_util.keystr(path))
  for key in s_ref:  # routing statistics stay whole-batch sums
    np.testing.assert_allclose(s[key], s_ref[key], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize('shape, skewed', grid([((1, 2, 1, 4), False), ((1, 2, 1, 4), True), ((1, 1, 1, 8), True),
                                                ((1, 1, 2, 4), True), ((1, 1, 1, 4, 2), True)],
                                               fast=[((1, 2, 1, 4), True)], unpack=True,
                                               ids=lambda c: 'x'.join(map(str, c[0])) + ('-skewed' if c[1] else '')))
def test_expert_parallel_layer_equals_unsharded(shape, skewed):
  got = _ep_gather(shape, skewed)
  _assert_same_layer(got, _ep_reference(skewed))
  if skewed:
    np.testing.assert_array_equal(got[2]['load'][2:], 0)  # the skew is real: experts 2..7 got nothing


@pytest.mark.e2e  # the dense reference path through the same exchange
def test_expert_parallel_dense_impl_equals_unsharded():
  _assert_same_layer(_ep_out_grads_stats((1, 2, 1, 4), True, impl='dense'), _ep_reference(True))


def test_gather_transport_moves_tokens_not_expert_weights():
  """The gather transport's compiled step all-gathers token rows and reduce-scatters the outputs over the expert
  axis; no expert weight (X, D, F) is ever gathered whole over it."""
  import re
  *_, mesh, hlo = _ep_gather((1, 2, 1, 4), True)  # the layer test's fast mesh: fsdp=2 × expert=4
  gathers = re.findall(r'= (\S+) all-gather\(', hlo)
  scatters = re.findall(r'= (\S+) reduce-scatter\(', hlo)
  # Tokens x (N=32, D) on 8 devices: 4 rows each, gathered over the 4 of the expert axis to 16 rows; the outputs
  # (and the backward's token gradients) reduce-scattered back to 4.
  assert any(re.match(rf'f32\[16,{D}\]', s) for s in gathers), gathers
  assert any(re.match(rf'f32\[4,{D}\]', s) for s in scatters), scatters
  # An expert weight whole over the experts: a leading X=8 with D and F behind it; each device holds 2 experts.
  whole = [s for s in gathers if re.match(rf'f32\[8,({D},{F}|{F},{D})\]', s)]
  assert not whole, whole


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_expert_weights_and_batch_are_split_over_the_expert_axis():
  from jaxlm import sharding, train
  cfg = _moe_config(moe_experts=8)
  cfg.mesh.update(data=1, fsdp=2, tensor=1, expert=4)
  mesh = sharding.make_mesh(cfg.mesh, jax.devices())
  assert mesh.axis_names == ('data', 'fsdp', 'expert', 'tensor', 'context')
  from tests.helpers import plain_program
  program = plain_program(cfg, mesh)
  state = program.init()
  p = jax.tree.map(lambda x: x.sharding, state.params)  # the arrays as they lie
  # The scanned layer axis first, then (experts, embed, mlp): experts over `expert`, embed over fsdp.
  assert p['layers']['moe']['gate'].spec == P(None, 'expert', 'fsdp', 'tensor')
  assert p['layers']['moe']['down'].spec == P(None, 'expert', 'tensor', 'fsdp')
  assert p['layers']['moe']['bias'].spec == P(None, 'expert')
  # Every other parameter's embed over fsdp × expert (fully sharded over the expert axis too).
  assert p['layers']['attention']['query'].spec[1] == ('fsdp', 'expert')
  batch = train.global_batch(random_batch(8, 16, cfg.model.vocab_size), program.batch_sharding)
  assert batch['inputs'].sharding.spec == P(('data', 'fsdp', 'expert'), 'context')
  gate = state.params['layers']['moe']['gate']
  assert {s.data.shape for s in gate.addressable_shards} == {(2, 2, 28, 18)}  # 8 experts over 4: 2 each
  # The expert-sharded init draws one device's values (what the step tests start every mesh from).
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), _moe_init(8).params)
  assert {s.data.shape for s in batch['inputs'].addressable_shards} == {(1, 16)}  # 8 rows over 2 × 4


def test_fit_buffer_counts_what_does_not_fit():
  # 2 devices of the expert axis, 4 experts (device 0 owns 0-1, device 1 owns 2-3); rows asked [sender, expert].
  counts = jnp.array([[3, 2, 1, 0],
                      [4, 1, 0, 2]])
  sent, overflow = moe.fit_buffer(counts, 100)  # room for everything: all sent, nothing lost
  np.testing.assert_array_equal(sent, counts)
  assert int(overflow) == 0
  # 6 rows per receiver: receiver 0 takes sender 0's 5 (3 + 2) and 1 of sender 1's 5 (its lowest expert's
  # first); receiver 1 takes sender 0's 1 and sender 1's 2.
  sent, overflow = moe.fit_buffer(counts, 6)
  np.testing.assert_array_equal(sent, [[3, 2, 1, 0], [1, 0, 0, 2]])
  assert int(overflow) == 4
  assert moe.buffer_rows(tokens=5, top_k=2, local_experts=2, ways=2, factor=0) == 2 * 5 * 2  # the worst case
  assert moe.buffer_rows(tokens=5, top_k=2, local_experts=1, ways=2, factor=0) == 2 * 5  # k=2 but 1 local
  assert moe.buffer_rows(tokens=5, top_k=2, local_experts=2, ways=2, factor=1.0) == 10
  assert moe.buffer_rows(tokens=5, top_k=2, local_experts=2, ways=2, factor=9.0) == 20  # capped at the worst


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
  """jax.lax.ragged_all_to_all's semantics from all_gather (XLA:CPU lacks the op): each receiver copies every
  sender's slice operand[input_offsets[r]:+send_sizes[r]] to output[output_offsets[r]:...] as that sender
  asked. Differentiable, so the all_to_all transport's gradients run through it too."""
  E = jax.lax.axis_size(axis_name)
  r = jax.lax.axis_index(axis_name)
  ops, ins, sends, outs = (jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                                      output_offsets))
  recv = jax.lax.all_gather(recv_sizes, axis_name)
  i = jnp.arange(output.shape[0])
  for s in range(E):
    start, size = outs[s, r], sends[s, r]
    inside = (i >= start) & (i < start + size) & (size == recv[r, s])  # what the receiver expects to get
    rows = jnp.take(ops[s], jnp.clip(ins[s, r] + i - start, 0, operand.shape[0] - 1), axis=0)
    output = jnp.where(inside[:, None], rows, output)
  return output


@pytest.mark.parametrize('shape, skewed', grid([((1, 2, 1, 4), True), ((1, 1, 1, 8), False), ((1, 1, 2, 4), True),
                                                ((1, 1, 1, 4, 2), False)],
                                               fast=[((1, 2, 1, 4), True)], unpack=True,
                                               ids=lambda c: 'x'.join(map(str, c[0])) + ('-skewed' if c[1] else '')))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_all_to_all_transport_equals_unsharded(shape, skewed, monkeypatch):
  """The all_to_all transport's own sort / counts / offsets / regrouping, with the exchange emulated on CPU."""
  monkeypatch.setattr(moe, 'ragged_all_to_all', _emulated_ragged_all_to_all)
  monkeypatch.setattr(moe, 'transport', lambda name: 'all_to_all')
  got = _ep_out_grads_stats(shape, skewed)
  _assert_same_layer(got, _ep_reference(skewed))
  assert float(got[2]['overflow']) == 0  # the default buffer is the worst case


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_all_to_all_transport_carries_gpt_oss_biases(monkeypatch):
  """gpt-oss's expert biases travel with their experts through the all_to_all transport too (tensor × expert)."""
  monkeypatch.setattr(moe, 'ragged_all_to_all', _emulated_ragged_all_to_all)
  monkeypatch.setattr(moe, 'transport', lambda name: 'all_to_all')
  gpt_oss = _LAYER_CASES['gpt-oss']
  _assert_same_layer(_ep_out_grads_stats((1, 1, 2, 4), False, **gpt_oss), _ep_out_grads_stats(None, False, **gpt_oss))


@pytest.mark.parametrize('fsdp', grid([1, 2], fast=[2]))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_all_to_all_overflow_is_counted_and_zeroed(fsdp, monkeypatch):
  """An undersized receive buffer (factor 1: the balanced share) under full skew: the rows that do not fit are
  counted exactly, summed over the fsdp groups that exchange separately, and only their tokens lose the experts'
  output."""
  monkeypatch.setattr(moe, 'ragged_all_to_all', _emulated_ragged_all_to_all)
  monkeypatch.setattr(moe, 'transport', lambda name: 'all_to_all')
  x, seg = _ep_inputs()
  seg = jnp.ones_like(seg)  # no padding: every device sends all its n·k rows to device 0
  m = _cfg(moe_buffer_factor=1.0, **_EP)
  params = _with_bias(_params(**_EP), np.array([10.0, 5.0] + [0.0] * 6))
  from jaxlm import sharding
  want, _ = _apply_stats(_cfg(**_EP), params, x, seg)
  with sharding.activate(_ep_mesh((1, fsdp, 1, 4))):
    y, stats = _apply_stats(m, params, x, seg)
  n = x.shape[0] * x.shape[1] // (4 * fsdp)  # tokens per device; each sends 2n rows, expert 0's buffer holds 2n
  assert float(stats[moe.STATS]['overflow']) == fsdp * 3 * 2 * n
  y, want = np.asarray(y).reshape(fsdp, 4, n, D), np.asarray(want).reshape(fsdp, 4, n, D)
  np.testing.assert_allclose(y[:, 0], want[:, 0], atol=1e-5)  # each group's sender 0 filled the buffer
  np.testing.assert_array_equal(y[:, 1:], 0.0)  # the others' overflowed
  metrics = moe.metrics({'layers_0': {'moe': stats[moe.STATS]}}, m.moe)
  assert float(metrics['moe/0/overflow']) == fsdp * 3 * 2 * n


@pytest.mark.e2e  # a whole train step compiled for TPU
def test_all_to_all_transport_compiles_for_tpu():
  """XLA:CPU cannot run ragged-all-to-all, so the all_to_all transport (what model.moe_transport=auto picks on a
  TPU or GPU) is compiled for four compile-only TPU v5e chips: the whole moe_tiny train step, expert=4."""
  from jaxlm import config as config_lib, sharding, step as step_lib
  from jaxlm.tools import size
  from tests.helpers import load_config
  try:
    devices = size.tpu_devices('v5e:2x2')
  except size.PreflightError as e:
    pytest.skip(f'no libtpu here: {e}')
  cfg = load_config('moe_tiny')
  cfg.mesh.update(data=1, fsdp=1, tensor=1, expert=4)
  cfg.model.moe_transport = 'auto'
  config_lib.validate(cfg, len(devices))
  mesh = sharding.make_mesh(cfg.mesh, devices)
  program = step_lib.build_program(cfg, mesh)
  batch = step_lib.abstract_batch(cfg.train.batch_size, cfg.data.seq_len, program.batch_sharding)
  with jax.default_matmul_precision('default'):
    hlo = program.train_step.lower(program.abstract_state, batch).compile().as_text()
  # Forward and backward each send the rows there and back: at least four exchanges per MoE layer's step.
  assert hlo.count('ragged-all-to-all(') >= 4, hlo.count('ragged-all-to-all(')
  import re  # and no expert weight (4 experts of 64 × 32) gathered whole: each chip keeps its own expert
  gathers = re.findall(r'= (\S+) all-gather\(', hlo)
  assert not [g for g in gathers if re.match(r'\w+\[(2,)?4,(64,32|32,64)\]', g)], gathers
  assert program.state_shardings.params['layers']['moe']['gate'].spec[1] == 'expert'


@pytest.mark.e2e  # prefill and decode programs compiled twice
def test_generate_on_an_expert_mesh_equals_one_device():
  """Sampling a MoE model on an expert=4 mesh (the batch rounded up to its 8 ways, one token per decode step)
  gives one device's tokens and logits."""
  from jaxlm import generate, sharding
  from tests.helpers import load_config, plain_program
  cfg = load_config('moe_tiny')
  cfg.model.dtype = 'float32'
  cfg.mesh.update(data=1, fsdp=2, tensor=1, expert=4)
  mesh = sharding.make_mesh(cfg.mesh)
  program = plain_program(cfg, mesh)
  params = program.init().params
  m = program.model.config
  prompts = [[5, 17, 3], [9, 2, 44, 8, 1]]
  one = generate.generate(m, jax.device_get(params), prompts, 6, return_logits=True)
  ep = generate.generate(m, params, prompts, 6, mesh=mesh, return_logits=True)
  np.testing.assert_array_equal(ep.tokens, one.tokens)
  np.testing.assert_allclose(ep.logits, one.logits, atol=1e-4)


def test_transport_is_chosen_for_the_mesh_platform_and_reported():
  from jaxlm import errors
  from jaxlm.tools import size
  m = _cfg(**_EP)
  cpu = _ep_mesh((1, 2, 1, 4))
  assert moe.describe(m.moe, _ep_mesh((1, 8, 1))) is None  # no expert axis: nothing travels
  line = moe.describe(m.moe, cpu)
  assert line.startswith('experts: 8 over expert=4, 2 per device; tokens travel by gather (')
  with pytest.raises(errors.ConfigError, match='XLA:CPU has no ragged-all-to-all'):  # refused before compiling
    moe.describe(_cfg(moe_transport='all_to_all', **_EP).moe, cpu)
  try:
    tpus = size.tpu_devices('v5e:2x2')
  except size.PreflightError as e:
    pytest.skip(f'no libtpu here: {e}')
  import ml_collections
  from jaxlm import sharding
  tpu = sharding.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1, expert=4)), tpus)
  assert 'tokens travel by all_to_all (ragged all-to-all there and back, receive buffers the worst case' in \
      moe.describe(m.moe, tpu)
  assert '1.5× the balanced share (overflow counted)' in moe.describe(_cfg(moe_buffer_factor=1.5, **_EP).moe, tpu)


def test_all_to_all_on_a_cpu_mesh_is_refused_by_the_command(tmp_path):
  """What a user typing the command sees: one `jaxlm:` line and exit 2, before any step is compiled."""
  from tests.helpers import assert_fails_with, run_cli
  out = run_cli('jaxlm.train', '--config=configs/moe_tiny.py', f'--workdir={tmp_path}', '--config.mesh.fsdp=2',
                '--config.mesh.expert=4', '--config.model.moe_transport=all_to_all', timeout=300)
  assert_fails_with(out, 2, 'model.moe_transport=all_to_all on a CPU mesh', 'use model.moe_transport=gather')
  assert 'tokens travel by' not in out.stdout
