"""RoPE scaling (model.rope_scaling): frequencies against transformers' ROPE_INIT_FUNCTIONS, and what they do.

The Hugging Face logit parity of scaled models (import and export) is in tests/hf/test_export.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm import config as config_lib
from jaxlm import model as model_lib
from tests.helpers import load_config

# (jaxlm overrides, transformers rope_parameters): Llama 3.1's published values, YaRN with and without its
# default attention factor, and a yarn whose ramp does not truncate.
CASES = {
    'linear': (dict(rope_scaling='linear', rope_factor=4.0), dict(rope_type='linear', factor=4.0)),
    'llama3': (dict(rope_scaling='llama3', rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_max_positions=8192),
               dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)),
    'yarn': (dict(rope_scaling='yarn', rope_factor=16.0, rope_original_max_positions=4096),
             dict(rope_type='yarn', factor=16.0, original_max_position_embeddings=4096)),
    'yarn-explicit': (dict(rope_scaling='yarn', rope_factor=4.0, rope_original_max_positions=2048,
                           rope_beta_fast=16.0, rope_beta_slow=2.0, rope_attention_factor=1.25,
                           rope_truncate=False),
                      dict(rope_type='yarn', factor=4.0, original_max_position_embeddings=2048, beta_fast=16.0,
                           beta_slow=2.0, attention_factor=1.25, truncate=False)),
}


def _model_config(**overrides):
  c = load_config('palm_tiny').model
  c.update(d_model=512, num_heads=4, num_kv_heads=1, head_dim=128, rope_theta=500_000.0)
  c.update(**overrides)
  return model_lib.ModelConfig.from_config(c)


@pytest.mark.parametrize('case', list(CASES))
def test_frequencies_match_transformers(case):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  ours, theirs = CASES[case]
  m = _model_config(**ours)
  hf = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=65536,
                                rope_parameters={**theirs, 'rope_theta': 500_000.0})
  want, want_scale = ROPE_INIT_FUNCTIONS[theirs['rope_type']](hf, torch.device('cpu'))
  got, scale = model_lib.rope_frequencies(m)
  np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
  assert scale == pytest.approx(want_scale, rel=1e-7)
  assert not np.allclose(got, model_lib.rope_frequencies(_model_config())[0])  # scaling changed something


def test_reference_formulas_by_hand():
  plain, _ = model_lib.rope_frequencies(_model_config())
  np.testing.assert_allclose(plain, 500_000.0 ** (-np.arange(0, 128, 2) / 128), rtol=1e-6)
  linear, _ = model_lib.rope_frequencies(_model_config(rope_scaling='linear', rope_factor=4.0))
  np.testing.assert_allclose(linear, plain / 4, rtol=1e-6)
  # Llama 3.1: short wavelengths (< 8192/4 tokens) kept, long ones (> 8192/1) divided by 8.
  llama3, _ = model_lib.rope_frequencies(_model_config(**CASES['llama3'][0]))
  wavelen = 2 * np.pi / plain
  np.testing.assert_allclose(llama3[wavelen < 2048], plain[wavelen < 2048], rtol=1e-6)
  np.testing.assert_allclose(llama3[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=1e-6)
  # YaRN: the fastest dimensions extrapolate (unchanged), the slowest interpolate (÷ factor); 0.1 ln s + 1.
  yarn, scale = model_lib.rope_frequencies(_model_config(**CASES['yarn'][0]))
  assert yarn[0] == pytest.approx(plain[0]) and yarn[-1] == pytest.approx(plain[-1] / 16)
  assert scale == pytest.approx(0.1 * np.log(16) + 1)


def test_linear_scaling_is_position_interpolation():
  # Linear scaling at position p is plain RoPE at p / factor (Chen et al. 2023), on q and k alike.
  m = _model_config(rope_scaling='linear', rope_factor=4.0)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 6, 2, 128)), jnp.float32)
  positions = jnp.asarray([[0, 4, 8, 400, 4000, 40000]])
  scaled = model_lib.rope(x, positions, m.rope_theta, model_lib.rope_frequencies(m))
  plain = model_lib.rope(x, positions / 4, m.rope_theta)
  np.testing.assert_allclose(scaled, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('overrides, says', [
    (dict(rope_scaling='ntk'), 'model.rope_scaling'),
    (dict(rope_scaling='linear', rope_factor=0.5), 'model.rope_factor'),
    (dict(rope_scaling='llama3', rope_factor=8.0), 'model.rope_original_max_positions'),
    (dict(rope_scaling='llama3', rope_factor=8.0, rope_original_max_positions=8192, rope_low_freq_factor=4.0),
     'model.rope_low_freq_factor'),
    (dict(rope_scaling='yarn', rope_factor=8.0, rope_original_max_positions=4096, rope_beta_slow=64.0),
     'model.rope_beta_slow'),
])
def test_bad_rope_scaling_is_refused_by_field(overrides, says):
  c = load_config('palm_tiny')
  c.model.update(**overrides)
  with pytest.raises(config_lib.ConfigError, match=says):
    config_lib.validate(c, 8)
