"""Experiment tooling in the step: gradient accumulation, fp16 loss scaling, Adafactor, LR schedules."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxlm import optimizer, sharding, train
from tests.helpers import load_config, odd_config, plain_program, random_batch


def _steps(cfg, batch, n=1, microbatches=1, mesh_shape=(1, 8, 1)):
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh_shape
  mesh = sharding.make_mesh(cfg.mesh)
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    program = plain_program(cfg, mesh, steps=50, microbatches=microbatches)
    state, out = program.init(), []
    for _ in range(n):
      state, m = program.train_step(state, train.global_batch(batch, program.batch_sharding))
      out.append(jax.device_get(m))
    return state, out


@pytest.mark.e2e  # two compiled programs on a 32-row batch
def test_microbatches_give_the_full_batch_gradient():
  cfg = odd_config()
  # A first Adam step is g / (|g| + eps): with eps = 1 it is ~linear in g, so parameters compare gradients.
  cfg.optim.eps = 1.0
  batch = random_batch(32, 24, cfg.model.vocab_size, docs=3)  # 4 rows per device: split stays local
  batch['weights'][:5, 17:] = 0.0  # uneven token counts per microbatch: the denominator must be global
  full_state, full = _steps(cfg, batch)
  acc_state, acc = _steps(cfg, batch, microbatches=4)
  keys = [k for k in full[0] if k == 'loss' or k.startswith(('grad_norm', 'z_loss', 'max_logit'))]
  assert len(keys) >= 7  # loss, z_loss, max_logit, total and per-group gradient norms
  for key in keys:
    np.testing.assert_allclose(acc[0][key], full[0][key], rtol=1e-5, err_msg=key)
  for a, b in zip(jax.tree.leaves(acc_state.params), jax.tree.leaves(full_state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


@pytest.mark.e2e  # two 10-step training runs
def test_fp16_with_dynamic_loss_scaling_tracks_bf16():
  batch = random_batch(8, 24, 398, docs=2)
  losses = {}
  for dtype in ('bfloat16', 'float16'):
    cfg = odd_config()
    cfg.model.dtype = dtype
    cfg.optim.update(loss_scale_init=2.0 ** 15, loss_scale_period=3)
    _, metrics = _steps(cfg, batch, n=10)
    losses[dtype] = [float(m['loss']) for m in metrics]
  np.testing.assert_allclose(losses['float16'], losses['bfloat16'], rtol=0.03)
  assert losses['float16'][-1] < losses['float16'][0] - 1.0


@pytest.mark.e2e  # a 14-step training run
def test_fp16_loss_scale_backs_off_on_overflow_and_grows_again():
  cfg = odd_config()
  cfg.model.dtype = 'float16'
  cfg.optim.update(loss_scale_init=2.0 ** 28, loss_scale_period=3)  # far too high: float16 gradients overflow
  _, metrics = _steps(cfg, random_batch(8, 24, 398, docs=2), n=14)
  scales = [float(m['loss_scale']) for m in metrics]
  losses = [float(m['loss']) for m in metrics]
  assert scales[:3] == [2.0 ** 27, 2.0 ** 26, 2.0 ** 25]  # halved at each overflow ...
  assert losses[1] == losses[0]  # ... and the overflowed step changed nothing
  assert any(b == 2 * a for a, b in zip(scales, scales[1:]))  # grew again after `period` good steps
  assert losses[-1] < losses[0] - 0.5


@pytest.mark.e2e  # a 6-step training run
def test_adafactor_trains_and_shards():
  cfg = odd_config()
  cfg.optim.update(name='adafactor', lr=1e-2)
  state, metrics = _steps(cfg, random_batch(8, 24, 398), n=6)
  assert metrics[-1]['loss'] < metrics[0]['loss']
  assert state.params['layers']['mlp']['up'].sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp', 'tensor')


@pytest.mark.parametrize('name,expected', [
    ('cosine', {0: 0.0, 10: 1.0, 55: 0.55, 100: 0.1}),
    ('linear', {0: 0.0, 10: 1.0, 55: 0.55, 100: 0.1}),
    ('wsd', {0: 0.0, 10: 1.0, 79: 1.0, 80: 1.0, 90: 0.55, 100: 0.1}),
    ('constant', {0: 0.0, 5: 0.5, 10: 1.0, 100: 1.0}),
])
def test_schedules(name, expected):
  o = load_config('base').optim
  o.update(schedule=name, lr=1.0, warmup_steps=10, final_lr_fraction=0.1, decay_fraction=0.2)
  lr = optimizer.schedule(o, total_steps=100)
  for step, value in expected.items():
    np.testing.assert_allclose(float(lr(step)), value, atol=1e-6, err_msg=f'{name} at {step}')


@pytest.mark.slow(reason='one compile per batch-ramp stage, then a resume across stages compared with an uninterrupted run')
def test_batch_ramp_one_compile_per_stage_and_exact_resume_across_stages(tmp_path, data_cache):
  import shutil
  from tests.helpers import read_records
  cfg = load_config('palm_tiny')
  cfg.data.cache_dir = str(data_cache)
  cfg.mesh.update(fsdp=2, tensor=4)
  cfg.train.update(steps=20, log_every=1, batch_ramp='2:2000,4:5000', batch_size=8)
  cfg.checkpoint.update(every=5, keep=5)
  train.run(cfg, str(tmp_path / 'full'))
  records = read_records(tmp_path / 'full')
  # 64-token rows: 2 rows per step until 2,048 tokens (16 steps), then 4 until 5,120, then 8.
  assert [r['batch_size'] for r in records] == [2] * 16 + [4] * 4
  assert records[-1]['tokens'] == 16 * 2 * 64 + 4 * 4 * 64
  # Resume from step 10 (before the stage change): the same losses, so the iterator's position was exact.
  (tmp_path / 'resumed' / 'checkpoints').mkdir(parents=True)
  shutil.copytree(tmp_path / 'full' / 'checkpoints' / '10', tmp_path / 'resumed' / 'checkpoints' / '10')
  train.run(cfg, str(tmp_path / 'resumed'))
  resumed = read_records(tmp_path / 'resumed')
  assert [r['step'] for r in resumed] == list(range(11, 21))
  assert [r['loss'] for r in resumed] == [r['loss'] for r in records[10:]]
