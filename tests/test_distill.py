"""Distillation's loss against TRL's GKDTrainer.generalized_jsd_loss on the same logits, labels and mask; top-K
with K = V equal to the full vocabulary; the hard-label mix and fractional loss weights as the LM loss has them."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import distill
from jaxlm import model as model_lib

B, T, V = 3, 7, 37  # prime-ish: a wrong axis fails loudly


@pytest.fixture(scope='module')
def logits():
  rng = np.random.default_rng(0)
  student = (rng.standard_normal((B, T, V)) * 2).astype(np.float32)
  teacher = (rng.standard_normal((B, T, V)) * 3).astype(np.float32)
  targets = rng.integers(0, V, (B, T)).astype(np.int32)
  labels = targets.copy()
  labels[0, :3] = -100  # a prompt: no loss
  labels[2, 5:] = -100  # padding
  return student, teacher, targets, labels


@pytest.fixture(scope='module')
def trl_loss():
  os.environ.setdefault('TRL_EXPERIMENTAL_SILENCE', '1')
  torch = pytest.importorskip('torch')
  from trl.experimental.gkd import GKDTrainer  # pylint: disable=import-outside-toplevel

  def loss(student, teacher, labels, **kw):
    return float(GKDTrainer.generalized_jsd_loss(torch.from_numpy(student), torch.from_numpy(teacher),
                                                  torch.from_numpy(labels.astype(np.int64)), **kw))

  return loss


def _ours(student, teacher, targets, weights, *, beta, temperature, alpha=0.0, top_k=0):
  objective = distill.DistillObjective(beta=beta, temperature=temperature, alpha=alpha, top_k=top_k)
  batch = dict(targets=jnp.asarray(targets), weights=jnp.asarray(weights, jnp.float32),
               **distill.teacher_targets(jnp.asarray(teacher), temperature, top_k))
  total, aux = jax.jit(lambda s, b: objective.loss(s, b, jnp.maximum(b['weights'].sum(), 1.0)))(
      jnp.asarray(student), batch)
  return float(total), aux


@pytest.mark.parametrize('temperature', [1.0, 0.7])
@pytest.mark.parametrize('beta', [0.0, 0.5, 1.0])
def test_generalized_jsd_equals_trls(logits, trl_loss, beta, temperature):
  """beta 0 (forward KL), 0.5 (generalized JSD) and 1 (reverse KL) at two temperatures: TRL's batchmean over the
  tokens whose label is not -100 == ours with those tokens weighted 0; top-K with K = V gives the same loss."""
  student, teacher, targets, labels = logits
  want = trl_loss(student, teacher, labels, beta=beta, temperature=temperature)
  got, aux = _ours(student, teacher, targets, labels != -100, beta=beta, temperature=temperature)
  assert want > 0.1  # a real divergence, not two equal distributions
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(float(aux['divergence']), want, rtol=1e-6)
  top_v, _ = _ours(student, teacher, targets, labels != -100, beta=beta, temperature=temperature, top_k=V)
  np.testing.assert_allclose(top_v, want, rtol=1e-6)


def test_alpha_mixes_in_the_hard_label_cross_entropy(logits, trl_loss):
  """alpha 0.3: 0.7 · TRL's divergence + 0.3 · the cross-entropy of the same tokens (torch's, ignore_index -100)."""
  import torch  # pylint: disable=import-outside-toplevel
  student, teacher, targets, labels = logits
  ce = float(torch.nn.functional.cross_entropy(torch.from_numpy(student).reshape(-1, V),
                                               torch.from_numpy(labels.astype(np.int64)).reshape(-1)))
  jsd = trl_loss(student, teacher, labels, beta=0.0, temperature=1.0)
  got, aux = _ours(student, teacher, targets, labels != -100, beta=0.0, temperature=1.0, alpha=0.3)
  np.testing.assert_allclose(float(aux['ce']), ce, rtol=1e-6)
  np.testing.assert_allclose(got, 0.7 * jsd + 0.3 * ce, rtol=1e-6)


def test_fractional_weights_weigh_each_token_as_the_lm_loss_does(logits, trl_loss):
  """Weights w (an SFT run's masks, or any): Σ w · TRL's per-token divergence / Σ w, the LM loss's reduction."""
  student, teacher, targets, _ = logits
  weights = np.random.default_rng(1).uniform(0, 2, (B, T)).astype(np.float32)
  import torch  # pylint: disable=import-outside-toplevel
  from trl.experimental.gkd import GKDTrainer  # pylint: disable=import-outside-toplevel
  per_element = GKDTrainer.generalized_jsd_loss(torch.from_numpy(student), torch.from_numpy(teacher), None,
                                                beta=0.5, reduction='none').numpy()  # (B, T, V)
  want = (per_element.sum(-1) * weights).sum() / weights.sum()
  got, _ = _ours(student, teacher, targets, weights, beta=0.5, temperature=1.0)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  ce, _ = model_lib.loss_fn(jnp.asarray(student), jnp.asarray(targets), jnp.asarray(weights), 0.0)
  np.testing.assert_allclose(_ours(student, teacher, targets, weights, beta=0.5, temperature=1.0, alpha=1.0)[0],
                             float(ce), rtol=1e-6)


def test_top_k_compares_the_k_ids_and_the_mass_left_over(logits):
  """K < V: the generalized JSD over K + 1 categories (the teacher's K likeliest ids and the rest), computed in
  numpy from the full distributions; its gradient is finite."""
  student, teacher, targets, labels = logits
  K, beta, temperature = 5, 0.5, 0.7
  weights = (labels != -100).astype(np.float32)
  log_softmax = lambda x: x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(  # noqa: E731
      -1, keepdims=True)
  s, t = log_softmax(student.astype(np.float64) / temperature), log_softmax(teacher.astype(np.float64) / temperature)
  ids = np.argsort(-t, axis=-1)[..., :K]
  pick = lambda x: np.concatenate([np.take_along_axis(x, ids, -1), np.log1p(-np.exp(np.take_along_axis(  # noqa: E731
      x, ids, -1)).sum(-1, keepdims=True))], -1)
  ps, pt = np.exp(pick(s)), np.exp(pick(t))
  m = beta * pt + (1 - beta) * ps
  per_token = (beta * (pt * np.log(pt / m)).sum(-1) + (1 - beta) * (ps * np.log(ps / m)).sum(-1))
  want = (per_token * weights).sum() / weights.sum()
  got, _ = _ours(student, teacher, targets, weights, beta=beta, temperature=temperature, top_k=K)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  objective = distill.DistillObjective(beta=beta, temperature=temperature, top_k=K)
  batch = dict(targets=jnp.asarray(targets), weights=jnp.asarray(weights),
               **distill.teacher_targets(jnp.asarray(teacher), temperature, K))
  grad = jax.grad(lambda x: objective.loss(x, batch, weights.sum())[0])(jnp.asarray(student))
  assert np.isfinite(np.asarray(grad)).all() and np.abs(np.asarray(grad)).max() > 0


def test_a_distill_step_over_microbatches_equals_the_whole_batchs():
  """train.objective=distill through the one step builder, top-K keys (B, T, K) in the batch: two microbatches
  give the whole batch's loss and update (each divides by the whole batch's weight sum)."""
  from jaxlm import sharding, step
  from tests.helpers import load_config, plain_program
  c = load_config('palm_tiny')
  c.model.update(vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=32, dtype='float32')
  c.data.seq_len = 16
  c.train.update(objective='distill', batch_size=8)
  c.distill.update(beta=0.5, temperature=0.7, alpha=0.2, top_k=5)
  mesh = sharding.make_mesh(c.mesh)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (8, 16)).astype(np.int32)
  weights = (rng.uniform(size=(8, 16)) > 0.3).astype(np.float32)
  teacher = jax.device_get(distill.teacher_targets(jnp.asarray(rng.standard_normal((8, 16, 64)) * 3), 0.7, 5))
  batch = dict(inputs=tokens, targets=np.roll(tokens, -1, 1), segment_ids=np.ones_like(tokens),
               positions=np.tile(np.arange(16, dtype=np.int32), (8, 1)), weights=weights, **teacher)
  results, start = [], None
  for microbatches in (1, 2):
    program = plain_program(c, mesh, steps=10, microbatches=microbatches)
    assert dict((k, d) for k, d, *_ in program.batch_extra) == dict(
        teacher_ids=jnp.int32, teacher_logps=jnp.float32, teacher_rest=jnp.float32)
    if start is None:  # one starting state for both (the same model, seed and mesh): one init compiled
      start = jax.device_get(program.init())
    state, metrics = program.train_step(jax.device_put(start, program.state_shardings),
                                        step.global_batch(batch, program.batch_sharding))
    results.append((jax.device_get(metrics), jax.device_get(state.params)))
  (m1, p1), (m2, p2) = results
  assert m1['divergence'] > 0 and m1['ce'] > 0
  for key in ('loss', 'divergence', 'ce'):
    np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p2, p1)


def test_on_policy_rows_weigh_the_sampled_tokens_only():
  """prompt_of: a chat row's first conversation up to the token that predicts its first weighted target (cut to
  the last `longest`); on_policy_rows: prompt + completion as one sequence, only the completion's targets weighted."""
  inputs = np.array([5, 6, 7, 8, 9, 3, 4, 0], np.int32)
  weights = np.array([0, 0, 1, 1, 0, 0, 1, 0], np.float32)  # conversation 1 answers from target 2 (input 7 on)
  segments = np.array([1, 1, 1, 1, 1, 2, 2, 0], np.int32)
  assert distill.prompt_of(inputs, weights, segments, longest=8) == [5, 6, 7]
  assert distill.prompt_of(inputs, weights, segments, longest=2) == [6, 7]
  assert distill.prompt_of(inputs, np.zeros(8, np.float32), segments, longest=8) == [5, 6, 7, 8, 9]
  rows = distill.on_policy_rows([[5, 6, 7], [4]], [[11, 12, 2], [13]], seq_len=7)
  np.testing.assert_array_equal(rows['inputs'], [[5, 6, 7, 11, 12, 0, 0], [4, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(rows['targets'], [[6, 7, 11, 12, 2, 0, 0], [13, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(rows['weights'], [[0, 0, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(rows['segment_ids'], [[1, 1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(rows['positions'][0], [0, 1, 2, 3, 4, 0, 0])
