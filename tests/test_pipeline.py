"""Pipeline parallelism (jaxlm/pipeline.py): the same losses and gradients as the unpipelined step, each stage's
parameters on its own devices, checkpoints interchangeable across stage counts, bad configs refused up front."""

import functools

import jax
import numpy as np
import pytest

from jaxlm import checkpoint as checkpoint_lib
from jaxlm import config as config_lib
from jaxlm import model as model_lib
from jaxlm import pipeline
from jaxlm import sharding
from tests.helpers import (assert_fails_with, load_config, odd_config, plain_program, random_batch, read_records,
                           run_cli)

BATCH, SEQ = 16, 32


def small_config(parallel_block=True, remat='none', layers=8, **model):
  """odd_config's prime-ish sizes, 8 layers (every stage count here divides them), float32."""
  c = odd_config(parallel_block)
  c.model.update(num_layers=layers, remat=remat, **model)
  return c


def program_for(c, stage=1, data=1, fsdp=-1, tensor=1, devices=8, schedule='gpipe', repeats=2, microbatches=0,
                accumulate=1):
  c.mesh.update(stage=stage, data=data, fsdp=fsdp, tensor=tensor)
  c.pipeline.update(schedule=schedule, repeats=repeats, microbatches=microbatches)
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:devices])
  return plain_program(c, mesh, microbatches=accumulate)


def batches(c, n=2):
  return [random_batch(BATCH, SEQ, c.model.vocab_size, seed=i, docs=2) for i in range(n)]


@functools.lru_cache(maxsize=None)
def initial_state(parallel_block, remat, layers=8, **model):
  """The unpipelined program's initial state, on the host: every program here starts from it (one init compile)."""
  c = small_config(parallel_block, remat, layers, **model)
  return jax.tree.map(np.asarray, program_for(c).init())


def losses_and_grads(program, c, data, steps=0, **model):
  """Loss and gradients of the first batch at init, then the losses of `steps` train steps (float32)."""
  state = jax.device_put(initial_state(c.model.parallel_block, c.model.remat, c.model.num_layers, **model),
                         program.state_shardings)

  def loss(params, b):
    logits = program.model.apply({'params': params}, b['inputs'], b['segment_ids'], b['positions'])
    return model_lib.loss_fn(logits, b['targets'], b['weights'], c.model.z_loss)[0]

  put = lambda b: jax.device_put(b, program.batch_sharding)
  with sharding.activate(program.mesh):
    first, grads = jax.jit(jax.value_and_grad(loss))(state.params, put(data[0]))
    grads = jax.tree.map(np.asarray, grads)
  losses = [float(first)]
  for b in data[:steps]:
    state, metrics = program.train_step(state, put(b))
    losses.append(float(metrics['loss']))
  return np.array(losses), grads


@functools.lru_cache(maxsize=None)
def reference(parallel_block, remat, layers=8, steps=0, **model):
  """The unpipelined model and step on 8 devices (fsdp)."""
  c = small_config(parallel_block, remat, layers, **model)
  return losses_and_grads(program_for(c), c, batches(c), steps, **model)


def assert_same(got, want):
  (losses, grads), (ref_losses, ref_grads) = got, want
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    r = ref_grads
    for k in path:
      r = r[k.key]
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * np.abs(r).max(), err_msg=jax.tree_util.keystr(path))


# Mesh × schedule, with the block type and remat alternating so that each mesh sees both of each.
GRID = [
    # stage, data, fsdp, tensor, schedule, parallel_block, remat, layers
    (2, 1, 4, 1, 'gpipe', True, 'none', 8),
    (2, 1, 4, 1, 'circular', False, 'full', 8),
    (2, 1, 2, 2, 'gpipe', False, 'full', 8),
    (2, 1, 2, 2, 'circular', True, 'none', 8),
    (4, 2, 1, 1, 'gpipe', True, 'full', 8),
    (4, 2, 1, 1, 'circular', False, 'none', 8),
    (8, 1, 1, 1, 'gpipe', False, 'none', 8),
    (8, 1, 1, 1, 'circular', True, 'full', 16),
]
FAST = {0}  # the fast loop's representative (each pipelined compile takes ~15 s on a 2-core CPU)


@pytest.mark.parametrize('case', [pytest.param(g, marks=() if i in FAST else pytest.mark.e2e, id='-'.join(map(str, g)))
                                  for i, g in enumerate(GRID)])
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_pipeline_matches_unpipelined_step(case):
  """Loss and gradients at init, and (e2e only: a second compile) the losses of two AdamW steps."""
  stage, data, fsdp, tensor, schedule, parallel, remat, layers = case
  steps = 0 if GRID.index(case) in FAST else 2
  c = small_config(parallel, remat, layers)
  program = program_for(c, stage, data, fsdp, tensor, schedule=schedule, microbatches=stage)
  assert program.model.pipeline.stages == stage
  assert program.model.pipeline.repeats == (2 if schedule == 'circular' else 1)
  assert_same(losses_and_grads(program, c, batches(c), steps), reference(parallel, remat, layers, steps))


@pytest.mark.e2e
def test_more_microbatches_mqa_and_gradient_accumulation():
  """M = 2S, multi-query attention, and train.microbatches = 2 around the pipeline: still the plain step."""
  c = small_config(num_kv_heads=1)
  got = losses_and_grads(program_for(c, stage=2, fsdp=4, microbatches=4, accumulate=2), c, batches(c), steps=2,
                         num_kv_heads=1)
  assert_same(got, reference(True, 'none', 8, 2, num_kv_heads=1))


@pytest.mark.e2e
@pytest.mark.slow(reason='one pipelined train step compiled per stage count')
def test_dropout_follows_each_microbatch_whatever_the_stage_count():
  """Layer l on microbatch m draws the same mask on 2 stages as on 4 (and circular as gpipe): same losses."""
  # Two steps: the first loss checks the forward's masks, the second the update, so the backward's masks too.
  def losses(**kw):
    c = small_config(dropout_rate=0.1)
    program = program_for(c, microbatches=4, **kw)
    state = program.init()
    init = jax.device_get(state.params)  # before the step donates it
    out = []
    for b in batches(c, 2):
      state, metrics = program.train_step(state, jax.device_put(b, program.batch_sharding))
      out.append(float(metrics['loss']))
    return np.array(out), init

  two, init = losses(stage=2, fsdp=4)
  np.testing.assert_allclose(losses(stage=4, fsdp=2)[0], two, rtol=1e-5)
  np.testing.assert_allclose(losses(stage=2, fsdp=4, schedule='circular')[0], two, rtol=1e-5)
  c = small_config()
  program = program_for(c, stage=2, fsdp=4, microbatches=4)
  params = jax.device_put(init, program.state_shardings.params)  # dropout draws no parameters: the same init
  b = jax.device_put(batches(c, 1)[0], program.batch_sharding)

  def loss(params):  # the same batch's loss without dropout, at init: forward only
    logits = program.model.apply({'params': params}, b['inputs'], b['segment_ids'], b['positions'])
    return model_lib.loss_fn(logits, b['targets'], b['weights'], c.model.z_loss)[0]
  with sharding.activate(program.mesh):
    no_dropout = float(jax.jit(loss)(params))
  assert np.all(np.abs(two - no_dropout) > 1e-4)  # dropout is on


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_each_stage_holds_its_own_layers_and_per_device_bytes_fall_by_the_stage_count():
  """Parameters and Adam's moments of layer l live only on the devices of stage l // (L/S)."""
  c = small_config()
  program = program_for(c, stage=4, data=2, fsdp=1)
  state = jax.device_put(initial_state(True, 'none', 8), program.state_shardings)  # placed as the step keeps it
  mesh, L = program.mesh, c.model.num_layers
  stage_of = {d: s for s in range(4) for d in mesh.devices[s].flat}
  checked = 0
  for tree in (state.params, state.opt_state):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if "'layers'" not in jax.tree_util.keystr(path):
        continue
      checked += 1
      assert x.sharding.spec[0] == 'stage', jax.tree_util.keystr(path)
      for device, index in x.sharding.devices_indices_map(x.shape).items():
        s = stage_of[device]
        assert index[0] == slice(s * L // 4, (s + 1) * L // 4), (jax.tree_util.keystr(path), device, index)
      for shard in x.addressable_shards:  # what each device really holds: its stage's layers, nothing else
        s = stage_of[shard.device]
        np.testing.assert_array_equal(shard.data, np.asarray(x)[s * L // 4:(s + 1) * L // 4])
  assert checked == 3 * len(jax.tree.leaves(state.params['layers']))  # params, mu, nu
  # Same data × fsdp × tensor without stages (on 2 devices): the layers take 4× the bytes on each device.
  flat = program_for(small_config(), stage=1, data=2, fsdp=1, devices=2)
  held = lambda p: sharding.bytes_per_device(p.abstract_state.params['layers'], p.state_shardings.params['layers'])
  assert held(flat) == 4 * held(program)


def test_layout_report_and_bubble():
  lay = pipeline.Layout(stages=4, microbatches=8, repeats=2, schedule='circular')
  assert lay.iterations == 2 * 8 + 3 and lay.bubble == pytest.approx(3 / 19)
  assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)
  assert [[list(r) for r in chunks] for chunks in pipeline.stage_layers(lay, 16)] == [
      [[0, 1], [8, 9]], [[2, 3], [10, 11]], [[4, 5], [12, 13]], [[6, 7], [14, 15]]]
  text = pipeline.describe(lay, 16)
  assert 'circular' in text and 'bubble' in text and '0.158' in text and 'stage 3: layers 6-7, 14-15' in text


@pytest.mark.e2e
@pytest.mark.slow(reason='pipelined programs for two stage counts, a checkpoint written by one and read by the other')
def test_checkpoint_restores_across_stage_counts(tmp_path):
  """A stage=4 checkpoint restores on 1 and 2 stages (other data/fsdp/tensor shapes) with the same losses."""
  ckpt_cfg = load_config('palm_tiny').checkpoint
  ckpt_cfg.async_save = False
  data = batches(small_config(), 4)

  def steps(restore, save=False, program=None, **mesh):
    program = program or program_for(small_config(), **mesh)
    ckpt = checkpoint_lib.Checkpointer(str(tmp_path / 'ckpt'), ckpt_cfg, lambda *a, **k: None)
    if restore:
      state, _ = ckpt.restore(program.abstract_state, program.state_shardings, None)
      assert state.params['layers']['mlp']['up'].sharding == program.state_shardings.params['layers']['mlp']['up']
    else:
      state = program.init()
    losses = []
    for b in data[2:] if restore else data[:2]:
      state, metrics = program.train_step(state, jax.device_put(b, program.batch_sharding))
      losses.append(float(metrics['loss']))
    if save:
      ckpt.save(int(state.step), state, None, {})
    ckpt.close()
    return np.array(losses)

  # The stage=4 program that wrote the checkpoint reads it back too (one compiled step, not two): the restore is what
  # is tested, and a program's steps depend on nothing but the state they are given.
  four = program_for(small_config(), stage=4, data=2, fsdp=1)
  steps(False, save=True, program=four)
  continued = steps(True, program=four)
  np.testing.assert_allclose(steps(True, stage=1, fsdp=4, tensor=2), continued, rtol=1e-5)
  np.testing.assert_allclose(steps(True, stage=2, fsdp=2, tensor=2, schedule='circular'), continued, rtol=1e-5)


@pytest.mark.parametrize('overrides, says', [
    (dict(stage=4, layers=6), 'model.num_layers=6 is not divisible by the 4 stages'),
    (dict(stage=2, schedule='circular', repeats=3), 'stages × pipeline.repeats = 2×3'),
    (dict(stage=4, microbatches=2), 'pipeline.microbatches=2 is fewer than the 4 pipeline stages'),
    (dict(stage=2, microbatches=3), 'train.batch_size=16 is not divisible'),
    (dict(stage=16), 'exceed the 8 devices'),
    (dict(stage=2, schedule='1f1b'), "pipeline.schedule='1f1b' is unknown"),
    (dict(stage=2, model=dict(scan_layers=False)), 'model.scan_layers=False cannot run as a pipeline'),
    (dict(stage=2, model=dict(matmul_dtype='fp8')), 'model.matmul_dtype=fp8 does not run under a pipeline'),
])
def test_bad_pipeline_configs_name_the_field_and_the_fix(overrides, says):
  c = small_config(layers=overrides.pop('layers', 8))
  c.train.batch_size = BATCH
  c.mesh.update(stage=overrides.pop('stage'), fsdp=-1)
  c.model.update(**overrides.pop('model', {}))
  c.pipeline.update(**overrides)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, 8)
  assert says in str(e.value) and str(e.value).count('\n  - ') == 1, str(e.value)


def test_bad_pipeline_config_exits_before_device_work():
  out = run_cli('jaxlm.train', '--config=configs/palm_tiny.py', '--config.mesh.stage=4', '--config.model.num_layers=4',
                '--config.pipeline.microbatches=2', '--workdir=/nonexistent/never-created')
  assert_fails_with(out, 2, 'pipeline.microbatches=2 is fewer than the 4 pipeline stages')


def test_a_pipelined_run_reports_its_stages_and_its_checkpoint_serves_eval_export_and_warm_start(
    tmp_path, data_cache, capsys, monkeypatch):
  """The real trainer on 2 stages; eval, HF export (unpipelined), the warm-start loader, the sampler and lm-eval
  tasks (jaxlm/harness.py) read its checkpoint."""
  import json
  from jaxlm import train
  cfg = load_config('palm_tiny')
  cfg.data.cache_dir = str(data_cache)
  cfg.mesh.stage = 2  # palm_tiny's 2 layers: one per stage, fsdp over 4 devices in each
  cfg.train.update(steps=6, eval_batches=2, log_every=3)
  cfg.optim.warmup_steps = 2
  cfg.checkpoint.update(every=0, async_save=False)
  cfg.log.update(tensorboard=False, compilation_cache='')
  workdir = str(tmp_path / 'run')
  trained = train.run(cfg, workdir)
  report = capsys.readouterr().out
  assert "mesh: {'stage': 2, 'data': 1, 'fsdp': 4, 'tensor': 1, 'context': 1}" in report
  assert 'pipeline: gpipe, 2 stages × 1 repeat(s), 2 microbatches, 3 iterations; bubble' in report
  assert 'stage 0: layers 0\n' in report and 'stage 1: layers 1\n' in report and 'parameters per device' in report
  records = read_records(workdir)
  assert records and all(r['bubble'] == pytest.approx(1 / 3) for r in records)

  out = run_cli('jaxlm.tools.eval', f'--workdir={workdir}', '--json', timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.strip().splitlines()[-1])['loss'] == pytest.approx(trained['eval_loss'], rel=1e-4)
  out = run_cli('jaxlm.hf.export', f'--workdir={workdir}', f'--out={tmp_path / "hf"}', devices=1, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert (tmp_path / 'hf' / 'model.safetensors').exists()

  # Warm start's loader: the same parameters on 2 stages as on none.
  loaded = []
  for stage in (2, 1):
    c = load_config('palm_tiny')
    c.mesh.stage = stage
    program = plain_program(c, sharding.make_mesh(c.mesh))
    loaded.append(checkpoint_lib.load_params(f'{workdir}/checkpoints', program.abstract_state.params,
                                             program.state_shardings.params))
  assert loaded[0]['layers']['mlp']['up'].sharding.spec[0] == 'stage'
  for a, b in zip(jax.tree.leaves(loaded[0]), jax.tree.leaves(loaded[1])):
    np.testing.assert_array_equal(a, b)

  # The sampler reads the pipelined checkpoint too (its stages folded into fsdp): greedy tokens equal the full
  # recompute on the unpipelined parameters (issue #30).
  from jaxlm import generate as generate_lib
  from jaxlm import model as model_lib
  from jaxlm import rundir
  from jaxlm.tools import generate as generate_tool
  records, _ = generate_tool.run(workdir, ['def main('], max_new_tokens=8, sampling=generate_lib.Sampling(0.0))
  tok = rundir.load_tokenizer(cfg, workdir)
  reference = generate_lib.generate_without_cache(model_lib.ModelConfig.from_config(cfg.model), loaded[1],
                                                  [[tok.separator_id] + tok.encode('def main(')], 8)
  mine = records[0]['completion_ids']
  assert len(mine) >= 1 and list(reference[0][:len(mine)]) == list(mine), (mine, reference)

  # lm-eval's tasks scored by jaxlm on the pipelined checkpoint equal lm-eval's Hugging Face backend on its export,
  # request by request (issue #61: --tasks on a pipelined run).
  from lm_eval.models.huggingface import HFLM
  from jaxlm import harness
  from jaxlm.tools import eval as eval_lib
  from tests.test_harness import TASKS, flat_responses, write_tasks
  monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'hf_datasets'))
  tasks = write_tasks(tmp_path / 'tasks', {'h_mc': TASKS['h_mc']})
  lm, _ = eval_lib.harness_lm(workdir)
  hf = HFLM(pretrained=str(tmp_path / 'hf'), dtype='float32', add_bos_token=True, batch_size=8, device='cpu')
  ours, theirs = (harness.evaluate(model, ['h_mc'], include_path=tasks, log_samples=True)['samples']['h_mc']
                  for model in (lm, hf))
  got, want = ([x for s in samples for x in flat_responses(s['resps'])] for samples in (ours, theirs))
  assert len(got) == len(want) == 2 * sum(len(d['choices']) for d in TASKS['h_mc'][1])
  assert got == pytest.approx(want, abs=1e-4)
