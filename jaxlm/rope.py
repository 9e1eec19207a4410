"""Rotary position embeddings (Su et al. 2021): plain, scaled (linear, llama3, yarn), and per layer.

`m` below is a model.ModelConfig (read by field: this module sits beside model.py and does not import it).
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

ROPE_SCALINGS = ('none', 'linear', 'llama3', 'yarn')  # model.rope_scaling


def rope_frequencies(m) -> tuple[np.ndarray, float]:
  """RoPE's inverse frequencies (E/2,) and the cos/sin scale under `m.rope_scaling`, from the shape alone.

  none    θ^(-2i/E), PaLM/Llama's rotary embeddings (Su et al. 2021).
  linear  position interpolation (Chen et al. 2023): every frequency divided by `rope_factor`.
  llama3  Llama 3.1: wavelengths longer than original_max_positions / low_freq_factor divided by `rope_factor`,
          shorter than original_max_positions / high_freq_factor kept, a smooth blend between.
  yarn    YaRN (Peng et al. 2023): per-frequency blend of interpolation and extrapolation with a linear ramp over
          the dimensions that turn between beta_fast and beta_slow times within original_max_positions, and
          cos/sin scaled by `rope_attention_factor` (0: 0.1·ln(factor) + 1, the paper's).
  The same formulas as transformers' ROPE_INIT_FUNCTIONS (tests compare them), in float64 then rounded once.
  """
  E, theta, factor = m.head_dim, m.rope_theta, m.rope_factor
  inv_freq = 1.0 / theta ** (np.arange(0, E, 2, dtype=np.float64) / E)  # (E/2,)
  scale = 1.0
  if m.rope_scaling == 'linear':
    inv_freq = inv_freq / factor
  elif m.rope_scaling == 'llama3':
    original = m.rope_original_max_positions
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / m.rope_low_freq_factor, original / m.rope_high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - m.rope_low_freq_factor) / (m.rope_high_freq_factor - m.rope_low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv_freq = np.where(medium, blended, scaled)
  elif m.rope_scaling == 'yarn':
    def dim_of(rotations):  # the dimension that turns `rotations` times over the original context
      return E * math.log(m.rope_original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(m.rope_beta_fast), dim_of(m.rope_beta_slow)
    if m.rope_truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, E - 1)
    ramp = np.clip((np.arange(E // 2) - low) / ((high - low) or 0.001), 0, 1)  # 0: extrapolate, 1: interpolate
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    scale = m.rope_attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
  return inv_freq.astype(np.float32), float(scale)


def softmax_mscale(m) -> float:
  """The multiplier of MLA's softmax scale under DeepSeek's YaRN: (0.1·rope_mscale_all_dim·ln(factor) + 1)², 1.0
  when model.rope_mscale_all_dim is 0 or the factor <= 1 (transformers' DeepseekV3 yarn_get_mscale).

  DeepSeek splits YaRN's attention factor between the rotary dims (cos/sin by the ratio mscale / mscale_all_dim,
  `rope_attention_factor`) and the whole head (this, on every score, including the non-rotary En dims)."""
  if not m.rope_mscale_all_dim or m.rope_factor <= 1:
    return 1.0
  return (0.1 * m.rope_mscale_all_dim * math.log(m.rope_factor) + 1.0) ** 2


def rope(x, positions, theta: float, frequencies: tuple[np.ndarray, float] | None = None):
  """Rotary embeddings, half-split layout (GPT-NeoX/Llama): dims [0, E/2) pair with [E/2, E).

  x: (B, T, N, E) for N heads; positions: (B, T). Angles in float32: bf16 positions lose integer precision
  past 256. `frequencies`: (inverse frequencies, cos/sin scale) of a scaled RoPE (`rope_frequencies`); None is
  plain RoPE with base `theta`.
  """
  E = x.shape[-1]
  if frequencies is None:
    inv_freq, scale = theta ** (-jnp.arange(0, E, 2, dtype=jnp.float32) / E), 1.0  # (E/2,)
  else:
    inv_freq, scale = jnp.asarray(frequencies[0]), frequencies[1]
  angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # (B, T, 1, E/2)
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if not (isinstance(scale, float) and scale == 1.0):  # YaRN's attention factor: q and k alike, logits by its square
    sin, cos = sin * scale, cos * scale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def layer_frequencies(m, local):
  """RoPE's (inverse frequencies, scale) for a layer, `local` (a bool, traced when layers are scanned) choosing
  model.rope_local_theta's plain RoPE over the global one; None: plain RoPE with rope_theta (its float32 formula)."""
  local_theta = m.attention.local_rope_theta
  if not local_theta or (local_theta == m.rope_theta and m.rope_scaling == 'none'):
    return None if m.rope_scaling == 'none' else rope_frequencies(m)
  inv, scale = rope_frequencies(m)
  inv_local, _ = rope_frequencies(dataclasses.replace(m, rope_theta=local_theta, rope_scaling='none'))
  return jnp.where(local, inv_local, inv), jnp.where(local, 1.0, scale)
