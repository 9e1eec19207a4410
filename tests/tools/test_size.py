"""Tests of jaxlm.tools.size: the analytic numbers against the model's formulas and PaLM 8B worked by hand, memory
from an ahead-of-time compile on fake CPU devices, and the command line."""

import subprocess
import sys

import jax
import pytest

from jaxlm import model as model_lib
from jaxlm import perf
from jaxlm import sharding
from jaxlm.tools import size
from tests.conftest import ROOT
from tests.helpers import load_config, train_env


def run_size(*args) -> subprocess.CompletedProcess:
  command = [sys.executable, '-m', 'jaxlm.tools.size', *args]
  return subprocess.run(command, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=300)


def test_palm_tiny_numbers_are_the_model_formulas():
  cfg = load_config('palm_tiny')
  m = model_lib.ModelConfig.from_config(cfg.model)
  a = size.analytic(cfg)
  assert a['params'] == model_lib.param_count(m)
  assert a['flops_per_token'] == model_lib.flops_per_token(m, 64)
  assert a['flops_per_token_causal'] == model_lib.flops_per_token(m, 64, causal=True)
  assert a['run_tokens'] == 30 * 8 * 64 and a['chinchilla_tokens'] == 20 * a['params']


def test_moe_tiny_counts_active_parameters_and_the_experts_memory():
  cfg = load_config('moe_tiny')
  m = model_lib.ModelConfig.from_config(cfg.model)
  a = size.analytic(cfg)
  X, k, D, F, L = m.moe.experts, m.moe.top_k, m.d_model, m.moe.mlp_dim, m.num_layers
  assert a['expert_params'] == L * X * 3 * D * F  # every layer MoE: (X, D, F) gate and up, (X, F, D) down
  assert a['params'] - a['active_params'] == L * (X - k) * 3 * D * F  # k of X routed experts are active
  attention = 12 * L * m.num_heads * m.head_dim * cfg.data.seq_len
  assert a['flops_per_token'] == 6 * a['active_params'] + attention  # MFU's FLOPs count active parameters
  rows = dict(size.model_rows(a, cfg))
  assert rows['active per token (shared + k/X routed + router)'].startswith(f'{a["active_params"]:,}')
  # The stacked experts' bytes per device on an abstract 8-way fsdp mesh: float32, split 8 ways (D = 64).
  cfg.mesh.update(data=1, fsdp=8, tensor=1)
  mem = size.memory(cfg)
  assert mem['expert_bytes'] == a['expert_params'] * 4 // 8 and mem['expert_bytes'] < mem['param_bytes']
  assert dict(size.memory_rows(mem))['  of which routed experts'] == perf.format_bytes(mem['expert_bytes'])
  # An expert axis on 16 devices that do not exist (fsdp=4 × expert=4): the experts split over it too.
  cfg.mesh.update(fsdp=4, expert=4)
  cfg.train.batch_size = 16
  mem = size.memory(cfg)
  assert mem['expert_bytes'] == a['expert_params'] * 4 // 16
  # Both report titles name the axes as make_mesh orders them: expert after fsdp, a stage axis outermost.
  assert size.mesh_axes(sharding.MeshShape.resolve(cfg.mesh, 16)) == 'data=1 × fsdp=4 × expert=4 × tensor=1'
  cfg.mesh.update(stage=2, context=2, expert=1)
  assert size.mesh_axes(sharding.MeshShape.resolve(cfg.mesh, 16)) == 'stage=2 × data=1 × fsdp=4 × tensor=1 × context=2'


def test_palm_8b_by_hand():
  a = size.analytic(load_config('palm_8b'))
  # L=32, D=4096, H=16 heads of E=256, one kv head, F=4D=16384, V=256k tied:
  # per layer q+o 2·4096·16·256 + k+v 2·4096·256 + mlp 3·4096·16384 + LayerNorm 4096 = 236,982,272
  assert a['params'] == 32 * 236_982_272 + 4096 + 256_000 * 4096 == 8_632_012_800  # PaLM's "8B" (8.63B)
  assert a['chinchilla_tokens'] == 172_640_256_000  # ≈ 172.6B
  attention = 12 * 32 * 16 * 256 * 2048  # 12·L·H·Q·T = 3,221,225,472
  assert a['flops_per_token'] == 6 * 8_632_012_800 + attention == 55_013_302_272
  assert a['flops_per_token_causal'] == 6 * 8_632_012_800 + attention // 2
  assert a['run_tokens'] == 250_000 * 512 * 2048
  # Chinchilla tokens on 64 TPU v4 (275 TFLOP/s) at 50% MFU: 9.4975e21 FLOPs / 8.8e15 FLOP/s = 12.49 days.
  seconds = size.train_seconds(a['chinchilla_tokens'], a['flops_per_token'], 64, 275e12, 0.5)
  assert seconds == pytest.approx(172_640_256_000 * 55_013_302_272 / 8.8e15)
  assert seconds / 86400 == pytest.approx(12.49, abs=0.01)


def mesh_config(data, fsdp, tensor):
  cfg = load_config('palm_tiny')
  cfg.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
  return cfg


@pytest.mark.e2e  # compiles the whole program twice
def test_compiled_memory_shrinks_with_fsdp():
  one = size.memory(mesh_config(1, 1, 1), jax.devices()[:1])
  eight = size.memory(mesh_config(1, 8, 1), jax.devices()[:8])
  for m in (one, eight):
    assert m['total_bytes'] > 0 and m['temp_bytes'] > 0 and m['argument_bytes'] > 0
  # Every parameter (and its Adam moments) has an embed axis, split 8 ways over fsdp.
  assert eight['param_bytes'] * 8 == one['param_bytes']
  assert eight['opt_state_bytes'] < one['opt_state_bytes'] / 4
  assert eight['argument_bytes'] < one['argument_bytes'] / 4 and eight['total_bytes'] < one['total_bytes']
  # Without devices the mesh is abstract: the same state bytes, nothing compiled.
  abstract = size.memory(mesh_config(1, 8, 1))
  assert abstract == {'param_bytes': eight['param_bytes'], 'opt_state_bytes': eight['opt_state_bytes']}


def test_palm_8b_state_on_an_abstract_mesh():
  # 64 devices that do not exist: shapes and shardings alone give the state bytes each would hold.
  cfg = load_config('palm_8b')
  cfg.mesh.update(data=1, fsdp=64, tensor=1)
  m = size.memory(cfg)
  assert m['param_bytes'] == 8_632_012_800 * 4 // 64  # float32, every parameter split 64 ways along embed
  # Adam's two moments mirror the parameters; a few replicated scalars (step count, skip counters) on top.
  assert 0 <= m['opt_state_bytes'] - 2 * m['param_bytes'] < 64


def test_command_line_on_a_mesh_larger_than_the_host():
  result = run_size('--config=configs/palm_8b.py', '--mesh=1,64,1', '--chips=64', '--mfu=0.5',
                    '--device_kind=TPU v4')
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert '8,632,012,800 (8.632B)' in out and '172.6B' in out
  assert 'needs 64 devices, this host has 8' in out and '--fake_devices=64' in out
  assert '514.51 MiB' in out and '1.00 GiB' in out  # params and Adam moments, as below
  assert 'on 64 × TPU v4 (275 TFLOP/s peak each) at 50% MFU' in out
  assert '12.5 days' in out


def test_command_line_compiles_on_fake_devices():
  result = run_size('--config=configs/palm_tiny.py', '--mesh=2,2,2', '--fake_devices=8', '--peak_tflops=100')
  assert result.returncode == 0, result.stderr
  assert 'compiled ahead of time for 8 × cpu' in result.stdout and 'step total' in result.stdout
  assert 'on 8 × chips (100 TFLOP/s peak each) at 40% MFU' in result.stdout


def test_command_line_bad_mesh():
  result = run_size('--config=configs/palm_tiny.py', '--mesh=1,3,1')
  assert result.returncode == 2
  assert 'model.d_model=64 is not divisible by mesh.fsdp=3' in result.stderr
