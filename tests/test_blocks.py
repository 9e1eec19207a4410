"""The block features of today's open families (model.attention_window and the other options in blocks.py):
the window's convention is transformers', the scores match a reference written out in numpy, scanned layers
equal unrolled ones, a sharded step equals one device, and validation refuses the paths that cannot honour them.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxlm import attention, config, errors, model as model_lib
from tests.helpers import load_config, odd_config, random_batch
from tests.test_sharding import _two_steps

W = 4  # the window in these tests: sequences are several windows long


def test_window_mask_is_transformers_sliding_window():
  """Local layers: key position > query position - W (the query itself and W-1 before it), as transformers."""
  masking_utils = pytest.importorskip('transformers.masking_utils')
  torch = pytest.importorskip('torch')
  T = 3 * W + 1
  ours = np.asarray(attention.attention_mask(np.ones((1, T), np.int32), window=W))[0, 0, 0]  # (T, T)
  fn = masking_utils.sliding_window_causal_mask_function(W)
  idx = torch.arange(T)
  theirs = np.array([[bool(fn(0, 0, q, k)) for k in idx] for q in idx])
  np.testing.assert_array_equal(ours, theirs)
  assert ours.sum(-1).max() == W  # W keys at most, itself included


def _reference(q, k, v, segment_ids, window, softcap, sinks, scale):
  """Attention written out per head in numpy float64 (gpt-oss's eager sinks: an extra softmax column)."""
  B, T, H, E = q.shape
  G = H // k.shape[2]
  out = np.zeros((B, T, H, E))
  for b in range(B):
    for h in range(H):
      s = q[b, :, h].astype(np.float64) @ k[b, :, h // G].T.astype(np.float64) * scale  # (T, T)
      if softcap:
        s = softcap * np.tanh(s / softcap)
      i, j = np.arange(T)[:, None], np.arange(T)[None, :]
      ok = (j <= i) & (i - j < window) & (segment_ids[b][:, None] == segment_ids[b][None, :])
      s = np.concatenate([np.where(ok, s, -np.inf), np.full((T, 1), sinks[h])], axis=-1)
      p = np.exp(s - s.max(-1, keepdims=True))
      out[b, :, h] = (p / p.sum(-1, keepdims=True))[:, :T] @ v[b, :, h // G]
  return out


@pytest.mark.parametrize('block_q', [0, 8])
def test_window_softcap_sinks_scale_match_reference(block_q):
  rng = np.random.default_rng(0)
  B, T, H, K, E = 2, 32, 4, 2, 8
  q, k, v = (rng.standard_normal((B, n, h, E)).astype(np.float32) for n, h in ((T, H), (T, K), (T, K)))
  segment_ids = np.repeat(np.array([[1] * 20 + [2] * 12]), B, axis=0).astype(np.int32)
  sinks = rng.standard_normal(H).astype(np.float32)
  scores = attention.Scores(window=W, softcap=2.0, sinks=sinks, scale=0.3)
  ours = np.asarray(jax.jit(lambda *a: attention.xla_attention(*a, block_q=block_q, scores_cfg=scores))(
      q, k, v, segment_ids))
  np.testing.assert_allclose(ours, _reference(q, k, v, segment_ids, W, 2.0, sinks, 0.3), atol=2e-5)
  plain = np.asarray(attention.xla_attention(q, k, v, segment_ids, block_q=block_q))
  for off in (dict(window=0), dict(softcap=0.0), dict(sinks=None), dict(scale=0.0)):  # each matters
    other = attention.xla_attention(q, k, v, segment_ids, block_q=block_q,
                                    scores_cfg=dataclasses.replace(scores, **off))
    assert np.abs(np.asarray(other) - ours).max() >= 1e-2, off
  assert np.abs(plain - ours).max() >= 1e-2


def _features_config(**overrides) -> model_lib.ModelConfig:
  """A 3-layer sequential model with every option on: local, global, local (global_every=2)."""
  m = model_lib.ModelConfig(vocab_size=97, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                            mlp_dim=40, parallel_block=False, dtype='float32', remat='none', rope_theta=1000.0,
                            attention=model_lib.AttentionConfig(window=W, global_every=2, local_rope_theta=50.0,
                                                                softcap=3.0, sinks=True, query_scalar=12.0,
                                                                qk_norm='head'),
                            norms=model_lib.NormsConfig(placement='sandwich', offset=True),
                            mlp=model_lib.MlpConfig('geglu'), embed_scale=True, final_softcap=5.0)
  return dataclasses.replace(m, **overrides)


def test_scanned_layers_equal_unrolled_and_sinks_matter():
  """One scanned stack carries local and global layers (a traced flag per layer): the same logits as unrolled
  layers, each told its kind in Python, with the same parameters; the learned sinks move the logits."""
  m = _features_config()
  tokens = np.random.default_rng(1).integers(0, 97, (2, 32)).astype(np.int32)
  segment_ids, positions = np.ones_like(tokens), np.tile(np.arange(32, dtype=np.int32), (2, 1))
  params = nn.unbox(jax.jit(model_lib.Decoder(m).init)(jax.random.PRNGKey(0), tokens, segment_ids, positions)['params'])
  rng = np.random.default_rng(2)
  params = jax.tree.map(lambda x: x + 0.3 * rng.standard_normal(x.shape).astype(np.float32), params)  # sinks, w
  apply = functools.cache(lambda m: jax.jit(model_lib.Decoder(m).apply))  # one compile per model config
  logits = lambda m, p: np.asarray(apply(m)({'params': p}, tokens, segment_ids, positions))  # noqa: E731
  scanned = logits(m, params)
  unrolled = {k: v for k, v in params.items() if k != 'layers'}
  unrolled.update({f'layers_{i}': jax.tree.map(lambda x, i=i: x[i], params['layers']) for i in range(3)})
  np.testing.assert_allclose(logits(dataclasses.replace(m, scan_layers=False), unrolled), scanned, atol=1e-5)
  zero_sinks = {**params, 'layers': {**params['layers'], 'attention': {
      **params['layers']['attention'], 'sinks': np.full_like(params['layers']['attention']['sinks'], -1e9)}}}
  assert np.abs(logits(m, zero_sinks) - scanned).max() >= 1e-2
  # The local layers' own RoPE base and the pattern matter too.
  for other in (dataclasses.replace(m.attention, local_rope_theta=0.0), dataclasses.replace(m.attention, global_every=0)):
    assert np.abs(logits(dataclasses.replace(m, attention=other), params) - scanned).max() >= 1e-2
  assert model_lib.param_count(m) == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.parametrize('overrides, mesh, says', [
    (dict(attention_window=8, attention_sinks=True, attention='splash'), {},
     'model.attention_sinks: model.attention=splash cannot compute it'),
    (dict(attention_softcap=50.0, attention_sinks=True, attention='cudnn'), {},
     'model.attention_softcap, model.attention_sinks: model.attention=cudnn cannot compute them'),
    (dict(attention_window=8, attention_global_every=2), dict(stage=2, data=4),
     'model.attention_global_every=2 with mesh.stage=2'),
    (dict(norm_placement='sandwich', parallel_block=True), {}, 'model.norm_placement=sandwich needs the sequential'),
    (dict(norm_placement='middle'), {}, "model.norm_placement='middle' is unknown"),
    (dict(mlp_activation='geglu', moe_experts=4), {}, 'model.mlp_activation=geglu'),
    (dict(attention_window=-1), {}, 'model.attention_window=-1 must be >= 0'),
    (dict(mlp_activation='clamped', mlp_swiglu_limit=0.0), {}, 'model.mlp_swiglu_limit=0.0 and'),
    (dict(attention_bias=True, kv_lora_rank=16), {}, 'model.attention_bias=True with MLA'),
])
def test_validate_refuses_paths_that_cannot_honour_the_features(overrides, mesh, says):
  """(A window on splash or cuDNN, and a soft-cap on splash, are computed by the kernels: tests/test_attention.py.)"""
  c = load_config('palm_tiny')
  c.model.update(parallel_block=False)
  c.model.update(**overrides)
  c.mesh.update(**mesh)
  with pytest.raises(errors.ConfigError, match=says.replace('(', r'\(')):
    config.validate(c, num_devices=8)


# The blocks of the families a sharded step is checked on (gpt-oss's experts and biases on an expert mesh:
# tests/test_moe.py; Mistral's all-local stack under context parallelism: tests/test_context.py).
SHARDED_BLOCKS = {
    # Gemma 2/3: local and global layers, two RoPE bases, soft-caps, sandwich (1 + w) norms, GeGLU, the embedding
    # scaled; sinks and attention biases (gpt-oss's) ride along.
    'gemma': dict(attention_window=W, attention_global_every=2, attention_softcap=3.0, attention_sinks=True,
                  attention_bias=True, norm_placement='sandwich', norm_offset=True, mlp_activation='geglu',
                  embed_scale=True, final_softcap=8.0, rope_local_theta=100.0),
    # OLMo 2/3: post-norms, QK-norm over the whole projection (its heads split over tensor), local and global
    # layers with YaRN on the global ones.
    'olmo': dict(attention_window=W, attention_global_every=2, norm_placement='post', qk_norm='full',
                 rope_local_theta=100.0, rope_scaling='yarn', rope_factor=2.0, rope_original_max_positions=8),
}


@pytest.mark.parametrize('block', list(SHARDED_BLOCKS))
def test_sharded_step_with_sliding_window_matches_single_device(block):
  """Two training steps of each family's block on fsdp 4 × tensor 2 equal one device (1e-5), in loss and
  gradient norm; documents are packed two to a row."""
  cfg = odd_config(parallel_block=False)
  cfg.model.update(**SHARDED_BLOCKS[block])
  batch = random_batch(8, 24, cfg.model.vocab_size, docs=2)
  reference, _ = _two_steps(cfg.copy_and_resolve_references(), (1, 1, 1), batch)
  assert reference[1] < reference[0]  # the step did something
  got, _ = _two_steps(cfg, (1, 4, 2), batch)
  np.testing.assert_allclose(got, reference, rtol=1e-5)


def test_ring_cache_greedy_equals_full_recompute():
  """An all-local model (every option on) decodes from a W-slot ring per layer, prompts longer than W prefilled
  at once, and its greedy tokens equal greedy by full recompute without a cache."""
  # Untied: a tied random model's greedy path repeats its input token, which would hide a wrong cache.
  m = _features_config(attention=dataclasses.replace(_features_config().attention, global_every=0),
                       tie_embeddings=False)
  cache = _greedy_equals_full_recompute(m)
  assert cache['layers']['attention']['key'].shape[2] == W  # not 64


def _greedy_equals_full_recompute(m) -> dict:
  """Greedy from the KV cache equals greedy by full recompute on random parameters (prompts and replies several
  windows long); returns the cache's shapes."""
  from jaxlm import generate as generate_lib
  dummy = np.zeros((1, 8), np.int32)
  params = nn.unbox(jax.jit(model_lib.Decoder(m).init)(jax.random.PRNGKey(3), dummy, dummy + 1, dummy)['params'])
  rng = np.random.default_rng(4)
  params = jax.tree.map(lambda x: x + 0.5 * rng.standard_normal(x.shape).astype(np.float32), params)
  prompts = [list(rng.integers(1, 97, 19)), list(rng.integers(1, 97, 11))]
  cached = generate_lib.generate(m, params, prompts, 12).tokens
  np.testing.assert_array_equal(np.array(cached), generate_lib.generate_without_cache(m, params, prompts, 12))
  assert len(set(cached[0])) > 3
  return generate_lib.cache_shapes(generate_lib.inference_model(m), params, 2, 64)


def test_mixed_scanned_stack_decodes_with_a_ring_per_local_layer():
  """Local and global layers in one scanned stack (every option on): decoding goes layer by layer, parameters
  sliced from the stack, a local layer's cache a W-slot ring and a global layer's the whole sequence; greedy
  with the cache equals greedy by full recompute over prompts and replies several windows long."""
  m = _features_config(tie_embeddings=False)  # layers local, global, local (global_every=2), scanned
  assert m.scan_layers and m.attention.global_every == 2
  cache = _greedy_equals_full_recompute(m)
  assert [cache[f'layers_{i}']['attention']['key'].shape[1] for i in range(3)] == [W, 64, W]
