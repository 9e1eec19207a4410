"""Attention kernels: dispatch and fallback, and every kernel against an independent reference.

On a CPU: the `xla` kernel against a float64 NumPy loop; the exact call the `cudnn` kernel makes
(jax.nn.dot_product_attention with is_causal and the document mask) through its XLA implementation; and the
splash kernel in Pallas interpret mode, alone and inside shard_map on a mesh. On an NVIDIA GPU (`pytest -m gpu`):
cuDNN against xla in bfloat16, forward and gradients, and the whole model with either kernel.
"""

import dataclasses
import logging
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import attention
from jaxlm import sharding
from tests.helpers import grid


@pytest.fixture(autouse=True)
def fresh_log():
  """Each test sees the once-only log messages anew."""
  attention._logged.clear()
  yield
  attention._logged.clear()


def segments(B: int, T: int, docs: int, pad: int = 0, seed: int = 0) -> np.ndarray:
  """(B, T) segment ids: `docs` documents of random lengths per row, then `pad` padding (0) tokens."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T - pad), docs - 1, replace=False)) if docs > 1 else []
    bounds = [0, *cuts, T - pad]
    for d in range(docs):
      seg[b, bounds[d]:bounds[d + 1]] = d + 1
  return seg


def _heads(case) -> str:
  return f'{case[0]}-{case[1]}'  # (query heads, kv heads), as the ids were before


def qkv(B, T, H, K, E, dtype=jnp.float32, seed=0):
  """Random q (B, T, H, E), k and v (B, T, K, E)."""
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(kq, (B, T, H, E), dtype), jax.random.normal(kk, (B, T, K, E), dtype),
          jax.random.normal(kv, (B, T, K, E), dtype))


def numpy_attention(q, k, v, seg) -> np.ndarray:
  """Float64 loops: each real query attends to earlier-or-same keys of its own document."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, E = q.shape
  G = H // k.shape[2]
  out = np.zeros_like(q)
  for b in range(B):
    for t in range(T):
      if seg[b, t] == 0:
        continue
      keys = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
      for h in range(H):
        logits = k[b, keys, h // G] @ q[b, t, h] / np.sqrt(E)
        p = np.exp(logits - logits.max())
        out[b, t, h] = (p / p.sum()) @ v[b, keys, h // G]
  return out


def real(x, seg):
  """x at real (non-padding) tokens only: outputs at padding positions are unspecified."""
  return np.asarray(x, np.float32)[np.asarray(seg) != 0]


def loss_grads(fn, q, k, v, seg):
  """Gradients of a random projection of the output at real tokens, for q, k and v."""
  w = jax.random.normal(jax.random.PRNGKey(7), q.shape, jnp.float32) * (seg != 0)[:, :, None, None]
  grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * w), argnums=(0, 1, 2))
  return jax.jit(grads)(q, k, v)  # one program, not one compile per op


# --- dispatch -----------------------------------------------------------------------------------------------

HOPPER = types.SimpleNamespace(compute_capability='9.0', client=types.SimpleNamespace(platform_version='cuda 12080'))
AMPERE = types.SimpleNamespace(compute_capability='8.0', client=types.SimpleNamespace(platform_version='cuda 12080'))
ROCM = types.SimpleNamespace(client=types.SimpleNamespace(platform_version='rocm 60300'))


@pytest.mark.parametrize('impl, platform, device, dtype, head_dim, seq_len, expected, why', [
    ('xla', 'gpu', HOPPER, 'bfloat16', 128, 2048, 'xla', 'as configured'),
    ('auto', 'cpu', None, 'float32', 64, 128, 'xla', 'no fused kernel'),
    ('auto', 'gpu', HOPPER, 'bfloat16', 128, 2048, 'cudnn', 'auto on gpu'),
    ('auto', 'gpu', HOPPER, 'float32', 128, 2048, 'xla', 'bfloat16 or float16'),
    ('auto', 'tpu', None, 'bfloat16', 128, 2048, 'splash', 'auto on tpu'),
    ('auto', 'tpu', None, 'bfloat16', 128, 200, 'xla', 'multiple of 128'),
    ('cudnn', 'gpu', HOPPER, 'float16', 64, 512, 'cudnn', 'cudnn'),
    ('cudnn', 'cpu', None, 'bfloat16', 64, 128, 'xla', 'only on NVIDIA GPUs'),
    ('cudnn', 'gpu', ROCM, 'bfloat16', 64, 128, 'xla', 'ROCm'),
    ('cudnn', 'gpu', HOPPER, 'bfloat16', 12, 128, 'xla', 'multiple of 8'),
    ('cudnn', 'gpu', AMPERE, 'bfloat16', 192, 128, 'xla', '<= 128'),
    ('cudnn', 'gpu', HOPPER, 'bfloat16', 192, 128, 'cudnn', 'cudnn'),
    ('cudnn', 'gpu', HOPPER, 'bfloat16', 64, 127, 'xla', 'even sequence length'),
    ('splash', 'gpu', HOPPER, 'bfloat16', 128, 2048, 'xla', 'only on TPU'),
    ('splash', 'tpu', None, 'float32', 64, 384, 'splash', 'splash'),
])
def test_select(impl, platform, device, dtype, head_dim, seq_len, expected, why):
  kernel, reason = attention.select(impl, dtype=dtype, head_dim=head_dim, seq_len=seq_len, platform=platform,
                                    device=device)
  assert kernel == expected
  assert why in reason
  if expected == 'xla' and impl not in ('xla', 'auto'):
    assert 'falling back to xla' in reason


def test_select_rejects_unknown():
  with pytest.raises(ValueError, match='unknown attention'):
    attention.select('flash', dtype='float32', head_dim=64, seq_len=128)


@pytest.mark.parametrize('impl, platform, device, dtype, expected, why', [
    ('auto', 'gpu', HOPPER, 'bfloat16', 'xla', 'no reliable deterministic form of cuDNN'),  # cudnn otherwise
    ('cudnn', 'gpu', HOPPER, 'bfloat16', 'xla', 'no reliable deterministic form of cuDNN'),  # falls back, says why
    ('auto', 'tpu', None, 'bfloat16', 'splash', 'auto on tpu'),  # TPU kernels are deterministic already
    ('cudnn', 'cpu', None, 'bfloat16', 'xla', 'only on NVIDIA GPUs'),
    ('xla', 'gpu', HOPPER, 'bfloat16', 'xla', 'as configured'),
])
def test_select_in_deterministic_mode(impl, platform, device, dtype, expected, why, monkeypatch):
  kernel, reason = attention.select(impl, dtype=dtype, head_dim=128, seq_len=2048, platform=platform, device=device,
                                    deterministic=True)
  assert (kernel, why in reason) == (expected, True), reason
  # By default the mode is read from XLA_FLAGS, where train.deterministic (or a user) puts the flag.
  monkeypatch.setenv('XLA_FLAGS', f'--xla_force_host_platform_device_count=8 {attention.DETERMINISTIC_XLA_FLAGS}')
  assert attention.deterministic_ops()
  assert attention.select(impl, dtype=dtype, head_dim=128, seq_len=2048, platform=platform, device=device) == (
      kernel, reason)
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  assert not attention.deterministic_ops()
  assert attention.select('auto', dtype=dtype, head_dim=128, seq_len=2048, platform='gpu', device=HOPPER)[0] == 'cudnn'


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_fallback_is_logged_once_and_runs_xla(caplog):
  q, k, v = qkv(2, 16, 4, 2, 8)
  seg = jnp.asarray(segments(2, 16, 2))
  expected = jax.jit(attention.xla_attention)(q, k, v, seg)  # one program, not one compile per op
  with caplog.at_level(logging.INFO, logger='jaxlm.attention'):
    for _ in range(3):  # three traces, one message
      out = jax.jit(lambda q, k, v, s: attention.attention(q, k, v, s, impl='cudnn'))(q, k, v, seg)
      jax.clear_caches()
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and 'attention=cudnn cannot run here' in warnings[0].getMessage()
  assert 'falling back to xla' in warnings[0].getMessage()
  np.testing.assert_array_equal(out, expected)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_auto_logs_its_choice_once_as_info(caplog):
  q, k, v = qkv(1, 8, 2, 1, 8)
  seg = jnp.ones((1, 8), jnp.int32)
  with caplog.at_level(logging.INFO, logger='jaxlm.attention'):
    attention.attention(q, k, v, seg, impl='auto')
    attention.attention(q, k, v, seg, impl='auto')
  messages = [r.getMessage() for r in caplog.records]
  assert messages == ['attention=auto on cpu: no fused kernel for this platform, using xla']
  assert all(r.levelno == logging.INFO for r in caplog.records)


# --- numerics on a CPU --------------------------------------------------------------------------------------

@pytest.mark.parametrize('H, K', grid([(4, 1), (6, 2), (3, 3)], fast=[(4, 1)], ids=_heads, unpack=True))
def test_xla_matches_numpy(H, K):
  B, T, E = 2, 23, 10
  q, k, v = qkv(B, T, H, K, E)
  seg = segments(B, T, docs=3, pad=4)
  out = jax.jit(attention.xla_attention)(q, k, v, jnp.asarray(seg))  # one program, not one compile per op
  np.testing.assert_allclose(real(out, seg), real(numpy_attention(q, k, v, seg), seg), atol=2e-5, rtol=2e-5)
  assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize('shards', [1, 4])
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_query_blocks_give_the_unblocked_result(shards):
  """block_q: the same outputs and gradients (f32), in array order and in context parallelism's zig-zag order."""
  B, T, H, K, E = 2, 64, 4, 2, 8
  q, k, v = qkv(B, T, H, K, E)
  seg = jnp.asarray(segments(B, T, docs=3, pad=5))
  order = sharding.zigzag_order(T, shards) if shards > 1 else None
  whole = lambda q, k, v, s: attention.xla_attention(q, k, v, s, order)  # noqa: E731
  want, want_grads = jax.jit(whole)(q, k, v, seg), loss_grads(whole, q, k, v, seg)
  for block_q in (4, 8):
    blocked = lambda q, k, v, s: attention.xla_attention(q, k, v, s, order, block_q, shards)  # noqa: E731
    np.testing.assert_allclose(real(jax.jit(blocked)(q, k, v, seg), seg), real(want, seg), rtol=1e-5, atol=1e-6)
    for got, ref in zip(loss_grads(blocked, q, k, v, seg), want_grads):
      np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # The blocks are a loop: the largest scores array in the program is one block's, not (T, T).
    hlo = jax.jit(blocked).lower(q, k, v, seg).as_text()
    assert f'x{block_q * shards * H // K}x{T}xf32>' in hlo and f'x{T * H // K}x{T}xf32>' not in hlo


@pytest.mark.parametrize('H, K', grid([(4, 1), (6, 2), (4, 4)], fast=[], ids=_heads, unpack=True))
def test_cudnn_call_through_xla_matches_reference(H, K):
  """The mask and call the cudnn kernel uses, run by jax.nn's XLA implementation: forward and gradients."""
  B, T, E = 2, 32, 16
  q, k, v = qkv(B, T, H, K, E)
  seg = jnp.asarray(segments(B, T, docs=3, pad=5, seed=1))
  via_jax_nn = lambda q, k, v, s: attention.cudnn_attention(q, k, v, s, implementation='xla')
  out = jax.jit(via_jax_nn)(q, k, v, seg)  # jitted here and below: one program, not one compile per op
  assert np.isfinite(np.asarray(out)).all()  # padding rows too: they must not poison a zero-weight loss
  np.testing.assert_allclose(real(out, seg), real(jax.jit(attention.xla_attention)(q, k, v, seg), seg), atol=1e-5)
  for got, want in zip(loss_grads(via_jax_nn, q, k, v, seg), loss_grads(attention.xla_attention, q, k, v, seg)):
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.e2e  # the kernel-parity family (cudnn, splash interpret) runs in the full suite
def test_cudnn_call_through_xla_in_bfloat16():
  B, T, H, K, E = 2, 64, 4, 1, 32
  q, k, v = qkv(B, T, H, K, E, jnp.bfloat16)
  seg = jnp.asarray(segments(B, T, docs=2))
  out = jax.jit(lambda q, k, v, s: attention.cudnn_attention(q, k, v, s, implementation='xla'))(q, k, v, seg)
  want = jax.jit(attention.xla_attention)(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), seg)
  np.testing.assert_allclose(real(out, seg), real(want, seg), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize('H, K', grid([(4, 1), (4, 2), (2, 2)], fast=[], ids=_heads, unpack=True))
def test_splash_interpret_matches_xla(H, K):
  """The Pallas splash kernel's semantics (interpret mode), forward and gradients, with documents and padding."""
  B, T, E = 2, 256, 64  # two 128-blocks per axis; E = 64 makes the 1/sqrt(E) pre-scaling of q exact
  q, k, v = qkv(B, T, H, K, E)
  seg = jnp.asarray(segments(B, T, docs=3, pad=20, seed=2))
  splash = lambda q, k, v, s: attention.splash_attention(q, k, v, s, interpret=True)
  out = jax.jit(splash)(q, k, v, seg)  # jitted here and below: one program, not one compile per op
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(real(out, seg), real(jax.jit(attention.xla_attention)(q, k, v, seg), seg), atol=2e-5)
  for got, want in zip(loss_grads(splash, q, k, v, seg), loss_grads(attention.xla_attention, q, k, v, seg)):
    np.testing.assert_allclose(got, want, atol=2e-4)


def _dot_shapes(jaxpr) -> list[tuple]:
  """The output shapes of every dot_general in a jaxpr, its sub-jaxprs (loops, conds, checkpoints) included."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      shapes += [tuple(v.aval.shape) for v in eqn.outvars]
    for p in eqn.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          shapes += _dot_shapes(inner)
  return shapes


def test_a_local_layer_computes_only_the_keys_its_window_reaches():
  """xla attention of a local layer (window W) goes by blocks of W queries over the W + b keys they can reach, so
  no (T, T) scores are formed and the cost grows with T, not T²; it equals the whole row's masked attention (soft-
  cap, sinks, documents and padding included), forward and gradients. A traced window (scanned local and global
  layers) takes this path when > 0 and the whole row's otherwise."""
  B, T, H, K, E, W = 2, 64, 4, 2, 16, 8
  q, k, v = qkv(B, T, H, K, E)
  seg = jnp.asarray(segments(B, T, docs=3, pad=5, seed=5))
  local = attention.Scores(window=W, softcap=2.0, sinks=jnp.linspace(-1.0, 1.0, H))
  whole = lambda q, k, v, s: attention._scores_attention(q, k, v, s, np.arange(T), s, np.arange(T), local)  # noqa: E731
  blocked = lambda q, k, v, s: attention.xla_attention(q, k, v, s, scores_cfg=local)  # noqa: E731
  np.testing.assert_allclose(real(blocked(q, k, v, seg), seg), real(whole(q, k, v, seg), seg), atol=2e-6)
  for got, want in zip(loss_grads(blocked, q, k, v, seg), loss_grads(whole, q, k, v, seg)):
    np.testing.assert_allclose(got, want, atol=2e-5)
  scores = [s[-1] for s in _dot_shapes(jax.make_jaxpr(blocked)(q, k, v, seg).jaxpr) if len(s) == 4]
  assert scores and max(scores) == 2 * W, scores  # (…, W + b) keys per block, never T
  assert T in [s[-1] for s in _dot_shapes(jax.make_jaxpr(whole)(q, k, v, seg).jaxpr)]
  traced = jax.jit(lambda w: attention.xla_attention(q, k, v, seg, scores_cfg=dataclasses.replace(
      local, window=w, width=W)))
  np.testing.assert_allclose(real(traced(jnp.int32(W)), seg), real(whole(q, k, v, seg), seg), atol=2e-6)
  plain = attention.xla_attention(q, k, v, seg, scores_cfg=dataclasses.replace(local, window=0))
  np.testing.assert_allclose(real(traced(jnp.int32(0)), seg), real(plain, seg), atol=2e-6)
  # Context parallelism's zig-zag order (4 shards: chunks of T/8 = W positions): the same blocks of keys, each
  # gathered from wherever its positions lie, the shards a batch axis; equal to the whole row's, permuted.
  order = sharding.zigzag_order(T, 4)
  zig = lambda q, k, v, s: attention.xla_attention(q, k, v, s, order, 0, 4, local)  # noqa: E731
  whole_zig = lambda q, k, v, s: attention._scores_attention(q, k, v, s, order, s, order, local)  # noqa: E731
  args = [x[:, order] for x in (q, k, v, seg)]
  np.testing.assert_allclose(real(zig(*args), args[3]), real(whole(q, k, v, seg)[:, order], args[3]), atol=2e-6)
  for got, want in zip(loss_grads(zig, *args), loss_grads(whole_zig, *args)):
    np.testing.assert_allclose(got, want, atol=2e-5)
  scores = [s[-1] for s in _dot_shapes(jax.make_jaxpr(zig)(*args).jaxpr) if len(s) == 5]
  assert scores and max(scores) == 2 * W, scores  # (shards, …, W + b) per block, never T
  # Past max_scores the blocks (folded into the batch) go through a loop in groups, here 4 groups of 2: the same.
  looped = lambda q, k, v, s: attention._window_groups(  # noqa: E731
      q, k, v, s, width=W, block=W, scores_cfg=local, max_scores=2 * B * W * 2 * W * H)
  assert len([e for e in jax.make_jaxpr(looped)(q, k, v, seg).jaxpr.eqns if e.primitive.name == 'scan']) == 1
  want = [real(whole(q, k, v, seg), seg), *loss_grads(whole, q, k, v, seg)]
  # On a mesh (rows over data, heads over tensor), in one pass and looped, equal to one device's whole rows.
  mesh = jax.make_mesh((2, 1, 2, 1), sharding.AXES, devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)
  put = lambda x, *spec: jax.device_put(x, jax.NamedSharding(mesh, jax.P(*spec)))  # noqa: E731
  sharded = (put(q, 'data', None, 'tensor'), put(k, 'data', None, 'tensor'), put(v, 'data', None, 'tensor'),
             put(seg, 'data'))
  for fn, args in ((blocked, sharded), (looped, sharded)):
    got = [real(jax.jit(fn)(*args), seg), *loss_grads(fn, *args)]
    for g, w, tol in zip(got, want, (2e-6, 2e-5, 2e-5, 2e-5)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tol)


def test_fused_kernels_take_a_window_and_splash_a_soft_cap():
  """cuDNN's call (jax.nn.dot_product_attention's local_window_size; its xla implementation on a CPU) with a
  window, and splash (interpret mode: a LocalMask and attn_logits_soft_cap) with a window and a soft-cap, equal
  xla attention's masks, documents and padding included; a traced window (scanned layers mixing local and
  global) takes the local kernel when > 0 and the global one otherwise. Window and cap each move the output."""
  import functools
  B, T, H, K, E, W, cap = 2, 256, 4, 2, 64, 40, 1.0
  q, k, v = qkv(B, T, H, K, E)
  seg = jnp.asarray(segments(B, T, docs=2, pad=8, seed=4))
  xla = lambda scores: real(attention.xla_attention(q, k, v, seg, scores_cfg=scores), seg)  # noqa: E731
  cudnn = functools.partial(attention.cudnn_attention, implementation='xla')
  local, capped = attention.Scores(window=W), attention.Scores(window=W, softcap=cap)
  np.testing.assert_allclose(real(attention.windowed(cudnn, local, q, k, v, seg), seg), xla(local), atol=2e-5)
  splash = functools.partial(attention.splash_attention, interpret=True, softcap=cap)
  np.testing.assert_allclose(real(attention.windowed(splash, capped, q, k, v, seg), seg), xla(capped), atol=2e-5)
  plain = xla(attention.PLAIN)
  assert np.abs(xla(local) - plain).max() > 1e-2 and np.abs(xla(capped) - xla(local)).max() > 1e-2
  traced = jax.jit(lambda w: attention.windowed(cudnn, attention.Scores(window=w, width=W), q, k, v, seg))
  np.testing.assert_allclose(real(traced(jnp.int32(W)), seg), xla(local), atol=2e-5)
  np.testing.assert_allclose(real(traced(jnp.int32(0)), seg), plain, atol=2e-5)
  assert attention.Scores(softcap=cap).unsupported('cudnn') == 'soft-cap'
  assert attention.Scores(softcap=cap, sinks=jnp.zeros(H)).unsupported('splash') == 'sinks'
  assert attention.Scores(window=W, softcap=cap).unsupported('splash') is None


@pytest.mark.parametrize('H, K', grid([(4, 1), (4, 2), (4, 4), (6, 3)], fast=[(4, 1)], ids=_heads, unpack=True))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_splash_under_a_mesh_runs_per_shard(H, K):
  """Inside jit on a (data 2, fsdp 2, tensor 2) mesh: batch over data×fsdp, heads over tensor, via shard_map.

  K = 1 keeps the one kv head on every shard; K = 3 does not split in two, so kv heads are repeated to H.
  """
  mesh = jax.make_mesh((2, 2, 2, 1), sharding.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)  # context 1
  B, T, E = 4, 128, 64
  q, k, v = qkv(B, T, H, K, E)
  seg = jnp.asarray(segments(B, T, docs=2, pad=8, seed=3))
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    out = jax.jit(lambda q, k, v, s: attention.splash_attention(q, k, v, s, interpret=True))(q, k, v, seg)
  want = jax.jit(attention.xla_attention)(q, k, v, seg)  # one program, not one compile per op
  np.testing.assert_allclose(real(out, seg), real(want, seg), atol=2e-5)


# --- on an NVIDIA GPU (opt-in: pytest -m gpu) ----------------------------------------------------------------

gpu = pytest.mark.skipif(jax.default_backend() != 'gpu', reason='needs an NVIDIA GPU')


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize('H, K, T', [(16, 1, 2048), (8, 2, 512), (4, 4, 256)])
def test_cudnn_matches_xla_on_gpu(H, K, T):
  B, E = 2, 128
  assert attention.select('cudnn', dtype=jnp.bfloat16, head_dim=E, seq_len=T)[0] == 'cudnn'
  q, k, v = qkv(B, T, H, K, E, jnp.bfloat16)
  for docs, pad in ((1, 0), (4, 37)):
    seg = jnp.asarray(segments(B, T, docs=docs, pad=pad))
    cudnn = jax.jit(attention.cudnn_attention)
    out = cudnn(q, k, v, seg)
    assert 'cudnn' in cudnn.lower(q, k, v, seg).compile().as_text()  # the fused kernel, not a silent fallback
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(real(out, seg), real(attention.xla_attention(q, k, v, seg), seg), atol=3e-2,
                               rtol=3e-2)
    for got, want in zip(loss_grads(attention.cudnn_attention, q, k, v, seg),
                         loss_grads(attention.xla_attention, q, k, v, seg)):
      scale = float(jnp.abs(want.astype(jnp.float32)).max())
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2 * scale)


@pytest.mark.gpu
@gpu
def test_model_with_cudnn_matches_xla_on_gpu():
  from jaxlm import model as model_lib
  from tests.helpers import load_config, random_batch
  c = load_config('palm_tiny')
  c.model.update(dtype='bfloat16', head_dim=64, num_heads=4, num_kv_heads=1)
  c.data.seq_len = 256
  batch = random_batch(2, 256, c.model.vocab_size, docs=3)
  outs = {}
  for impl in ('xla', 'cudnn'):
    c.model.attention = impl
    model = model_lib.Decoder(model_lib.ModelConfig.from_config(c.model))
    params = model.init(jax.random.PRNGKey(0), batch['inputs'], batch['segment_ids'], batch['positions'])
    outs[impl] = model.apply(params, batch['inputs'], batch['segment_ids'], batch['positions'])
  np.testing.assert_allclose(np.asarray(outs['cudnn'], np.float32), np.asarray(outs['xla'], np.float32),
                             atol=5e-2, rtol=5e-2)
