"""The loss on chat data: only assistant tokens count, packing changes nothing, and the mean is over the weighted
tokens of the whole batch (not a mean of per-row or per-microbatch means)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import model as model_lib
from jaxlm import sharding
from jaxlm.data import chat as chat_lib
from jaxlm.data import pipeline as data_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import tokenizer as tokenizer_lib
from tests.data import chat_fixtures
from tests.helpers import load_config, plain_program

T = 128


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  """(config, the first packed rows of a prepared chat dataset, their conversations one per row, params)."""
  d = tmp_path_factory.mktemp('sft')
  tok_dir = chat_fixtures.make_tokenizer(str(d / 'tok'))
  chat_fixtures.write_jsonl(d / 'chat.jsonl', chat_fixtures.conversations(30))
  out = str(d / 'prepared')
  prepare_lib.prepare(prepare_lib.expand_inputs([str(d / 'chat.jsonl')]), out, tokenizer=tok_dir, workers=1,
                      data_format='chat', seq_len=T, eval_fraction=0.1, progress=False)
  vocab = tokenizer_lib.load(out).vocab_size
  cfg = load_config('palm_tiny')
  cfg.model.update(vocab_size=vocab, d_model=32, num_heads=2, num_kv_heads=1, mlp_dim=64, num_layers=2)
  cfg.data.update(source='prepared', paths=out, seq_len=T)
  rows, _ = data_lib.make_train_rows(cfg.data, seed=0, vocab_size=vocab)
  packed = [r for r in (rows[k] for k in range(12)) if r['segment_ids'].max() > 1][:2]
  single = []  # the same conversations, one per row, at its start
  for row in packed:
    for s in range(1, row['segment_ids'].max() + 1):
      at = row['segment_ids'] == s
      one = {k: np.zeros_like(v) for k, v in row.items()}
      for k in one:
        one[k][:at.sum()] = row[k][at]
      one['segment_ids'][:at.sum()] = 1
      single.append(one)
  assert len(single) > len(packed)  # packing really put several conversations in a row
  stack = lambda rs: {k: np.stack([r[k] for r in rs]) for k in rs[0]}
  m = model_lib.ModelConfig.from_config(cfg.model)
  model = model_lib.Decoder(m)
  b = stack(packed)
  variables = model.init({'params': jax.random.PRNGKey(0)}, b['inputs'], b['segment_ids'], b['positions'])
  params = nn.unbox(variables['params'])
  return cfg, m, model, stack(packed), stack(single), params


@functools.partial(jax.jit, static_argnums=(0, 1))
def _loss_and_grads(model, z_loss, params, batch):
  def loss(p):
    logits = model.apply({'params': p}, batch['inputs'], batch['segment_ids'], batch['positions'])
    return model_lib.loss_fn(logits, batch['targets'], batch['weights'], z_loss)[0]
  return jax.value_and_grad(loss)(params)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_prompt_targets_do_not_count_and_assistant_targets_do(setup):
  cfg, m, model, packed, _, params = setup
  loss, grads = _loss_and_grads(model, m.z_loss, params, packed)
  prompt = np.argwhere((packed['weights'] == 0) & (packed['segment_ids'] > 0))
  assistant = np.argwhere(packed['weights'] > 0)
  assert len(prompt) and len(assistant)
  for where, counts in ((prompt[len(prompt) // 2], False), (assistant[len(assistant) // 2], True)):
    changed = {k: v.copy() for k, v in packed.items()}
    changed['targets'][tuple(where)] = (changed['targets'][tuple(where)] + 7) % m.vocab_size
    loss2, grads2 = _loss_and_grads(model, m.z_loss, params, changed)
    same = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2))]
    if counts:
      assert float(loss2) != float(loss) and not all(same)
    else:  # bit for bit
      assert np.array_equal(np.asarray(loss2), np.asarray(loss)) and all(same)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_packed_rows_equal_one_conversation_per_row(setup):
  cfg, m, model, packed, single, params = setup
  loss_p, grads_p = _loss_and_grads(model, m.z_loss, params, packed)
  loss_s, grads_s = _loss_and_grads(model, m.z_loss, params, single)
  np.testing.assert_allclose(float(loss_p), float(loss_s), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_s)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.e2e  # compiles a whole microbatched train step: the full suite, not the fast loop
def test_train_step_loss_is_the_mean_over_the_whole_batchs_weighted_tokens(setup):
  """Rows carry very different numbers of assistant tokens: a mean of per-microbatch means would differ."""
  cfg, m, model, _, single, params = setup
  rows = {k: v[:4] for k, v in single.items()}
  counts = rows['weights'].sum(axis=1)
  assert len(set(counts.tolist())) > 1
  mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:1])
  # The global weighted mean, computed whole: loss_fn divides by the sum of all the batch's weights.
  expected, grads = _loss_and_grads(model, m.z_loss, params, rows)
  norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(g))) for g in jax.tree.leaves(grads))))
  c = cfg.copy_and_resolve_references()
  c.mesh.update(data=1, fsdp=1, tensor=1)
  c.train.batch_size = 4
  program = plain_program(c, mesh, microbatches=4)  # one row per microbatch
  # A state of zeros but for the parameters (no init compile): loss and gradients depend on the parameters only.
  # Copies: the step donates its state, so it must never hold the fixture's arrays.
  state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), program.abstract_state)
  state = jax.device_put(state.replace(params=jax.tree.map(np.array, params)), program.state_shardings)
  _, metrics = program.train_step(state, {k: jax.device_put(v, program.batch_sharding) for k, v in rows.items()})
  np.testing.assert_allclose(float(metrics['loss'] + metrics['z_loss']), float(expected), rtol=1e-5)
  np.testing.assert_allclose(float(metrics['grad_norm']), norm, rtol=1e-5)
  # A mean of per-microbatch (here per-row) means is a different number: the test tells them apart.
  logits = jax.jit(model.apply)({'params': params}, rows['inputs'], rows['segment_ids'], rows['positions'])
  ce = np.asarray(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, rows['targets'][..., None], -1)[..., 0])
  per_row = np.mean((ce * rows['weights']).sum(1) / rows['weights'].sum(1))
  assert abs(per_row - float(expected)) > 1e-3
