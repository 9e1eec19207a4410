"""Pre-flight (#18): the real train step compiled for TPU topologies this machine does not have (libtpu's
compile-only devices), the memory-fit check shared by `jaxlm.tools.size --target` and the trainer, and the
attention kernel chosen for the mesh's platform.

The TPU tests need libtpu (`pip install -e '.[test]'` pins it); without it they skip with the reason. libtpu's
topology descriptions load under JAX_PLATFORMS=cpu (measured with libtpu 0.0.42.1), so these run in-process.
"""

import math
import re

import jax
import numpy as np
import pytest

from jaxlm import attention, perf, preflight, sharding, step as step_lib
from jaxlm.tools import size
from tests.helpers import assert_fails_with, load_config, run_cli, train_command, train_env


@pytest.fixture(scope='module')
def v5e_2x2():
  """Four compile-only TPU v5e chips, or a skip that says why."""
  try:
    return size.tpu_devices('v5e:2x2')
  except size.PreflightError as e:
    pytest.skip(f'no libtpu here: {e}')


def small_tpu_config(attention_impl: str):
  """A few-MB model TPU kernels accept: head dim 128, sequence 512 (a multiple of splash's 512 block)."""
  cfg = load_config('palm_tiny')
  cfg.model.update(d_model=256, num_heads=2, num_kv_heads=1, head_dim=128, mlp_dim=512, dtype='bfloat16',
                   attention=attention_impl)
  cfg.data.seq_len = 512
  cfg.mesh.update(data=1, fsdp=4, tensor=1)
  return cfg


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_splash_compiles_for_a_real_tpu_target(v5e_2x2, caplog):
  cfg = small_tpu_config('splash')
  # Gemma 2's pattern on its two scanned layers: a local layer (splash's LocalMask, W = 128) and a global one,
  # chosen per layer by a cond, both soft-capped (attn_logits_soft_cap): one compile covers every splash mask.
  cfg.model.update(attention_window=128, attention_global_every=2, attention_softcap=50.0)
  # conftest's 'highest' matmul precision asks Mosaic for an fp32-precision bf16 matmul, which it rejects.
  with caplog.at_level('WARNING', logger='jaxlm.attention'), jax.default_matmul_precision('default'):
    attention._logged.clear()
    report = size.compile_step(cfg, v5e_2x2)
  assert report['device_kind'] == 'TPU v5 lite' and report['devices'] == 4
  # The Pallas kernel, lowered for the TPU (not interpret mode): causal mask plus segment ids (documents).
  assert report['kernel'] == 'splash' and report['tpu_custom_calls'] > 0
  assert 'tpu_custom_call' in report['hlo']
  # Two kernels, local and global, each forward and its two backward passes (a causal-only model compiles 3).
  assert report['tpu_custom_calls'] == 6, report['tpu_custom_calls']
  # (The parameters' shapes come from an 8-token dummy trace, which says splash cannot take 8 tokens: no step
  # runs it.)
  assert not [r for r in caplog.records if 'falling back' in r.getMessage() and 'it is 8;' not in r.getMessage()]
  assert report['fits'] is True and report['limit_bytes'] == 16 * 2**30
  assert report['collectives']['all-gather'][0] > 0  # fsdp gathers the parameters layer by layer


@pytest.mark.e2e  # a second whole-program TPU compile; the splash one above stays in the fast loop
def test_xla_kernel_arguments_are_the_sharded_state(v5e_2x2):
  cfg = small_tpu_config('xla')
  cfg.data.seq_len = 128  # XLA's attention takes any length (512 is splash's block): half the compile time
  report = size.compile_step(cfg, v5e_2x2)
  assert report['kernel'] == 'xla' and report['tpu_custom_calls'] == 0
  mesh = sharding.make_mesh(cfg.mesh, v5e_2x2)
  program = step_lib.build_program(cfg, mesh)
  state = sharding.bytes_per_device(program.abstract_state, program.state_shardings)
  batch = 5 * cfg.train.batch_size // 4 * cfg.data.seq_len * 4  # five int32/float32 (B, T) arrays, B split 4 ways
  # Equal up to TPU tiling: a leaf smaller than one (8, 128) tile (scalars, norm scales, the RNG key) is padded
  # in HBM, by less than a KiB each here.
  shards = [math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x, s in zip(
      jax.tree.leaves(program.abstract_state), jax.tree.leaves(
          program.state_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding)))]
  small = sum(b < 4096 for b in shards)
  assert state + batch <= report['memory']['argument_bytes'] <= state + batch + 1024 * small
  assert report['param_bytes'] + report['opt_state_bytes'] < state  # + step, rng, lr_scale, batches


@pytest.mark.e2e  # a third whole-program TPU compile
def test_moe_tiny_compiles_for_a_tpu_target_with_ragged_dot_kernels(v5e_2x2):
  cfg = load_config('moe_tiny')
  cfg.model.dtype = 'bfloat16'
  cfg.mesh.update(data=1, fsdp=4, tensor=1)
  # conftest's 'highest' precision asks the ragged-dot Mosaic kernel for an fp32-precision bf16 matmul, which it
  # rejects (as splash's does above); the trainer runs at the default precision.
  with jax.default_matmul_precision('default'):
    report = size.compile_step(cfg, v5e_2x2)
  assert report['fits'] is True and report['memory']['total_bytes'] > report['memory']['argument_bytes'] > 0
  a = size.analytic(cfg)
  assert report['expert_bytes'] == a['expert_params'] * 4 // 4  # float32 master weights, split 4 ways over fsdp
  # The experts' grouped GEMMs are XLA:TPU's ragged-dot kernels: gate, up and down forward, and their input
  # gradients backward (six), plus the group metadata; the weight gradients are XLA fusions.
  assert report['ragged_dot_kernels'] >= 6
  assert report['tpu_custom_calls'] == 0  # xla attention: no other kernel
  rows = dict(size.target_rows(report))
  assert rows['expert GEMMs (ragged_dot)'].startswith(f'{report["ragged_dot_kernels"]} ragged-dot')
  assert rows['verdict'].startswith('fits')


def test_building_creates_no_array(v5e_2x2):
  # Any eager op on a compile-only mesh fails ("not available with compile-only client"): building must not.
  cfg = small_tpu_config('splash')
  program = step_lib.build_program(cfg, sharding.make_mesh(cfg.mesh, v5e_2x2))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(program.abstract_state))


def test_kernel_is_chosen_for_the_mesh_platform(v5e_2x2):
  mesh = sharding.make_mesh(small_tpu_config('auto').mesh, v5e_2x2)
  kw = dict(dtype='bfloat16', head_dim=128, seq_len=512)
  assert jax.default_backend() == 'cpu' and attention.select('auto', **kw)[0] == 'xla'
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    assert attention.mesh_platform() == 'tpu'
    assert attention.select('auto', **kw)[0] == 'splash'


def test_collectives_are_parsed_from_hlo():
  hlo = '\n'.join([
      'ENTRY %main (p: f32[8]) -> f32[8] {',
      '  %all-gather.1 = bf16[4,256]{1,0} all-gather(%p), replica_groups={}',
      '  %ag-start = (bf16[2,8]{1,0}, bf16[8,8]{1,0}) all-gather-start(%q)',
      '  %all-reduce.2 = (f32[16]{0}, f32[]{}) all-reduce(%a, %b), to_apply=%add',
      '  %fusion.3 = bf16[64,128]{1,0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.7',
      # TPU's async permute: (operand, output, two u32[] context words); the output is what moves.
      '  %cp-start = (bf16[8,128]{1,0}, bf16[8,128]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%h)',
      '}',
      '%all-reduce-scatter.7 (input: bf16[256,128]) -> bf16[64,128] {',
      '  %all-reduce.9 = bf16[256,128]{1,0} all-reduce(%input), to_apply=%add',
      '}'])
  assert size.collectives(hlo) == {'all-gather': (2, 4 * 256 * 2 + 8 * 8 * 2), 'all-reduce': (1, 16 * 4 + 4),
                                   'reduce-scatter': (1, 64 * 128 * 2), 'collective-permute': (1, 8 * 128 * 2)}


def test_fit_candidates_cheapest_first():
  cfg = load_config('palm_tiny')  # remat=none, batch 8
  cfg.mesh.update(data=1, fsdp=2, tensor=1)
  assert preflight.candidates(cfg) == [
      {'remat': r, 'microbatches': 1} for r in ('dots', 'dots_no_batch', 'attn_out', 'full')] + [
      {'remat': 'full', 'microbatches': 2}, {'remat': 'full', 'microbatches': 4}]


def test_device_memory_env_and_table(monkeypatch, v5e_2x2):
  monkeypatch.delenv(preflight.MEMORY_ENV, raising=False)
  assert preflight.device_memory(jax.devices()[:1]) == (None, pytest.approx(preflight.device_memory(
      jax.devices()[:1])[1]))  # a CPU reports no limit: unknown, never a failure
  assert preflight.device_memory(v5e_2x2) == (16 * 2**30, 'HBM of a TPU v5 lite chip')
  monkeypatch.setenv(preflight.MEMORY_ENV, '1e6')
  assert preflight.device_memory(jax.devices()[:1])[0] == 1_000_000


@pytest.mark.e2e
@pytest.mark.slow(reason='tools/size --fit in a child process compiles palm_tiny for TPU targets until a setting fits')
def test_command_line_does_not_fit_then_fit(v5e_2x2):
  # palm_8b's 256k x 4096 embedding alone, with Adam's moments and its gradient, is > 16 GiB on one v5e chip.
  out = run_cli('jaxlm.tools.size', '--config=configs/palm_8b.py', '--target=v5e:1x1',
                '--config.model.num_layers=1', '--config.train.batch_size=8', devices=1)
  assert 'does NOT fit' in out.stdout and 'TPU v5 lite' in out.stdout, out.stdout + out.stderr
  # XLA:TPU refuses to compile it (RESOURCE_EXHAUSTED): its numbers are the answer.
  assert_fails_with(out, 2, 'per device', 'a device holds 15.75 GiB', '--fit to find the cheapest setting')
  # A model whose activations are what does not fit: --fit compiles cheaper settings until one does. palm_tiny
  # itself (xla attention) at 64 x 256 tokens: without remat its attention scores dominate the step; with `dots`
  # they are recomputed. Splash's own TPU compile is the test above; here it would only double the compile time.
  args = ['--config=configs/palm_tiny.py', '--target=v5e:2x2', '--mesh=1,4,1', '--fit', '--config.train.batch_size=64',
          '--config.data.seq_len=256']
  # 40 MiB "chips": the configured step (~66 MiB) does not fit, the first cheaper setting (~23 MiB) does, so only
  # two compiles (each cheaper candidate is one more TPU compile, the slow part of this test).
  env = dict(train_env(1), **{preflight.MEMORY_ENV: str(40 * 2**20)})
  out = run_cli('jaxlm.tools.size', *args, env=env)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert 'does NOT fit' in out.stdout, out.stdout
  assert re.search(r'cheapest that fits +--config\.model\.remat=\w+ --config\.train\.microbatches=\d', out.stdout)


@pytest.mark.e2e
def test_trainer_refuses_a_step_that_cannot_fit(tmp_path, data_cache):
  env = dict(train_env(), **{preflight.MEMORY_ENV: '100000'})  # 100 kB devices
  out = run_cli('jaxlm.train', *train_command(tmp_path / 'run', f'--config.data.cache_dir={data_cache}')[3:],
                env=env)
  assert_fails_with(out, 2, 'the train step needs', 'a device holds', f'${preflight.MEMORY_ENV}',
                    '--config.model.remat=dots')


def _remat_auto_config():
  """palm_tiny with long enough rows that the remat policies' compiled sizes differ."""
  cfg = load_config('palm_tiny')
  cfg.model.remat = preflight.REMAT_AUTO
  cfg.data.seq_len = 256
  cfg.mesh.update(data=1, fsdp=1, tensor=1)
  return cfg


@pytest.mark.e2e
@pytest.mark.slow(reason='compiles the train step once per remat policy, then choose_remat compiles them again')
def test_remat_auto_picks_the_least_recompute_that_fits(monkeypatch):
  from jaxlm import config as config_lib, train  # pylint: disable=import-outside-toplevel
  cfg = _remat_auto_config()
  config_lib.validate(cfg, num_devices=1)  # `auto` is a valid model.remat
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  sizes = {}
  for policy in preflight.REMAT_LADDER:  # each candidate compiled here, independently of choose_remat
    trial = preflight.with_setting(cfg, {'remat': policy, 'microbatches': 1})
    program = step_lib.build_program(trial, mesh)
    batch = step_lib.abstract_batch(trial.train.batch_size, trial.data.seq_len, program.batch_sharding)
    sizes[policy] = preflight.step_memory(program.train_step.lower(program.abstract_state, batch).compile())[
        'total_bytes']
  # A budget just under `none`'s step: the answer is the first policy in recompute order at or under it.
  budget = sizes['none'] - 1
  expected = next(p for p in preflight.REMAT_LADDER if sizes[p] <= budget)
  monkeypatch.setenv(preflight.MEMORY_ENV, str(budget))
  printed = []
  resolved = train.resolve_remat(cfg, mesh, printed.append)
  assert resolved.model.remat == expected, (sizes, budget)
  assert cfg.model.remat == preflight.REMAT_AUTO  # the caller's config is left as it was
  assert len(printed) == 1 and printed[0].startswith(f'INFO model.remat=auto chose {expected}: '), printed
  for policy in preflight.REMAT_LADDER[:preflight.REMAT_LADDER.index(expected) + 1]:
    assert f'{policy} {perf.format_bytes(sizes[policy])}' in printed[0], printed[0]
  # Unknown memory (a CPU without the variable): no recompute, and nothing compiled.
  monkeypatch.delenv(preflight.MEMORY_ENV)
  assert preflight.choose_remat(cfg, mesh)[0] == 'none'
  # Nothing fits: one `jaxlm: <what>; <fix>` line with every candidate's size.
  monkeypatch.setenv(preflight.MEMORY_ENV, str(min(sizes.values()) - 1))
  with pytest.raises(preflight.DoesNotFitError) as e:
    preflight.choose_remat(cfg, mesh)
  message = str(e.value)
  assert message.startswith('model.remat=auto: no activation checkpointing fits: ') and '; shard wider' in message
  assert all(f'{p} ' in message for p in preflight.REMAT_LADDER) and '\n' not in message
