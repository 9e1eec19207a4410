"""gpt-oss (GptOssForCausalLM) through import and export: jaxlm's logits equal transformers'.

One tiny random transformers model (float32, eager attention) serves every test: two layers (sliding, full) with a
window of 8 over 40 tokens, 4 experts of which 2 per token, YaRN over an original context of 16, and every bias,
sink and norm scale drawn away from its init; the clamp limit is small enough that the clamps act. Kept cheap: the
suite runs on two CPU cores, so the model is built, saved and imported once, and each jaxlm variant compiled once.
"""

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest

from jaxlm import model as model_lib
from jaxlm.hf import export
from jaxlm.hf import import_llama as import_hf
from tests.helpers import export_round_trip

WINDOW, SEQ = 8, 40
CONFIG = dict(vocab_size=211, hidden_size=48, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
              max_position_embeddings=64, rms_norm_eps=1e-5, swiglu_limit=0.3, initializer_range=0.3,
              bos_token_id=1, eos_token_id=2, pad_token_id=0,
              rope_parameters={'rope_type': 'yarn', 'factor': 4.0, 'beta_fast': 8.0, 'beta_slow': 1.0,
                               'truncate': False, 'original_max_position_embeddings': 16, 'rope_theta': 1000.0})
# Turning one gpt-oss feature off (cfg.model key -> its off value) must move the logits by at least 1e-2.
FEATURES = dict(mlp_swiglu_limit=1e9, attention_bias=False, moe_expert_bias=False, moe_router_bias=False,
                attention_sinks=False, rope_scaling='none')  # the window's own test: tests/hf/test_families.py
MAX_ABS = {}  # 'import' / 'export' -> max |logit difference| (printed with pytest -s)
MOVED = {}  # FEATURES key -> max |logit difference| with it off


@pytest.fixture(scope='module')
def gpt_oss(tmp_path_factory):
  """(torch, transformers, the transformers model, its directory, the import's result, tokens, its logits)."""
  torch = pytest.importorskip('torch', reason='torch is not installed: pip install -e ".[test]"')
  transformers = pytest.importorskip('transformers', reason='transformers is not installed: pip install -e ".[test]"')
  pytest.importorskip('safetensors', reason='safetensors is not installed: pip install -e ".[test]"')
  os.environ['HF_HUB_OFFLINE'] = '1'
  root = tmp_path_factory.mktemp('gpt_oss')
  config = transformers.GptOssConfig(**CONFIG)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access  (the sinks' reference path)
  torch.manual_seed(0)  # the same random model whatever ran before in this process
  model = transformers.GptOssForCausalLM(config).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(torch.rand_like(p) + 0.5)
      elif name.endswith(('bias', 'sinks')):  # transformers starts the expert biases at 0: draw them all
        p.copy_(torch.randn_like(p) * 0.5)
  model.save_pretrained(str(root / 'hf'), safe_serialization=True)
  result = import_hf.import_hf(str(root / 'hf'), str(root / 'run'))
  tokens = np.random.default_rng(1).integers(3, 211, (2, SEQ)).astype(np.int32)
  with torch.no_grad():
    theirs = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  yield torch, transformers, model, root, result, tokens, theirs
  if MAX_ABS:
    print('\ngpt-oss max |logits(jaxlm) - logits(transformers)|: '
          + ', '.join(f'{k} {v:.2e}' for k, v in MAX_ABS.items()))
  if MOVED:
    print('gpt-oss max |logit change| with a feature off: ' + ', '.join(f'{k} {v:.2e}' for k, v in MOVED.items()))


def _logits(m, params, tokens):
  B, T = tokens.shape
  positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
  return np.asarray(jax.jit(model_lib.Decoder(m).apply)({'params': params}, tokens, np.ones_like(tokens), positions))


def _imported(root, result):
  """(cfg.model of the import in float32, its params)."""
  cfg = export.read_config(result['checkpoint'])
  cfg.model.dtype = 'float32'
  m = model_lib.ModelConfig.from_config(cfg.model)
  return cfg.model, m, import_hf.from_hf(import_hf.read_safetensors(str(root / 'hf')), m, scan_layers=True)


def test_import_equals_transformers_and_each_feature_matters(gpt_oss):
  """The import's flags name every gpt-oss feature; its logits equal transformers' (1e-4); turning any feature
  off (the clamp, each bias, the sinks, YaRN) moves them by >= 1e-2."""
  *_, root, result, tokens, theirs = gpt_oss
  o = result['overrides']
  assert (o['moe_router'], o['mlp_activation'], o['attention_window'], o['attention_global_every']) == (
      'gpt_oss', 'clamped', WINDOW, 2)
  assert o['attention_sinks'] and o['attention_bias'] and o['moe_expert_bias'] and o['moe_router_bias']
  assert o['rope_scaling'] == 'yarn' and o['rope_truncate'] is False and o['mlp_swiglu_limit'] == 0.3
  assert '--config.model.moe_router=gpt_oss' in result['flags']
  model_cfg, m, params = _imported(root, result)
  MAX_ABS['import'] = float(np.abs(_logits(m, params, tokens) - theirs).max())
  assert MAX_ABS['import'] <= 1e-4
  for key, off in FEATURES.items():
    changed = model_cfg.copy_and_resolve_references()
    changed[key] = off
    MOVED[key] = float(np.abs(_logits(model_lib.ModelConfig.from_config(changed), params, tokens) - theirs).max())
    assert MOVED[key] >= 1e-2, key


def test_the_imported_load_balancing_loss_is_transformers_aux_loss(gpt_oss):
  """router_aux_loss_coef imports as model.moe_aux_loss with moe_aux_loss_form=pooled: on the same tokens jaxlm's
  routing loss equals coefficient · transformers' aux_loss (load_balancing_loss_func over every layer's router
  logits; k at uniform routing), which the per-layer Switch form (1 at uniform) does not."""
  from jaxlm import moe as moe_lib
  torch, _, model, root, result, tokens, _ = gpt_oss
  assert result['overrides']['moe_aux_loss_form'] == 'pooled'
  assert result['overrides']['moe_aux_loss'] == model.config.router_aux_loss_coef
  with torch.no_grad():
    want = float(model(torch.from_numpy(tokens.astype(np.int64)), output_router_logits=True).aux_loss)
  _, m, params = _imported(root, result)
  positions = np.tile(np.arange(tokens.shape[1], dtype=np.int32), (tokens.shape[0], 1))
  _, stats = jax.jit(functools.partial(model_lib.Decoder(m).apply, mutable=[moe_lib.STATS]))(
      {'params': params}, tokens, np.ones_like(tokens), positions)
  routing = lambda moe: float(moe_lib.loss(stats[moe_lib.STATS], moe, float(tokens.size)))  # noqa: E731
  unit = dataclasses.replace(m.moe, aux_loss=1.0)
  np.testing.assert_allclose(routing(unit), want, rtol=1e-5)
  assert abs(routing(dataclasses.replace(unit, aux_loss_form='switch')) - want) > 0.1 * want  # another loss


def test_export_reloads_in_transformers_with_the_same_logits(gpt_oss):
  """Export writes the same tensors under the same names, and transformers reloads GptOssForCausalLM from them
  with the original's logits."""
  torch, transformers, _, root, _, tokens, theirs = gpt_oss
  written, back = export_round_trip(root / 'hf', root / 'run', root / 'back', 'GptOssForCausalLM')
  assert written['model_type'] == 'gpt_oss' and written['layer_types'] == ['sliding_attention', 'full_attention']
  with torch.no_grad():
    ours = back(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  MAX_ABS['export'] = float(np.abs(ours - theirs).max())
  assert MAX_ABS['export'] <= 1e-4


def test_greedy_with_the_kv_cache_equals_transformers_generate(gpt_oss):
  """jaxlm.generate (KV cache) continues a prompt token for token as transformers' generate does, 16 tokens past
  a prompt of 8: three windows of W = 8."""
  torch, _, model, root, result, _, _ = gpt_oss
  from jaxlm import generate as generate_lib
  _, m, params = _imported(root, result)
  prompt = list(range(10, 18))
  ours = generate_lib.generate(m, params, [prompt], 16).tokens[0]
  with torch.no_grad():
    want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
  assert ours == want[0, len(prompt):].tolist()
  assert len(set(ours)) > 3  # not one token repeated


def test_mxfp4_checkpoint_imports_with_transformers_dequantized_logits(tmp_path):
  """A checkpoint quantized as the released ones are (quantization_config quant_method mxfp4: the experts'
  projections as E2M1 blocks and E8M0 scales) imports dequantized: jaxlm's logits equal those of transformers
  loading the same directory (it dequantizes on a CPU), 1e-4; the dequantization itself is bit-exact."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  from safetensors.numpy import save_file
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  from jaxlm.hf import gpt_oss as gpt_oss_lib
  os.environ['HF_HUB_OFFLINE'] = '1'
  X, D, F = 4, 64, 32  # MXFP4 scales blocks of 32 along the contracted axis: D and F multiples of 32
  config = transformers.GptOssConfig(**dict(CONFIG, hidden_size=D, intermediate_size=F, vocab_size=101))
  torch.manual_seed(0)
  tensors = {k: v.numpy() for k, v in transformers.GptOssForCausalLM(config).float().state_dict().items()}
  rng = np.random.default_rng(0)
  for name, (rows, cols) in ((n, s) for i in range(2) for n, s in (
      (f'model.layers.{i}.mlp.experts.gate_up_proj', (2 * F, D)), (f'model.layers.{i}.mlp.experts.down_proj', (D, F)))):
    del tensors[name]
    tensors[name + '_blocks'] = rng.integers(0, 256, (X, rows, cols // 32, 16)).astype(np.uint8)
    tensors[name + '_scales'] = rng.integers(120, 125, (X, rows, cols // 32)).astype(np.uint8)
  blocks, scales = (tensors[f'model.layers.0.mlp.experts.down_proj_{part}'] for part in ('blocks', 'scales'))
  want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
  np.testing.assert_array_equal(gpt_oss_lib.dequantize_mxfp4(blocks, scales), want)
  config.quantization_config = {'quant_method': 'mxfp4', 'modules_to_not_convert': [
      'model.layers.*.self_attn', 'model.layers.*.mlp.router', 'model.embed_tokens', 'lm_head']}
  config.save_pretrained(str(tmp_path / 'hf'))
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp_path / 'hf' / 'model.safetensors'),
            metadata={'format': 'pt'})
  theirs_model = transformers.GptOssForCausalLM.from_pretrained(
      str(tmp_path / 'hf'), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32)
  theirs_model.config._attn_implementation = 'eager'  # pylint: disable=protected-access  (the sinks' reference)
  tokens = np.random.default_rng(1).integers(3, 101, (2, SEQ)).astype(np.int32)
  with torch.no_grad():
    theirs = theirs_model.eval()(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  result = import_hf.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'run'))
  _, m, params = _imported(tmp_path, result)
  assert np.abs(_logits(m, params, tokens) - theirs).max() <= 1e-4


def test_yarn_frequencies_match_transformers_for_gpt_oss_20b():
  """configs/gpt_oss_20b's YaRN (factor 32 over 4k, untruncated ramp, base 150k) against transformers' own."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from tests.helpers import load_config
  hf = transformers.GptOssConfig()  # its defaults are the released models' RoPE
  want, want_scale = ROPE_INIT_FUNCTIONS['yarn'](hf, torch.device('cpu'))
  got, scale = model_lib.rope_frequencies(model_lib.ModelConfig.from_config(load_config('gpt_oss_20b').model))
  np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
  assert scale == pytest.approx(want_scale, rel=1e-7) and scale > 1.3  # 0.1·ln 32 + 1


def test_import_refuses_what_jaxlm_does_not_compute():
  """A quantised checkpoint other than MXFP4 (which imports dequantized), an unknown config field and an unknown
  layer type are each refused in one line naming the key; the export of a gpt_oss-routed model without sinks is
  refused by name."""
  hf = dict(CONFIG, model_type='gpt_oss', layer_types=['sliding_attention', 'full_attention'])
  assert import_hf.model_overrides(hf)['moe_top_k'] == 2
  assert import_hf.model_overrides(dict(hf, quantization_config={'quant_method': 'mxfp4'}))['moe_top_k'] == 2
  for bad, match in [(dict(hf, quantization_config={'quant_method': 'bitsandbytes'}), 'quantization_config'),
                     (dict(hf, router_jitter=0.1), "'router_jitter'"),
                     (dict(hf, layer_types=['sliding_attention', 'chunked_attention']), 'chunked_attention')]:
    with pytest.raises(import_hf.HFImportError, match=match) as e:
      import_hf.model_overrides(bad)
    assert '\n' not in str(e.value)
  c = load_overrides(hf)
  m = dataclasses.replace(c, attention=dataclasses.replace(c.attention, sinks=False))
  with pytest.raises(export.ExportError, match='attention_sinks'):
    export.architecture(m)
  assert export.architecture(c) == 'GptOssForCausalLM'


def load_overrides(hf: dict) -> model_lib.ModelConfig:
  """The ModelConfig an import of config.json `hf` builds (palm_tiny's other keys)."""
  from tests.helpers import load_config
  c = load_config('palm_tiny').model
  c.update(**import_hf.model_overrides(hf))
  return model_lib.ModelConfig.from_config(c)
