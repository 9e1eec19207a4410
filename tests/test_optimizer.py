"""Learning-rate schedule values and the weight-decay mask."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxlm import optimizer
from tests.conftest import made_once
from tests.helpers import assert_fails_with, grid, load_config, odd_config, random_batch, read_records


def test_schedule_warmup_peak_and_end():
  o = load_config('base').optim
  o.update(lr=1e-3, warmup_steps=100, final_lr_fraction=0.1)
  lr = optimizer.schedule(o, total_steps=1000)
  np.testing.assert_allclose(float(lr(0)), 0.0)
  np.testing.assert_allclose(float(lr(50)), 5e-4, rtol=1e-6)  # halfway up the linear warmup
  np.testing.assert_allclose(float(lr(100)), 1e-3, rtol=1e-6)  # end of warmup = peak
  np.testing.assert_allclose(float(lr(550)), 1e-3 * (0.1 + 0.9 * 0.5), rtol=1e-5)  # cosine midpoint
  np.testing.assert_allclose(float(lr(1000)), 1e-4, rtol=1e-6)  # last step: final fraction of the peak
  assert all(float(lr(s)) >= float(lr(s + 1)) for s in range(100, 1000, 50))


def test_decay_mask_skips_norms_and_biases_even_when_stacked():
  specs = {'embedding': P('vocab', 'embed'), 'layers': {'norm': {'scale': P('layers', 'embed')},
                                                        'mlp': {'up': P('layers', 'embed', 'mlp')},
                                                        'moe': {'gate_bias': P('layers', 'experts', 'mlp')}},
           'final_norm': {'scale': P('embed')}}
  assert optimizer.decay_mask(specs) == {'embedding': True, 'layers': {'norm': {'scale': False},
                                                                      'mlp': {'up': True},
                                                                      'moe': {'gate_bias': False}},
                                         'final_norm': {'scale': False}}


# Muon (jaxlm/muon.py) ------------------------------------------------------------------------------------------

import functools  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from jaxlm import model as model_lib  # noqa: E402
from jaxlm import muon, sharding  # noqa: E402


@functools.cache
def _tiny_logical(scan_layers: bool = True, layers: int = 2):
  """palm_tiny's parameter logical specs and shapes (no arrays)."""
  c = load_config('palm_tiny')
  c.model.update(scan_layers=scan_layers, tie_embeddings=False, num_layers=layers)  # an unembedding too
  m = model_lib.ModelConfig.from_config(c.model)
  tokens = jnp.zeros((1, 8), jnp.int32)
  boxed = jax.eval_shape(lambda: model_lib.Decoder(m).init({'params': jax.random.PRNGKey(0)}, tokens, tokens + 1,
                                                           tokens)['params'])
  return nn.get_partition_spec(boxed), jax.tree.map(lambda b: b.shape, nn.unbox(boxed))


def _muon_cfg(**kw):
  o = load_config('palm_tiny').optim
  o.update(name='muon', clip=0.0, **kw)
  return o


def _muon_tx(logical, lr=1e-2, **kw):
  o = _muon_cfg(**kw)
  return muon.muon(o, lr, lr, logical, optimizer.decay_mask(logical))


def _random_tree(shapes, seed):
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  rng = np.random.default_rng(seed)
  return treedef.unflatten([rng.standard_normal(s).astype(np.float32) for s in leaves])


def test_muon_routes_matrices_by_logical_names():
  logical, shapes = _tiny_logical()
  labels = muon.labels(logical)
  flat = {jax.tree_util.keystr(k): (lab, shapes_leaf) for (k, lab), shapes_leaf in zip(
      jax.tree_util.tree_flatten_with_path(labels)[0], jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))}
  under_muon = sorted(k for k, (lab, _) in flat.items() if lab == 'muon')
  print('under Muon:', under_muon)
  # Every (scanned) matrix weight, 3-D and 4-D alike, goes to Muon; embedding, unembedding and norms to AdamW.
  assert under_muon == [f"['layers']['{g}']['{w}']" for g, ws in (('attention', ('key', 'out', 'query', 'value')),
                                                                  ('mlp', ('down', 'gate', 'up'))) for w in ws]
  for k in ("['embedding']", "['unembed']", "['final_norm']['scale']", "['layers']['norm']['scale']"):
    assert flat[k][0] == 'adam', k
  size = lambda keys: sum(int(np.prod(flat[k][1])) for k in keys)
  non_embedding = [k for k in flat if k not in ("['embedding']", "['unembed']")]
  assert size(under_muon) / size(non_embedding) >= 0.99
  # The matrix's rows and columns: q/k/v read embed and write (heads, kv); out and down write embed.
  assert muon.dimension_numbers(P('layers', 'embed', 'heads', 'kv')) == ((1,), (2, 3))
  assert muon.dimension_numbers(P('layers', 'heads', 'kv', 'embed')) == ((1, 2), (3,))
  assert muon.dimension_numbers(P('stage', 'layers', 'mlp', 'embed')) == ((2,), (3,))
  assert muon.dimension_numbers(P('vocab', 'embed')) is None


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_muon_stacked_updates_equal_per_layer_updates():
  logical, shapes = _tiny_logical(scan_layers=True)
  flat_logical, flat_shapes = _tiny_logical(scan_layers=False)
  params, grads = _random_tree(shapes, 0), _random_tree(shapes, 1)
  layers = shapes['layers']['norm']['scale'][0]
  per_layer = lambda tree: {k: v for k, v in tree.items() if k != 'layers'} | {
      f'layers_{i}': jax.tree.map(lambda x: x[i], tree['layers']) for i in range(layers)}
  assert jax.tree.structure(per_layer(params)) == jax.tree.structure(flat_shapes, is_leaf=lambda x: isinstance(x, tuple))
  stacked_tx, flat_tx = _muon_tx(logical), _muon_tx(flat_logical)
  s_update, f_update = jax.jit(stacked_tx.update), jax.jit(flat_tx.update)
  # Two steps: the momentum carries over.
  _, s_state = s_update(grads, stacked_tx.init(params), params)
  _, f_state = f_update(per_layer(grads), flat_tx.init(per_layer(params)), per_layer(params))
  stacked, _ = s_update(params, s_state, params)
  flat, _ = f_update(per_layer(params), f_state, per_layer(params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), per_layer(stacked), flat)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_newton_schulz_singular_values_and_scale_invariance():
  g = np.random.default_rng(0).standard_normal((4, 48, 80)).astype(np.float32)
  s = np.linalg.svd(np.asarray(muon.orthogonalize(jnp.asarray(g))), compute_uv=False)
  assert 0.6 <= s.min() and s.max() <= 1.2, (s.min(), s.max())
  reference = np.asarray(muon.orthogonalize(jnp.asarray(g)))
  for c in (1e-12, 1e-9, 1e-6, 1e-3, 10.0, 1e3, 1e6):
    np.testing.assert_allclose(np.asarray(muon.orthogonalize(jnp.asarray(g * c))), reference, atol=1e-3,
                               err_msg=f'c={c}')
  assert not np.any(np.asarray(muon.orthogonalize(jnp.zeros((1, 8, 16)))))  # a zero gradient stays zero


@pytest.mark.parametrize('mode', ['rms', 'spectral'])
def test_muon_update_rms(mode):
  logical, shapes = _tiny_logical()
  lr = 1e-2
  tx = _muon_tx(logical, lr=lr, weight_decay=0.0, muon_scale=mode)
  params, grads = _random_tree(shapes, 0), _random_tree(shapes, 1)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  labels = muon.labels(logical)
  for lab, u, spec in zip(jax.tree.leaves(labels), jax.tree.leaves(updates),
                          jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, P))):
    if lab != 'muon':
      continue
    rms = float(np.sqrt(np.mean(np.square(u)))) / lr
    if mode == 'rms':  # ≈ 0.2, AdamW's typical update RMS, whatever the shape
      assert 0.15 <= rms <= 0.25, (spec, rms)
    else:  # spectral: √max(1, fan_out/fan_in) × an orthogonal matrix's RMS 1/√max(fan_in, fan_out)
      d = muon.dimension_numbers(spec)
      rows = np.prod([u.shape[a] for a in d.reduction_axis])
      cols = np.prod([u.shape[a] for a in d.output_axis])
      expect = np.sqrt(max(1, cols / rows)) / np.sqrt(max(rows, cols))
      assert 0.7 * expect <= rms <= 1.2 * expect, (spec, rms, expect)


def _mesh(**axes):
  c = load_config('palm_tiny')
  c.mesh.update(**axes)
  return sharding.make_mesh(c.mesh)


def _state_shardings(tx, logical, params, mesh):
  """Muon's momentum sharded like its parameters (as the trainer places it), the rest replicated."""
  abstract = jax.eval_shape(lambda: params)
  return sharding.logical_to_mesh(optimizer.state_logical(tx, jax.eval_shape(tx.init, abstract), logical, abstract),
                                  mesh)


def _sharded_updates(logical, shapes, mesh, steps=2):
  """`steps` Muon updates of random gradients on `mesh` (None: one device, no mesh), as host arrays."""
  tx = _muon_tx(logical)
  params = _random_tree(shapes, 0)
  if mesh is None:
    state, update = tx.init(params), jax.jit(tx.update)
    for i in range(steps):
      updates, state = update(_random_tree(shapes, i + 1), state, params)
    return jax.tree.map(np.asarray, (updates, state))
  shard = sharding.logical_to_mesh(logical, mesh)
  with sharding.activate(mesh):
    params = jax.device_put(params, shard)
    state = jax.jit(tx.init, out_shardings=_state_shardings(tx, logical, params, mesh))(params)
    update = jax.jit(tx.update, in_shardings=(shard, None, shard))
    for i in range(steps):
      updates, state = update(jax.device_put(_random_tree(shapes, i + 1), shard), state, params)
  for u, s in zip(jax.tree.leaves(updates), jax.tree.leaves(shard)):
    assert u.sharding.is_equivalent_to(s, u.ndim), (u.sharding, s)  # updates come back on the params' sharding
  return jax.tree.map(np.asarray, (updates, state))


_MESHES = {'fsdp4xtensor2': (dict(fsdp=4, tensor=2), True), 'pipeline': (dict(stage=2, fsdp=2, tensor=2), True),
           'fsdp8-unscanned': (dict(fsdp=8), False)}


@pytest.mark.parametrize('case', grid(list(_MESHES), fast=['fsdp4xtensor2']))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_muon_sharded_matches_one_device(case):
  axes, scan = _MESHES[case]
  logical, shapes = _tiny_logical(scan_layers=scan, layers=4)
  reference = _sharded_updates(logical, shapes, None)
  got = _sharded_updates(logical, shapes, _mesh(**axes))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, reference)


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_muon_orthogonalises_each_matrix_on_one_device_without_gathering_every_layer():
  # fsdp 4 x tensor 2, 4 layers: each device should hold a slot of whole matrices (a layer, or padding), never a
  # weight's every layer at once.
  import re
  logical, shapes = _tiny_logical(layers=4)
  mesh = _mesh(fsdp=4, tensor=2)
  tx = _muon_tx(logical)
  shard = sharding.logical_to_mesh(logical, mesh)
  with sharding.activate(mesh):
    params = jax.device_put(_random_tree(shapes, 0), shard)
    state = jax.jit(tx.init, out_shardings=_state_shardings(tx, logical, params, mesh))(params)
    hlo = jax.jit(tx.update).lower(params, state, params).compile().as_text()
  sizes = [int(np.prod([int(d) for d in dims.split(',') if d])) for dims in re.findall(r'f32\[([\d,]*)\]', hlo)]
  mlp = shapes['layers']['mlp']['up']  # (layers, embed, mlp): the largest Muon weight
  whole_layer, every_layer = mlp[1] * mlp[2], int(np.prod(mlp))
  assert max(sizes) < every_layer, max(sizes)  # no array on a device holds every layer's matrix ...
  assert 'all-to-all' in hlo  # ... the matrices move to their devices by all-to-all
  # Newton–Schulz runs on whole matrices: X Xᵀ of a whole (embed, mlp) matrix appears, per device.
  assert re.search(rf'f32\[(1,)?{mlp[1]},{mlp[1]}\]', hlo)
  assert whole_layer in sizes


# EMA and schedule-free ----------------------------------------------------------------------------------------


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_sf_adamw_is_optax_schedule_free_adamw_with_the_decay_mask():
  o = load_config('palm_tiny').optim
  o.update(name='sf_adamw', clip=0.0, weight_decay=0.0, warmup_steps=3)
  params = {'w': np.ones((4, 3), np.float32), 'b': np.zeros((3,), np.float32)}
  ours = optimizer.make_optimizer(o, 100, {'w': True, 'b': False})
  theirs = optax.contrib.schedule_free_adamw(o.lr, warmup_steps=3, b1=o.b1, b2=o.b2, eps=o.eps)
  s1, s2 = ours.init(params), theirs.init(params)
  for i in range(5):
    g = _random_tree({'w': (4, 3), 'b': (3,)}, i)
    u1, s1 = ours.update(g, s1, params)
    u2, s2 = theirs.update(g, s2, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), u1, u2)
    params = optax.apply_updates(params, u1)
  # Evaluation uses the averaged point x, not the interpolated y the gradients are taken at.
  x = optimizer.eval_params(s1, params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               x, optax.contrib.schedule_free_eval_params(s2, params))
  assert not np.allclose(x['w'], params['w'])


def _program_steps(cfg, n, mesh_shape=(1, 8, 1)):
  from jaxlm import train
  from tests.helpers import plain_program
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh_shape
  mesh = sharding.make_mesh(cfg.mesh)
  program = plain_program(cfg, mesh, steps=50)
  batch = random_batch(8, 24, cfg.model.vocab_size, docs=2)
  with sharding.activate(mesh):
    state = program.init()
    states = [jax.tree.map(np.asarray, state)] + [None] * n
    for i in range(n):
      state, metrics = program.train_step(state, train.global_batch(batch, program.batch_sharding))
      states[i + 1] = state if i == n - 1 else jax.tree.map(np.asarray, state)
  return program, states, metrics


@pytest.mark.e2e  # a 3-step training run
def test_ema_copies_until_start_then_averages_float32_sharded_like_params():
  cfg = odd_config()
  cfg.optim.update(name='muon', ema=0.75, ema_start=2)
  program, states, _ = _program_steps(cfg, 3)
  s0, s1, s2, last = states
  for ema, p, shard in zip(jax.tree.leaves(last.ema), jax.tree.leaves(last.params),
                           jax.tree.leaves(program.state_shardings.params)):
    assert ema.dtype == np.float32 and ema.sharding == shard == p.sharding
  jax.tree.map(lambda e, p: np.testing.assert_array_equal(e, p), s2.ema, s2.params)  # steps 0, 1 < ema_start: a copy
  jax.tree.map(lambda e, prev, p: np.testing.assert_allclose(e, 0.75 * prev + 0.25 * np.asarray(p), rtol=1e-6),
               jax.tree.map(np.asarray, last.ema), s2.ema, last.params)
  assert not np.allclose(np.asarray(last.ema['embedding']), np.asarray(last.params['embedding']))


@pytest.mark.e2e  # a 1-step float16 run
def test_fp16_overflow_leaves_muon_momentum_and_ema_unchanged():
  cfg = odd_config()
  cfg.model.dtype = 'float16'
  cfg.optim.update(name='muon', ema=0.9, loss_scale_init=2.0 ** 28)  # far too high: the gradients overflow
  _, (s0, s1), metrics = _program_steps(cfg, 1)
  assert float(metrics['loss_scale']) == 2.0 ** 27  # it did overflow
  trace = lambda s: optimizer.find_state(s.opt_state, optax.TraceState).trace
  for before, after in zip(jax.tree.leaves(trace(s0)) + jax.tree.leaves(s0.ema) + jax.tree.leaves(s0.params),
                           jax.tree.leaves(trace(s1)) + jax.tree.leaves(s1.ema) + jax.tree.leaves(s1.params)):
    np.testing.assert_array_equal(np.asarray(after), before)


# Checkpoints: exact resume, and a checkpoint of another optimizer refused --------------------------------------

OPTIMIZERS = {'muon_ema': ('--config.optim.name=muon', '--config.optim.ema=0.9', '--config.optim.ema_start=4'),
              'sf_adamw': ('--config.optim.name=sf_adamw',)}


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, data_cache):
  """One uninterrupted run per optimizer (trained on first use), as test_checkpoint's `reference`."""
  from tests import test_checkpoint
  runs = {}

  def get(name):
    if name not in runs:
      with made_once(tmp_path_factory, f'uninterrupted_{name}') as (workdir, done):
        if not done:
          test_checkpoint._run(workdir, data_cache, *OPTIMIZERS[name])
      runs[name] = workdir
    return runs[name]

  return get


def _final_state(workdir):
  import orbax.checkpoint as ocp
  from tests import test_checkpoint
  return ocp.StandardCheckpointer().restore(str(workdir / 'checkpoints' / str(test_checkpoint.STEPS) / 'state'))


@pytest.mark.parametrize('name', list(OPTIMIZERS))
@pytest.mark.slow(reason='a trainer killed with SIGKILL mid-run and its resume: two processes that compile and train')
def test_sigkill_resumes_bit_for_bit(name, uninterrupted, tmp_path, data_cache):
  import signal
  import time
  from tests import test_checkpoint as tc
  reference = uninterrupted(name)
  proc = tc._start(tmp_path, data_cache, *OPTIMIZERS[name])
  tc._wait_for_step(proc, tmp_path, 6)  # between checkpoints (every 4) ...
  while not (tmp_path / 'checkpoints' / '4' / 'commit_success.txt').exists() and proc.poll() is None:
    time.sleep(0.05)  # ... once step 4's (async) save is in: the steps after it are redone
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  out = tc._run(tmp_path, data_cache, *OPTIMIZERS[name])
  assert 'resumed from checkpoint step' in out.stdout
  expected = {step: losses[0] for step, losses in tc._losses(reference).items()}
  got = tc._losses(tmp_path)
  assert sorted(got) == list(range(1, tc.STEPS + 1))
  for step, losses in got.items():
    assert losses == [expected[step]] * len(losses), step
  evals = lambda w: [(r['step'], r.get('eval_loss'), r.get('eval_loss_ema')) for r in read_records(w, 'eval')]
  assert evals(tmp_path)[-1] == evals(reference)[-1]
  a, b = _final_state(reference), _final_state(tmp_path)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  if name == 'muon_ema':
    assert jax.tree.leaves(a['ema']) and evals(reference)[-1][2] is not None  # the EMA is checkpointed
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):  # params, Muon momentum, EMA, schedule-free's z
    np.testing.assert_array_equal(x, y)
  # tools.eval scores what the trainer evaluated: the EMA with --weights=ema, schedule-free's averaged point raw.
  import json
  from tests.helpers import run_cli
  weights, key = ('ema', 'eval_loss_ema') if name == 'muon_ema' else ('raw', 'eval_loss')
  out = run_cli('jaxlm.tools.eval', f'--workdir={reference}', f'--weights={weights}', '--json')
  assert out.returncode == 0, out.stderr[-2000:]
  last = read_records(reference, 'eval')[-1]
  np.testing.assert_allclose(json.loads(out.stdout.strip().splitlines()[-1])['loss'], last[key], rtol=1e-5)


@pytest.mark.slow(reason='a trainer run, then one refused resume per optimizer or shape change, each its own process')
def test_resuming_with_another_optimizer_or_shape_is_refused_and_keeps_the_checkpoint(uninterrupted, tmp_path,
                                                                                      data_cache):
  import shutil
  from tests import test_checkpoint as tc
  workdir = tmp_path / 'run'
  shutil.copytree(uninterrupted('muon_ema'), workdir)
  before = sorted(p.name for p in (workdir / 'checkpoints').iterdir())
  for extra, says in ((('--config.optim.name=adamw',), 'optim.name=muon, optim.ema on'),
                      (OPTIMIZERS['muon_ema'] + ('--config.model.mlp_dim=96',), 'params.layers.mlp.down')):
    out = tc._run(workdir, data_cache, f'--config.train.steps={tc.STEPS + 4}', *extra, check=False)
    last = assert_fails_with(out, 2, 'does not fit this run', says, 'checkpoint.init_from=')
    assert 'Traceback' not in out.stderr, last
    assert 'compiled the train step' not in out.stdout  # refused from the checkpoint's metadata, before the compile
  assert not (tmp_path / 'run' / 'checkpoints.unreadable').exists()  # never quarantined
  assert sorted(p.name for p in (workdir / 'checkpoints').iterdir()) == before


@pytest.mark.parametrize('overrides, message', [
    (dict(name='lion'), 'optim.name='), (dict(muon_scale='frobenius'), 'optim.muon_scale='),
    (dict(muon_momentum=1.0), 'optim.muon_momentum'), (dict(ema=1.0), 'optim.ema=')])
def test_bad_optimizer_config_names_the_field(overrides, message):
  from jaxlm import config as config_lib
  cfg = load_config('palm_tiny')
  cfg.optim.update(overrides)
  with pytest.raises(config_lib.ConfigError, match=message.replace('.', r'\.')):
    config_lib.validate(cfg, 8)
