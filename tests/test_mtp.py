"""Multi-token prediction (jaxlm/mtp.py): each depth's loss in the training step equals a NumPy cross-entropy of the
same logits against the targets shifted by the depth, packing and SFT weights applied; the MTP modules train and
the main logits do not depend on them."""

import flax.linen as nn
import jax
import numpy as np

from jaxlm import model as model_lib
from jaxlm import mtp as mtp_lib
from jaxlm import sharding
from jaxlm import train
from tests.helpers import odd_config, plain_program, random_batch

DEPTH, LAMBDA = 2, 0.25


def _numpy_depth_losses(logits, batch):
  """Depth k's mean cross-entropy: position i predicts targets[i + k] (token i + k + 1), where i + k is in the row,
  in i's document, and weighted by weights[i + k]."""
  out = []
  B, T, _ = logits.shape[1:]
  for k in range(1, logits.shape[0] + 1):
    total, count = 0.0, 0.0
    for b in range(B):
      for i in range(T - k):
        if batch['segment_ids'][b, i + k] != batch['segment_ids'][b, i]:
          continue
        w = float(batch['weights'][b, i + k])
        row = logits[k - 1, b, i].astype(np.float64)
        lse = np.log(np.exp(row - row.max()).sum()) + row.max()
        total += w * (lse - row[batch['targets'][b, i + k]])
        count += w
    out.append(total / count)
  return out


def test_mtp_losses_equal_numpy_and_the_modules_train():
  """One step of a model with two MTP depths on one device: its logged mtp_loss_1, mtp_loss_2 equal the NumPy
  cross-entropies (1e-5) of the depths' logits at the step's parameters, on a batch packed two documents to a row
  with some targets weighted 0; the step changes the MTP parameters, the main logits do not use them, and
  param_count counts them."""
  cfg = odd_config(parallel_block=False)
  cfg.model.update(mtp_depth=DEPTH, mtp_weight=LAMBDA)
  batch = random_batch(4, 16, cfg.model.vocab_size, docs=2)
  batch['weights'][:, :5] = 0.0  # an SFT-style prompt mask
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    program = plain_program(cfg, mesh)
    state = program.init()
    m = model_lib.ModelConfig.from_config(cfg.model)
    params = jax.device_get(state.params)
    assert model_lib.param_count(m) == sum(np.size(x) for x in jax.tree.leaves(params))
    # Jitted, not op by op: one compile each for this forward and the plain one below, not a hundred.
    main, sown = jax.jit(lambda p, *a: model_lib.Decoder(m).apply({'params': p}, *a, mutable=[mtp_lib.COLLECTION]))(
        params, batch['inputs'], batch['segment_ids'], batch['positions'])
    depth_logits = np.asarray(sown[mtp_lib.COLLECTION]['logits'][0])  # (D, B, T, V)
    assert depth_logits.shape == (DEPTH, 4, 16, cfg.model.vocab_size)
    new_state, metrics = program.train_step(state, train.global_batch(batch, program.batch_sharding))
  want = _numpy_depth_losses(depth_logits, batch)
  got = [float(metrics[f'mtp_loss_{k}']) for k in range(1, DEPTH + 1)]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert abs(want[0] - want[1]) > 1e-4  # the depths differ: not one loss logged twice
  plain = jax.jit(lambda p, *a: model_lib.Decoder(m).apply({'params': p}, *a))(
      params, batch['inputs'], batch['segment_ids'], batch['positions'])
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(main))  # sampling's logits: the main head's
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), params['mtp'],
                       jax.device_get(new_state.params['mtp']))
  assert min(jax.tree.leaves(moved)) > 0  # every MTP parameter got a gradient


def test_mtp_weight_scales_the_modules_gradient():
  """With model.mtp_weight=0 the MTP modules get no gradient (their parameters stay put under plain Adam without
  decay), so the loss that trains them is the weighted one."""
  cfg = odd_config(parallel_block=False)
  cfg.model.update(mtp_depth=1, mtp_weight=0.0)
  cfg.optim.weight_decay = 0.0
  batch = random_batch(4, 16, cfg.model.vocab_size)
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    program = plain_program(cfg, mesh)
    state = program.init()
    before = jax.device_get(state.params['mtp'])  # the step donates the state
    new_state, metrics = program.train_step(state, train.global_batch(batch, program.batch_sharding))
  assert float(metrics['mtp_loss_1']) > 0
  for a, b in zip(jax.tree.leaves(before),
                  jax.tree.leaves(jax.device_get(new_state.params['mtp']))):
    np.testing.assert_array_equal(a, b)
