"""LoRA: adapters beside the projections, sharded by the rules table; only they train; the base stays bit for bit."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from jaxlm import checkpoint, config, lora as lora_lib, model as model_lib, sharding, step, train
from jaxlm import generate as generate_lib
from tests.helpers import grid, load_config, plain_program, random_batch

RANK, ALPHA = 3, 6.0  # scale 2: a wrong alpha/r fails


def lora_config(rank: int = RANK, parallel_block: bool = False, **model):
  """palm_tiny with distinct sizes (a wrong transpose fails), float32 throughout, LoRA on every projection."""
  c = load_config('palm_tiny')
  c.model.update(vocab_size=400, d_model=56, num_heads=4, num_kv_heads=2, head_dim=14, mlp_dim=92,
                 parallel_block=parallel_block, dtype='float32', **model)
  c.model.lora.update(rank=rank, alpha=ALPHA)
  c.data.seq_len = 24
  # eps=1: the first Adam steps are ~lr·g rather than ~lr·sign(g), so tiny gradients compare stably across meshes.
  c.optim.update(warmup_steps=0, lr=1e-2, eps=1.0, weight_decay=0.0)
  return c


def _mesh(cfg, shape=(1, 8, 1), stage=1):
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = shape
  cfg.mesh.stage = stage
  return sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(shape)) * stage])


def _flat(tree):
  # Copies: a host view of a CPU buffer would change under the next step's donation.
  return {'/'.join(k): np.array(v, copy=True) for k, v in traverse_util.flatten_dict(jax.device_get(tree)).items()}


def _saved(path, params):
  """A checkpoint directory holding `params` as a run's step 1 (what checkpoint.init_from reads)."""
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path / '1' / 'state', {'params': params})
  return path


@pytest.fixture(scope='module')
def five_steps(tmp_path_factory):
  """A full model's parameters saved, a LoRA run warm-started from them, five steps: (saved, init, after, state,
  program). The saved model is the LoRA model's own base moved by noise (on the host, no second init compiled), so
  every base leaf after the warm start differs from what the LoRA program's init drew."""
  cfg = lora_config()
  program = plain_program(cfg, _mesh(cfg))
  state = program.init()
  rng = np.random.default_rng(0)
  base = jax.tree.map(lambda x: np.asarray(x) + (0.05 * rng.standard_normal(x.shape)).astype(x.dtype),
                      lora_lib.split_adapters(jax.device_get(state.params))[0])
  path = _saved(tmp_path_factory.mktemp('full'), base)
  params = checkpoint.load_params(str(path), program.abstract_state.params, program.state_shardings.params,
                                  fill=state.params)
  state = state.replace(params=params)
  init = _flat(state.params)
  for i in range(5):
    batch = train.global_batch(random_batch(8, 24, 400, seed=i, docs=2), program.batch_sharding)
    state, _ = program.train_step(state, batch)
  return _flat(base), init, _flat(state.params), state, program


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_step0_logits_equal_the_base_bit_for_bit():
  batch = random_batch(2, 24, 400, docs=2)
  cfg = lora_config()
  program = plain_program(cfg, _mesh(cfg, (1, 1, 1)))
  params = jax.device_get(program.init().params)
  plain = model_lib.Decoder(dataclasses.replace(program.model.config, lora=lora_lib.LoraConfig()))
  args = batch['inputs'], batch['segment_ids'], batch['positions']
  lora_logits = jax.jit(program.model.apply)({'params': params}, *args)
  base_logits = jax.jit(plain.apply)({'params': lora_lib.split_adapters(params)[0]}, *args)
  np.testing.assert_array_equal(np.asarray(lora_logits), np.asarray(base_logits))


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_five_steps_train_only_adapters_from_init_from(five_steps):
  saved, init, after, state, program = five_steps
  adapters = [k for k in after if lora_lib.is_adapter((k,))]
  assert len(adapters) == 2 * 7  # every projection of the scanned stack: A and B
  for k, v in saved.items():  # every base leaf is init_from's, bit for bit, after five steps
    np.testing.assert_array_equal(after[k], v, err_msg=k)
  for k in adapters:
    if k.endswith('_lora_b'):
      assert not np.any(init[k]) and all(np.any(layer) for layer in after[k]), k  # zero at init; every layer moved
  # Optimizer state: the adapters' moments only, no base-shaped leaf.
  base_shapes = {v.shape for v in saved.values()}
  opt_shapes = {x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim}
  assert opt_shapes and not opt_shapes & base_shapes, opt_shapes & base_shapes
  assert opt_shapes == {init[k].shape for k in adapters}


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_init_from_refuses_an_adapter_of_another_shape(five_steps, tmp_path_factory):
  *_, state, program = five_steps
  path = _saved(tmp_path_factory.mktemp('lora_run'), jax.device_get(state.params))
  cfg = lora_config(rank=5)
  other = plain_program(cfg, program.mesh)
  with pytest.raises(checkpoint.CheckpointError, match=r"attention.*key_lora_a.*\(2, 56, 3\)"):
    checkpoint.load_params(str(path), other.abstract_state.params, other.state_shardings.params,
                           fill=jax.tree.map(jnp.zeros_like, other.abstract_state.params))


def _steps(cfg, shape, batches):
  program = plain_program(cfg, _mesh(cfg, shape))
  state = program.init()
  losses = []
  for b in batches:
    state, metrics = program.train_step(state, train.global_batch(b, program.batch_sharding))
    losses.append(float(metrics['loss']))
  return losses, state


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_adapters_sharded_by_the_rules_and_a_step_equals_one_device():
  batches = [random_batch(8, 24, 400, seed=s, docs=2) for s in range(2)]
  losses, state = _steps(lora_config(), (1, 2, 4), batches)
  layers = state.params['layers']
  expected = {  # A follows the weight's input axes, B its output axes; the rank is never split
      ('attention', 'query_lora_a'): P(None, 'fsdp', None), ('attention', 'query_lora_b'): P(None, None, 'tensor', None),
      ('attention', 'key_lora_b'): P(None, None, None, None), ('attention', 'out_lora_a'): P(None, 'tensor', None, None),
      ('attention', 'out_lora_b'): P(None, None, 'fsdp'), ('mlp', 'gate_lora_a'): P(None, 'fsdp', None),
      ('mlp', 'gate_lora_b'): P(None, None, 'tensor'), ('mlp', 'down_lora_a'): P(None, 'tensor', None),
      ('mlp', 'down_lora_b'): P(None, None, 'fsdp')}
  for (module, name), spec in expected.items():
    assert layers[module][name].sharding.spec == spec, (name, layers[module][name].sharding.spec)
  adam = optax.tree_utils.tree_get(state.opt_state, 'mu')
  assert adam['layers']['attention']['query_lora_b'].sharding.spec == P(None, None, 'tensor', None)
  ref_losses, ref = _steps(lora_config(), (1, 1, 1), batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  got, want = _flat(lora_lib.split_adapters(state.params)[1]), _flat(lora_lib.split_adapters(ref.params)[1])
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)


def _loss_and_adapter_grads(program, params, batch):
  """(loss, adapter gradients) of `params` on `batch` through the program's model, on its mesh."""
  m = program.model.config

  def loss(adapters, batch):
    p = lora_lib.join_adapters(params, adapters)
    logits = program.model.apply({'params': p}, batch['inputs'], batch['segment_ids'], batch['positions'])
    return model_lib.loss_fn(logits, batch['targets'], batch['weights'], m.z_loss)[0]

  with sharding.activate(program.mesh):
    return jax.jit(jax.value_and_grad(loss))(lora_lib.split_adapters(params)[1], batch)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_scanned_unrolled_and_pipelined_give_the_same_loss_and_adapter_gradients():
  cfg = lora_config(num_layers=4)
  program = plain_program(cfg, _mesh(cfg, (1, 1, 1)))
  params = jax.device_get(program.init().params)
  # Non-zero Bs, so A's gradients are not zero and every adapter's path is exercised.
  params = jax.tree_util.tree_map_with_path(
      lambda k, x: np.random.default_rng(len(str(k))).normal(0, 0.05, x.shape).astype(np.float32)
      if str(k[-1].key).endswith('_lora_b') else x, params)
  batch = random_batch(8, 24, 400, docs=2)
  loss, grads = _loss_and_adapter_grads(program, params, batch)
  grads = _flat(grads)
  assert all(np.any(g) for g in grads.values())

  unrolled_cfg = lora_config(num_layers=4, scan_layers=False)
  unrolled = plain_program(unrolled_cfg, _mesh(unrolled_cfg, (1, 1, 1)))
  per_layer = {k: v for k, v in params.items() if k != 'layers'}
  per_layer.update({f'layers_{i}': jax.tree.map(lambda x, i=i: x[i], params['layers']) for i in range(4)})
  loss_u, grads_u = _loss_and_adapter_grads(unrolled, per_layer, batch)
  stacked = {'layers': jax.tree.map(lambda *xs: np.stack(xs), *[grads_u[f'layers_{i}'] for i in range(4)])}
  np.testing.assert_allclose(float(loss_u), float(loss), rtol=1e-6)
  for k, v in _flat(stacked).items():
    np.testing.assert_allclose(v, grads[k], rtol=1e-5, atol=1e-7, err_msg=f'unrolled {k}')

  piped_cfg = lora_config(num_layers=4)
  piped = plain_program(piped_cfg, _mesh(piped_cfg, (1, 4, 1), stage=2))
  placed = jax.device_put(params, piped.state_shardings.params)
  loss_p, grads_p = _loss_and_adapter_grads(piped, placed, batch)
  np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-5)
  for k, v in _flat(grads_p).items():
    np.testing.assert_allclose(v, grads[k], rtol=1e-4, atol=1e-7, err_msg=f'pipelined {k}')


@pytest.mark.parametrize('optimizer', grid(['adafactor', 'sf_adamw'], fast=['adafactor']))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_adafactor_and_schedule_free_train_adapters_only(optimizer):
  cfg = lora_config()
  # warmup_steps=1 (its first step has learning rate 0), then a step that moves the adapters.
  cfg.optim.update(name=optimizer, warmup_steps=1)
  program = plain_program(cfg, _mesh(cfg))
  state = program.init()
  before = _flat(state.params)
  for seed in range(2):
    state, metrics = program.train_step(state, train.global_batch(random_batch(8, 24, 400, seed=seed, docs=2),
                                                                  program.batch_sharding))
  after = _flat(state.params)
  assert np.isfinite(float(metrics['loss']))
  for k, v in before.items():
    if not lora_lib.is_adapter((k,)):
      np.testing.assert_array_equal(after[k], v, err_msg=k)
  assert any(np.any(after[k] != before[k]) for k in before if k.endswith('_lora_b'))
  base_shapes = {v.shape for k, v in before.items() if not lora_lib.is_adapter((k,))}
  assert not {x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim} & base_shapes
  # Evaluated at schedule-free's averaged point of the adapters; the base untouched.
  evaluated = _flat(step.eval_params(state, program.model.config))
  assert set(evaluated) == set(after)


def test_refusals_name_the_field():
  cfg = lora_config()
  cfg.optim.name = 'muon'
  cfg.model.lora.targets = ('query', 'router')
  cfg.model.lora.base_dtype = 'float16'
  with pytest.raises(config.ConfigError) as e:
    config.validate(cfg, 8)
  text = str(e.value)
  for what in ('optim.name=muon cannot run on LoRA adapters', 'model.lora.targets', 'model.lora.base_dtype'):
    assert what in text, text
  cfg = lora_config()
  cfg.model.lora.targets = ('query', 'kv_b')  # MLA's own projection, on a model without MLA
  with pytest.raises(config.ConfigError, match=r"model.lora.targets=\('query', 'kv_b'\).*MLA's only"):
    config.validate(cfg, 8)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_merged_weights_and_sampling_equal_the_lora_model():
  cfg = lora_config(parallel_block=True)
  program = plain_program(cfg, _mesh(cfg, (1, 1, 1)))
  params = jax.tree_util.tree_map_with_path(
      lambda k, x: np.random.default_rng(len(str(k))).normal(0, 0.1, x.shape).astype(np.float32)
      if str(k[-1].key).endswith('_lora_b') else np.asarray(x), jax.device_get(program.init().params))
  m = program.model.config
  plain = dataclasses.replace(m, lora=lora_lib.LoraConfig())
  merged = lora_lib.merge_adapters(params, m.lora)
  batch = random_batch(2, 24, 400, docs=2)
  args = batch['inputs'], batch['segment_ids'], batch['positions']
  # Jitted, not op by op: one compile per model, each used twice.
  lora_apply, plain_apply = jax.jit(program.model.apply), jax.jit(model_lib.Decoder(plain).apply)
  lora_logits = lora_apply({'params': params}, *args)
  plain_logits = plain_apply({'params': merged}, *args)
  base_logits = plain_apply({'params': lora_lib.split_adapters(params)[0]}, *args)
  np.testing.assert_allclose(lora_logits, plain_logits, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(lora_logits) - np.asarray(base_logits)).max() > 1e-2  # the adapters matter
  # adapters_off: the base model, exactly.
  np.testing.assert_array_equal(lora_apply({'params': lora_lib.adapters_off(params)}, *args), base_logits)
  prompts = [[5, 17, 33], [8, 2]]
  got = generate_lib.generate(m, params, prompts, 6).tokens
  want = generate_lib.generate(plain, merged, prompts, 6).tokens
  assert got == want


def test_a_refusal_is_one_line_and_exit_2():
  from tests.helpers import assert_fails_with, run_cli
  out = run_cli('jaxlm.train', '--config=configs/palm_tiny.py', '--config.model.lora.rank=4',
                '--config.optim.name=muon', '--config.train.objective=preference',
                '--config.preference.reference=base', timeout=300)
  assert_fails_with(out, 2, 'invalid config')
  for what in ('optim.name=muon cannot run on LoRA adapters', 'data.source=prepared'):
    assert what in out.stderr, out.stderr[-2000:]
