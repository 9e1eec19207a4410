"""LoRA export: the peft adapter on the HF base gives jaxlm's LoRA logits; the merged export equals merge_and_unload."""

import dataclasses
import json
import logging
import warnings

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxlm import lora as lora_lib
from jaxlm import model as model_lib
from jaxlm.hf import convert, export
from tests.helpers import LazyModule, grid, load_config

torch = LazyModule('torch')
transformers = LazyModule('transformers')
peft = LazyModule('peft')

RANK, ALPHA = 4, 12.0  # rsLoRA's alpha/sqrt(r) = 6 differs from alpha/r = 3: the scale is tested


def _lora_model(parallel_block: bool):
  c = load_config('palm_tiny')
  c.model.update(vocab_size=96, d_model=40, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=52, dtype='float32',
                 parallel_block=parallel_block, tie_embeddings=parallel_block, remat='none')
  c.model.lora.update(rank=RANK, alpha=ALPHA)
  m = model_lib.ModelConfig.from_config(c.model)
  tokens = np.zeros((1, 8), np.int32)
  params = jax.jit(model_lib.Decoder(m).init)(jax.random.PRNGKey(0), tokens, tokens + 1, tokens)['params']
  rng = np.random.default_rng(0)
  # Trained-looking adapters: B non-zero, so every adapter changes the logits.
  params = jax.tree_util.tree_map_with_path(
      lambda k, x: rng.normal(0, 0.2, x.shape).astype(np.float32) if str(k[-1].key).endswith('_lora_b')
      else np.asarray(x, np.float32), jax.device_get(nn.unbox(params)))
  return m, params


def _hf_base(m, params, directory):
  """The HF base model (jaxlm's weights without the adapters), written and loaded as a user would."""
  plain = dataclasses.replace(m, lora=lora_lib.LoraConfig())
  base = lora_lib.split_adapters(params)[0]
  export.save_safetensors(convert.to_hf(base, plain), str(directory / 'model.safetensors'))
  (directory / 'config.json').write_text(json.dumps(convert.hf_config(plain, max_positions=64, dtype='float32',
                                                                      bos_id=1, eos_id=2)))
  return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def _peft_model(base, adapter_dir):
  """peft's model with the adapter, failing on any missing- or unexpected-key warning (peft only warns)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
  keys = [str(w.message) for w in caught if 'key' in str(w.message).lower()]
  assert not keys, keys
  return model


@pytest.mark.parametrize('parallel_block', grid([False, True], fast=[False],
                                                ids=lambda p: 'cohere' if p else 'llama'))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_peft_adapter_and_merged_export_give_jaxlm_lora_logits(parallel_block, tmp_path, caplog):
  m, params = _lora_model(parallel_block)
  tokens = np.random.default_rng(1).integers(0, m.vocab_size, (2, 11)).astype(np.int32)
  want = np.asarray(jax.jit(model_lib.Decoder(m).apply)({'params': params}, tokens, np.ones_like(tokens),
                                                         np.broadcast_to(np.arange(11), tokens.shape)))
  (tmp_path / 'base').mkdir()
  base = _hf_base(m, params, tmp_path / 'base')
  with torch.no_grad():
    base_logits = base(torch.tensor(tokens)).logits.numpy()
  assert np.abs(base_logits - want).max() > 1e-2  # the adapters matter
  files = export.write_adapter(params, m, str(tmp_path / 'adapter'))
  assert sorted(files) == ['adapter_config.json', 'adapter_model.safetensors']
  with caplog.at_level(logging.WARNING):
    model = _peft_model(base, tmp_path / 'adapter')
  assert not [r for r in caplog.records if 'key' in r.getMessage().lower()]
  with torch.no_grad():
    got = model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  # Merged: W + (alpha/r)·A·B through the converter equals peft's merge_and_unload, and gives the same logits.
  plain = dataclasses.replace(m, lora=lora_lib.LoraConfig())
  merged = convert.to_hf(lora_lib.merge_adapters(params, m.lora), plain)
  unloaded = {k: v.numpy() for k, v in model.merge_and_unload().state_dict().items()}
  for k, v in merged.items():
    np.testing.assert_allclose(v, unloaded[k], rtol=1e-6, atol=1e-6, err_msg=k)
  merged_model = transformers.AutoModelForCausalLM.from_config(base.config).eval()
  merged_model.load_state_dict({k: torch.tensor(v) for k, v in merged.items()}, strict=False)
  with torch.no_grad():
    np.testing.assert_allclose(merged_model(torch.tensor(tokens)).logits.numpy(), want, rtol=1e-5, atol=1e-5)

  # The same adapter read with rsLoRA's scale (alpha/sqrt(r)) must not match: the scale is what is tested.
  config = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  (tmp_path / 'adapter' / 'adapter_config.json').write_text(json.dumps(dict(config, use_rslora=True)))
  base = _hf_base(m, params, tmp_path / 'base')
  with torch.no_grad():
    rs = _peft_model(base, tmp_path / 'adapter')(torch.tensor(tokens)).logits.numpy()
  assert np.abs(rs - want).max() > 1e-3
