"""Every config loads, validates and builds its abstract state; every bad config fails with a clear message."""

import pathlib
import subprocess
import sys

import jax
import pytest

from jaxlm import attention
from jaxlm import config as config_lib
from jaxlm import model as model_lib
from jaxlm import sharding, step
from tests.conftest import ROOT
from tests.helpers import load_config

CONFIGS = sorted(p.stem for p in (ROOT / 'configs').glob('*.py'))


@pytest.mark.parametrize('name', CONFIGS)
def test_config_builds_abstract_state_without_allocating(name):
  cfg = load_config(name)
  config_lib.validate(cfg, jax.device_count())
  mesh = sharding.make_mesh(cfg.mesh)
  program = step.build_program(cfg, mesh)  # needs no mesh or rules context from its caller
  params = program.abstract_state.params
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(program.abstract_state))
  assert sum(x.size for x in jax.tree.leaves(params)) == model_lib.param_count(program.model.config)
  sharding.check_sharded(params, program.state_shardings.params, mesh)


def test_reference_configs_have_palm_sizes():
  sizes = {name: model_lib.param_count(model_lib.ModelConfig.from_config(load_config(name).model))
           for name in ('palm_1b', 'palm_8b', 'palm_62b', 'palm_540b')}
  assert 0.9e9 < sizes['palm_1b'] < 1.2e9
  assert 8.0e9 < sizes['palm_8b'] < 9.0e9  # PaLM table: 8.63B
  assert 62e9 < sizes['palm_62b'] < 63e9  # 62.50B
  assert 540e9 < sizes['palm_540b'] < 541e9  # 540.35B


BAD = [
    ('mesh.fsdp', dict(mesh=dict(data=1, fsdp=3, tensor=1)), 'does not match the 8 devices'),
    ('train.batch_size', dict(train=dict(batch_size=12), mesh=dict(data=1, fsdp=8, tensor=1)), 'use a multiple of 8'),
    ('model.num_heads', dict(model=dict(num_heads=3, head_dim=16), mesh=dict(fsdp=-1, tensor=2)),
     'not divisible by mesh.tensor=2'),
    ('model.num_kv_heads', dict(model=dict(num_kv_heads=3)), 'does not divide model.num_heads'),
    ('model.d_model', dict(model=dict(d_model=0)), 'model.d_model is 0'),
    ('optim.lr', dict(optim=dict(lr=0.0)), 'optim.lr=0.0 must be positive'),
    ('optim.warmup_steps', dict(optim=dict(warmup_steps=100), train=dict(steps=50)), 'shorter than train.steps'),
    ('model.remat', dict(model=dict(remat='some')), "model.remat='some' is unknown"),
    ('model.dtype', dict(model=dict(dtype='float8')), "model.dtype='float8' is unknown"),
    ('data.source', dict(data=dict(source='web')), "data.source='web' is unknown"),
    ('data.paths', dict(data=dict(source='prepared')), 'needs data.paths'),
    ('mesh two -1', dict(mesh=dict(data=-1, fsdp=-1)), 'at most one'),
    ('data.seq_len (context)', dict(data=dict(seq_len=60), mesh=dict(fsdp=-1, context=4)),
     'not divisible by 2 × mesh.context = 2×4'),
    ('mesh.context', dict(mesh=dict(data=1, fsdp=1, tensor=1, context=3)), 'does not match the 8 devices'),
    ('model.attention_block_q', dict(model=dict(attention_block_q=24), mesh=dict(fsdp=-1, context=2)),
     'does not divide the 32 query rows of each context shard'),
    ('data.seq_len (tensor)', dict(data=dict(seq_len=36), mesh=dict(fsdp=1, tensor=4, context=2)),
     'not divisible by mesh.context × mesh.tensor = 2×4'),
    ('train.deterministic', dict(train=dict(deterministic=True), model=dict(attention='cudnn')),
     'model.attention=cudnn has no deterministic backward under train.deterministic=True'),
    ('model.moe_top_k', dict(model=dict(moe_experts=4, moe_top_k=5)), 'model.moe_top_k=5 must be between 1'),
    ('model.moe_every', dict(model=dict(moe_experts=4, moe_every=3)), 'model.moe_every=3 must be a positive divisor'),
    ('model.moe_router', dict(model=dict(moe_experts=4, moe_router='gshard')), "model.moe_router='gshard' is unknown"),
    ('model.moe_capacity_factor', dict(model=dict(moe_experts=4, moe_capacity_factor=-1.0)),
     'model.moe_capacity_factor=-1.0 must be >= 0'),
    ('model.moe_experts (pipeline)', dict(model=dict(moe_experts=4), mesh=dict(fsdp=-1, stage=2)),
     'mixture-of-experts layers do not run inside a pipeline'),
    ('model.qk_norm', dict(model=dict(qk_norm='yes')), "model.qk_norm='yes' is unknown"),
    ('model.moe_first_dense', dict(model=dict(moe_experts=4, num_layers=2, moe_first_dense=2)),
     'model.moe_first_dense=2 must be between 0 and model.num_layers - 1 = 1'),
    ('model.moe_every (first dense)', dict(model=dict(moe_experts=4, num_layers=4, moe_first_dense=1, moe_every=2)),
     'model.moe_every=2 must be a positive divisor of model.num_layers - model.moe_first_dense = 3'),
    ('model.moe_groups', dict(model=dict(moe_experts=4, moe_router='deepseek_v3', moe_groups=3)),
     'model.moe_groups=3 must divide model.moe_experts=4'),
    ('model.moe_groups (router)', dict(model=dict(moe_experts=4, moe_groups=2)),
     "model.moe_groups=2 is DeepSeek-V3's group-limited routing"),
    ('model.moe_top_groups', dict(model=dict(moe_experts=8, moe_top_k=3, moe_router='deepseek_v3', moe_groups=4,
                                             moe_top_groups=1)), 'model.moe_top_groups=1 of model.moe_groups=4 leaves 2'),
    ('mesh.expert (experts)', dict(model=dict(moe_experts=6), mesh=dict(fsdp=2, expert=4)),
     'model.moe_experts=6 is not divisible by mesh.expert×mesh.dcn_expert = 4'),
    ('mesh.expert (dense)', dict(mesh=dict(fsdp=2, expert=4)), '= 4 on a dense model'),
    ('mesh.expert (devices)', dict(mesh=dict(data=1, fsdp=1, tensor=1, expert=3)),
     'mesh data×fsdp×tensor×context×expert = 1×1×1×1×3 does not match the 8 devices'),
    ('mesh.expert (batch)', dict(model=dict(moe_experts=4), mesh=dict(fsdp=2, expert=4), train=dict(batch_size=4)),
     'not divisible by mesh data×fsdp×expert × train.microbatches = 1×2×4×1'),
    ('model.moe_transport', dict(model=dict(moe_experts=4, moe_transport='nccl')),
     "model.moe_transport='nccl' is unknown"),
]


@pytest.mark.parametrize('field,overrides,message', BAD, ids=[b[0] for b in BAD])
def test_bad_config_names_field_and_fix(field, overrides, message):
  cfg = load_config('palm_tiny')
  for section, values in overrides.items():
    cfg[section].update(values)
  with pytest.raises(config_lib.ConfigError, match=message.replace('(', r'\(').replace('.', r'\.')):
    config_lib.validate(cfg, 8)


def test_entry_point_reports_bad_config_without_traceback(tmp_path):
  out = subprocess.run(
      [sys.executable, '-m', 'jaxlm.train', '--config=configs/palm_tiny.py', f'--workdir={tmp_path}',
       '--config.model.num_kv_heads=3', '--config.optim.lr=-1'],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  assert 'Traceback' not in out.stderr
  assert 'model.num_kv_heads=3 does not divide' in out.stderr and 'optim.lr=-1' in out.stderr
  assert not pathlib.Path(tmp_path, 'metrics.jsonl').exists()  # failed before any work


@pytest.mark.parametrize('name', CONFIGS)
def test_every_config_in_deterministic_mode_selects_a_deterministic_attention(name):
  """On a GPU with train.deterministic, each shipped config validates and selects an attention that is not cuDNN's
  (whose backward has no deterministic form there); model.attention=cudnn itself is refused (BAD above)."""
  cfg = load_config(name)
  cfg.train.deterministic = True
  config_lib.validate(cfg, jax.device_count())
  m = cfg.model
  kernel, why = attention.select(m.attention, dtype=m.dtype, head_dim=model_lib.head_dim(m),
                                 seq_len=cfg.data.seq_len, platform='gpu', context=1, deterministic=True)
  assert kernel == 'xla', why
